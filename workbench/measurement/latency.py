"""Latency of ``model(*inputs)``: warm-up, then timed runs; median and p90 in milliseconds.

CPU: ``time.perf_counter`` around each call. CUDA: CUDA events around each call and a synchronise,
so queued kernels are counted. The thread count is set for the measurement and restored afterwards
(importing the workbench never changes it).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from workbench.tasks.inputs import call  # model(*inputs), or model(**inputs) for keyword inputs

__all__ = ["Latency", "time_forward", "num_threads", "threads_option"]


@contextlib.contextmanager
def num_threads(n: int | None):
    """Run the block with ``torch.set_num_threads(n)``, restoring the previous value."""
    before = torch.get_num_threads()
    if n is not None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"threads must be a positive int, got {n!r}")
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def threads_option(fn):
    """Give ``fn`` a keyword argument ``threads`` (default None: leave torch's setting alone): the call runs
    under `num_threads` and the previous thread count is restored afterwards, also on error or interrupt."""
    @functools.wraps(fn)
    def wrapper(*args, threads: int | None = None, **kwargs):
        with num_threads(threads):
            return fn(*args, **kwargs)

    sig = inspect.signature(fn)
    extra = inspect.Parameter("threads", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="int | None")
    wrapper.__signature__ = sig.replace(parameters=[*sig.parameters.values(), extra])
    return wrapper


@dataclass(frozen=True)
class Latency:
    median_ms: float
    p90_ms: float
    runs: int
    threads: int


def time_forward(model: nn.Module, inputs: tuple, *, warmup: int = 3, min_runs: int = 5, max_runs: int = 50,
                 budget_s: float = 2.0, threads: int | None = None) -> Latency:
    """Time ``model(*inputs)`` (``model(**inputs)`` for keyword inputs): ``warmup`` untimed calls, then between
    ``min_runs`` and ``max_runs`` timed calls, stopping early once ``budget_s`` seconds have been spent."""
    from workbench.tasks.base import model_device

    cuda = model_device(model).type == "cuda"
    times: list[float] = []
    with num_threads(threads) as used, torch.inference_mode():
        for _ in range(warmup):
            call(model, inputs)
        if cuda:
            torch.cuda.synchronize()
        start_all = time.perf_counter()
        while len(times) < max_runs and (len(times) < min_runs or time.perf_counter() - start_all < budget_s):
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                call(model, inputs)
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                call(model, inputs)
                times.append((time.perf_counter() - t0) * 1e3)
    arr = np.asarray(times)
    return Latency(float(np.median(arr)), float(np.percentile(arr, 90)), len(arr), used)
