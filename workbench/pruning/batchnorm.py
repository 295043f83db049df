"""`reestimate_batchnorm`: fresh BatchNorm running statistics for a pruned (or otherwise compressed) model.

Pruning changes what every later layer sees: the running mean and variance a BatchNorm learned on the dense
network no longer describe its inputs, and at eval time it normalises with the wrong numbers. Re-estimating them
on a few hundred unlabelled calibration samples (no gradients, no weight changes) recovers much of the loss -
the "BN recalibration" step of the pruning literature.

    small = wb.apply(model, {"*": wb.prune.Magnitude(0.3)})
    fixed = wb.prune.reestimate_batchnorm(small, task.calibration(256))
"""
from __future__ import annotations

import copy
from typing import Iterable

import torch
from torch import nn
from tqdm.auto import tqdm

__all__ = ["reestimate_batchnorm"]

_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def reestimate_batchnorm(model: nn.Module, calibration: Iterable, *, inplace: bool = False,
                         progress: bool = True) -> nn.Module:
    """A copy of ``model`` (or ``model`` itself with ``inplace=True``) whose BatchNorm running statistics are
    recomputed as the plain average over ``calibration`` (input batches: tensors, tuples or dicts of keyword
    inputs). Only the statistics change: weights, biases and the recorded plans are kept, so `wb.save` /
    `wb.load` work as before. Raises if the model has no BatchNorm with running statistics or no batch is given."""
    from workbench.plans.apply import normalize_calibration
    from workbench.tasks.inputs import call

    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    target = model if inplace else copy.deepcopy(model)
    bns = [m for m in target.modules() if isinstance(m, _BN) and m.track_running_stats]
    if not bns:
        raise ValueError(f"{type(model).__name__} has no BatchNorm layer with running statistics to re-estimate")
    batches = normalize_calibration(calibration, target)
    if not batches:
        raise ValueError("reestimate_batchnorm needs at least one calibration batch")
    saved = [(m.momentum, m.training) for m in bns]
    was = target.training
    target.eval()
    try:
        for m in bns:
            m.reset_running_stats()
            m.momentum = None   # a cumulative (equal-weight) average over every batch
            m.train()           # only the BatchNorms update their statistics; dropout and the rest stay in eval
        with torch.no_grad():
            for batch in tqdm(batches, desc="BatchNorm statistics", leave=False, disable=not progress):
                call(target, batch)
    finally:
        for m, (momentum, training) in zip(bns, saved):
            m.momentum = momentum
            m.train(training)
        target.train(was)
    return target
