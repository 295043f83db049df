"""Pruning configs (registered with the plan registry).

    wb.prune.Magnitude(sparsity=0.5)                  # unstructured, smallest |w| first
    wb.prune.Random(sparsity=0.5, seed=0)             # the baseline
    wb.prune.NM(n=2, m=4)                             # semi-structured along the input dimension
    wb.prune.global_plan(model, ["fc*", "conv*"], 0.7) # one magnitude threshold across layers

``storage`` decides what the pruned layer keeps:

- ``"mask"`` (default): the dense weight and its mask (`PrunedLinear` / `PrunedConv2d`) - fine-tune it, then
  `finalize` it to another storage;
- ``"dense"``: a plain layer whose pruned weights are zeros (no bytes saved, nothing to carry);
- ``"csr"``: `SparseLinear` (nn.Linear only), which stores only the kept weights;
- ``"2:4"``: `SemiStructuredLinear` (nn.Linear, ``NM(2, 4)`` only): the kept half of the weights plus 2-bit
  positions (0.52x the fp32 bytes); on CUDA its ``kernel="semi_structured"`` path multiplies with
  ``torch.sparse.to_sparse_semi_structured`` (see `SemiStructuredLinear`).

Masks keep an exact count of weights (``numel - round(sparsity * numel)``; N:M keeps ``n/m``), so a saved
file's structure follows from its plan alone.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
from torch import nn

from workbench.plans.apply import PLANS_ATTR, applied_plans
from workbench.plans.plan import Plan
from workbench.plans.registry import Config, register_config
from workbench.pruning import masks
from workbench.pruning.modules import PrunedConv2d, PrunedLinear, SemiStructuredLinear, SparseLinear

__all__ = ["Magnitude", "Random", "NM", "global_plan", "finalize", "STORAGES", "sparsity_of"]

STORAGES = ("mask", "dense", "csr", "2:4")


def _mask_for(config, w2d: torch.Tensor) -> torch.Tensor:
    if isinstance(config, Magnitude):
        return masks.magnitude_mask(w2d, config.sparsity)
    if isinstance(config, Random):
        return masks.random_mask(w2d, config.sparsity, config.seed)
    return masks.nm_mask(w2d, config.n, config.m)


def _kept(config, numel: int) -> int:
    if isinstance(config, NM):
        return numel // config.m * config.n
    return numel - round(config.sparsity * numel)


def _build(module: nn.Module, config, mask: torch.Tensor | None) -> nn.Module:
    """The pruned module of ``config.storage``; ``mask`` None builds the empty structure (for wb.load)."""
    w = module.weight
    if config.storage == "2:4":
        if mask is None:
            return SemiStructuredLinear(module.in_features, module.out_features, module.bias is not None,
                                        dtype=w.dtype, device=w.device)
        return SemiStructuredLinear.from_dense(w, mask.reshape(w.shape), module.bias)
    if config.storage == "csr":
        if mask is None:
            return SparseLinear(module.in_features, module.out_features, _kept(config, w.numel()),
                                module.bias is not None, device=w.device)
        return SparseLinear.from_dense(w, mask.reshape(w.shape), module.bias)
    if config.storage == "dense":
        new = copy.deepcopy(module)
        if mask is not None:
            with torch.no_grad():
                new.weight.mul_(mask.reshape(w.shape))
        return new
    cls = PrunedLinear if type(module) is nn.Linear else PrunedConv2d
    new = copy.deepcopy(module)
    new.__class__ = cls  # same constructor arguments and parameters; only forward and the mask differ
    new.register_buffer("mask", mask.reshape(w.shape).clone() if mask is not None
                        else torch.ones(w.shape, dtype=torch.bool, device=w.device))
    return new


class _PruneHandler:
    def supports(self, module: nn.Module, config) -> bool:
        if config.storage in ("csr", "2:4"):
            return type(module) in (nn.Linear, PrunedLinear)
        return type(module) in (nn.Linear, nn.Conv2d, PrunedLinear, PrunedConv2d)

    def needs_calibration(self, config) -> bool:
        return False

    def apply(self, name, module, config, inputs):
        w = module.weight.detach()
        if hasattr(module, "mask"):  # pruning a pruned layer: what is pruned scores 0 and stays pruned
            w = w * module.mask
        w2d = w.reshape(w.shape[0], -1)
        if not torch.isfinite(w2d).all():
            raise ValueError(f"weight of {name!r} contains NaN or Inf")
        mask = _mask_for(config, w2d)
        if hasattr(module, "mask"):
            mask &= module.mask.reshape(w2d.shape)
        plain = _plain(module)
        return _build(plain, config, mask)

    def skeleton(self, name, module, config):
        return _build(_plain(module), config, None)


def _plain(module: nn.Module) -> nn.Module:
    """A plain nn.Linear / nn.Conv2d copy of a (possibly already pruned) layer."""
    if type(module) in (PrunedLinear, PrunedConv2d):
        new = copy.deepcopy(module)
        new.__class__ = nn.Linear if type(module) is PrunedLinear else nn.Conv2d
        del new._buffers["mask"]
        return new
    return module


def _check_storage(config) -> None:
    if config.storage not in STORAGES:
        raise ValueError(f"{type(config).__name__}.storage must be one of {STORAGES}, got {config.storage!r}")
    if config.storage == "2:4" and not (isinstance(config, NM) and (config.n, config.m) == (2, 4)):
        raise ValueError(f"storage '2:4' holds 2:4 semi-structured weights: use wb.prune.NM(2, 4, storage='2:4'), "
                         f"not {config!r}")


_HANDLER = _PruneHandler()


@register_config(_HANDLER, kind="prune.Magnitude")
@dataclass(frozen=True)
class Magnitude(Config):
    """Unstructured magnitude pruning of ``sparsity`` of the layer's weights."""

    sparsity: float = 0.5
    storage: str = "mask"

    def __post_init__(self):
        masks.check_sparsity(self.sparsity, "Magnitude.sparsity")
        _check_storage(self)


@register_config(_HANDLER, kind="prune.Random")
@dataclass(frozen=True)
class Random(Config):
    """Random unstructured pruning (the baseline every criterion must beat)."""

    sparsity: float = 0.5
    seed: int = 0
    storage: str = "mask"

    def __post_init__(self):
        masks.check_sparsity(self.sparsity, "Random.sparsity")
        _check_storage(self)


@register_config(_HANDLER, kind="prune.NM")
@dataclass(frozen=True)
class NM(Config):
    """N:M semi-structured magnitude pruning along the input dimension (2:4 by default)."""

    n: int = 2
    m: int = 4
    storage: str = "mask"

    def __post_init__(self):
        if not (isinstance(self.n, int) and isinstance(self.m, int) and 0 < self.n < self.m):
            raise ValueError(f"NM needs integers 0 < n < m, got {self.n}:{self.m}")
        _check_storage(self)


def global_plan(model: nn.Module, patterns, sparsity: float, storage: str = "mask") -> Plan:
    """A plan of per-layer `Magnitude` configs from one |w| threshold over the selected layers."""
    probe = Plan({p: Magnitude(0.0) for p in ([patterns] if isinstance(patterns, str) else patterns)})
    layers = {a.name: model.get_submodule(a.name).weight for a in probe.resolve(model)}
    per_layer = masks.global_sparsities(layers, sparsity)
    for name, s in per_layer.items():
        if s >= 1.0:
            raise ValueError(f"global sparsity {sparsity} would prune every weight of {name!r}")
    return Plan({name: Magnitude(s, storage) for name, s in per_layer.items()})


def sparsity_of(model: nn.Module) -> dict[str, float]:
    """Fraction of zero (or masked) weights of each Linear / Conv2d / pruned layer."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (SparseLinear, SemiStructuredLinear)):
            out[name] = 1 - m.values.numel() / (m.in_features * m.out_features)
        elif isinstance(m, (nn.Linear, nn.Conv2d)):
            w = m.weight * m.mask if hasattr(m, "mask") else m.weight
            out[name] = float((w == 0).float().mean())
    return out


def finalize(model: nn.Module, storage: str = "dense") -> nn.Module:
    """A copy of a model pruned with ``storage="mask"`` (e.g. after fine-tuning) with its masks made permanent
    in ``storage`` ("dense", "csr" or, for 2:4 masks, "2:4"). The recorded plans are rewritten to that storage,
    so `wb.save` / `wb.load` rebuild the same structure."""
    if storage not in ("dense", "csr", "2:4"):
        raise ValueError(f"finalize storage must be 'dense', 'csr' or '2:4', got {storage!r}")
    plans = applied_plans(model)
    target = copy.deepcopy(model)
    replacements = {}
    for name, m in target.named_modules():
        if type(m) in (PrunedLinear, PrunedConv2d):
            if storage in ("csr", "2:4") and type(m) is PrunedConv2d:
                raise ValueError(f"{name!r}: {storage} storage is for nn.Linear; finalize convolutions as 'dense'")
            plain = _plain(m)
            if storage == "csr":
                replacements[name] = SparseLinear.from_dense(plain.weight, m.mask, plain.bias)
            elif storage == "2:4":
                replacements[name] = SemiStructuredLinear.from_dense(plain.weight, m.mask, plain.bias, name)
            else:
                replacements[name] = _build(plain, Magnitude(0.0, "dense"), m.mask)
    for name, new in replacements.items():
        target.set_submodule(name, new)

    def restore(config):
        if not (isinstance(config, (Magnitude, Random, NM)) and config.storage == "mask"):
            return config
        return replace(config, storage=storage)  # (a "2:4" finalize only gets here with NM(2, 4): checked above)

    object.__setattr__(target, PLANS_ATTR, tuple(Plan({p: (restore(c) if c is not None else None)
                                                       for p, c in plan.items()}) for plan in plans))
    return target.eval() if not model.training else target
