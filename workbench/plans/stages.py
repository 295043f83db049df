"""Model-level stages: techniques that change the whole model before its layers are compressed.

A stage is a registered config (a frozen dataclass) whose handler is a `registry.StageHandler`: ``apply`` transforms
the model in place (it is `wb.apply`'s copy), ``skeleton`` makes the same structural change without data (for
`wb.load`). A plan lists its stages (``wb.Plan(entries, stages=[...])``); they run in order before the per-layer
entries, inside the same transaction, and round-trip through the plan's JSON.

`FoldBatchNorm`: every BatchNorm folded into the convolution or Linear before it (eval statistics; found by torch.fx
tracing, else by order inside ``nn.Sequential``: `workbench.models.fuse`), so quantization acts on the weights that
really compute. ``wb.Plan(entries, fold_batchnorm=True)`` is the same plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torch import nn

from workbench.plans.registry import Config, StageHandler, register_config

__all__ = ["FoldBatchNorm"]


def _fold(model: nn.Module) -> None:
    from workbench.models.fuse import fold_batchnorm

    was = model.training
    model.eval()   # folding uses the running statistics (eval semantics)
    try:
        fold_batchnorm(model)
    finally:
        model.train(was)


class _FoldBatchNormHandler(StageHandler):
    def apply(self, model: nn.Module, config: Config, calibration: Sequence) -> None:
        _fold(model)

    def skeleton(self, model: nn.Module, config: Config) -> None:
        _fold(model)   # the structure (convolutions gain their biases, BatchNorms become identities); meta works too


@register_config(_FoldBatchNormHandler(), kind="plans.FoldBatchNorm")
@dataclass(frozen=True)
class FoldBatchNorm(Config):
    """Fold every BatchNorm into the convolution or Linear before it (eval statistics) before compressing."""
