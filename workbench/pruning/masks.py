"""Pruning masks: pure functions from weights to boolean keep-masks (True = keep).

- `magnitude_mask(w, sparsity)`: prune the ``round(sparsity * numel)`` smallest |w| (ties broken by position).
- `random_mask(w, sparsity, seed)`: the same count, chosen uniformly at random (the baseline).
- `nm_mask(w, n, m)`: N:M semi-structured - keep the ``n`` largest |w| of every ``m`` consecutive weights
  along the input (last) dimension, e.g. 2:4 for sparse tensor cores.
- `global_sparsities(weights, sparsity)`: one magnitude threshold across many layers -> each layer's sparsity.
"""
from __future__ import annotations

import torch

__all__ = ["check_sparsity", "magnitude_mask", "random_mask", "nm_mask", "global_sparsities"]


def check_sparsity(sparsity: float, what: str = "sparsity") -> float:
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
        raise ValueError(f"{what} must be in [0, 1), got {sparsity!r}")
    return float(sparsity)


def _keep_largest(scores: torch.Tensor, prune: int) -> torch.Tensor:
    flat = scores.reshape(-1)
    mask = torch.ones_like(flat, dtype=torch.bool)
    if prune > 0:
        # stable sort: equal scores are pruned in index order, so masks are deterministic
        idx = torch.sort(flat, stable=True).indices[:prune]
        mask[idx] = False
    return mask.reshape(scores.shape)


def magnitude_mask(w: torch.Tensor, sparsity: float) -> torch.Tensor:
    check_sparsity(sparsity)
    return _keep_largest(w.detach().abs().float(), round(sparsity * w.numel()))


def random_mask(w: torch.Tensor, sparsity: float, seed: int = 0) -> torch.Tensor:
    check_sparsity(sparsity)
    scores = torch.rand(w.shape, generator=torch.Generator().manual_seed(seed))
    return _keep_largest(scores, round(sparsity * w.numel())).to(w.device)


def nm_mask(w: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    if not (isinstance(n, int) and isinstance(m, int) and 0 < n < m):
        raise ValueError(f"N:M needs integers 0 < n < m, got {n}:{m}")
    K = w.shape[-1]
    if K % m:
        raise ValueError(f"N:M {n}:{m} needs the input dimension to be a multiple of {m}, got {K}")
    groups = w.detach().abs().float().reshape(-1, m)                               # (groups, m)
    top = torch.topk(groups, n, dim=1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, top, True)
    return mask.reshape(w.shape)


def global_sparsities(weights: dict[str, torch.Tensor], sparsity: float) -> dict[str, float]:
    """Per-layer sparsity that one global |w| threshold gives when ``sparsity`` of all weights are pruned."""
    check_sparsity(sparsity)
    if not weights:
        raise ValueError("global pruning needs at least one layer")
    scores = torch.cat([w.detach().abs().float().reshape(-1) for w in weights.values()])
    prune = round(sparsity * scores.numel())
    if prune == 0:
        return {name: 0.0 for name in weights}
    threshold = torch.sort(scores).values[prune - 1]
    out = {}
    for name, w in weights.items():
        out[name] = float((w.detach().abs().float() <= threshold).sum()) / w.numel()
    return out
