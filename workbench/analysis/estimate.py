"""Estimate the peak memory and time of calibration-heavy work *before* running it.

Calibration (GPTQ, AWQ, static activation ranges, SmoothQuant) and training (QAT, distillation) are where
users run out of memory without warning. These estimates are built from measurements of one step, scaled:

`estimate_calibration(model, plan, calibration)`: the core's (`workbench.plans.estimate`, which
`wb.apply(..., estimate=True)` calls), re-exported here with `Estimate`, `available_memory` and
`matmul_flops_per_s`.

`estimate_training(model, batch, steps)`:
  two training steps are run on a copy (forward, backward, optimizer step, with a teacher when given);
  the peak of the first (which allocates gradients and optimizer state) is replayed from the profiler's
  allocator events and the time of the second is multiplied by ``steps``.

Both return an `Estimate` that prints as a short sentence, says whether it fits in the memory available
now, and keeps its parts (``parts``) for inspection. Tests compare the estimates against measured runs.
"""
from __future__ import annotations

import copy
import time
from typing import Callable

import torch
from torch import nn

from workbench.measurement.footprint import peak_allocated_during, size_bytes
from workbench.plans.estimate import Estimate, available_memory, estimate_calibration, matmul_flops_per_s

__all__ = ["Estimate", "estimate_calibration", "estimate_training", "available_memory", "matmul_flops_per_s"]


def estimate_training(model: nn.Module, batch: tuple[torch.Tensor, ...], steps: int, *,
                      loss_fn: Callable[..., torch.Tensor] | None = None, teacher: nn.Module | None = None,
                      optimizer_cls=torch.optim.AdamW) -> Estimate:
    """Peak memory and time of ``steps`` training steps of ``model`` on batches like ``batch``
    (the last tensor of ``batch`` is the target; ``loss_fn(output, target)`` defaults to cross-entropy;
    with a ``teacher``, its forward pass is included). Two real steps run on a copy of the model."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise ValueError("batch must be a tuple (inputs..., target)")
    from workbench.tasks.base import model_device

    work = copy.deepcopy(model).train()
    optimizer = optimizer_cls([p for p in work.parameters() if p.requires_grad])
    loss_fn = loss_fn or nn.functional.cross_entropy
    *inputs, target = batch

    def step():
        if teacher is not None:
            with torch.no_grad():
                teacher(*inputs)
        out = work(*inputs)
        loss = loss_fn(out, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    transient = peak_allocated_during(step)  # step 1: gradients and optimizer state are allocated here
    t0 = time.perf_counter()
    step()
    step_s = time.perf_counter() - t0
    resident = size_bytes(model) + (size_bytes(teacher) if teacher is not None else 0)
    parts = {"weights bytes": resident, "step transient bytes": transient, "step s": step_s, "steps": steps}
    return Estimate("training", resident + transient, step_s * steps, available_memory(model_device(model)), parts)
