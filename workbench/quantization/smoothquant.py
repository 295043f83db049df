"""SmoothQuant (Xiao et al., 2023): migrate activation outliers into the weights before W8A8.

For a Linear with inputs X ``(tokens, K)`` and weight W ``(N, K)``, per input channel j:

    s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha)         X' = X / s,   W' = W * s   (X' W'^T = X W^T)

``alpha`` = 0 leaves activations alone, 1 moves all their range into the weights; 0.5 is the paper's default
for most models. Channels that never fire (max |X_j| = 0) keep s_j = 1.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["activation_absmax", "smoothing_factors"]


def activation_absmax(inputs: Sequence[tuple[torch.Tensor, ...]] | None, in_features: int,
                      name: str = "layer") -> torch.Tensor:
    """max |x_j| over every calibration token, per input channel ``(K,)``."""
    if not inputs:
        raise ValueError(f"SmoothQuant needs calibration inputs for {name!r}, and none were recorded")
    amax = torch.zeros(in_features)
    for batch in inputs:
        x = batch[0].detach().float().reshape(-1, in_features).cpu()
        amax = torch.maximum(amax, x.abs().amax(dim=0))
    return amax


def smoothing_factors(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """The per-input-channel factors ``s`` ``(K,)``."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"SmoothQuant alpha must be in [0, 1], got {alpha}")
    w_absmax = weight.detach().float().abs().amax(dim=0).cpu().clamp(min=1e-5)   # (K,)
    s = act_absmax.clamp(min=1e-5).pow(alpha) / w_absmax.pow(1 - alpha)
    return torch.where(act_absmax > 0, s, torch.ones_like(s)).clamp(min=1e-5)
