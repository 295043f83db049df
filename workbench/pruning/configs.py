"""Pruning configs (registered with the plan registry).

    wb.prune.Magnitude(sparsity=0.5)                  # unstructured, smallest |w| first
    wb.prune.Random(sparsity=0.5, seed=0)             # the baseline
    wb.prune.NM(n=2, m=4)                             # semi-structured along the input channels
    wb.prune.Wanda(sparsity=0.5)                      # |w| x input norm (calibrated; nn.Linear); nm=(2, 4) too
    wb.prune.SparseGPT(nm=(2, 4))                     # OBS pruning with error feedback (calibrated; nn.Linear)
    wb.prune.global_plan(model, ["fc*", "conv*"], 0.7) # one magnitude threshold across layers

``storage`` decides what the pruned layer keeps:

- ``"mask"`` (default): the layer, its pruned weights stored as zeros, whose gradients stay zero
  (`PrunedLinear`, `PrunedConv1d`, `PrunedConv2d`, `PrunedEmbedding`, or `pruned_class` of a subclass) - fine-tune
  it, then `finalize` it to another storage; no more bytes than the original, no cost per forward;
- ``"dense"``: the plain layer with its pruned weights as zeros (fine-tuning may regrow them);
- ``"csr"``: `SparseLinear` (nn.Linear only), which stores only the kept weights;
- ``"2:4"``: `SemiStructuredLinear` (nn.Linear, ``NM(2, 4)`` only): the kept half of the weights plus 2-bit
  positions (0.52x the fp32 bytes); on CUDA its ``kernel="semi_structured"`` path multiplies with
  ``torch.sparse.to_sparse_semi_structured`` (see `SemiStructuredLinear`).

Layers are chosen by what they compute: nn.Linear, nn.Conv1d, nn.Conv2d (grouped and depthwise too),
nn.Embedding and their subclasses. A subclass with its own forward (EfficientNet's same-padding convolution)
keeps it - the pruned weight is its own ``.weight`` - once a probe shows it computes its parent's computation
(`workbench.plans.lookalike`) or that its output follows ``.weight``; otherwise it is refused, naming the layer.
csr / 2:4 storages and Wanda / SparseGPT take an nn.Linear that computes nn.Linear's (its own forward, if any,
checked on a probe input: Falcon's ``FalconLinear``).

A mixture of experts' fused experts (transformers 5's ``MixtralExperts``, ``Qwen2MoeExperts``, ``GptOssExperts``:
3-D ``gate_up_proj`` / ``down_proj`` with the experts first, `workbench.quantization.experts.experts_layout`) are
taken too: each expert's matrix is pruned exactly as the config prunes an nn.Linear holding it (N:M groups along
its inputs, whichever way the model stores it); Wanda and SparseGPT score it on the tokens the router sent to that
expert (`oneshot.prune_experts`), and an expert that received fewer than `MIN_EXPERT_TOKENS` of them is pruned by
magnitude at the same sparsity / N:M instead, as its layer's note and `workbench.quantization.experts.coverage`
say. The result is the model's own experts class with the pruned weights stored as zeros in its 3-D parameters
("mask" and "dense" alike: no gradient mask is kept for them, so fine-tuning may regrow them); csr / 2:4 storages
refuse experts. The router stays dense.

Masks keep an exact count of weights (``numel - round(sparsity * numel)``; N:M keeps ``n/m``), so a saved
file's structure follows from its plan alone.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from workbench.plans.layers import applied_plans, record_plan, swap_layers
from workbench.plans.plan import Plan
from workbench.plans.registry import Config, Handler, register_config
from workbench.pruning import masks
from workbench.pruning.modules import PRUNABLE, Pruned, SemiStructuredLinear, SparseLinear, freeze_zeros, pruned_class
from workbench.quantization.experts import (
    MIN_EXPERT_TOKENS,
    experts_layout,
    experts_refusal,
    experts_shell,
    takes_experts,
)

__all__ = ["PruneConfig", "Magnitude", "Random", "NM", "Wanda", "SparseGPT", "global_plan", "finalize", "STORAGES",
           "sparsity_of"]

STORAGES = ("mask", "dense", "csr", "2:4")
UNSTRUCTURED_STORAGES = tuple(s for s in STORAGES if s != "2:4")   # "2:4" holds N:M (2:4) weights only


def _nm(config) -> tuple[int, int] | None:
    """The N:M pattern a config prunes to (None: unstructured): every pruning config's ``pattern``."""
    return config.pattern


def _kept(config, numel: int) -> int:
    if (nm := _nm(config)) is not None:
        return numel // nm[1] * nm[0]
    return numel - round(config.sparsity * numel)


def _rows(w: torch.Tensor) -> torch.Tensor:
    """The weight as (output rows, inputs): the input dimension (the one N:M groups run along) last."""
    return w.reshape(w.shape[0], -1)                                    # Linear (out, in); Conv (out, in*k...)


def _completed(config, mask: torch.Tensor) -> torch.Tensor:
    """``mask`` (kept = True) with zero-valued positions added, in index order, until it keeps exactly what
    ``config`` keeps (a kept weight may be exactly 0.0, and a pruned layer's mask is its zero pattern): the
    structure of a csr / 2:4 layer then follows from the plan alone, and its values are unchanged."""
    if (nm := _nm(config)) is not None:
        groups = masks.nm_groups(mask, nm[1])                                 # (groups, m)
        short = nm[0] - groups.sum(1, keepdim=True)                           # (groups, 1)
        if bool((short < 0).any()):
            return mask   # more than n kept in a group: not N:M, which the 2:4 storage reports
        fill = (~groups).cumsum(1) <= short
        return masks.nm_ungroup(groups | (fill & ~groups), mask.shape)
    flat = _rows(mask).clone().reshape(-1)
    short = _kept(config, flat.numel()) - int(flat.sum())
    if short > 0:
        flat[(~flat).nonzero().flatten()[:short]] = True
    return flat.reshape(mask.shape)


def _build(module: nn.Module, config, mask: torch.Tensor | None) -> nn.Module:
    """The pruned module of ``config.storage`` from a plain layer; ``mask`` None builds the empty structure
    (for wb.load)."""
    w = module.weight
    if config.storage in ("2:4", "csr"):
        if mask is not None:
            mask = _completed(config, mask.reshape(w.shape))
        if config.storage == "2:4":
            if mask is None:
                return SemiStructuredLinear(module.in_features, module.out_features, module.bias is not None,
                                            dtype=w.dtype, device=w.device)
            return SemiStructuredLinear.from_dense(w, mask, module.bias)
        if mask is None:
            return SparseLinear(module.in_features, module.out_features, _kept(config, w.numel()),
                                module.bias is not None, device=w.device)
        return SparseLinear.from_dense(w, mask, module.bias)
    new = copy.deepcopy(module)
    if mask is not None:
        with torch.no_grad():
            new.weight.mul_(mask.reshape(w.shape))        # pruned weights are stored as zeros
    if config.storage == "mask":
        new.__class__ = pruned_class(type(module))   # same parameters; only the gradients of zeros differ
        freeze_zeros(new.weight)
    return new


def _plain_class(module: nn.Module) -> type:
    return module.pruned_base if isinstance(module, Pruned) else type(module)


def _own_forward(cls: type) -> bool:
    """Whether a layer class computes something other than its PyTorch parent's forward."""
    parent = next(c for c in cls.__mro__ if c in PRUNABLE)
    return cls.forward is not parent.forward


def _linear_reason(module: nn.Module) -> str | None:
    """None when ``module`` (pruned or not) computes nn.Linear's: its class keeps nn.Linear's forward, or its own
    forward does so on a probe input (`workbench.plans.lookalike`: Falcon's ``FalconLinear``); else why
    not."""
    from workbench.plans.lookalike import computation

    base = _plain_class(module)
    if not issubclass(base, nn.Linear):
        return f"{type(module).__name__} is not an nn.Linear"
    if not _own_forward(base):
        return None
    found = computation(module)
    if found.taken and found.transform is None:
        return None
    return found.reason or f"{type(module).__name__}'s own forward adds a step to nn.Linear's"


def _probe_input(module: nn.Module, changed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A small input of the layer's kind that reaches the ``changed`` weights, to check that a subclass's own
    forward reads ``.weight``."""
    w = module.weight
    g = torch.Generator().manual_seed(0)
    if isinstance(module, nn.Embedding):                      # the rows that lost weights
        return (changed.any(1).nonzero().flatten()[:64].reshape(1, -1).to(w.device),)
    if isinstance(module, nn.Linear):
        return (torch.randn(2, module.in_features, generator=g).to(w),)
    span = [d * (k - 1) + 1 + 2 * s for k, d, s in zip(module.kernel_size, module.dilation, module.stride)]
    return (torch.randn(1, module.in_channels, *span, generator=g).to(w),)


def _indexed_by_input(module: nn.Module) -> bool:
    """Whether `_check_reads_weight`'s probe (indices, for an embedding) is an input of ``module``: not for an
    embedding whose forward computes its rows from other arguments (OPT's positions from an attention mask,
    `workbench.plans.lookalike.RowsFromForward`), which was checked to read them from ``.weight`` instead."""
    from workbench.plans.lookalike import RowsFromForward, computation

    return not isinstance(computation(module).transform, RowsFromForward)


def _check_reads_weight(name: str, original: nn.Module, pruned: nn.Module) -> None:
    """A subclass with its own forward is kept as it is (its padding, its extra steps): refuse it unless its
    output follows the pruned ``.weight``, e.g. a forward that caches its own copy of the weight."""
    changed = original.weight != pruned.weight
    if not bool(changed.any()):
        return   # pruning removed only weights that were zero already: nothing to see
    x = _probe_input(original, changed)
    try:
        with torch.no_grad():
            before, after = original(*x), pruned(*x)
    except Exception as e:
        raise ValueError(f"{name!r} is a {type(original).__name__}, whose forward is its own; pruning keeps that "
                         f"forward and checks on a probe input that it reads the pruned .weight, but the probe "
                         f"failed ({type(e).__name__}: {e})") from e
    if not isinstance(before, torch.Tensor) or torch.equal(before, after):
        raise ValueError(f"{name!r} is a {type(original).__name__}, whose own forward does not compute with its "
                         f".weight (its output did not change when weights were pruned): pruning it would be a "
                         f"silent no-op")


class _PruneHandler(Handler):
    def why_not(self, module: nn.Module, config) -> str | None:
        if (refusal := experts_refusal(module)) is not None:
            return refusal
        if takes_experts(module):
            if config.storage in ("csr", "2:4"):
                return f"storage {config.storage!r} replaces an nn.Linear; fused mixture-of-experts weights are " \
                       f"pruned in place, as zeros in their 3-D parameters: use 'mask' or 'dense'"
            return None
        base = _plain_class(module)
        if config.storage in ("csr", "2:4"):
            if (why := _linear_reason(module)) is not None:
                return f"storage {config.storage!r} replaces an nn.Linear (with its forward): {why}; use 'mask' or " \
                       f"'dense'"
            return None
        if not issubclass(base, PRUNABLE):
            return f"unstructured pruning masks the weight of {', '.join(c.__name__ for c in PRUNABLE)}"
        return None

    def supports(self, module: nn.Module, config) -> bool:
        return self.why_not(module, config) is None

    def needs_calibration(self, config) -> bool:
        return False

    def mask(self, config, w: torch.Tensor, name: str) -> torch.Tensor:
        """The keep-mask of ``w`` (its shape; N:M groups run along the input channels, at each kernel position):
        what each pruning config's own handler decides."""
        raise NotImplementedError(f"{type(self).__name__} must define mask()")

    def prune_expert(self, config, label: str, w: torch.Tensor, inputs) -> tuple[torch.Tensor, str]:
        """One expert's matrix ``w`` (rows, K), as an nn.Linear weight, pruned (zeros where pruned), and the method
        that did it; ``inputs``: the tokens routed to it, for a calibrated config."""
        return w * self.mask(config, w, label), type(config).__name__

    def experts_note(self, config, rows) -> str:
        """What the layer's note says of how its experts were pruned (``rows``: `oneshot.prune_experts`')."""
        return f"each expert's matrix pruned as {type(config).__name__} prunes an nn.Linear holding it"

    def apply_experts(self, name, module, config, inputs) -> nn.Module:
        """``module``'s own class with every expert's matrix pruned (`oneshot.prune_experts`)."""
        from workbench.pruning.oneshot import prune_experts

        layout = experts_layout(module)
        for m in layout:
            if not torch.isfinite(module.get_parameter(m.name)).all():
                raise ValueError(f"{m.name} of {name!r} contains NaN or Inf")
        calls = [tuple(c) for c in inputs or () if c] if self.needs_calibration(config) else None
        tensors, rows = prune_experts(name, module, layout, functools.partial(self.prune_expert, config), calls)
        new = _experts_copy(module, tensors)
        new.__dict__.pop("coverage", None)   # (an earlier calibration's, if ``module`` was compressed before)
        if calls is not None:
            new.coverage = rows
        new.note = f"{self.experts_note(config, rows)}; {layout[0].experts} experts' " \
                   f"{', '.join(m.name for m in layout)} stored as zeros in the model's own {type(module).__name__} " \
                   f"(no gradient mask for fused experts: fine-tuning may regrow them); the router stays dense"
        return new

    def apply(self, name, module, config, inputs):
        if takes_experts(module):
            return self.apply_experts(name, module, config, inputs)
        w = module.weight.detach()
        if not torch.isfinite(w).all():
            raise ValueError(f"weight of {name!r} contains NaN or Inf")
        mask = self.mask(config, w, name)      # a pruned layer's zeros score 0: they stay pruned (Random: below)
        if isinstance(module, Pruned):
            mask &= module.mask.reshape(mask.shape)
        plain = _plain(module)
        new = _build(plain, config, mask)
        if config.storage in ("mask", "dense") and _own_forward(type(plain)) and _indexed_by_input(plain):
            _check_reads_weight(name, plain, new)
        return new

    def skeleton(self, name, module, config):
        if takes_experts(module):
            return _experts_copy(module, {m.name: torch.empty_like(module.get_parameter(m.name))
                                          for m in experts_layout(module)})
        return _build(_plain(module), config, None)


def _experts_copy(module: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """An instance of ``module``'s own class holding ``tensors`` as its expert projections (`experts_shell`: the
    rest cloned or shared, neither ``__init__`` run nor the float projections copied)."""
    new = experts_shell(module, type(module), set(tensors))
    for key, value in tensors.items():
        new._parameters[key] = nn.Parameter(value, module.get_parameter(key).requires_grad)
    return new


def _plain(module: nn.Module) -> nn.Module:
    """An unpruned-class copy of a (possibly already pruned) layer (its zeros stay zeros)."""
    if isinstance(module, Pruned):
        new = copy.deepcopy(module)
        new.__class__ = module.pruned_base
        return new
    return module


def _check_storage(config) -> None:
    if config.storage not in STORAGES:
        raise ValueError(f"{type(config).__name__}.storage must be one of {STORAGES}, got {config.storage!r}")
    if config.storage == "2:4" and _nm(config) != (2, 4):
        raise ValueError(f"storage '2:4' holds 2:4 semi-structured weights: use wb.prune.NM(2, 4, storage='2:4') "
                         f"(or Wanda / SparseGPT with nm=(2, 4)), not {config!r}")


class PruneConfig(Config):
    """The base of the weight-pruning configs (unstructured and N:M): what `finalize`, the plans and the UI ask of any
    of them, whatever its criterion. A subclass is a frozen dataclass with a ``storage`` field (one of `STORAGES`:
    what the pruned layer keeps) and a ``pattern`` (the N:M pattern it prunes to, or None), registered with its
    handler (a `_PruneHandler` that computes the keep-mask); a new criterion needs nothing else here."""

    storage: str            # (declared by each dataclass subclass as a field)
    pattern: tuple[int, int] | None


class _MagnitudeHandler(_PruneHandler):
    def mask(self, config, w, name):
        return masks.magnitude_mask(w, config.sparsity)


class _RandomHandler(_PruneHandler):
    def mask(self, config, w, name):
        return masks.random_mask(w, config.sparsity, config.seed)


class _NMHandler(_PruneHandler):
    def mask(self, config, w, name):
        return masks.nm_mask(w, config.n, config.m, name)


@register_config(_MagnitudeHandler(), kind="prune.Magnitude")
@dataclass(frozen=True)
class Magnitude(PruneConfig):
    """Unstructured magnitude pruning of ``sparsity`` of the layer's weights."""

    sparsity: float = 0.5
    storage: str = field(default="mask", metadata={"choices": UNSTRUCTURED_STORAGES})  # what the layer keeps:
    #                  "mask" (zeros that stay zero when trained), "dense" or "csr" (see the module docstring)
    pattern = None   # the N:M pattern pruned to (None: unstructured)

    def __post_init__(self):
        masks.check_sparsity(self.sparsity, "Magnitude.sparsity")
        _check_storage(self)


@register_config(_RandomHandler(), kind="prune.Random")
@dataclass(frozen=True)
class Random(PruneConfig):
    """Random unstructured pruning (the baseline every criterion must beat)."""

    sparsity: float = 0.5
    seed: int = 0
    storage: str = field(default="mask", metadata={"choices": UNSTRUCTURED_STORAGES})  # what the layer keeps:
    #                  "mask" (zeros that stay zero when trained), "dense" or "csr" (see the module docstring)
    pattern = None

    def __post_init__(self):
        masks.check_sparsity(self.sparsity, "Random.sparsity")
        _check_storage(self)


@register_config(_NMHandler(), kind="prune.NM")
@dataclass(frozen=True)
class NM(PruneConfig):
    """N:M semi-structured magnitude pruning (2:4 by default): keep the n largest |w| of every m consecutive input
    channels - along a Linear's inputs, at each kernel position of a convolution (as sparse tensor cores and
    NVIDIA's ASP group them). A layer whose input channels (per group) are not a multiple of m is refused,
    naming it (a depthwise or first convolution: prune it another way or leave it out of the plan)."""

    n: int = 2
    m: int = 4
    storage: str = field(default="mask", metadata={"choices": STORAGES})  # what the layer keeps: "mask"
    #                  (zeros that stay zero when trained), "dense", "csr", "2:4" (2:4 only; see the module doc)

    def __post_init__(self):
        if not (isinstance(self.n, int) and isinstance(self.m, int) and 0 < self.n < self.m):
            raise ValueError(f"NM needs integers 0 < n < m, got {self.n}:{self.m}")
        _check_storage(self)

    @property
    def pattern(self) -> tuple[int, int]:
        return self.n, self.m


class _OneShotHandler(_PruneHandler):
    """Wanda and SparseGPT: calibrated one-shot pruning of nn.Linear (see `workbench.pruning.oneshot`); each has
    its own handler below (its statistics, its cost, its pruning)."""

    def why_not(self, module: nn.Module, config) -> str | None:
        if takes_experts(module) or experts_refusal(module) is not None:   # fused experts: per expert, routed tokens
            return super().why_not(module, config)
        if (why := _linear_reason(module)) is not None:
            return f"{type(config).__name__} prunes nn.Linear layers (it scores weights by their inputs): {why}"
        return super().why_not(module, config)

    def needs_calibration(self, config) -> bool:
        return True

    def prune(self, w: torch.Tensor, inputs, config, name: str) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(the updated weight, or None when only masked; the keep-mask)."""
        raise NotImplementedError(f"{type(self).__name__} must define prune()")

    def prune_expert(self, config, label, w, inputs):
        """On the tokens routed to the expert; with fewer than `MIN_EXPERT_TOKENS`, magnitude at the same sparsity
        (or N:M) - never a score from no data."""
        if sum(x.shape[0] for (x,) in inputs) < MIN_EXPERT_TOKENS:
            nm = config.nm
            keep = masks.magnitude_mask(w, config.sparsity) if nm is None else masks.nm_mask(w, *nm, label)
            return w * keep, "magnitude"
        updated, keep = self.prune(w, inputs, config, label)
        return (w if updated is None else updated) * keep, type(config).__name__

    def experts_note(self, config, rows) -> str:
        first = rows[0][0]
        tokens = [t for n, _, t, _ in rows if n == first]
        few = sorted({e for _, e, _, how in rows if how == "magnitude"})
        said = f"{type(config).__name__} per expert on its routed calibration tokens ({first}: {tokens} tokens per " \
               f"expert)"
        if few:
            said += f"; expert(s) {few} saw fewer than {MIN_EXPERT_TOKENS} tokens in some projection and were " \
                    f"pruned by magnitude at the same {'N:M' if config.nm else 'sparsity'} there"
        return said

    def accumulator(self, name: str, module: nn.Module, config):
        """None for fused experts: their calls are kept (each expert's tokens are only known from the routing)."""
        return None if takes_experts(module) else self.linear_accumulator(name, module, config)

    def linear_accumulator(self, name: str, module: nn.Module, config):
        raise NotImplementedError(f"{type(self).__name__} must define linear_accumulator()")

    def apply(self, name, module, config, inputs):
        if takes_experts(module):
            return self.apply_experts(name, module, config, inputs)
        w = module.weight.detach()
        if not torch.isfinite(w).all():
            raise ValueError(f"weight of {name!r} contains NaN or Inf")
        plain = copy.deepcopy(_plain(module))
        updated, mask = self.prune(w, inputs, config, name)
        if updated is not None:
            with torch.no_grad():
                plain.weight.copy_(updated)
        if isinstance(module, Pruned):
            mask &= _rows(module.mask)
        return _build(plain, config, mask)


class _WandaHandler(_OneShotHandler):
    def linear_accumulator(self, name: str, module: nn.Module, config):
        from workbench.pruning.oneshot import NormAccumulator

        return NormAccumulator(module.in_features, name)

    def calibration_cost(self, module: nn.Module, config, tokens: int) -> tuple[int, float]:
        costs = [(8 * 3 * N * K, 2.0 * tokens * K + count * 10.0 * N * K) for count, N, K in _scored(module)]
        return max(b for b, _ in costs), sum(f for _, f in costs) + _routing_flops(module, tokens)

    def prune(self, w, inputs, config, name):
        from workbench.pruning.oneshot import wanda_mask

        return None, wanda_mask(w, inputs, config.sparsity, config.nm, name)


class _SparseGPTHandler(_OneShotHandler):
    def linear_accumulator(self, name: str, module: nn.Module, config):
        from workbench.quantization.gptq import HessianAccumulator

        return HessianAccumulator(module.in_features, name)

    def calibration_cost(self, module: nn.Module, config, tokens: int) -> tuple[int, float]:
        # fp32 Hessian and its inverse factor, the working weight and the mask
        costs = [(2 * 4 * K * K + 4 * 4 * N * K, 2.0 * tokens * K * K + count * (2.0 * K ** 3 + 2.0 * N * K * K))
                 for count, N, K in _scored(module)]
        return max(b for b, _ in costs), sum(f for _, f in costs) + _routing_flops(module, tokens)

    def prune(self, w, inputs, config, name):
        from workbench.pruning.oneshot import sparsegpt_prune

        return sparsegpt_prune(w, inputs, config.sparsity, config.nm, config.damp, config.block_size, name)


def _scored(module: nn.Module) -> list[tuple[int, int, int]]:
    """(how many, rows N, inputs K) of the matrices a calibrated config scores: the layer's weight, or each
    projection's expert matrices (whose calibration tokens are shared among the experts)."""
    if takes_experts(module):
        return [(m.experts, m.rows, m.K) for m in experts_layout(module)]
    return [(1, *module.weight.shape)]


def _routing_flops(module: nn.Module, tokens: int) -> float:
    """The per-expert forward that finds each expert's inputs (fused experts: every projection once per token and
    routed expert, counted once per token here)."""
    return sum(2.0 * tokens * N * K for _, N, K in _scored(module)) if takes_experts(module) else 0.0


def _check_oneshot(config) -> None:
    what = type(config).__name__
    if config.nm is not None:
        n, m = config.nm
        if not (isinstance(n, int) and isinstance(m, int) and 0 < n < m):
            raise ValueError(f"{what}.nm needs integers 0 < n < m, got {config.nm!r}")
        object.__setattr__(config, "sparsity", 1 - n / m)
    masks.check_sparsity(config.sparsity, f"{what}.sparsity")
    _check_storage(config)


@register_config(_WandaHandler(), kind="prune.Wanda")
@dataclass(frozen=True)
class Wanda(PruneConfig):
    """Wanda: prune the weights with the lowest |w| x ||x||_2 (calibrated; nn.Linear): ``sparsity`` of each
    output row, or ``nm=(n, m)`` - keep n of every m consecutive inputs (``sparsity`` is then 1 - n/m)."""

    sparsity: float = 0.5
    nm: tuple[int, int] | None = None
    storage: str = field(default="mask", metadata={"choices": STORAGES})  # what the layer keeps: "mask"
    #                  (zeros that stay zero when trained), "dense", "csr", "2:4" (2:4 only; see the module doc)

    def __post_init__(self):
        if self.nm is not None:
            object.__setattr__(self, "nm", tuple(self.nm))
        _check_oneshot(self)

    @property
    def pattern(self) -> tuple[int, int] | None:
        return self.nm


@register_config(_SparseGPTHandler(), kind="prune.SparseGPT")
@dataclass(frozen=True)
class SparseGPT(PruneConfig):
    """SparseGPT: OBS pruning with the error fed back into the kept weights (calibrated; nn.Linear): ``sparsity``
    of the layer, or ``nm=(n, m)``; ``damp``: fraction of the mean Hessian diagonal added for stability."""

    sparsity: float = 0.5
    nm: tuple[int, int] | None = None
    damp: float = 0.01
    block_size: int = 128
    storage: str = field(default="mask", metadata={"choices": STORAGES})  # what the layer keeps: "mask"
    #                  (zeros that stay zero when trained), "dense", "csr", "2:4" (2:4 only; see the module doc)

    def __post_init__(self):
        if self.nm is not None:
            object.__setattr__(self, "nm", tuple(self.nm))
        if not 0 < self.damp < 1:
            raise ValueError(f"SparseGPT.damp must be in (0, 1), got {self.damp!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"SparseGPT.block_size must be a positive int, got {self.block_size!r}")
        _check_oneshot(self)

    @property
    def pattern(self) -> tuple[int, int] | None:
        return self.nm


def global_plan(model: nn.Module, patterns, sparsity: float, storage: str = "mask") -> Plan:
    """A plan of per-layer `Magnitude` configs from one |w| threshold over the selected layers (fused experts: the
    share of all their matrices under it, which each expert's matrix is then pruned to)."""
    probe = Plan({p: Magnitude(0.0) for p in ([patterns] if isinstance(patterns, str) else patterns)})
    layers = {a.name: _weights(model.get_submodule(a.name)) for a in probe.resolve(model)}
    per_layer = masks.global_sparsities(layers, sparsity)
    for name, s in per_layer.items():
        if s >= 1.0:
            raise ValueError(f"global sparsity {sparsity} would prune every weight of {name!r}")
    return Plan({name: Magnitude(s, storage) for name, s in per_layer.items()})


def _weights(module: nn.Module) -> torch.Tensor:
    """The weights a pruning config masks: the layer's ``weight``, or every expert matrix of fused experts (flat)."""
    if takes_experts(module):
        return torch.cat([module.get_parameter(m.name).detach().reshape(-1) for m in experts_layout(module)])
    return module.weight


def sparsity_of(model: nn.Module) -> dict[str, float]:
    """Fraction of zero (pruned) weights of each prunable or pruned layer (fused experts: of all their matrices)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (SparseLinear, SemiStructuredLinear)):
            out[name] = 1 - m.values.numel() / (m.in_features * m.out_features)
        elif isinstance(m, PRUNABLE) or takes_experts(m):
            out[name] = float((_weights(m) == 0).float().mean())
    return out


def _config_of(plans, name: str):
    """The pruning config that last shaped layer ``name`` (with storage "mask")."""
    for plan in reversed(plans):
        hit = plan.match(name)
        if hit is not None and isinstance(hit[1], PruneConfig):
            return hit[1]
    return None


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
        if storage in ("csr", "2:4") and takes_experts(m) and getattr(_config_of(plans, name), "storage", "") == "mask":
            raise ValueError(f"{name!r}: {storage} storage replaces an nn.Linear; finalize the fused experts of "
                             f"{type(m).__name__} as 'dense'")
        if isinstance(m, Pruned):
            if storage in ("csr", "2:4") and _linear_reason(m) is not None:
                raise ValueError(f"{name!r}: {storage} storage replaces an nn.Linear; finalize "
                                 f"{type(m).__name__} as 'dense'")
            plain = _plain(m)
            if storage == "dense":
                replacements[name] = plain
                continue
            config = _config_of(plans, name)
            mask = m.mask if config is None else _completed(config, m.mask)
            if storage == "csr":
                replacements[name] = SparseLinear.from_dense(plain.weight, mask, plain.bias)
            else:
                replacements[name] = SemiStructuredLinear.from_dense(plain.weight, mask, plain.bias, name)
    swap_layers(target, replacements)

    def restore(config):
        if not (isinstance(config, PruneConfig) and config.storage == "mask"):
            return config
        return replace(config, storage=storage)  # (a "2:4" finalize only gets here with NM(2, 4): checked above)

    record_plan(target, tuple(Plan({p: (restore(c) if c is not None else None) for p, c in plan.items()},
                                   stages=plan.stages) for plan in plans))
    return target.eval() if not model.training else target
