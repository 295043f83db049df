"""`apply`: build a compressed model from a `Plan`, transactionally.

1. Resolve the plan against the model (every pattern must select a layer it can handle).
2. Work on a deep copy unless ``inplace=True``.
3. Where a config needs calibration, run the calibration batches once through the model and record
   each such layer's inputs (forward pre-hooks, removed afterwards).
4. Ask each layer's handler for a *new* module; nothing is swapped in until every layer succeeded,
   so a failure leaves the input model exactly as it was and names the layer and config at fault.

The applied plans are recorded on the result (`applied_plans`), which is what `wb.save` writes.
"""
from __future__ import annotations

import copy
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from workbench.plans.plan import Assignment, Plan
from workbench.plans.registry import Config, handler_for

__all__ = ["apply", "build_skeleton", "applied_plans", "ApplyError", "normalize_calibration"]

PLANS_ATTR = "_workbench_plans"

Batch = tuple[torch.Tensor, ...]


class ApplyError(RuntimeError):
    """A layer could not be transformed; the message names the layer and the config."""

    def __init__(self, layer: str, config: Config, cause: BaseException):
        self.layer = layer
        self.config = config
        super().__init__(f"layer {layer!r} with {config!r} failed: {type(cause).__name__}: {cause}")


def applied_plans(model: nn.Module) -> tuple[Plan, ...]:
    """The plans applied to ``model`` by `apply`, oldest first (empty for an untouched model)."""
    return tuple(getattr(model, PLANS_ATTR, ()))


def _as_plan(plan: Plan | Mapping[str, Config | None]) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, Mapping):
        return Plan(plan)
    raise TypeError(f"expected a wb.Plan (or a mapping of pattern -> config), got {type(plan).__name__}")


def _check_module(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module to compress, got {type(model).__name__}")
    return model


def normalize_calibration(calibration: Iterable[Any], model: nn.Module) -> list[Batch]:
    """Calibration batches as tuples of tensors on the model's device.

    Accepts what `Task.calibration` returns (a list of tuples), a list of tensors (one input each),
    or a single tensor (one batch). Floating tensors are moved to the model's device and cast to
    the dtype of its first floating-point parameter, so data prepared elsewhere just works.
    """
    from workbench.tasks.base import model_device

    if isinstance(calibration, torch.Tensor):
        calibration = [calibration]
    try:
        batches = list(calibration)
    except TypeError:
        raise TypeError(f"calibration must be a list of input batches, got {type(calibration).__name__}") from None
    device = model_device(model)
    fdtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    out = []
    for i, b in enumerate(batches):
        items = (b,) if isinstance(b, torch.Tensor) else tuple(b) if isinstance(b, (tuple, list)) else None
        if not items or not all(isinstance(t, torch.Tensor) for t in items):
            raise TypeError(f"calibration batch {i} must be a tensor or a tuple of tensors, got {b!r:.80}")
        out.append(tuple(t.to(device=device, dtype=fdtype if t.is_floating_point() else t.dtype)
                         for t in items))
    return out


def _describe(batch: Batch) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in batch)


def _capture_inputs(model: nn.Module, names: Sequence[str], batches: list[Batch],
                    progress: bool = True) -> dict[str, list[Batch]]:
    """Run the calibration batches through ``model`` and record the inputs of the named layers."""
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
            for i, batch in enumerate(tqdm(batches, desc="calibration", leave=False, disable=not progress)):
                try:
                    model(*batch)
                except Exception as e:
                    raise ValueError(
                        f"calibration batch {i} ({_describe(batch)}) could not be run through "
                        f"{type(model).__name__}: {type(e).__name__}: {e}") from e
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return records


def _swap(model: nn.Module, replacements: dict[str, nn.Module]) -> None:
    for name, new in replacements.items():
        model.set_submodule(name, new)


def apply(model: nn.Module, plan: Plan | Mapping[str, Config | None], calibration: Iterable[Any] | None = None,
          inplace: bool = False, progress: bool = True, estimate: bool = False) -> nn.Module:
    """Apply ``plan`` to ``model`` and return the compressed model.

    ``model`` is never modified unless ``inplace=True``; even then it is modified only once every
    layer has been transformed successfully. ``calibration``: input batches for configs that need
    them (e.g. ``task.calibration(128)``). ``estimate``: first estimate the calibration's peak memory
    and time (`wb.analysis.estimate_calibration`), print it, and raise ``MemoryError`` - before
    anything is copied - if it does not fit in the memory available now.
    """
    _check_module(model)
    plan = _as_plan(plan)
    assignments: list[Assignment] = plan.resolve(model)
    needing = [a for a in assignments if handler_for(a.config).needs_calibration(a.config)]
    batches: list[Batch] | None = None
    if calibration is not None:
        batches = normalize_calibration(calibration, model)
    if needing and not batches:
        layers = ", ".join(f"{a.name} ({type(a.config).__name__})" for a in needing[:5])
        raise ValueError(f"calibration data is required for {len(needing)} layer(s): {layers}"
                         f"{', ...' if len(needing) > 5 else ''}; pass calibration=task.calibration(n)")

    if estimate and needing:
        from workbench.analysis.estimate import estimate_calibration

        found = estimate_calibration(model, plan, batches, inplace=inplace)
        tqdm.write(str(found))
        if not found.fits:
            raise MemoryError(f"not calibrating: {found}")
    target = model if inplace else copy.deepcopy(model)
    inputs = _capture_inputs(target, [a.name for a in needing], batches, progress) if needing else {}
    replacements: dict[str, nn.Module] = {}
    resolved: list[tuple[str, Config]] = []
    for a in tqdm(assignments, desc="apply", disable=not progress or len(assignments) < 2, leave=False):
        module = target.get_submodule(a.name)
        handler = handler_for(a.config)
        try:
            new = handler.apply(a.name, module, a.config, inputs.get(a.name))
        except (KeyboardInterrupt, ApplyError):
            raise
        except Exception as e:
            raise ApplyError(a.name, a.config, e) from e
        if not isinstance(new, nn.Module):
            raise ApplyError(a.name, a.config, TypeError(f"handler returned {type(new).__name__}, not a module"))
        replacements[a.name] = new
        concrete = getattr(handler, "resolved", None)
        if concrete is not None and (c := concrete(a.config, new)) != a.config:
            resolved.append((a.name, c))
    _swap(target, replacements)
    # A config whose structure depends on the data (e.g. a rank chosen by an energy threshold) is recorded
    # as the concrete per-layer config, ahead of the user's patterns, so wb.load rebuilds the same shapes.
    recorded = Plan([*resolved, *((p, c) for p, c in plan.items() if p not in dict(resolved))]) if resolved else plan
    object.__setattr__(target, PLANS_ATTR, (*applied_plans(model), recorded))
    return target


def build_skeleton(model: nn.Module, plans: Sequence[Plan]) -> nn.Module:
    """A deep copy of ``model`` with the compressed *structure* of ``plans`` (values to be loaded)."""
    target = copy.deepcopy(_check_module(model))
    for plan in plans:
        replacements = {}
        for a in plan.resolve(target):
            module = target.get_submodule(a.name)
            try:
                replacements[a.name] = handler_for(a.config).skeleton(a.name, module, a.config)
            except Exception as e:
                raise ApplyError(a.name, a.config, e) from e
        _swap(target, replacements)
        object.__setattr__(target, PLANS_ATTR, (*applied_plans(target), plan))
    return target
