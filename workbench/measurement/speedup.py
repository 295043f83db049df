"""`speedup`: how much faster one model is than another, measured side by side, with an interval.

Two latencies taken minutes apart differ by more than most compression gains on a shared machine (a second
process on one core moves a CPU forward pass by 2-20x). So a speedup is measured as *paired rounds*: after a
warm-up of both models, each round times the baseline and the model back to back, alternating which goes first
(A B, B A, A B, ...) so that slow drift and "second call is warmer" effects cancel. Each round gives one ratio
``t_baseline / t_model``; the estimate is the median of the ratios and the interval is a distribution-free
confidence interval of that median (order statistics of the sorted ratios, from the binomial distribution): no
normality assumption, and a burst of noise in a few rounds moves neither. Rounds continue until the interval is
narrower than ``rel_width`` of the ratio or ``budget_s`` seconds have been spent.

A ratio whose interval reaches into ``1 +- min_effect`` is reported as "no measurable change", never as a gain.

Rounds that collapse are counted, not trusted: when other processes want the same cores (more runnable threads
than cores), a single timed call waits for a core and runs 5-100x slower than its neighbours - on one side of a
round or the other, so ratios of 50x and 0.02x appear and the order-statistic interval, which assumes rounds
alike, no longer covers what the models do. A call that takes more than `COLLAPSE` times its model's lower
quartile is a *disturbed* round; when more than `MAX_DISTURBED` of the rounds are disturbed the reading is not
reliable: the verdict says so (and why), and ``changed`` is False - never a gain or a loss from a busy machine.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Speedup", "speedup", "median_interval", "disturbed_rounds", "COLLAPSE", "MAX_DISTURBED"]

COLLAPSE = 3.0          # a call this many times its model's lower-quartile time waited for a core
MAX_DISTURBED = 0.1     # above this fraction of disturbed rounds a speedup is not a reading


def disturbed_rounds(model_times: list[float], baseline_times: list[float]) -> int:
    """How many paired rounds have a call (either model's) over `COLLAPSE` times that model's lower-quartile
    time: rounds in which the process waited for a core (see the module docstring)."""
    def quartile(v: list[float]) -> float:
        return sorted(v)[len(v) // 4] if v else float("nan")

    qm, qb = quartile(model_times), quartile(baseline_times)
    return sum(m > COLLAPSE * qm or b > COLLAPSE * qb for m, b in zip(model_times, baseline_times))


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free ``confidence`` interval of the median of ``values`` (order statistics): the widest
    pair of sorted values ``(v[k], v[n-1-k])`` whose coverage, from Binomial(n, 1/2), is at least ``confidence``;
    the whole range when there are too few values for that."""
    v = sorted(values)
    n = len(v)
    if n == 0:
        return float("nan"), float("nan")
    # [v[d], v[n-1-d]] covers the median with probability 1 - 2 P(Binomial(n, 1/2) <= d)
    drops, cdf = 0, 0.0
    for d in range(n // 2):
        cdf += math.comb(n, d) / 2 ** n
        if 1 - 2 * cdf < confidence:
            break
        drops = d
    return v[drops], v[n - 1 - drops]


@dataclass(frozen=True)
class Speedup:
    """``ratio`` = baseline time / model time (> 1: the model is faster), ``low`` / ``high`` its interval."""

    ratio: float
    low: float
    high: float
    model_ms: float        # median latency of the model over the rounds
    baseline_ms: float     # median latency of the baseline over the same rounds
    rounds: int
    threads: int
    confidence: float = 0.95
    min_effect: float = 0.03
    # the model's time in each round (ms), for callers that report its latency from the same rounds
    model_times_ms: tuple[float, ...] = field(default=(), repr=False, compare=False)
    disturbed: int = 0     # rounds in which a call waited for a core (`disturbed_rounds`)

    @property
    def reliable(self) -> bool:
        """False when more than `MAX_DISTURBED` of the rounds collapsed (other work competed for the cores)."""
        return self.disturbed <= MAX_DISTURBED * self.rounds

    @property
    def changed(self) -> bool:
        """True when the whole interval lies outside ``1 +- min_effect``: a difference the noise cannot explain
        (and the rounds were not disturbed: `reliable`)."""
        return self.reliable and (self.low > 1 + self.min_effect or self.high < 1 / (1 + self.min_effect))

    @property
    def faster(self) -> bool:
        return self.changed and self.ratio > 1

    @property
    def slower(self) -> bool:
        return self.changed and self.ratio < 1

    @property
    def verdict(self) -> str:
        """A short reading for people: "2.31x faster (2.25-2.40)", "0.62x: slower ...", "no measurable change"."""
        span = f"{self.low:.2f}-{self.high:.2f}"
        if not self.reliable:
            return (f"no reliable reading: {self.disturbed} of {self.rounds} rounds ran over {COLLAPSE:g}x slower "
                    f"than the rest - other work competes for the cores; measure again with fewer threads or on a "
                    f"quieter machine ({self.ratio:.2f}x, {span})")
        if not self.changed:
            return f"no measurable change ({self.ratio:.2f}x, {span})"
        if self.ratio > 1:
            return f"{self.ratio:.2f}x faster ({span})"
        return f"{self.ratio:.2f}x: slower ({span})"

    def __str__(self) -> str:
        return (f"{self.verdict}; {self.model_ms:.3g} ms vs {self.baseline_ms:.3g} ms, {self.rounds} paired rounds, "
                f"{self.threads} thread{'' if self.threads == 1 else 's'}, {self.confidence:.0%} interval")

    def to_dict(self) -> dict[str, Any]:
        return {"speedup": self.ratio, "speedup_low": self.low, "speedup_high": self.high,
                "speedup_verdict": self.verdict, "speedup_rounds": self.rounds,
                "speedup_disturbed_rounds": self.disturbed}


def _runner(model: nn.Module, inputs):
    if isinstance(inputs, dict):
        return lambda: model(**inputs)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    return lambda: model(*inputs)


def _timed(fn, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def speedup(model: nn.Module, baseline: nn.Module, task_or_inputs, *, batch_size: int | None = None,
            threads: int | None = None, warmup: int = 2, min_rounds: int = 8, max_rounds: int = 400,
            rel_width: float = 0.05, budget_s: float = 2.0, confidence: float = 0.95,
            min_effect: float = 0.03) -> Speedup:
    """``baseline`` time / ``model`` time on the same inputs, measured in paired, alternating rounds (see the
    module docstring). ``task_or_inputs``: a task or a task's name (its ``example_inputs(batch_size)``), a tensor,
    a tuple of tensors, or a dict of keyword inputs. ``threads``: CPU threads for both (default: torch's current
    setting)."""
    from workbench.measurement.latency import num_threads
    from workbench.tasks.base import Task, model_device

    for what, m in (("model", model), ("baseline", baseline)):
        if not isinstance(m, nn.Module):
            raise TypeError(f"speedup: {what} must be a torch.nn.Module, got {type(m).__name__}")
    if min_rounds < 6:
        raise ValueError(f"speedup: min_rounds must be at least 6 for a 95% interval of the median, got {min_rounds}")
    if isinstance(task_or_inputs, str):   # a task's name, as wb.measure takes it
        from workbench import tasks

        task_or_inputs = tasks.load(task_or_inputs)
    if not isinstance(task_or_inputs, (Task, torch.Tensor, tuple, list, dict)):
        raise TypeError(f"speedup: task_or_inputs must be a wb.tasks.Task, a task name, a tensor, a tuple of tensors "
                        f"or a dict of keyword inputs, got {type(task_or_inputs).__name__}")
    inputs = task_or_inputs.example_inputs(batch_size) if isinstance(task_or_inputs, Task) else task_or_inputs
    cuda = model_device(model).type == "cuda"
    run_m, run_b = _runner(model, inputs), _runner(baseline, inputs)
    was = model.training, baseline.training
    model.eval(), baseline.eval()
    ratios: list[float] = []
    tm: list[float] = []
    tb: list[float] = []
    try:
        with num_threads(threads) as used, torch.inference_mode():
            for _ in range(warmup):
                run_b(), run_m()
            start = time.perf_counter()
            while len(ratios) < max_rounds:
                if len(ratios) % 2 == 0:
                    b = _timed(run_b, cuda)
                    m = _timed(run_m, cuda)
                else:
                    m = _timed(run_m, cuda)
                    b = _timed(run_b, cuda)
                tm.append(m)
                tb.append(b)
                ratios.append(b / max(m, 1e-9))
                if len(ratios) >= min_rounds:
                    lo, hi = median_interval(ratios, confidence)
                    mid = _median(ratios)
                    if (hi - lo) <= rel_width * mid or time.perf_counter() - start > budget_s:
                        break
    finally:
        model.train(was[0])
        baseline.train(was[1])
    lo, hi = median_interval(ratios, confidence)
    return Speedup(_median(ratios), lo, hi, _median(tm), _median(tb), len(ratios), used, confidence, min_effect,
                   tuple(tm), disturbed_rounds(tm, tb))


def _median(v: list[float]) -> float:
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
