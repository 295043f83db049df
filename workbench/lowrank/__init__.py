"""Low-rank factorisation (`wb.lowrank`): replace a Linear by two thinner Linears from a truncated SVD.

    W (out x in) ~ U_r S_r V_r^T   ->   down = sqrt(S_r) V_r^T  (r x in),   up = U_r sqrt(S_r)  (out x r)

``SVD(rank=r)`` keeps r singular values; ``SVD(energy=e)`` keeps the fewest whose squared sum reaches
``e`` of the total (the rank is then recorded per layer, so a saved model reloads with the same shapes).
The factorisation only saves parameters and FLOPs when ``r < out * in / (out + in)``; `summary` reports both.

`LowRankLinear` is a drop-in for the nn.Linear it replaces: ``in_features``, ``out_features``, ``bias`` and
``weight`` are there. Its ``weight`` is the product ``up.weight @ down.weight`` (out x in): while gradients are
recorded, that product itself (so ``layer.weight`` trains the factors); otherwise a `FactoredWeight` - a tensor
whose shape, dtype and device are read for free (Hugging Face's ``wo.weight.dtype`` checks) and which
multiplies the factors out only when an operation reads its values. Being a tensor subclass, it also turns
PyTorch's fused ``TransformerEncoderLayer`` path off, so the layer runs its own two thin matmuls.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_map

from workbench.plans import lookalike
from workbench.plans.registry import Config, Handler, register_config

__all__ = ["SVD", "LowRankLinear", "FactoredWeight", "summary"]


class FactoredWeight(torch.Tensor):
    """The weight ``up @ down`` of a `LowRankLinear`, multiplied out only when an operation reads its values.

    Metadata (shape, dtype, device) costs nothing; any operation on it runs on the dense product (computed for
    that operation, never stored). Not differentiable: `LowRankLinear.weight` returns the plain product while
    gradients are recorded."""

    @staticmethod
    def __new__(cls, up: torch.Tensor, down: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, (up.shape[0], down.shape[1]), dtype=up.dtype,
                                                   device=up.device, requires_grad=False)

    def __init__(self, up: torch.Tensor, down: torch.Tensor):
        self.up, self.down = up, down                                           # (out, r), (r, in)

    def dense(self) -> torch.Tensor:
        return self.up.detach() @ self.down.detach()                            # (out, in)

    def __repr__(self) -> str:
        return f"FactoredWeight(shape={tuple(self.shape)}, rank={self.up.shape[1]}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t.dense() if isinstance(t, FactoredWeight) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


class LowRankLinear(nn.Module):
    """y = up(down(x)): ``down`` (in -> rank, no bias), ``up`` (rank -> out, with the original bias)."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.down = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.up = nn.Linear(rank, out_features, bias=bias, device=device, dtype=dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The effective (out, in) weight: see the module docstring."""
        up, down = self.up.weight, self.down.weight
        if torch.is_grad_enabled() and (up.requires_grad or down.requires_grad):
            return up @ down
        return FactoredWeight(up, down)

    @property
    def bias(self) -> torch.Tensor | None:
        return self.up.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in)
        return self.up(self.down(x))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


def choose_rank(singular_values: torch.Tensor, energy: float) -> int:
    e = singular_values.double().pow(2)
    cum = torch.cumsum(e, 0) / e.sum()
    return int(torch.searchsorted(cum, torch.tensor(energy, dtype=cum.dtype)).item()) + 1


class _SVDHandler(Handler):
    def why_not(self, module: nn.Module, config) -> str | None:
        if not isinstance(module, nn.Linear):
            return "SVD factorises an nn.Linear's weight"
        if type(module).forward is nn.Linear.forward:
            return None
        # its own forward must compute nn.Linear's (checked on a probe); a layer the workbench produced (a cast, a
        # QAT layer) is a result, not an input
        own = f"{type(module).__name__} has its own forward, which two thin nn.Linears would not reproduce"
        if type(module).__module__.partition(".")[0] == "workbench":
            return own
        found = lookalike.computation(module)
        return None if found.taken else f"{own}: {found.reason}"

    def supports(self, module: nn.Module, config) -> bool:
        return self.why_not(module, config) is None

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
        out_f, in_f = W.shape
        if r * (out_f + in_f) >= out_f * in_f:
            # two factors of rank r hold r (out + in) values: at or above the dense weight's, no compression
            even = (out_f * in_f) // (out_f + in_f)
            kept = float((S[:even] ** 2).sum() / (S ** 2).sum()) if even else 0.0
            raise ValueError(f"{name!r} {tuple(W.shape)}: rank {r} ({config}) would store {r * (out_f + in_f):,} "
                             f"values, not fewer than the dense {out_f * in_f:,}; the largest rank that saves bytes "
                             f"is {even} ({kept:.0%} of the energy) - use a smaller rank / energy, or leave "
                             f"{name!r} out of the plan")
        root = S[:r].sqrt()
        new = LowRankLinear(module.in_features, module.out_features, r, module.bias is not None,
                            device=W.device, dtype=W.dtype)
        with torch.no_grad():
            new.down.weight.copy_((root[:, None] * Vh[:r]).to(W.dtype))        # (r, in)
            new.up.weight.copy_((U[:, :r] * root[None, :]).to(W.dtype))        # (out, r)
            if module.bias is not None:
                new.up.bias.copy_(module.bias)
        return lookalike.kept(module, new)

    def resolved(self, config, new: LowRankLinear) -> "SVD":
        return SVD(rank=new.rank)

    def skeleton(self, name, module, config):
        if config.rank is None:   # `apply` records SVD(rank=...) per layer (`resolved`), ahead of the pattern
            raise ValueError(f"{name!r}: an energy-based SVD has no fixed rank; saved plans record SVD(rank=...) "
                             f"for every layer it factorised, so this layer was not factorised when it was saved")
        return LowRankLinear(module.in_features, module.out_features, config.rank, module.bias is not None,
                             device=module.weight.device, dtype=module.weight.dtype)


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
