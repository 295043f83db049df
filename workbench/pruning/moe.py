"""Structured pruning of mixture-of-experts blocks whose experts are fused 3-D parameters (transformers 5's
``MixtralExperts``, ``Qwen2MoeExperts``, ``GptOssExperts`` ...): each expert loses the same number of intermediate
channels, so the stacked tensors stay rectangular.

An experts module holds, per projection, one tensor with the experts as its first dimension (found by
`workbench.quantization.experts.experts_layout`): ``gate_up_proj`` (E, 2I, H) + ``down_proj`` (E, H, I) used as
``F.linear(x, W[e])``, or the transpose (E, H, 2I) / (E, I, H) used as ``x @ W[e]`` (GPT-OSS), possibly with
per-expert biases ``<projection>_bias``; or ``gate_proj`` + ``up_proj`` + ``down_proj``, or ``up_proj`` +
``down_proj``. Intermediate channel j of expert e is row j of its gate and up projections and column j of its down
projection; a fused ``gate_up_proj`` holds the gate and up rows of channel j at (j, I + j) when transformers says
``is_concatenated`` ([gate; up], then ``.chunk(2)``) and at (2j, 2j + 1) when not (GPT-OSS's ``[..., ::2]`` /
``[..., 1::2]``). The gate is applied element-wise, so keeping both rows of a channel keeps what it computes.

`keep_intermediate` cuts the channels in place (on the copy `wb.prune.channels` works on) and rewrites the size
attributes the class keeps (``intermediate_dim`` ...); each expert ranks its own channels by the norm of its gate
and up rows (`intermediate_importance`). The kept count is rounded to a multiple of `ALIGN` channels (`kept_width`):
transformers runs fused experts with ``torch.grouped_mm``, which needs 16-byte aligned weight rows.

`experts` removes whole experts instead, the least used ones: the tokens each block's router sends to each expert
are counted on calibration batches (`routed_tokens`), and the experts' slices, the router's rows and their
``num_experts`` are cut.

The results record `KeptExperts` (and `KeptRouter`) so `wb.save` / `wb.load` rebuild the shapes. Anything else an
experts module or router holds (another parameter, no ``is_concatenated`` flag on a fused projection) is refused,
naming the module.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from workbench.plans.registry import Config, Handler, register_config
from workbench.quantization.experts import EXPERT_MATRICES, ExpertMatrix, experts_layout, router_note

__all__ = ["ExpertsLayout", "KeptExperts", "KeptRouter", "ALIGN", "experts", "routed_tokens", "intermediate_layout",
           "intermediate_importance", "keep_intermediate", "keep_experts", "kept_width", "is_experts"]

_GATES = ("gate_up_proj", "gate_proj", "up_proj")   # the projections whose rows are intermediate channels
_SIZE_ATTRS = ("intermediate_dim", "intermediate_size", "expert_dim")   # what transformers' classes call I
ALIGN = 8   # channels kept per expert come in multiples of this (see `kept_width`)


@dataclass(frozen=True)
class ExpertsLayout:
    """What `keep_intermediate` needs to know of an experts module: its projections, ``width`` (I, channels per
    expert) and, for a fused ``gate_up_proj``, whether gate and up rows are interleaved."""

    matrices: tuple[ExpertMatrix, ...]
    width: int
    interleaved: bool = False

    @property
    def experts(self) -> int:
        return self.matrices[0].experts

    def rows(self, name: str, idx: torch.Tensor) -> torch.Tensor:
        """The rows of projection ``name`` that hold channels ``idx`` (..., k): (..., 2k) for a fused gate_up."""
        if name != "gate_up_proj":
            return idx
        if self.interleaved:
            return torch.stack([2 * idx, 2 * idx + 1], dim=-1).flatten(-2)
        return torch.cat([idx, idx + self.width], dim=-1)

    def per_channel(self, name: str, score: torch.Tensor) -> torch.Tensor:
        """A per-row score (E, rows) of projection ``name`` summed per channel: (E, I)."""
        if name != "gate_up_proj":
            return score
        if self.interleaved:
            return score[:, 0::2] + score[:, 1::2]
        return score[:, :self.width] + score[:, self.width:]


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds fused expert projections: a 3-D parameter named as one (``gate_up_proj`` ...); in
    a layout that can be cut or not (`intermediate_layout` says)."""
    return any(p.dim() == 3 and n in EXPERT_MATRICES for n, p in module.named_parameters(recurse=False))


def intermediate_layout(name: str, module: nn.Module) -> ExpertsLayout:
    """The layout of experts module ``name``; raises ValueError naming it when its channels cannot be cut safely."""
    kind = type(module).__name__
    try:
        matrices = experts_layout(module)
    except ValueError as e:
        raise ValueError(f"cannot cut the channels of {name!r}: {e}") from None
    if matrices is None:
        raise ValueError(f"{name!r} ({kind}) holds no fused expert projections")
    names = {m.name for m in matrices}
    known = names | {f"{n}_bias" for n in names}
    other = sorted(k for k, p in module.named_parameters(recurse=False) if k not in known)
    other += sorted(k for k, _ in module.named_buffers(recurse=False))
    if other:
        raise ValueError(f"cannot cut the channels of {name!r} ({kind}): it also holds {other}, whose role is not "
                         f"known (it may be sized by the intermediate channels)")
    down = next(m for m in matrices if m.name == "down_proj")
    interleaved = False
    if "gate_up_proj" in names:
        concatenated = getattr(module, "is_concatenated", None)
        if not isinstance(concatenated, bool):
            raise ValueError(f"cannot cut the channels of {name!r} ({kind}): whether its fused gate_up_proj holds "
                             f"[gate; up] or gate and up rows interleaved is not known (no is_concatenated flag)")
        interleaved = not concatenated
    return ExpertsLayout(matrices, width=down.K, interleaved=interleaved)


def kept_width(name: str, width: int, amount: float) -> int:
    """How many of its ``width`` channels each expert keeps when ``amount`` of them are removed: ``width -
    round(amount * width)`` rounded to the nearest multiple of `ALIGN` (ties keep more; the alignment is
    gcd(width, `ALIGN`) when ``width`` itself is not a multiple). transformers runs fused experts with
    ``torch.grouped_mm``, which needs every row of a weight to span a multiple of 16 bytes: 8 channels of bf16 /
    fp16 (4 of fp32), so the pruned experts also run after a cast to half precision. Raises, naming ``name``,
    when the rounding keeps every channel or none."""
    align = math.gcd(width, ALIGN)
    keep = width - round(amount * width)
    keep = align * math.floor(keep / align + 0.5)
    if amount > 0 and keep >= width or keep < 1:
        raise ValueError(f"pruning {amount} of {name!r} would keep {max(keep, 0)} of its experts' {width} channels "
                         f"once rounded to a multiple of {align} (grouped matmuls need 16-byte aligned rows): ask "
                         f"for {'more' if keep >= width else 'less'}")
    return keep


def _per_expert(param: torch.Tensor, m: ExpertMatrix) -> torch.Tensor:
    """The parameter as (E, rows, K) whatever its storage order."""
    return param.transpose(1, 2) if m.transposed else param


def intermediate_importance(name: str, module: nn.Module, criterion: str = "l1") -> torch.Tensor:
    """(E, I): each expert's importance of each of its intermediate channels, the summed norm (``"l1"`` or
    ``"l2"``) of its gate and up rows (as `channels` ranks Llama's gate and up projections)."""
    if criterion not in ("l1", "l2"):
        raise ValueError(f"{name!r} ({type(module).__name__}) computes its experts' channels inside its forward: "
                         f"they are ranked by weight norm ('l1' or 'l2'), not {criterion!r}")
    lay = intermediate_layout(name, module)
    score = torch.zeros(lay.experts, lay.width)
    for m in lay.matrices:
        if m.name not in _GATES:
            continue
        w = _per_expert(module.get_parameter(m.name).detach(), m).float()     # (E, rows, K)
        norm = w.abs().sum(-1) if criterion == "l1" else w.pow(2).sum(-1).sqrt()
        score += lay.per_channel(m.name, norm)
    return score


def keep_intermediate(name: str, module: nn.Module, idx: torch.Tensor) -> None:
    """Keep, in place, channels ``idx`` (E, k) of each expert of ``module`` (expert e keeps ``idx[e]``): the rows
    of its gate / up projections (and their biases), the columns of its down projection, and the size attributes
    that said I."""
    lay = intermediate_layout(name, module)
    if idx.dim() != 2 or idx.shape[0] != lay.experts:
        raise ValueError(f"{name!r}: expected kept channels (experts={lay.experts}, k), got {tuple(idx.shape)}")
    for m in lay.matrices:
        param = module.get_parameter(m.name)
        rows = lay.rows(m.name, idx).to(param.device)                          # (E, k') along the cut axis
        axis = (1 if m.transposed else 2) if m.name == "down_proj" else (2 if m.transposed else 1)
        _replace(module, m.name, _gather(param, rows, axis))
        bias = module._parameters.get(f"{m.name}_bias")
        if bias is not None and m.name != "down_proj":                         # (E, rows); down's bias is (E, H)
            _replace(module, f"{m.name}_bias", _gather(bias, rows, 1))
    for attr in _SIZE_ATTRS:
        if getattr(module, attr, None) == lay.width:
            setattr(module, attr, idx.shape[1])


def _gather(t: torch.Tensor, rows: torch.Tensor, axis: int) -> torch.Tensor:
    """``t[e]`` restricted to ``rows[e]`` along ``axis`` (of ``t``), for every expert e."""
    shape = [1] * t.dim()
    shape[0], shape[axis] = rows.shape
    index = rows.reshape(shape).expand(*[rows.shape[1] if d == axis else t.shape[d] for d in range(t.dim())])
    return t.detach().gather(axis, index)


def _replace(module: nn.Module, key: str, value: torch.Tensor) -> None:
    old = module._parameters[key]
    module._parameters[key] = nn.Parameter(value.contiguous(), requires_grad=old.requires_grad)


class _KeptExpertsHandler(Handler):
    """Rebuilds the experts modules `channels` / `experts` cut, so `wb.load` can restore them (the file holds the
    values)."""

    def why_not(self, module: nn.Module, config) -> str | None:
        if not is_experts(module):
            return "KeptExperts rebuilds fused mixture-of-experts modules"
        try:
            intermediate_layout("module", module)
        except ValueError as e:
            return str(e)
        return None

    def supports(self, module: nn.Module, config) -> bool:
        return self.why_not(module, config) is None

    def apply(self, name, module, config, inputs):
        raise ValueError(f"{name!r}: KeptExperts records what wb.prune.channels / experts removed; it cannot choose "
                         f"channels or experts itself - call those functions instead")

    def skeleton(self, name, module, config):
        lay = intermediate_layout(name, module)
        kept = config.experts or lay.experts
        if not 0 < kept <= lay.experts or not 0 < (config.intermediate or lay.width) <= lay.width:
            raise ValueError(f"{name!r} has {lay.experts} experts of {lay.width} channels: cannot keep {config}")
        new = copy.deepcopy(module)
        if config.experts is not None:
            keep_experts(name, new, torch.arange(kept))
        if config.intermediate is not None:
            keep_intermediate(name, new, torch.arange(config.intermediate).expand(kept, -1))
        return new


@register_config(_KeptExpertsHandler(), kind="prune.KeptExperts")
@dataclass(frozen=True)
class KeptExperts(Config):
    """Recorded per fused experts module by `wb.prune.channels` (``intermediate``: the channels each expert keeps)
    and `experts` (``experts``: how many experts remain); None: unchanged."""

    intermediate: int | None = None
    experts: int | None = None

    def __post_init__(self):
        for key in ("intermediate", "experts"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"KeptExperts.{key} must be a positive int or None, got {v!r}")


class _KeptRouterHandler(Handler):
    """Rebuilds the routers `experts` cut (one row per remaining expert)."""

    def supports(self, module: nn.Module, config) -> bool:
        return router_note(module) is not None

    def why_not(self, module: nn.Module, config) -> str | None:
        return None if self.supports(module, config) else "KeptRouter rebuilds mixture-of-experts routers"

    def apply(self, name, module, config, inputs):
        raise ValueError(f"{name!r}: KeptRouter records what wb.prune.experts removed; it cannot choose experts "
                         f"itself - call it instead")

    def skeleton(self, name, module, config):
        new = copy.deepcopy(module)
        _keep_routes(name, new, torch.arange(config.experts))
        return new


@register_config(_KeptRouterHandler(), kind="prune.KeptRouter")
@dataclass(frozen=True)
class KeptRouter(Config):
    """Recorded per mixture-of-experts router by `experts`: how many experts it still routes to."""

    experts: int = 1

    def __post_init__(self):
        if isinstance(self.experts, bool) or not isinstance(self.experts, int) or self.experts < 1:
            raise ValueError(f"KeptRouter.experts must be a positive int, got {self.experts!r}")


# --- whole experts, by routing share ---------------------------------------------------------------------------

def keep_experts(name: str, module: nn.Module, ids: torch.Tensor) -> None:
    """Keep, in place, experts ``ids`` (1-D, sorted) of experts module ``name``: every per-expert parameter
    (projections and biases) and ``num_experts``."""
    lay = intermediate_layout(name, module)
    for key, p in list(module._parameters.items()):
        if p is not None and p.shape[0] == lay.experts:
            _replace(module, key, p.detach().index_select(0, ids.to(p.device)))
    module.num_experts = len(ids)


def _keep_routes(name: str, router: nn.Module, ids: torch.Tensor) -> None:
    """Keep, in place, the rows of router ``name`` for experts ``ids`` (its weight and bias), and ``num_experts``."""
    other = sorted(k for k, _ in [*router.named_parameters(recurse=False), *router.named_buffers(recurse=False)]
                   if k not in ("weight", "bias"))
    if other or list(router.children()):
        raise ValueError(f"cannot remove experts from router {name!r} ({type(router).__name__}): it also holds "
                         f"{other or [n for n, _ in router.named_children()]}, whose role is not known")
    if router.top_k > len(ids):
        raise ValueError(f"router {name!r} picks {router.top_k} experts per token: it cannot be left {len(ids)}")
    for key in ("weight", "bias"):
        if router._parameters.get(key) is not None:
            _replace(router, key, router._parameters[key].detach().index_select(0, ids.to(router.weight.device)))
    router.num_experts = len(ids)


def _blocks(model: nn.Module) -> list[tuple[str, str]]:
    """(experts module, its router) of every mixture-of-experts block: the router is the experts' sibling with one
    weight row per expert and a ``top_k`` (`workbench.quantization.experts.router_note`)."""
    out = []
    for name, m in model.named_modules():
        if not name or not is_experts(m):
            continue
        E = intermediate_layout(name, m).experts
        parent = name.rpartition(".")[0]
        routers = [f"{parent}.{k}" if parent else k for k, c in model.get_submodule(parent).named_children()
                   if router_note(c) is not None and c.weight.shape[0] == E]
        if len(routers) != 1:
            raise ValueError(f"cannot tell which router sends tokens to {name!r}: found {routers or 'none'} beside it")
        out.append((name, routers[0]))
    return out


def routed_tokens(model: nn.Module, calibration) -> dict[str, torch.Tensor]:
    """``{experts module: (E,) tokens routed to each expert}`` over ``calibration`` batches (tensors, tuples or dicts
    of keyword inputs): read from the expert indices each block passes its experts module (its second argument)."""
    from workbench.pruning.structured import run

    counts: dict[str, torch.Tensor] = {}
    handles = []

    def counter(name: str, experts: int):
        def hook(module, args):
            idx = args[1] if len(args) > 1 else None
            if not isinstance(idx, torch.Tensor) or idx.is_floating_point():
                raise ValueError(f"{name!r} ({type(module).__name__}) is not called with the expert indices as its "
                                 f"second argument: the tokens routed to each expert cannot be counted")
            counts[name] += torch.bincount(idx.flatten().long().cpu(), minlength=experts)[:experts]
        return hook

    for name, _ in _blocks(model):
        module = model.get_submodule(name)
        E = intermediate_layout(name, module).experts
        counts[name] = torch.zeros(E, dtype=torch.long)
        handles.append(module.register_forward_pre_hook(counter(name, E)))
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in calibration:
                run(model, batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    return counts


def experts(model: nn.Module, amount: float, calibration) -> nn.Module:
    """A copy of ``model`` in which every mixture-of-experts block keeps its ``E - round(amount * E)`` most used
    experts: the tokens its router sends to each expert are counted over ``calibration`` batches (ties keep the
    lower index). The experts' slices, the router's rows and their ``num_experts`` are cut; the result records
    `KeptExperts` / `KeptRouter` so `wb.save` / `wb.load` rebuild the shapes. Routers that normalise over every
    expert (Qwen2-MoE without ``norm_topk_prob``) then normalise over the remaining ones. The model's own
    ``config`` is left as it was (its training-time load-balancing loss still counts the original experts)."""
    from workbench.plans.layers import applied_plans, record_plan
    from workbench.plans.plan import Plan

    if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 < amount < 1:
        raise ValueError(f"amount must be in (0, 1), got {amount!r}")
    if not calibration:
        raise ValueError("wb.prune.experts counts the tokens routed to each expert: give calibration batches")
    target = copy.deepcopy(model)
    blocks = _blocks(target)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts block with fused experts")
    counts = routed_tokens(target, calibration)
    entries: dict[str, Config] = {}
    for name, router in blocks:
        total = len(counts[name])
        keep = total - round(amount * total)
        if keep < 1:
            raise ValueError(f"removing {amount} of the {total} experts of {name!r} would remove them all")
        order = sorted(range(total), key=lambda e: (-int(counts[name][e]), e))
        ids = torch.tensor(sorted(order[:keep]))
        _keep_routes(router, target.get_submodule(router), ids)
        keep_experts(name, target.get_submodule(name), ids)
        entries[name], entries[router] = KeptExperts(experts=keep), KeptRouter(experts=keep)
    record_plan(target, (*applied_plans(model), Plan(entries)))
    return target
