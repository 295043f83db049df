"""Pruning masks: pure functions from weights to boolean keep-masks (True = keep).

- `magnitude_mask(w, sparsity)`: prune the ``round(sparsity * numel)`` smallest |w| (ties broken by position).
- `random_mask(w, sparsity, seed)`: the same count, chosen uniformly at random (the baseline).
- `nm_mask(w, n, m)`: N:M semi-structured - keep the ``n`` largest |w| of every ``m`` consecutive input channels
  (for a convolution: at each kernel position, as sparse tensor cores need), e.g. 2:4; `nm_groups` /
  `nm_ungroup` give those groups.
- `global_sparsities(weights, sparsity)`: one magnitude threshold across many layers -> each layer's sparsity.
"""
from __future__ import annotations

import torch

__all__ = ["check_sparsity", "prune_lowest", "magnitude_mask", "random_mask", "nm_mask", "nm_groups", "nm_ungroup",
           "global_sparsities"]


def check_sparsity(sparsity: float, what: str = "sparsity") -> float:
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
        raise ValueError(f"{what} must be in [0, 1), got {sparsity!r}")
    return float(sparsity)


def prune_lowest(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Keep-mask of ``scores`` (any shape) with its ``count`` lowest entries pruned. The sort is stable: equal
    scores are pruned in index order, so masks are deterministic."""
    flat = scores.reshape(-1)
    keep = torch.ones_like(flat, dtype=torch.bool)
    if count > 0:
        keep[torch.sort(flat, stable=True).indices[:count]] = False
    return keep.reshape(scores.shape)


def magnitude_mask(w: torch.Tensor, sparsity: float) -> torch.Tensor:
    check_sparsity(sparsity)
    return prune_lowest(w.detach().abs().float(), round(sparsity * w.numel()))


def random_mask(w: torch.Tensor, sparsity: float, seed: int = 0) -> torch.Tensor:
    check_sparsity(sparsity)
    scores = torch.rand(w.shape, generator=torch.Generator().manual_seed(seed))
    return prune_lowest(scores, round(sparsity * w.numel())).to(w.device)


def nm_groups(x: torch.Tensor, m: int) -> torch.Tensor:
    """``x`` (a weight or mask, ``(out, in)`` or a convolution's ``(out, in/groups, *kernel)``) as ``(groups, m)``:
    ``m`` consecutive input channels at one output and one kernel position per row - the groups sparse tensor
    cores (and NVIDIA's ASP) use, never a mix of kernel positions. `nm_ungroup` is its inverse."""
    inputs_last = x.movedim(1, -1) if x.ndim > 2 else x                           # (out, *kernel, in)
    return inputs_last.reshape(-1, m)                                            # (groups, m)


def nm_ungroup(groups: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The inverse of `nm_groups`: ``(groups, m)`` back to a tensor of ``shape``."""
    if len(shape) <= 2:
        return groups.reshape(shape)
    inputs_last = groups.reshape(shape[0], *shape[2:], shape[1])                 # (out, *kernel, in)
    return inputs_last.movedim(-1, 1).contiguous()


def nm_mask(w: torch.Tensor, n: int = 2, m: int = 4, name: str = "") -> torch.Tensor:
    """Keep the ``n`` largest |w| of every ``m`` consecutive input channels (dim 1): along the inputs of a Linear,
    and at each kernel position of a convolution. The input channels (per group, for a grouped convolution)
    must be a multiple of ``m``; ``name`` (the layer) goes into the error otherwise."""
    if not (isinstance(n, int) and isinstance(m, int) and 0 < n < m):
        raise ValueError(f"N:M needs integers 0 < n < m, got {n}:{m}")
    if w.ndim < 2:
        raise ValueError(f"N:M needs a weight of 2 or more dimensions, got shape {tuple(w.shape)}")
    K = w.shape[1]
    if K % m:
        where = f"{name!r}: " if name else ""
        what = "input channels per group" if w.ndim > 2 else "input dimension"
        raise ValueError(f"{where}N:M {n}:{m} needs the input dimension to be a multiple of {m}, got {K} ({what} of "
                         f"weight {tuple(w.shape)}; groups of {m} run along the input channels at each kernel "
                         f"position): prune this layer another way or leave it dense")
    groups = nm_groups(w.detach().abs().float(), m)                              # (groups, m)
    top = torch.topk(groups, n, dim=1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, top, True)
    return nm_ungroup(mask, w.shape)


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
