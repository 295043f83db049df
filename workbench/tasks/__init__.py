"""Tasks: ``wb.tasks.load(name)`` bundles evaluation data, a disjoint calibration split, the quality
metrics (primary first, with their direction) and example inputs for latency.

``digits`` and ``mnist1d`` (top-1 accuracy), ``tiny-lm`` and ``tiny-llama`` (held-out perplexity, lower is
better; generation speed: `workbench.measurement.decode.tokens_per_second`) and
``minilm`` (embedding fidelity to fp32, plus four human-judgement benchmarks) and ``imagenet-photos``
(top-1 agreement and logit KL of an ImageNet classifier with fp32 EfficientNet-Lite0 on bundled photos).

Tasks on the user's own data and model, in one line (tensors, numpy, dicts of keyword inputs or DataLoaders):
`Classification(x, y, calibration=...)`, `Fidelity(reference_model, inputs)` (no labels),
`CausalLM(texts, tokenizer)` and `Custom(evaluate=fn, ...)`. `check_fit(model, task)` runs before every
measurement and names the task, its inputs and the model's error when the two do not fit.
"""
from __future__ import annotations

from typing import Callable

from workbench.tasks.base import MetricSpec, Task, TaskMismatchError, check_fit
from workbench.tasks.causal_lm import CausalLM
from workbench.tasks.generic import Classification, Custom, Fidelity

__all__ = ["Task", "MetricSpec", "names", "load", "Classification", "Fidelity", "CausalLM", "Custom", "check_fit",
           "TaskMismatchError"]


def _digits() -> Task:
    from workbench.tasks import data
    from workbench.tasks.classification import ClassificationTask

    return ClassificationTask("digits", data.digits, "(B, 64) pixels in [0, 1]")


def _mnist1d() -> Task:
    from workbench.tasks import data
    from workbench.tasks.classification import ClassificationTask

    return ClassificationTask("mnist1d", data.mnist1d, "(B, 40) signals")


def _tiny_lm() -> Task:
    from workbench.tasks.lm import CharLMTask

    return CharLMTask()


def _tiny_llama() -> Task:
    from workbench.tasks.llama import TinyLlamaTask

    return TinyLlamaTask()


def _minilm() -> Task:
    from workbench.tasks.sentence import SentenceTask

    return SentenceTask()


def _imagenet_photos() -> Task:
    from workbench.tasks.images import ImagePhotosTask

    return ImagePhotosTask()


_TASKS: dict[str, Callable[[], Task]] = {
    "digits": _digits,
    "mnist1d": _mnist1d,
    "tiny-lm": _tiny_lm,
    "tiny-llama": _tiny_llama,
    "minilm": _minilm,
    "imagenet-photos": _imagenet_photos,
}


def names() -> list[str]:
    return list(_TASKS)


def load(name: str) -> Task:
    """The task called ``name`` (see `names()`), or what a ``package.module:factory`` entry point returns."""
    from workbench.entry_points import is_entry_point, resolve

    if is_entry_point(name):
        task = resolve(name, "task")
        if not isinstance(task, Task):
            raise TypeError(f"task {name!r}: the factory returned {type(task).__name__}, not a wb.tasks.Task")
        return task
    try:
        factory = _TASKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown task {name!r}; available tasks: {', '.join(_TASKS)}") from None
    return factory()
