"""The `Task` interface: evaluation data, a disjoint calibration split, metrics and latency inputs.

A task never trains anything. It answers four questions about a model:

- ``evaluate(model, quick=False) -> dict``: quality metrics (the primary one first);
  ``evaluate_with_error`` adds the 95 % half-width of each metric's sampling error where the task knows it;
- ``calibration(n)``: ``n`` samples from a split disjoint from the evaluation data, as a list of
  input batches (each a tuple of tensors to call ``model(*batch)`` with);
- ``example_inputs(batch_size)``: a realistic input batch for latency and memory measurement;
- ``metrics``: what each metric means and whether higher is better.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MetricSpec", "Task", "TaskMismatchError", "model_device", "check_model", "check_fit"]

Batch = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class MetricSpec:
    name: str
    higher_is_better: bool
    description: str


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Evaluate in eval mode (BatchNorm running statistics, no dropout); the model's own mode is restored."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def check_model(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    return model


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU for a parameterless model)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


class Task(ABC):
    """Base class; see the module docstring."""

    name: str = ""
    metrics: tuple[MetricSpec, ...] = ()
    default_batch_size: int = 1

    @property
    def primary(self) -> MetricSpec:
        return self.metrics[0]

    def metric(self, name: str) -> MetricSpec:
        for m in self.metrics:
            if m.name == name:
                return m
        raise KeyError(f"task {self.name!r} has no metric {name!r}; its metrics: {[m.name for m in self.metrics]}")

    @abstractmethod
    def evaluate(self, model: nn.Module, quick: bool = False) -> dict[str, float]:
        """Quality metrics of ``model`` on the evaluation split (``quick``: a fixed subset)."""

    def evaluate_with_error(self, model: nn.Module, quick: bool = False) -> tuple[dict[str, float], dict[str, float]]:
        """The metrics of `evaluate` and, for those whose sampling error the task can state, the half-width of
        its 95 % interval (`workbench.measurement.sampling`). Tasks that see per-sample scores override this and
        derive `evaluate` from it; the default states no error."""
        return self.evaluate(model, quick), {}

    @abstractmethod
    def calibration(self, n: int, batch_size: int | None = None) -> list[Batch]:
        """``n`` calibration samples (disjoint from the evaluation data) as input batches."""

    @abstractmethod
    def example_inputs(self, batch_size: int | None = None) -> Batch:
        """One input batch for latency and memory measurement."""

    def check_fit(self, model: nn.Module) -> None:
        """Run two example inputs through ``model``; tasks add checks of the output (see `check_fit`)."""
        from workbench.tasks import inputs

        batch = inputs.to_device(self.example_inputs(2), model_device(model))
        with eval_mode(model), torch.inference_mode():
            inputs.call(model, batch)

    def __repr__(self) -> str:
        return f"<Task {self.name!r}: {', '.join(m.name for m in self.metrics)}>"


def check_count(n: int, available: int, what: str) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"{what}: the number of samples must be a positive int, got {n!r}")
    if n > available:
        raise ValueError(f"{what}: asked for {n} samples, but the split has only {available}")
    return n


class TaskMismatchError(ValueError):
    """A model and a task do not fit together (raised by `check_fit` before any measurement)."""


def check_fit(model: nn.Module, task: Task) -> None:
    """Raise `TaskMismatchError` - naming the task, the inputs it feeds and what the model raised - when
    ``model`` cannot run on ``task``'s inputs or its output is not what the task scores. One small forward pass."""
    from workbench.tasks import inputs

    check_model(model)
    try:
        task.check_fit(model)
    except Exception as e:
        try:
            fed = inputs.describe(task.example_inputs(2))
        except Exception as e2:
            fed = f"(its example inputs failed: {type(e2).__name__}: {e2})"
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TaskMismatchError(f"{type(model).__name__} does not fit task {task.name!r}: the task feeds {fed}; "
                                f"running it raised {type(e).__name__}: {first}") from e
