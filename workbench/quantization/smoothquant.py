"""SmoothQuant (Xiao et al., 2023): migrate activation outliers into the weights before W8A8.

For a Linear with inputs X ``(tokens, K)`` and weight W ``(N, K)``, per input channel j:

    s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha)         X' = X / s,   W' = W * s   (X' W'^T = X W^T)

``alpha`` = 0 leaves activations alone, 1 moves all their range into the weights; 0.5 is the paper's default
for most models. Channels that never fire (max |X_j| = 0) keep s_j = 1.
"""
from __future__ import annotations

from typing import Sequence

import torch

from workbench.plans.registry import Accumulator

__all__ = ["activation_absmax", "AbsMaxAccumulator", "smoothing_factors"]


class AbsMaxAccumulator(Accumulator):
    """max |x_j| per input channel, one batch at a time (``add`` is what a forward pre-hook calls)."""

    def __init__(self, in_features: int, name: str = "layer"):
        self.K, self.name = in_features, name
        self.amax = torch.zeros(in_features)   # (K,)
        self.n = 0

    def add(self, batch: tuple[torch.Tensor, ...]) -> None:
        x = batch[0].detach().float().reshape(-1, self.K).cpu()   # (tokens, K)
        self.amax = torch.maximum(self.amax, x.abs().amax(dim=0))
        self.n += 1

    def value(self) -> torch.Tensor:
        if self.n == 0:
            raise ValueError(f"SmoothQuant needs calibration inputs for {self.name!r}, and none were recorded")
        return self.amax


def activation_absmax(inputs: Sequence[tuple[torch.Tensor, ...]] | AbsMaxAccumulator | None, in_features: int,
                      name: str = "layer") -> torch.Tensor:
    """max |x_j| over every calibration token, per input channel ``(K,)`` (from the recorded inputs, or an
    accumulator that saw them)."""
    if isinstance(inputs, AbsMaxAccumulator):
        return inputs.value()
    acc = AbsMaxAccumulator(in_features, name)
    for batch in inputs or ():
        acc.add(batch)
    return acc.value()


def smoothing_factors(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """The per-input-channel factors ``s`` ``(K,)``."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"SmoothQuant alpha must be in [0, 1], got {alpha}")
    w_absmax = weight.detach().float().abs().amax(dim=0).cpu().clamp(min=1e-5)   # (K,)
    s = act_absmax.clamp(min=1e-5).pow(alpha) / w_absmax.pow(1 - alpha)
    return torch.where(act_absmax > 0, s, torch.ones_like(s)).clamp(min=1e-5)
