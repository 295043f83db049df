"""Low-rank factorisation (`wb.lowrank`): replace a Linear by two thinner Linears from a truncated SVD.

    W (out x in) ~ U_r S_r V_r^T   ->   down = sqrt(S_r) V_r^T  (r x in),   up = U_r sqrt(S_r)  (out x r)

``SVD(rank=r)`` keeps r singular values; ``SVD(energy=e)`` keeps the fewest whose squared sum reaches
``e`` of the total (the rank is then recorded per layer, so a saved model reloads with the same shapes).
The factorisation only saves parameters and FLOPs when ``r < out * in / (out + in)``; `summary` reports both.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workbench.plans.registry import Config, register_config

__all__ = ["SVD", "LowRankLinear", "summary"]


class LowRankLinear(nn.Module):
    """y = up(down(x)): ``down`` (in -> rank, no bias), ``up`` (rank -> out, with the original bias)."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True, device=None):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.down = nn.Linear(in_features, rank, bias=False, device=device)
        self.up = nn.Linear(rank, out_features, bias=bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in)
        return self.up(self.down(x))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


def choose_rank(singular_values: torch.Tensor, energy: float) -> int:
    e = singular_values.double().pow(2)
    cum = torch.cumsum(e, 0) / e.sum()
    return int(torch.searchsorted(cum, torch.tensor(energy, dtype=cum.dtype)).item()) + 1


class _SVDHandler:
    def supports(self, module: nn.Module, config) -> bool:
        return type(module) is nn.Linear

    def needs_calibration(self, config) -> bool:
        return False

    def apply(self, name, module, config, inputs):
        W = module.weight.detach()
        if not torch.isfinite(W).all():
            raise ValueError(f"weight of {name!r} contains NaN or Inf")
        max_rank = min(W.shape)
        if config.rank is not None and config.rank > max_rank:
            raise ValueError(f"rank {config.rank} exceeds min(out, in) = {max_rank} for {name!r} {tuple(W.shape)}")
        U, S, Vh = torch.linalg.svd(W.double(), full_matrices=False)
        r = config.rank if config.rank is not None else min(choose_rank(S, config.energy), max_rank)
        root = S[:r].sqrt()
        new = LowRankLinear(module.in_features, module.out_features, r, module.bias is not None)
        with torch.no_grad():
            new.down.weight.copy_((root[:, None] * Vh[:r]).to(W.dtype))        # (r, in)
            new.up.weight.copy_((U[:, :r] * root[None, :]).to(W.dtype))        # (out, r)
            if module.bias is not None:
                new.up.bias.copy_(module.bias)
        return new

    def resolved(self, config, new: LowRankLinear) -> "SVD":
        return SVD(rank=new.rank)

    def skeleton(self, name, module, config):
        if config.rank is None:
            raise ValueError(f"{name!r}: an energy-based SVD has no fixed rank; saved plans record SVD(rank=...)")
        return LowRankLinear(module.in_features, module.out_features, config.rank, module.bias is not None,
                             device=module.weight.device)


@register_config(_SVDHandler(), kind="lowrank.SVD")
@dataclass(frozen=True)
class SVD(Config):
    """Truncated SVD of a Linear: give ``rank`` or ``energy`` (fraction of squared singular values kept)."""

    rank: int | None = None
    energy: float | None = None

    def __post_init__(self):
        if (self.rank is None) == (self.energy is None):
            raise ValueError("SVD needs exactly one of rank= or energy=")
        if self.rank is not None and (not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1):
            raise ValueError(f"SVD.rank must be a positive int, got {self.rank!r}")
        if self.energy is not None and not 0.0 < self.energy <= 1.0:
            raise ValueError(f"SVD.energy must be in (0, 1], got {self.energy!r}")


def summary(original: nn.Module, factorised: nn.Module):
    """Per factorised layer: rank, parameters and multiply-adds per token before and after (a DataFrame)."""
    import pandas as pd

    rows = []
    for name, m in factorised.named_modules():
        if isinstance(m, LowRankLinear):
            before = m.in_features * m.out_features
            after = m.rank * (m.in_features + m.out_features)
            rows.append({"layer": name, "shape": (m.out_features, m.in_features), "rank": m.rank,
                         "params_before": before, "params_after": after, "params_saved": before - after,
                         "macs_per_token_before": before, "macs_per_token_after": after})
    return pd.DataFrame(rows)
