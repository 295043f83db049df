"""`Metrics` and `measure`: every number measured on the real model, never estimated."""
from __future__ import annotations

import datetime as _dt
import math
import platform
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from workbench.measurement.footprint import bytes_by_dtype, peak_memory, size_bytes
from workbench.measurement.latency import Latency, num_threads, time_forward
from workbench.measurement.speedup import Speedup, speedup
from workbench.tasks.base import Task, check_fit, check_model, model_device
from workbench.tasks.inputs import to_device

__all__ = ["Metrics", "measure", "compare", "kernel_paths", "slowdown_reasons", "slowdown_note", "quality_change"]


@dataclass(frozen=True)
class Metrics:
    """What `measure` found. Quality metrics keep the task's direction (`higher_is_better`)."""

    model: str
    task: str
    quality: dict[str, float]
    primary: str
    higher_is_better: dict[str, bool]
    latency_ms: float
    latency_p90_ms: float
    latency_runs: int
    batch_size: int
    size_bytes: int
    peak_memory_bytes: int
    memory_method: str
    dtypes: dict[str, int]
    device: str
    threads: int
    torch_version: str
    quick: bool
    plans: list[dict] = field(default_factory=list)
    kernels: dict[str, int] = field(default_factory=dict)
    timestamp: str = ""
    host: str = ""
    speedup: Speedup | None = None   # against the ``baseline`` given to `measure`, measured side by side
    # 95 % half-width of each quality metric's sampling error, where the task states one (quick subsets above
    # all: 256 digits images give accuracy +-0.02); `workbench.measurement.sampling`
    quality_error: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float | None = None   # greedy batch-1 generation (causal LMs, ``generate_tokens=``), else None

    @property
    def primary_value(self) -> float:
        return self.quality[self.primary]

    @property
    def primary_error(self) -> float | None:
        """The 95 % half-width of the primary metric's sampling error (None: the task states none)."""
        return self.quality_error.get(self.primary)

    def _error_text(self, name: str) -> str:
        err = self.quality_error.get(name)
        return f" +- {err:.2g}" if err is not None and not math.isnan(err) else ""

    def to_dict(self) -> dict[str, Any]:
        """A flat dict: one key per quality metric, plus the measurement fields."""
        d = asdict(self)
        quality = d.pop("quality")
        d.pop("higher_is_better")
        d.pop("speedup")
        errors = {f"{k}_error": v for k, v in d.pop("quality_error").items()}
        d["plans"] = self.plans
        d.update(self.speedup.to_dict() if self.speedup is not None else {})
        return {"model": d.pop("model"), "task": d.pop("task"), **quality, **errors, "primary": self.primary,
                "primary_value": self.primary_value, **d}

    def to_series(self):
        import pandas as pd

        return pd.Series(self.to_dict())

    def to_frame(self):
        """A one-row DataFrame (concatenate rows of several runs with ``pd.concat``)."""
        import pandas as pd

        return pd.DataFrame([self.to_dict()])

    def better_than(self, other: "Metrics", metric: str | None = None) -> bool:
        name = metric or self.primary
        a, b = self.quality[name], other.quality[name]
        return a > b if self.higher_is_better[name] else a < b

    def __str__(self) -> str:
        q = ", ".join(f"{k}={v:.4g}{self._error_text(k)}{'' if self.higher_is_better[k] else ' (lower is better)'}"
                      for k, v in self.quality.items())
        return (f"{self.model} on {self.task}: {q}; latency {self.latency_ms:.3g} ms (p90 {self.latency_p90_ms:.3g}, "
                f"batch {self.batch_size}, {self.threads} thread{'' if self.threads == 1 else 's'}, {self.device}); "
                f"size {self.size_bytes / 2**20:.3f} MiB; "
                f"peak memory {self.peak_memory_bytes / 2**20:.3f} MiB"
                + (f"; vs baseline: {self.speedup.verdict}" if self.speedup is not None else ""))


def kernel_paths(model: nn.Module) -> dict[str, int]:
    """How many layers ran each kernel path, e.g. ``{"W8A8Linear:cpu": 36}``; compressed modules
    declare theirs in a ``kernel`` attribute (plain PyTorch layers are not listed)."""
    out: dict[str, int] = {}
    for module in model.modules():
        path = getattr(module, "kernel", None)
        if isinstance(path, str):
            key = f"{type(module).__name__}:{path}"
            out[key] = out.get(key, 0) + 1
    return out


def measure(model: nn.Module, task: Task | str, *, batch_size: int | None = None, quick: bool = False,
            threads: int | None = None, name: str | None = None, progress: bool = True,
            baseline: nn.Module | None = None, generate_tokens: int = 0) -> Metrics:
    """Measure quality, latency, size and peak memory of ``model`` on ``task``.

    ``quick``: evaluate the primary metric on the task's fixed quick subset and time fewer runs.
    ``threads``: CPU threads for the whole measurement (default: torch's current setting); recorded.
    ``batch_size``: latency/memory batch (default: the task's).
    ``progress``: show a progress bar over the three stages (quality, latency, memory).
    ``baseline``: also measure the speedup over this model side by side (`wb.speedup`: paired rounds on the
    same inputs, with an interval) - the only latency comparison that survives a noisy machine. The model's
    latency is then read from those same rounds.
    Quality comes with its sampling error where the task states one (`Metrics.quality_error`).
    ``generate_tokens``: for a causal LM, also time greedy batch-1 generation of this many tokens
    (`workbench.measurement.decode`: Hugging Face ``generate`` with its KV cache) into ``tokens_per_s``.
    """
    from tqdm.auto import tqdm

    from workbench import models, tasks
    from workbench.plans.apply import applied_plans

    check_model(model)
    if isinstance(task, str):
        task = tasks.load(task)
    if not isinstance(task, Task):
        raise TypeError(f"expected a wb.tasks.Task or a task name, got {type(task).__name__}")
    bs = task.default_batch_size if batch_size is None else batch_size
    if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    check_fit(model, task)  # a model that cannot run the task fails here, in one line
    if generate_tokens:
        from workbench.measurement.decode import is_causal_lm

        if not isinstance(generate_tokens, int) or isinstance(generate_tokens, bool) or generate_tokens < 0:
            raise ValueError(f"generate_tokens must be an int >= 0, got {generate_tokens!r}")
        if not is_causal_lm(model):
            raise ValueError(f"generate_tokens={generate_tokens}: {type(model).__name__} is not a causal language "
                             f"model (token ids in, (batch, tokens, vocab) logits out)")
    device = model_device(model)
    was_training = model.training
    model.eval()
    try:
        with num_threads(threads) as used, tqdm(total=3, desc=f"measure {task.name}",
                                                leave=False, disable=not progress) as bar:
            bar.set_postfix_str("quality")
            quality, quality_error = task.evaluate_with_error(model, quick=quick)
            bar.update()
            inputs = to_device(task.example_inputs(bs), device)
            fast = None
            if baseline is not None:
                # the model's latency comes from the same paired rounds as its speedup: timing it again
                # apart would cost as much and be worth less (quick: one warm-up, at least 6 rounds, 0.6 s)
                bar.set_postfix_str("speedup + latency")
                fast = speedup(model, baseline, inputs, threads=used, warmup=1 if quick else 2,
                               min_rounds=6 if quick else 8, budget_s=0.6 if quick else 3.0)
                times = np.asarray(fast.model_times_ms)
                lat = Latency(float(np.median(times)), float(np.percentile(times, 90)), len(times), used)
            else:
                bar.set_postfix_str("latency")
                lat = time_forward(model, inputs, warmup=2 if quick else 3, min_runs=5 if quick else 10,
                                   max_runs=20 if quick else 100, budget_s=0.5 if quick else 2.0)
            bar.update()
            bar.set_postfix_str("memory")
            mem = peak_memory(model, inputs)
            bar.update()
            tps = None
            if generate_tokens:
                from workbench.measurement.decode import tokens_per_s

                bar.set_postfix_str("generate")
                tps = tokens_per_s(model, generate_tokens, runs=1 if quick else 3)
    finally:
        model.train(was_training)
    missing = [m.name for m in task.metrics if m.name not in quality and (not quick or m is task.primary)]
    if missing:
        raise RuntimeError(f"task {task.name!r} did not report metric(s) {missing}")
    return Metrics(
        model=name or models.source_of(model) or type(model).__name__,
        task=task.name,
        quality=quality,
        primary=task.primary.name,
        higher_is_better={m.name: m.higher_is_better for m in task.metrics if m.name in quality},
        latency_ms=lat.median_ms,
        latency_p90_ms=lat.p90_ms,
        latency_runs=lat.runs,
        batch_size=bs,
        size_bytes=size_bytes(model),
        peak_memory_bytes=mem.bytes,
        memory_method=mem.method,
        dtypes=bytes_by_dtype(model),
        device=str(device) if device.type != "cuda" else f"{device} ({torch.cuda.get_device_name(device)})",
        threads=used,
        torch_version=torch.__version__,
        quick=quick,
        plans=[p.to_dict() for p in applied_plans(model)],
        kernels=kernel_paths(model),
        timestamp=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        host=platform.node(),
        speedup=fast,
        quality_error={k: float(v) for k, v in quality_error.items() if k in quality},
        tokens_per_s=tps,
    )


def compare(*metrics: Metrics, labels: list[str] | None = None):
    """A DataFrame with one row per `Metrics` (``labels`` name the rows), plus ratios to the first row.

    ``speedup`` comes from each row's side-by-side measurement (``wb.measure(..., baseline=first_model)``) with its
    interval and verdict; a row without one shows the ratio of latencies measured separately, and its verdict says
    so (such a ratio can be noise). ``slowdown_reason`` says why a slower row is slower (`slowdown_note`).
    ``same_rounds_reference_ms``: the first row's latency in the rounds that timed this row (a paired row's
    ``latency_ms`` comes from those rounds too; the first row's own ``latency_ms`` is its own measurement, so on a
    busy machine the two can differ). Returns a `MetricsTable` (a DataFrame; numbers formatted with units in a
    notebook). ``<metric>_error`` is the 95 % sampling error of a quality metric where the task states one, and
    ``quality_change`` reads the primary metric against the first row: a difference inside the combined error is
    "within sampling error", never a loss or a gain."""

    if not metrics:
        raise ValueError("compare needs at least one Metrics")
    from workbench.measurement.table import MetricsTable

    rows = [m.to_dict() for m in metrics]
    df = MetricsTable(rows, index=labels or [f"{i}: {m.model}" for i, m in enumerate(metrics)])
    base = metrics[0]
    df["size_ratio"] = df["size_bytes"] / base.size_bytes
    separate = base.latency_ms / df["latency_ms"]
    for col in ("speedup", "speedup_low", "speedup_high", "speedup_verdict"):
        if col not in df.columns:
            df[col] = None
    for i, m in enumerate(metrics):
        if m.speedup is None:
            idx = df.index[i]
            if i == 0:
                df.loc[idx, ["speedup", "speedup_low", "speedup_high"]] = 1.0
                df.loc[idx, "speedup_verdict"] = "baseline"
            else:
                df.loc[idx, "speedup"] = separate.iloc[i]
                df.loc[idx, "speedup_verdict"] = ("latencies measured separately, not side by side: may be noise "
                                                  "(measure with baseline= for an interval)")
    # the first row's latency in the same paired rounds as each row's: read beside latency_ms, one regime
    df["same_rounds_reference_ms"] = [m.speedup.baseline_ms if i and m.speedup is not None else None
                                      for i, m in enumerate(metrics)]
    df["slowdown_reason"] = [slowdown_note(m, separate.iloc[i] if i else None) for i, m in enumerate(metrics)]
    df["quality_change"] = ["reference" if i == 0 else quality_change(m, base) for i, m in enumerate(metrics)]
    errors = [f"{k}_error" for k in base.quality if f"{k}_error" in df.columns]
    cols = ["model", *base.quality.keys(), *errors, "quality_change", "latency_ms", "same_rounds_reference_ms",
            "latency_p90_ms", "speedup",
            "speedup_low", "speedup_high", "speedup_verdict", "slowdown_reason", "size_bytes", "size_ratio",
            "peak_memory_bytes", "batch_size", "threads", "device"]
    return df[[c for c in cols if c in df.columns]]


def quality_change(metrics: Metrics, reference: Metrics) -> str:
    """The primary metric of ``metrics`` against ``reference``'s, read with both sampling errors: "within
    sampling error (-0.0039, +-0.024)", "worse by 0.052 (+-0.021)", "better by ...", or the bare difference
    when a task states no error."""
    from workbench.measurement.sampling import combined_halfwidth

    name = metrics.primary
    if name not in reference.quality:
        return f"{name} not measured on the reference"
    diff = metrics.quality[name] - reference.quality[name]
    h = combined_halfwidth(metrics.quality_error.get(name), reference.quality_error.get(name))
    if h is None:
        return f"{diff:+.4g} (the task states no sampling error)"
    if abs(diff) <= h:
        return f"within sampling error ({diff:+.2g}, +-{h:.2g})"
    better = (diff > 0) == metrics.higher_is_better[name]
    return f"{'better' if better else 'worse'} by {abs(diff):.2g} (+-{h:.2g})"


def slowdown_note(metrics: Metrics, separate_ratio: float | None = None) -> str:
    """"" unless ``metrics`` was measured slower than its baseline; then "slower: " and its known reasons
    (`slowdown_reasons`), or a statement that none is known. Without a side-by-side `Speedup`, a
    ``separate_ratio`` (baseline latency / this latency, measured apart) below 1 / 1.03 counts, said as such."""
    if metrics.speedup is not None:
        if not metrics.speedup.slower:
            return ""
        head = f"slower ({metrics.speedup.ratio:.2f}x)"
    elif separate_ratio is not None and separate_ratio < 1 / 1.03:
        head = f"slower ({separate_ratio:.2f}x, latencies measured separately)"
    else:
        return ""
    reasons = slowdown_reasons(metrics)
    if not reasons:
        return (f"{head}: no known cause (no reference kernel, bf16 or fp16 layer ran); compare the layers' own "
                f"latency with wb.sensitivity(..., latency=True)")
    return f"{head}: " + "; ".join(reasons)


def slowdown_reasons(metrics: Metrics) -> list[str]:
    """Known reasons a compressed model runs slower than its original here, read from what was measured: the
    kernel paths that ran, the storage dtypes, the device and the batch."""
    reasons = []
    reference = sum(n for k, n in metrics.kernels.items() if k.endswith(":reference"))
    if reference:
        reasons.append(f"{reference} layer(s) ran the reference path (decode the weights, then a float matmul, on "
                       f"every call); kernel='auto' picks the device's fast path where the layer has one")
    cpu = metrics.device.startswith("cpu")
    if cpu and metrics.dtypes.get("bfloat16", 0) and metrics.batch_size <= 8:
        reasons.append(f"bf16 layers on a CPU at batch {metrics.batch_size}: converting activations costs more than "
                       f"the bf16 matmul saves at small batches")
    weight_only_cpu = sum(n for k, n in metrics.kernels.items() if k.startswith("WeightOnlyLinear") and
                          k.endswith(":cpu"))
    if cpu and weight_only_cpu and metrics.batch_size > 1:
        reasons.append(f"{weight_only_cpu} layer(s) ran the CPU weight-only kernel at batch {metrics.batch_size}: it "
                       f"widens every code to fp32 on each call, which pays off when reading the weights is the "
                       f"cost (decode, large layers) and can cost more than a small layer's fp32 matmul "
                       f"(docs/kernels.md, CPU weight-only)")
    # fp16 bytes that are not just the scales of integer codes (an int2 g16 layer holds half as many scale bytes
    # as code bytes): layers stored or cast to fp16
    integer = sum(n for k, n in metrics.dtypes.items() if k.startswith(("int", "uint")))
    if cpu and metrics.dtypes.get("float16", 0) > integer:
        reasons.append("fp16 layers on a CPU: most CPUs have no fast fp16 kernels (convolutions especially)")
    return reasons
