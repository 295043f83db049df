"""The per-layer steps of the core, written once: every path that changes layers calls these.

- `capture_inputs`: run calibration batches once and record the inputs of named layers.
- `transform_layer`: look up the config's handler, build the *new* module, and return it with the
  concrete config that rebuilds exactly its structure (e.g. ``SVD(energy=0.9)`` -> ``SVD(rank=37)``) and the
  handler's note on what it did (e.g. a per-channel fallback for a layer whose width no group divides).
- `skeleton_layer`: the same structure without values or calibration (what `wb.load` fills).
- `tie_groups` / `share_tied`: layers that share a weight (GPT-2's ``lm_head`` and ``wte``) are compressed
  into one stored copy, so a compressed model never grows.
- `swap_layers`: put modules in place and return what they replaced (for an all-or-nothing rollback); an
  `InputTransform` hook on a replaced layer (part of the model's function, e.g. an online rotation) moves with it.
- `record_plan` / `applied_plans`: what was applied, which is what `wb.save` writes.

`wb.apply`, `wb.load` (through `build_skeleton`), the workbench's `Session`, `wb.sensitivity`, QAT's
``convert`` and pruning's finalize use these functions rather than their own copies of the loop.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from workbench.plans.registry import Config, handler_for

__all__ = ["ApplyError", "Transformed", "transform_layer", "skeleton_layer", "capture_inputs", "swap_layers",
           "tie_groups", "share_tied", "record_plan", "applied_plans", "PLANS_ATTR", "Batch", "default_configs",
           "compressible_layers", "canonical_targets", "canonicalize_for", "canonical_view", "empty_copy",
           "InputTransform", "input_transforms"]

PLANS_ATTR = "_workbench_plans"

Batch = tuple[torch.Tensor, ...]


class ApplyError(RuntimeError):
    """A layer could not be transformed; the message names the layer and the config."""

    def __init__(self, layer: str, config: Config, cause: BaseException):
        self.layer = layer
        self.config = config
        super().__init__(f"layer {layer!r} with {config!r} failed: {type(cause).__name__}: {cause}")


@dataclass(frozen=True)
class Transformed:
    """One layer's result: the new module, the config asked for, the concrete config that rebuilds the new
    module's structure (equal to ``config`` for most techniques) and the handler's note (or "")."""

    name: str
    module: nn.Module
    config: Config
    concrete: Config
    note: str = ""


def transform_layer(name: str, module: nn.Module, config: Config,
                    inputs: Sequence[Batch] | None = None) -> Transformed:
    """Build the compressed replacement of ``module`` (never mutating it). Any failure is an `ApplyError`
    naming the layer and the config; Ctrl-C passes through."""
    handler = handler_for(config)
    try:
        new = handler.apply(name, module, config, inputs)
    except (KeyboardInterrupt, ApplyError):
        raise
    except Exception as e:
        raise ApplyError(name, config, e) from e
    if not isinstance(new, nn.Module):
        raise ApplyError(name, config, TypeError(f"handler returned {type(new).__name__}, not a module"))
    concrete = handler.resolved(config, new)
    return Transformed(name, new, config, concrete, str(getattr(new, "note", "") or ""))


def skeleton_layer(name: str, module: nn.Module, config: Config) -> nn.Module:
    """The compressed structure of ``module`` under ``config`` with no values computed (for `wb.load`)."""
    try:
        return handler_for(config).skeleton(name, module, config)
    except (KeyboardInterrupt, ApplyError):
        raise
    except Exception as e:
        raise ApplyError(name, config, e) from e


def _describe(batch: Batch) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in batch)


def _call(model: nn.Module, batch):
    """Run one batch: a dict is keyword inputs (Hugging Face style), a tuple positional inputs."""
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(*batch)


def batch_error(i: int, batch, model: nn.Module, error: Exception) -> ValueError:
    """The error for calibration batch ``i`` failing inside ``model`` (its shapes, the model, the cause)."""
    shown = _describe(batch) if isinstance(batch, tuple) else type(batch).__name__
    return ValueError(f"calibration batch {i} ({shown}) could not be run through {type(model).__name__}: "
                      f"{type(error).__name__}: {error}")


def capture_inputs(model: nn.Module, names: Sequence[str], batches: Iterable[Batch],
                   progress: bool = True) -> dict[str, list[Batch]]:
    """Run ``batches`` through ``model`` (eval mode, inference mode) once and record, per named layer, the
    tensor positional inputs of every call."""
    records: dict[str, list[Batch]] = {n: [] for n in names}
    handles = []
    for name in names:
        def hook(mod, args, _name=name):
            records[_name].append(tuple(a.detach() for a in args if isinstance(a, torch.Tensor)))
        handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for i, batch in enumerate(tqdm(list(batches), desc="calibration", leave=False, disable=not progress)):
                try:
                    _call(model, batch)
                except Exception as e:
                    raise batch_error(i, batch, model, e) from e
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return records


def empty_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and persistent buffers are meta tensors of the same shapes (none
    of its weights copied; tensors shared in ``model`` stay shared); non-persistent buffers are copied."""
    memo: dict[int, object] = {}
    for t in model.state_dict(keep_vars=True).values():
        if id(t) not in memo:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


class InputTransform:
    """A forward pre-hook that is part of the model's function: it changes a layer's input before the layer computes
    (e.g. `workbench.quantization.rotation`'s online Hadamard before ``down_proj``, whose weight holds the inverse).
    Register an instance with ``layer.register_forward_pre_hook``; `swap_layers` carries it onto whatever replaces the
    layer (a quantized module computes on the transformed input, and calibration records it), and `wb.export`
    refuses a model holding one (no exported format runs it). Subclasses implement ``__call__(module, args)``."""

    def __call__(self, module: nn.Module, args: tuple):   # pragma: no cover - abstract
        raise NotImplementedError


def input_transforms(model: nn.Module) -> dict[str, list[InputTransform]]:
    """``{layer name: its InputTransform hooks}`` for every layer of ``model`` holding one."""
    found = {}
    for name, m in model.named_modules():
        hooks = [h for h in m._forward_pre_hooks.values() if isinstance(h, InputTransform)]
        if hooks:
            found[name] = hooks
    return found


def _carry_transforms(old: nn.Module, new: nn.Module) -> None:
    present = list(new._forward_pre_hooks.values())
    for h in old._forward_pre_hooks.values():
        if isinstance(h, InputTransform) and not any(h is p for p in present):
            new.register_forward_pre_hook(h)


def swap_layers(model: nn.Module, replacements: Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    """Put each replacement in place; returns the modules replaced (swap them back to undo).

    A module registered under several names (T5's ``shared`` is also ``encoder.embed_tokens``) is replaced
    under every name, so no path keeps computing with the old module."""
    aliases: dict[int, list[str]] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        aliases.setdefault(id(m), []).append(n)
    done: list[tuple[str, nn.Module]] = []
    previous = {}
    try:
        for name, new in replacements.items():
            old = model.get_submodule(name)
            previous[name] = old
            for alias in aliases.get(id(old), [name]) or [name]:
                done.append((alias, model.get_submodule(alias)))
                _carry_transforms(old, new)
                model.set_submodule(alias, new)
    except BaseException:
        for alias, old in reversed(done):
            model.set_submodule(alias, old)
        raise
    return previous


def tie_groups(model: nn.Module) -> list[tuple[str, ...]]:
    """Groups of modules that hold the same parameter object (tied weights), each group in module order.

    Only parameters a module holds itself count (GPT-2: ``("transformer.wte", "lm_head")``)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():   # a module registered under two names counts once
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), [])
            if name not in owners[id(p)]:
                owners[id(p)].append(name)
    groups: list[tuple[str, ...]] = []
    for names in owners.values():
        if len(names) > 1:
            group = tuple(names)
            if group not in groups:
                groups.append(group)
    return groups


def share_tied(group: Sequence[str], modules: Mapping[str, nn.Module]) -> int:
    """Make the compressed modules of one tie group hold one copy: every tensor of a later member that has
    the same name, shape, dtype and values as the first member's becomes the first member's tensor.
    Returns how many tensors were shared; raises if nothing could be (the weights would be stored twice)."""
    first = modules[group[0]]
    ref = dict(first.named_parameters(recurse=False)) | dict(first.named_buffers(recurse=False))
    shared = 0
    for name in group[1:]:
        other = modules[name]
        n_before = shared
        for key, t in [*other.named_parameters(recurse=False), *other.named_buffers(recurse=False)]:
            r = ref.get(key)
            if r is None or r is t or r.shape != t.shape or r.dtype != t.dtype or not torch.equal(r, t):
                continue
            if key in other._parameters:
                if not isinstance(r, nn.Parameter):
                    continue
                other._parameters[key] = r
            else:
                other._buffers[key] = r
            shared += 1
        if shared == n_before:
            raise ValueError(f"{name!r} shares its weight with {group[0]!r}, but their compressed forms hold no "
                             f"common tensor ({type(first).__name__} and {type(other).__name__}); give both the "
                             f"same config, or exclude both (e.g. {{{group[0]!r}: None, {name!r}: None}})")
    return shared


def applied_plans(model: nn.Module) -> tuple:
    """The plans applied to ``model`` by `wb.apply` (and friends), oldest first (empty for an untouched model)."""
    return tuple(getattr(model, PLANS_ATTR, ()))


def record_plan(model: nn.Module, plans: Sequence) -> None:
    """Record ``plans`` as what was applied to ``model`` (replacing any earlier record)."""
    object.__setattr__(model, PLANS_ATTR, tuple(plans))


def default_configs() -> list[Config]:
    """One default-constructed config of every registered technique (those that have defaults)."""
    from workbench.plans.registry import registered_configs

    out = []
    for cls in registered_configs():
        try:
            out.append(cls())
        except (TypeError, ValueError):   # a technique with required fields has no default instance
            continue
    return out


def compressible_layers(model: nn.Module, configs: Sequence[Config] | None = None) -> list[str]:
    """Names of the modules of ``model`` that at least one of ``configs`` (default: `default_configs`) can
    take, in module order; a module inside a listed one is not listed again."""
    configs = default_configs() if configs is None else list(configs)
    out: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(o + ".") for o in out):
            continue
        if any(handler_for(c).supports(module, c) for c in configs):
            out.append(name)
    return out


# --- canonical layers ---------------------------------------------------------------------------------------
# Modules that compute a Linear in disguise (Hugging Face's Conv1D, nn.MultiheadAttention's packed projection)
# are rewritten as real nn.Linear layers (`workbench.models.canonical`) before a plan is resolved - but only the
# ones the plan reaches, so the rest of the model keeps its structure (and PyTorch's fused fast paths). The rule
# depends only on the model and the plan, so `wb.load` rebuilds the same structure from the saved plans.

_SPLIT_CHILDREN = ("q_proj", "k_proj", "v_proj", "out_proj")


def canonical_targets(model: nn.Module, plan) -> list[str]:
    """Names of the modules `canonicalize` would rewrite that ``plan`` reaches: the module itself, or (for
    attention) one of the projections it is split into, matched by a pattern with a config."""
    from workbench.models.canonical import needs_canonical

    def reached(name: str) -> bool:
        hit = plan.match(name)
        return hit is not None and hit[1] is not None

    out = []
    for name, module in model.named_modules():
        if not name or not needs_canonical(module):
            continue
        names = [name] + ([f"{name}.{c}" for c in _SPLIT_CHILDREN] if isinstance(module, nn.MultiheadAttention)
                          else [])
        if any(reached(n) for n in names):
            out.append(name)
    return out


def canonicalize_for(model: nn.Module, plan) -> dict[str, str]:
    """Rewrite, in place, the canonical targets of ``plan`` (see `canonical_targets`); returns what changed."""
    from workbench.models.canonical import canonicalize

    targets = canonical_targets(model, plan)
    return canonicalize(model, targets) if targets else {}


def canonical_view(model: nn.Module, plan) -> nn.Module:
    """``model`` as ``plan`` will see it: the model itself when the plan reaches no canonical target, else a
    copy of its structure (sharing the parameters, which are only read) with those targets rewritten."""
    if not canonical_targets(model, plan):
        return model
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    view = copy.deepcopy(model, memo)
    canonicalize_for(view, plan)
    return view
