"""Tasks built from the user's own data: `Classification`, `Fidelity` and `Custom` (``wb.tasks.*``).

    task = wb.tasks.Classification(x_eval, y_eval, calibration=x_cal)   # tensors, numpy, or DataLoaders
    task = wb.tasks.Fidelity(reference_model, inputs)                   # label-free
    task = wb.tasks.Custom(evaluate=fn, calibration=batches, example_inputs=batch, metric="f1")

Inputs may be tensors, numpy arrays, tuples of them, dicts (Hugging Face keyword inputs) or a DataLoader of
such batches (see `workbench.tasks.inputs`); outputs may be tensors, tuples or a ``ModelOutput``.

The calibration split must be disjoint from the evaluation data: passing the *same* samples for both is an
error (`ValueError`, naming the count); a partial overlap is a `UserWarning`. `Fidelity` without an explicit
calibration split takes its first ``calibration_fraction`` of the inputs for calibration and evaluates on the rest.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from workbench.tasks import inputs as I
from workbench.tasks.base import MetricSpec, Task, check_count, check_model, eval_mode, model_device

__all__ = ["Classification", "Fidelity", "Custom", "check_disjoint"]


def check_disjoint(evaluation: list[I.Batch], calibration: list[I.Batch], task: str) -> None:
    """Error if every calibration sample is also an evaluation sample; warn on a partial overlap."""
    seen = set(I.sample_digests(evaluation))
    cal = I.sample_digests(calibration)
    shared = sum(d in seen for d in cal)
    if shared == len(cal):
        raise ValueError(f"task {task!r}: all {len(cal)} calibration samples are also evaluation samples; "
                         f"calibrate on data disjoint from the evaluation data (e.g. a training split)")
    if shared:
        warnings.warn(f"task {task!r}: {shared} of {len(cal)} calibration samples also occur in the evaluation "
                      f"data; quality measured after calibration may be optimistic", UserWarning, stacklevel=3)


def _repeat_to(batch: I.Batch, n: int) -> I.Batch:
    """The first ``n`` samples of ``batch``, repeating it when it has fewer."""
    size = I.batch_size(batch)
    reps = -(-n // size)
    if isinstance(batch, dict):
        return {k: torch.cat([v] * reps)[:n] for k, v in batch.items()}
    return tuple(torch.cat([t] * reps)[:n] for t in batch)


class _BatchedTask(Task):
    """Shared plumbing: evaluation and calibration batches held in memory (CPU)."""

    eval_batches: list[I.Batch]
    cal_batches: list[I.Batch] | None

    def calibration(self, n: int, batch_size: int | None = None) -> list[I.Batch]:
        if not self.cal_batches:
            raise ValueError(f"task {self.name!r} has no calibration data; pass calibration=... when creating it")
        check_count(n, sum(I.batch_size(b) for b in self.cal_batches), f"{self.name} calibration")
        return I.take(self.cal_batches, n, batch_size)

    def example_inputs(self, batch_size: int | None = None) -> I.Batch:
        return _repeat_to(self.eval_batches[0], batch_size or self.default_batch_size)

    def _quick(self, batches: list[I.Batch], quick: bool) -> list[I.Batch]:
        if not quick:
            return batches
        total = sum(I.batch_size(b) for b in batches)
        return I.take(batches, min(total, self.quick_samples))

    quick_samples = 256


def _split_labels(batch: I.Batch, n_inputs: int | None, what: str) -> tuple[I.Batch, torch.Tensor | None]:
    """(inputs, labels) of one batch: a dict's ``labels`` key, or a tuple's last element when the tuple has
    one more element than the model's inputs (``n_inputs``; None: a tuple always ends with its labels)."""
    if isinstance(batch, dict):
        keys = [k for k in I.LABEL_KEYS if k in batch]
        labels = batch[keys[0]] if keys else None
        rest = {k: v for k, v in batch.items() if k not in I.LABEL_KEYS}
        if not rest:
            raise ValueError(f"{what}: the batch has labels but no inputs")
        return rest, labels
    if n_inputs is None or len(batch) == n_inputs + 1:
        if len(batch) < 2:
            raise ValueError(f"{what}: expected (inputs..., labels), got a single tensor")
        return batch[:-1], batch[-1]
    if len(batch) == n_inputs:
        return batch, None
    raise ValueError(f"{what}: expected {n_inputs} input tensor(s) (plus optional labels), got {len(batch)}")


def _check_labels(y: torch.Tensor, n: int, what: str) -> torch.Tensor:
    if y.is_floating_point() or y.dtype == torch.bool or y.is_complex():
        raise TypeError(f"{what}: labels must be integer class indices, got {str(y.dtype).removeprefix('torch.')}")
    if y.ndim != 1 or len(y) != n:
        raise ValueError(f"{what}: expected {n} labels (one per sample), got shape {tuple(y.shape)}")
    if len(y) and int(y.min()) < 0:
        raise ValueError(f"{what}: labels must be >= 0, found {int(y.min())}")
    return y.long()


def _logits_of(out: Any, n: int, task: str) -> torch.Tensor:
    logits = I.output_tensor(out, f"task {task!r}", prefer=("logits",))
    if logits.ndim != 2 or logits.shape[0] != n:
        raise ValueError(f"task {task!r} expects (batch, classes) logits, got shape {tuple(logits.shape)} "
                         f"for a batch of {n}")
    return logits.float()


class Classification(_BatchedTask):
    """Top-1 accuracy (higher is better; primary) and mean cross-entropy (lower is better) of the model's
    logits on the evaluation samples.

    ``Classification(x_eval, y_eval, calibration=x_cal)`` or ``Classification(eval_loader, calibration=...)``
    where the loader yields ``(inputs..., labels)`` tuples or dicts with a ``labels`` key. ``calibration``:
    inputs only, or batches with labels (kept for trainers: `calibration_labels`).
    """

    metrics = (MetricSpec("accuracy", True, "top-1 accuracy on the evaluation samples (higher is better)"),
               MetricSpec("cross_entropy", False, "mean cross-entropy of the logits (lower is better)"))
    default_batch_size = 64

    def __init__(self, x: Any, y: Any = None, *, calibration: Any = None, name: str = "classification",
                 batch_size: int = 256):
        self.name = name
        if y is None:  # a loader (or batches) of (inputs..., labels)
            pairs = [_split_labels(b, None, f"{name} evaluation batch {i}")
                     for i, b in enumerate(I.collect(x, f"{name} evaluation data", batch_size))]
        else:
            xs = I.collect(x, f"{name} evaluation inputs", batch_size)
            labels = I.as_tensor(y, f"{name} labels")
            n = sum(I.batch_size(b) for b in xs)
            labels = _check_labels(labels.reshape(-1) if labels.ndim > 1 and labels.numel() == n else labels, n,
                                   f"{name}: {n} evaluation inputs but labels")
            offsets = [0]
            for b in xs:
                offsets.append(offsets[-1] + I.batch_size(b))
            pairs = [(b, labels[offsets[i]:offsets[i + 1]]) for i, b in enumerate(xs)]
        for i, (b, lab) in enumerate(pairs):
            if lab is None:
                raise ValueError(f"{name} evaluation batch {i}: no labels")
            _check_labels(lab, I.batch_size(b), f"{name} evaluation batch {i}")
        self.eval_batches = [b for b, _ in pairs]
        self.eval_labels = [lab.long() for _, lab in pairs]
        self.n_inputs = None if isinstance(self.eval_batches[0], dict) else len(self.eval_batches[0])
        self.cal_batches, self._cal_labels = None, None
        if calibration is not None:
            cal = [_split_labels(b, self.n_inputs, f"{name} calibration batch {i}")
                   for i, b in enumerate(I.collect(calibration, f"{name} calibration data", batch_size))]
            self.cal_batches = [b for b, _ in cal]
            if all(lab is not None for _, lab in cal):
                self._cal_labels = torch.cat([_check_labels(lab, I.batch_size(b), f"{name} calibration labels")
                                              for b, lab in cal])
            check_disjoint(self.eval_batches, self.cal_batches, name)

    @property
    def num_samples(self) -> int:
        return sum(len(y) for y in self.eval_labels)

    def evaluate(self, model: nn.Module, quick: bool = False) -> dict[str, float]:
        return self.evaluate_with_error(model, quick)[0]

    def evaluate_with_error(self, model: nn.Module, quick: bool = False) -> tuple[dict[str, float], dict[str, float]]:
        """Accuracy (Wilson 95 % half-width) and mean cross-entropy (t interval over samples)."""
        from workbench.measurement.sampling import mean_halfwidth, wilson_halfwidth

        check_model(model)
        limit = min(self.quick_samples, self.num_samples) if quick else self.num_samples
        device = model_device(model)
        correct, seen, losses = 0, 0, []
        with eval_mode(model), torch.inference_mode():
            for b, y in zip(self.eval_batches, self.eval_labels):
                if seen >= limit:
                    break
                k = min(len(y), limit - seen)
                b, y = I.split_batch(b, 0, k), y[:k].to(device)
                logits = _logits_of(I.call(model, I.to_device(b, device)), k, self.name)  # (k, classes)
                if int(y.max()) >= logits.shape[1]:
                    raise ValueError(f"task {self.name!r}: label {int(y.max())} is outside the model's "
                                     f"{logits.shape[1]} logits")
                correct += int((logits.argmax(-1) == y).sum())
                losses.append(F.cross_entropy(logits.double(), y, reduction="none").cpu())           # (k,)
                seen += k
        loss = torch.cat(losses)
        return ({"accuracy": correct / seen, "cross_entropy": float(loss.mean())},
                {"accuracy": wilson_halfwidth(correct, seen), "cross_entropy": mean_halfwidth(loss.numpy())})

    def calibration_labels(self, n: int) -> torch.Tensor:
        """Labels of the first ``n`` calibration samples (same order as ``calibration(n)``)."""
        if self._cal_labels is None:
            raise ValueError(f"task {self.name!r}: the calibration data has no labels; pass (inputs, labels)")
        return self._cal_labels[:check_count(n, len(self._cal_labels), f"{self.name} calibration")]

    @property
    def split(self):
        """The data as a `workbench.tasks.data.Split` for the trainers that take one (``wb.distill.fit``,
        ``wb.precision.fit_mixed``): training = the labelled calibration split, test = the evaluation split.
        Needs single-tensor inputs and calibration labels."""
        from workbench.tasks.data import Split

        if self.n_inputs != 1 or self._cal_labels is None:
            raise ValueError(f"task {self.name!r}: training needs single-tensor inputs and a labelled calibration "
                             f"split (calibration=(x_cal, y_cal)); this task has "
                             f"{'keyword' if self.n_inputs is None else self.n_inputs} input(s) and "
                             f"{'no ' if self._cal_labels is None else ''}calibration labels")
        x_train = torch.cat([b[0] for b in self.cal_batches]).numpy()
        x_test = torch.cat([b[0] for b in self.eval_batches]).numpy()
        return Split(x_train, self._cal_labels.numpy(), x_test, torch.cat(self.eval_labels).numpy())

    def check_fit(self, model: nn.Module) -> None:
        super().check_fit(model)
        b, y = self.eval_batches[0], self.eval_labels[0]
        k = min(2, len(y))
        with eval_mode(model), torch.inference_mode():
            out = I.call(model, I.to_device(I.split_batch(b, 0, k), model_device(model)))
        logits = _logits_of(out, k, self.name)
        top = max(int(lab.max()) for lab in self.eval_labels)
        if top >= logits.shape[1]:
            raise ValueError(f"task {self.name!r}: label {top} is outside the model's {logits.shape[1]} logits")


def _per_position(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(B, ..., D) -> (N, D): the vectors scored, positions where the attention mask is 0 dropped."""
    if t.ndim == 1:
        return t.reshape(-1, 1)
    if mask is not None and t.ndim == 3 and tuple(mask.shape) == tuple(t.shape[:2]):
        return t[mask.to(t.device).bool()]
    return t.reshape(-1, t.shape[-1])


class Fidelity(_BatchedTask):
    """Agreement of a model's outputs with ``reference``'s on ``inputs`` - no labels needed.

    Logits (a ``ModelOutput`` with ``logits``, or ``logits=True``): ``kl_divergence`` KL(reference || model) of
    the softmax distributions, mean over samples (lower is better; the primary: it moves with any change,
    where agreement saturates), ``top1_agreement`` (higher is better) and ``cosine`` (higher is better).
    Other outputs (embeddings, hidden states): ``cosine`` only (higher is better). Vectors are compared along
    the last dimension; sequence positions whose ``attention_mask`` is 0 are left out.
    """

    default_batch_size = 8

    def __init__(self, reference: nn.Module, inputs: Any, *, calibration: Any = None, logits: bool | None = None,
                 calibration_fraction: float = 0.25, name: str = "fidelity", batch_size: int = 64):
        check_model(reference)
        self.name = name
        batches = I.collect(inputs, f"{name} inputs", batch_size)
        if calibration is None:
            if not 0 < calibration_fraction < 1:
                raise ValueError(f"calibration_fraction must be in (0, 1), got {calibration_fraction!r}")
            total = sum(I.batch_size(b) for b in batches)
            k = math.ceil(total * calibration_fraction)
            if total - k < 1:
                raise ValueError(f"task {name!r}: {total} input sample(s) cannot be split into calibration and "
                                 f"evaluation; pass more inputs or calibration=...")
            self.cal_batches = I.take(batches, k)
            self.eval_batches = _skip(batches, k)
        else:
            self.eval_batches = batches
            self.cal_batches = I.collect(calibration, f"{name} calibration data", batch_size)
            check_disjoint(self.eval_batches, self.cal_batches, name)
        with eval_mode(reference), torch.inference_mode():
            device = model_device(reference)
            outs = [I.call(reference, I.to_device(b, device)) for b in self.eval_batches]
        if logits is None:
            logits = isinstance(outs[0], Mapping) and outs[0].get("logits") is not None
        self.logits = bool(logits)
        self.reference = [self._vectors(o, b).cpu() for o, b in zip(outs, self.eval_batches)]
        self.metrics = ((MetricSpec("kl_divergence", False, "KL(reference || model) of the output distributions, "
                                    "mean over samples (lower is better)"),
                         MetricSpec("top1_agreement", True, "fraction of samples whose top-1 class matches the "
                                    "reference (higher is better)"),
                         MetricSpec("cosine", True, "mean cosine similarity of the logits to the reference's "
                                    "(higher is better)"))
                        if self.logits else
                        (MetricSpec("cosine", True, "mean cosine similarity of the outputs to the reference's "
                                    "(higher is better)"),))

    def _vectors(self, out: Any, batch: I.Batch) -> torch.Tensor:
        t = I.output_tensor(out, f"task {self.name!r}")
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        return _per_position(t.float(), mask)

    def evaluate(self, model: nn.Module, quick: bool = False) -> dict[str, float]:
        return self.evaluate_with_error(model, quick)[0]

    def evaluate_with_error(self, model: nn.Module, quick: bool = False) -> tuple[dict[str, float], dict[str, float]]:
        """The metrics and their 95 % sampling errors over the compared vectors: Wilson for the agreement, Student's
        t for the per-vector KL and cosine. (Positions of one sequence are not independent samples, so for
        sequence outputs the stated error is a lower bound.)"""
        from workbench.measurement.sampling import mean_halfwidth, wilson_halfwidth

        check_model(model)
        device = model_device(model)
        batches = self._quick(self.eval_batches, quick)
        cos, kl, agree = [], [], 0
        with eval_mode(model), torch.inference_mode():
            for b, ref in zip(batches, self.reference):
                got = self._vectors(I.call(model, I.to_device(b, device)), b).cpu()  # (N, D)
                ref = ref[:len(got)] if quick else ref
                if got.shape != ref.shape:
                    raise ValueError(f"task {self.name!r}: the model's outputs have shape {tuple(got.shape)} per "
                                     f"batch where the reference's have {tuple(ref.shape)}")
                cos.append(F.cosine_similarity(got.double(), ref.double(), dim=-1))
                if self.logits:
                    logp, logq = F.log_softmax(ref.double(), -1), F.log_softmax(got.double(), -1)  # fp64: KL >= 0
                    kl.append((logp.exp() * (logp - logq)).sum(-1))
                    agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        cos_t = torch.cat(cos)
        count = len(cos_t)
        values = {"cosine": float(cos_t.mean())}
        errors = {"cosine": mean_halfwidth(cos_t.numpy())}
        if self.logits:
            kl_t = torch.cat(kl)
            values = {"kl_divergence": float(kl_t.mean()), "top1_agreement": agree / count, **values}
            errors = {"kl_divergence": mean_halfwidth(kl_t.numpy()), "top1_agreement": wilson_halfwidth(agree, count),
                      **errors}
        return values, errors


def _skip(batches: list[I.Batch], k: int) -> list[I.Batch]:
    """The samples after the first ``k``."""
    out, start = [], 0
    for b in batches:
        n = I.batch_size(b)
        if start + n > k:
            out.append(I.split_batch(b, max(0, k - start), n))
        start += n
    return out


class Custom(_BatchedTask):
    """A task from a function: ``evaluate(model) -> float`` (or a dict holding ``metric``).

    ``calibration``: input batches (a list, a DataLoader or one batch) or None; ``example_inputs``: one batch
    for latency and memory (default: the first calibration batch). The function is also used for quick
    evaluations.
    """

    def __init__(self, evaluate: Callable[[nn.Module], float | Mapping[str, float]], *, metric: str,
                 higher_is_better: bool, calibration: Any = None, example_inputs: Any = None,
                 name: str = "custom", description: str = ""):
        if not callable(evaluate):
            raise TypeError(f"evaluate must be a function model -> float, got {type(evaluate).__name__}")
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"metric must be a non-empty name, got {metric!r}")
        if not isinstance(higher_is_better, bool):
            raise TypeError(f"higher_is_better must be True or False, got {higher_is_better!r}")
        self.name, self._fn = name, evaluate
        direction = "higher" if higher_is_better else "lower"
        self.metrics = (MetricSpec(metric, higher_is_better, description or f"{metric} ({direction} is better)"),)
        self.cal_batches = None if calibration is None else I.collect(calibration, f"{name} calibration data")
        if example_inputs is not None:
            self.eval_batches = [I.as_batch(example_inputs, f"{name} example_inputs")]
        elif self.cal_batches:
            self.eval_batches = self.cal_batches[:1]
        else:
            raise ValueError(f"task {name!r} needs example_inputs (or calibration) to measure latency")
        self.default_batch_size = I.batch_size(self.eval_batches[0])

    def evaluate(self, model: nn.Module, quick: bool = False) -> dict[str, float]:
        return self.evaluate_with_error(model, quick)[0]

    def evaluate_with_error(self, model: nn.Module, quick: bool = False) -> tuple[dict[str, float], dict[str, float]]:
        """The function's metrics; a key ``<metric>_error`` it returns (e.g. ``{"f1": 0.91, "f1_error": 0.02}``)
        is that metric's 95 % sampling error (half-width), shown as ``f1 +- 0.02`` and used by comparisons."""
        check_model(model)
        with eval_mode(model):
            value = self._fn(model)
        metric = self.primary.name
        found = dict(value) if isinstance(value, Mapping) else {metric: value}
        if metric not in found:
            raise ValueError(f"task {self.name!r}: evaluate returned {sorted(found)}, without {metric!r}")
        try:
            found = {k: float(v) for k, v in found.items()}
        except (TypeError, ValueError):
            raise TypeError(f"task {self.name!r}: evaluate must return numbers, got {found!r:.100}") from None
        errors = {k.removesuffix("_error"): v for k, v in found.items()
                  if k.endswith("_error") and k.removesuffix("_error") in found}
        for k, v in errors.items():
            if not v >= 0:
                raise ValueError(f"task {self.name!r}: {k}_error must be a half-width >= 0, got {v}")
        return {k: v for k, v in found.items() if f"{k.removesuffix('_error')}_error" != k or
                k.removesuffix("_error") not in errors}, errors
