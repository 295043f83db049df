"""`apply`: build a compressed model from a `Plan`, transactionally.

1. Resolve the plan against the model (every pattern must select a layer it can handle).
2. Work on a deep copy unless ``inplace=True``.
3. Where a config needs calibration, ``pipeline`` decides where each layer's inputs come from:
   ``"sequential"`` (default, `workbench.plans.sequential`): block by block, each block's layers recorded on
   the outputs of the blocks already compressed before it, holding one block's activations at a time
   (techniques with an ``accumulator`` - GPTQ's Hessian, activation observers - keep statistics built batch
   by batch instead of the layers' inputs);
   ``"original"``: the calibration batches run once through the original model, recording every such
   layer's inputs (forward pre-hooks, removed afterwards). A model with no block list is calibrated the
   original way, with a warning and a note in `applied_report`.
4. Ask each layer's handler for a *new* module. A failure puts every module already swapped back (the
   sequential pipeline swaps block by block), so it leaves the input model exactly as it was and names the
   layer and config at fault.

The applied plans are recorded on the result (`applied_plans`), which is what `wb.save` writes.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from workbench.plans.layers import (
    PLANS_ATTR,
    ApplyError,
    Transformed,
    applied_plans,
    canonical_targets,
    canonicalize_for,
    capture_inputs,
    empty_copy,
    record_plan,
    share_tied,
    skeleton_layer,
    swap_layers,
    tie_groups,
    transform_layer,
)
from workbench.plans.plan import Plan
from workbench.plans.registry import Accumulator, Config, handler_for, stage_handler_for
from workbench.plans.sequential import BlockList, Pipeline, capture_block_inputs, find_blocks, run_block, runs_as_chain
from workbench.plans.spill import Spill

__all__ = ["apply", "build", "Built", "Recorded", "undo", "build_skeleton", "applied_plans", "applied_report",
           "ApplyError", "normalize_calibration",
           "PLANS_ATTR", "Pipeline"]

Batch = tuple[torch.Tensor, ...]
REPORT_ATTR = "_workbench_report"


def applied_report(model: nn.Module):
    """What the last `apply` did, one row per layer its plan matched: layer, type, pattern, config, status
    ("compressed" / "passed over"), the concrete config recorded, the handler's note or the reason a layer
    was passed over, and ``calibration``: where a calibrated layer's inputs came from ("sequential" or
    "original"; "" for a layer without calibration); first a row per model-level stage (status "stage", layer "",
    the stage's note: what it did) (a DataFrame; empty for a model `apply` did not produce)."""
    import pandas as pd

    return pd.DataFrame(getattr(model, REPORT_ATTR, []),
                        columns=["layer", "type", "pattern", "config", "status", "recorded", "note", "calibration"])


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


def normalize_calibration(calibration: Iterable[Any], model: nn.Module) -> list:
    """Calibration batches on the model's device: each a tuple of tensors (positional inputs) or a dict of
    tensors (keyword inputs, as Hugging Face models take them).

    Accepts what `Task.calibration` returns (a list of batches), a list of tensors (one input each) or a single
    tensor (one batch). Floating tensors are moved to the model's device and cast to the dtype of its first
    floating-point parameter, so data prepared elsewhere just works."""
    from workbench.tasks.base import model_device

    if isinstance(calibration, (torch.Tensor, Mapping)):
        calibration = [calibration]
    try:
        batches = list(calibration)
    except TypeError:
        raise TypeError(f"calibration must be a list of input batches, got {type(calibration).__name__}") from None
    device = model_device(model)
    fdtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=fdtype if t.is_floating_point() else t.dtype)

    out: list = []
    for i, b in enumerate(batches):
        if isinstance(b, Mapping):
            if not b or not all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in b.items()):
                raise TypeError(f"calibration batch {i}: a dict batch maps input names to tensors, got {b!r:.80}")
            out.append({k: move(t) for k, t in b.items()})
            continue
        items = (b,) if isinstance(b, torch.Tensor) else tuple(b) if isinstance(b, (tuple, list)) else None
        if not items or not all(isinstance(t, torch.Tensor) for t in items):
            raise TypeError(f"calibration batch {i} must be a tensor, a tuple of tensors or a dict of tensors, "
                            f"got {b!r:.80}")
        out.append(tuple(move(t) for t in items))
    return out


def apply(model: nn.Module, plan: Plan | Mapping[str, Config | None], calibration: Iterable[Any] | None = None,
          inplace: bool = False, progress: bool = True, estimate: bool = False,
          pipeline: Pipeline | str = Pipeline.SEQUENTIAL) -> nn.Module:
    """Apply ``plan`` to ``model`` and return the compressed model.

    ``model`` is never modified unless ``inplace=True``; even then it is modified only once every
    layer has been transformed successfully. ``calibration``: input batches for configs that need
    them (e.g. ``task.calibration(128)``). ``pipeline``: ``"sequential"`` (default) calibrates block by block
    on the compressed blocks' outputs; ``"original"`` records every calibrated layer's inputs from the original
    model in one pass (see `Pipeline`). ``estimate``: first estimate the calibration's peak memory
    and time (`wb.analysis.estimate_calibration`), print it, and raise ``MemoryError`` - before
    anything is copied - if it does not fit in the memory available now.
    """
    _check_module(model)
    plan = _as_plan(plan)
    pipeline = Pipeline.of(pipeline)
    batches: list[Batch] = normalize_calibration(calibration, model) if calibration is not None else []
    stages = [(s, stage_handler_for(s)) for s in plan.stages]
    for stage, handler in stages:
        if inplace:
            raise ValueError(f"the plan's stage {stage!r} changes the model before its layers are compressed and "
                             f"cannot be rolled back in place; use inplace=False")
        if handler.needs_calibration(stage) and not batches:
            raise ValueError(f"the plan's stage {stage!r} needs calibration data; pass calibration=task.calibration(n)")
    if not stages:
        assignments, passed = plan.survey(model)   # errors in the plan surface before anything is copied
        _check_calibration(assignments, batches)
        if estimate:
            _estimate(model, plan, assignments, batches, inplace, pipeline)
    target = model if inplace else copy.deepcopy(model)
    stage_rows = []
    if stages:   # the model-level stages, in order, on the copy; then the layers as they left them
        for stage, handler in stages:
            try:
                note = handler.apply(target, stage, batches)
            except (KeyboardInterrupt, ValueError, TypeError):
                raise
            except Exception as e:
                raise RuntimeError(f"wb.apply: the plan's stage {stage!r} failed: {type(e).__name__}: {e}") from e
            stage_rows.append({"layer": "", "type": type(model).__name__, "pattern": "", "config": repr(stage),
                               "status": "stage", "recorded": repr(stage), "note": note or "", "calibration": ""})
        assignments, passed = plan.survey(target)
        _check_calibration(assignments, batches)
        if estimate:
            _estimate(target, plan, assignments, batches, True, pipeline)
    needing = [a for a in assignments if handler_for(a.config).needs_calibration(a.config)]
    originals = {n: target.get_submodule(n) for n in canonical_targets(target, plan)}
    flags = {m: m.use_nested_tensor for m in target.modules() if hasattr(m, "use_nested_tensor")}
    groups = tie_groups(target)
    swapped: list[dict[str, nn.Module]] = []   # what each swap replaced, in order (the rollback)
    spill = Spill(target) if inplace else None   # in place, what the blocks replaced waits on disk, not in memory
    try:
        canonicalize_for(target, plan)   # the Linear-in-disguise layers the plan reaches, as survey saw them
        if needing:   # a calibrated layer its model never calls (its parent reads its weight) has no inputs
            silent = _not_called(target, [a.name for a in needing], batches[0])
            if silent:
                assignments, needing, uncalled = _pass_over_uncalled(target, assignments, needing, silent)
                passed = [*passed, *uncalled]
        built = build(target, assignments, batches, pipeline, groups=groups, progress=progress, swapped=swapped,
                      spill=spill)
        if built.fallback:
            warnings.warn(f"wb.apply: {type(model).__name__} cannot be calibrated block by block ({built.why}); its "
                          f"layers are calibrated from the original model's activations (pipeline='original')",
                          stacklevel=2)
    except BaseException:
        if spill is not None:
            spill.restore()
            spill.close()
        undo(target, swapped)
        if inplace and originals:   # the user's model is left exactly as it was
            swap_layers(target, originals)
            for m, flag in flags.items():
                m.use_nested_tensor = flag
        raise
    if spill is not None:
        spill.close()
    done = built.done
    # A config whose structure depends on the data (e.g. a rank chosen by an energy threshold) is recorded
    # as the concrete per-layer config, ahead of the user's patterns, so wb.load rebuilds the same shapes.
    resolved = [(n, t.concrete) for n, t in done.items() if t.concrete != t.config]
    kept = [p.name for p in passed if p.reason.startswith(NOT_CALLED)]   # decided by a forward: say it in the file
    recorded = _recorded(plan, assignments, resolved, kept) if resolved or kept else plan
    record_plan(target, (*applied_plans(model), recorded))
    calibrated = {a.name for a in needing}
    rows = stage_rows + [{"layer": a.name, "type": a.module_type, "pattern": a.pattern, "config": repr(a.config),
             "status": "compressed", "recorded": repr(done[a.name].concrete),
             "note": "; ".join(x for x in (done[a.name].note, built.fallback if a.name in calibrated else "") if x),
             "calibration": built.calibration if a.name in calibrated else ""}
            for a in assignments]
    rows += [{"layer": p.name, "type": p.module_type, "pattern": p.pattern, "config": repr(p.config),
              "status": "passed over", "recorded": "", "note": p.reason, "calibration": ""} for p in passed]
    object.__setattr__(target, REPORT_ATTR, rows)
    _warn_passed_over(passed)
    return target


@dataclass
class Built:
    """What `build` made: each layer's `Transformed` (``done``), where the calibrated layers' inputs came from
    (``calibration``: "sequential", "original", or "" when no layer was calibrated), and - when the sequential
    pipeline was asked for but could not be used - ``why`` and the note the report shows (``fallback``, "" when only
    one layer was built: nothing before it to compress, both pipelines are the same)."""

    done: dict[str, Transformed]
    calibration: str = ""
    why: str = ""
    fallback: str = ""


class Recorded:
    """The "original" pipeline's data: each layer's inputs as ``model`` (as it is now, unchanged) receives them on
    the calibration ``batches``, recorded in one pass for the layers first asked for and kept until `drop`.
    ``wb.apply`` records once and drops each layer's inputs once it is built; the UI session and `wb.sensitivity`
    keep them for the next layers they build."""

    def __init__(self, model: nn.Module, batches: Sequence, progress: bool = True):
        self.model, self.batches, self.progress = model, batches, progress
        self._kept: dict[str, list[Batch]] = {}

    def inputs(self, names: Sequence[str]) -> dict[str, list[Batch]]:
        missing = [n for n in names if n not in self._kept]
        if missing:
            self._kept.update(capture_inputs(self.model, missing, self.batches, self.progress))
        return {n: self._kept[n] for n in names}

    def drop(self, name: str) -> None:
        self._kept.pop(name, None)


def undo(target: nn.Module, swapped: list[dict[str, nn.Module]]) -> None:
    """Put back what each swap `build` made replaced (``swapped``, in order), newest first; empties the list."""
    while swapped:
        swap_layers(target, swapped.pop())


def build(target: nn.Module, assignments: Sequence, batches: Sequence, pipeline: Pipeline | str = Pipeline.SEQUENTIAL,
          *, recorded: Recorded | None = None, groups: Sequence[tuple[str, ...]] = (), progress: bool = True,
          swapped: list[dict[str, nn.Module]] | None = None, spill: Spill | None = None,
          step: Callable[[str], None] | None = None, calibrated: Sequence[str] | None = None) -> Built:
    """The applier: build each assignment's layer (``assignments``: `Assignment`-like, ``.name`` / ``.config``) of
    ``target`` and put it in place, calibrating the layers that need it on ``batches`` through ``pipeline``.
    `wb.apply`, the UI's `Session` and `wb.sensitivity` all build layers here.

    Every assigned layer of ``target`` must be its original module when called (the session puts the originals of
    the layers it rebuilds back first). ``"sequential"``: block by block (`_apply_sequential`); when the model has no
    block list or its blocks cannot run as a chain, the layers are calibrated the original way and `Built` says why.
    ``"original"``: inputs from ``recorded`` (default: recorded from ``target`` as it is now). ``groups``: the
    model's tied layers (`tie_groups`, taken before any layer was swapped): each group fully built keeps one stored
    copy. What every swap replaced is appended to ``swapped`` (with ``spill``, its tensors wait on disk): on an
    error the caller puts it back with `undo` (and ``spill.restore()`` first). ``step(name)`` is called before each
    layer is built (raising there stops the build). ``calibrated``: the calibrated layers of the whole plan, from
    which the block list is found (default: those of ``assignments``) - the session rebuilds a part of its plan, and
    the blocks must be those `wb.apply` finds for all of it (a head alone has no block list)."""
    pipeline = Pipeline.of(pipeline)
    swapped = [] if swapped is None else swapped
    first = len(swapped)   # the swaps before this build (the session's originals put back) are the caller's
    needing = [a for a in assignments if handler_for(a.config).needs_calibration(a.config)]
    if needing and not batches:
        raise ValueError(f"calibration data is required for layer {needing[0].name!r} "
                         f"({type(needing[0].config).__name__})")
    blocks, why = None, ""
    own_arguments: list = []   # (True when the blocks take different arguments: each block's are kept)
    if needing and pipeline is Pipeline.SEQUENTIAL:
        blocks = find_blocks(target, list(calibrated) if calibrated is not None else [a.name for a in needing])
        found = "no block list (an nn.ModuleList holding the calibrated layers) was found" if blocks is None \
            else runs_as_chain(target, blocks, batches[0], own_arguments)
        if found is not None:
            blocks, why = None, found
    if blocks is not None:
        done = _apply_sequential(target, assignments, needing, blocks, batches, progress, swapped, spill,
                                 bool(own_arguments), step)
    else:
        own = recorded is None   # recorded for this build alone: each layer's inputs dropped once it is built
        recorded = Recorded(target, batches, progress) if recorded is None else recorded
        inputs = recorded.inputs([a.name for a in needing]) if needing else {}
        done = {}
        for a in tqdm(assignments, desc="apply", disable=not progress or len(assignments) < 2, leave=False):
            if step is not None:
                step(a.name)
            done[a.name] = transform_layer(a.name, target.get_submodule(a.name), a.config, inputs.pop(a.name, None))
            if own:
                recorded.drop(a.name)
    _share_tied_groups(groups, {n: t.module for n, t in done.items()}, {n: t.config for n, t in done.items()})
    placed = {n for made in swapped[first:] for n in made}
    swapped.append(swap_layers(target, {n: t.module for n, t in done.items() if n not in placed}))
    how = ("sequential" if blocks is not None else "original") if needing else ""
    fallback = f"calibrated from the original model's activations: {why}" if why and len(assignments) > 1 else ""
    return Built(done, how, why if len(assignments) > 1 else "", fallback)


def _check_calibration(assignments, batches) -> None:
    needing = [a for a in assignments if handler_for(a.config).needs_calibration(a.config)]
    if needing and not batches:
        layers = ", ".join(f"{a.name} ({type(a.config).__name__})" for a in needing[:5])
        raise ValueError(f"calibration data is required for {len(needing)} layer(s): {layers}"
                         f"{', ...' if len(needing) > 5 else ''}; pass calibration=task.calibration(n)")


def _estimate(model: nn.Module, plan: Plan, assignments, batches, inplace: bool, pipeline: Pipeline) -> None:
    """`apply(..., estimate=True)`: print the calibration's estimate; MemoryError when it does not fit."""
    if not any(handler_for(a.config).needs_calibration(a.config) for a in assignments):
        return
    from workbench.plans.estimate import estimate_calibration

    found = estimate_calibration(model, plan, batches, inplace=inplace, pipeline=pipeline)
    tqdm.write(str(found))
    if not found.fits:
        raise MemoryError(f"not calibrating: {found}")


def _apply_sequential(target: nn.Module, assignments, needing, blocks: BlockList, batches, progress: bool,
                      swapped: list[dict[str, nn.Module]], spill: Spill | None = None,
                      own_arguments: bool = False, step: Callable[[str], None] | None = None) -> dict[str, Transformed]:
    """Transform ``assignments`` block by block (see `workbench.plans.sequential`): each block's layers are
    calibrated on the outputs of the compressed blocks before it and put in place at once (what they replaced
    is appended to ``swapped``, for the caller's rollback, and its tensors moved to ``spill`` when given).
    Layers whose statistics can be shared and that read the very same input tensor (a decoder's q / k / v,
    gate / up) share one accumulator (`_Feed`). Layers outside the blocks come last, calibrated in one pass of
    the model with every block compressed. ``own_arguments``: each block runs with the other arguments it took in
    the original model (recorded in one pass), not the first block's."""
    calibrated = {a.name for a in needing}
    per_block: dict[str, list] = {b: [] for b in blocks.names}
    outside: list = []
    for a in assignments:
        b = blocks.block_of(a.name)
        (per_block[b] if b is not None else outside).append(a)
    done: dict[str, Transformed] = {}
    was_training = target.training
    target.eval()
    try:
        states = capture_block_inputs(target, blocks.names[0], batches, progress,
                                      every=blocks if own_arguments else None)
        last = max((i for i, b in enumerate(blocks.names) if any(a.name in calibrated for a in per_block[b])),
                   default=-1)
        for i, b in enumerate(tqdm(blocks.names, desc="apply: blocks", leave=False, disable=not progress)):
            block = target.get_submodule(b)
            mine = per_block[b]
            inputs = {a.name: _statistics(a.name, target.get_submodule(a.name), a.config) for a in mine
                      if a.name in calibrated}
            if inputs:
                feed = _Feed(inputs)
                handles = [target.get_submodule(n).register_forward_pre_hook(
                    lambda mod, args, _n=n: feed(_n, args)) for n in inputs]
                try:
                    for s in states:
                        run_block(block, s.for_block(i))
                        feed.next_batch()
                finally:
                    for h in handles:
                        h.remove()
            new = {}
            for a in mine:
                if step is not None:
                    step(a.name)
                done[a.name] = transform_layer(a.name, target.get_submodule(a.name), a.config, inputs.pop(a.name, None))
                new[a.name] = done[a.name].module
            if new:
                swapped.append(swap_layers(target, new))
                if spill is not None:
                    spill.stash(swapped[-1])
            if i < last:   # the next calibrated block's inputs: this (compressed) block's outputs
                for s in states:
                    s.hidden = run_block(block, s.for_block(i))
        del states
        names = [a.name for a in outside if a.name in calibrated]
        inputs = capture_inputs(target, names, batches, progress) if names else {}
        for a in outside:
            if step is not None:
                step(a.name)
            done[a.name] = transform_layer(a.name, target.get_submodule(a.name), a.config, inputs.pop(a.name, None))
    finally:
        target.train(was_training)
    return done


def _statistics(name: str, module: nn.Module, config: Config):
    """What the sequential pipeline keeps of a layer's inputs: the handler's accumulator (statistics built batch
    by batch, e.g. GPTQ's Hessian) or, for a technique without one, a list of the recorded inputs."""
    found = handler_for(config).accumulator(name, module, config)
    return [] if found is None else found


class _Feed:
    """The forward pre-hooks' target while a block runs: feeds each layer's statistics (``stats``: name ->
    accumulator or list of inputs). On the first batch, a layer whose input is the very tensor an earlier layer
    of the block read, and whose accumulator can stand for that layer's (`Accumulator.shares_with`, as a
    `HessianAccumulator` of the same width does), is linked to that layer's accumulator: ``stats`` then maps both
    names to one object and the input is accumulated once. Later batches must show the same sharing."""

    def __init__(self, stats: dict):
        self.stats = stats
        self.leader: dict[str, str] = {}
        self.first = True
        self.seen: dict[int, tuple[torch.Tensor, list[str]]] = {}   # id(input) -> (input, its layers), this batch

    def __call__(self, name: str, args: tuple) -> None:
        stat = self.stats[name]
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is None or not isinstance(stat, Accumulator):
            _add(stat, args)
            return
        readers = self.seen.get(id(x), (x, []))[1]   # the layers of this block that read x before, in order
        if name in self.leader:
            if self.leader[name] not in readers:
                raise RuntimeError(f"calibration: {name!r} read the same input as {self.leader[name]!r} on the "
                                   f"first batch but not on a later one; use pipeline='original'")
            return
        if self.first:
            for earlier in readers:   # any of them whose accumulator can stand for this one (not only the first)
                other = self.stats[earlier]
                if isinstance(other, Accumulator) and other.shares_with(stat):
                    self.leader[name] = earlier
                    other.users += 1
                    self.stats[name] = other
                    return
        self.seen.setdefault(id(x), (x, []))[1].append(name)
        _add(stat, args)

    def next_batch(self) -> None:
        self.first = False
        self.seen.clear()


def _add(statistics, args: tuple) -> None:
    batch = tuple(x.detach() for x in args if isinstance(x, torch.Tensor))
    if isinstance(statistics, list):
        statistics.append(batch)
    else:
        statistics.add(batch)


def _recorded(plan: Plan, assignments, resolved: list[tuple[str, Config]], untouched: Sequence[str] = ()) -> Plan:
    """The plan to save: the layers left untouched for a reason only a forward pass shows (``untouched``, as
    ``None`` entries), the concrete per-layer configs, then the user's patterns - less those whose every layer now
    has a concrete entry (on reload such a pattern would select nothing, which is an error)."""
    concrete = dict(resolved)
    left = {a.pattern for a in assignments if a.name not in concrete}
    kept = [(p, c) for p, c in plan.items() if p not in concrete and p not in untouched and (c is None or p in left)]
    return Plan([*((n, None) for n in untouched), *resolved, *kept], stages=plan.stages)


NOT_CALLED = "never called when the calibration batch ran through the model"


def _not_called(model: nn.Module, names: Sequence[str], batch) -> list[str]:
    """Which of ``names`` the model does not call (as a module) on ``batch``: a layer whose parent reads its
    weight directly (Mamba's ``dt_proj``, a causal convolution run by a fused function) never sees an input, so
    a technique calibrated on inputs has nothing to work on. Stops as soon as every layer was called."""
    from workbench.plans.layers import _call, batch_error
    from workbench.plans.sequential import _Stop

    waiting = set(names)
    handles = []
    for name in names:
        def hook(mod, args, _name=name):
            waiting.discard(_name)
            if not waiting:
                raise _Stop
        handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            _call(model, batch)
    except _Stop:
        pass
    except Exception as e:
        raise batch_error(0, batch, model, e) from e
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return [n for n in names if n in waiting]


def _pass_over_uncalled(model: nn.Module, assignments, needing, silent: Sequence[str]):
    """Take the calibrated layers the model never calls out of the plan: passed over (with the reason) when a
    glob chose them, refused (`ApplyError`) when the plan names them exactly."""
    from workbench.plans.plan import PassedOver

    total = sum(p.numel() * p.element_size() for p in model.parameters()) or 1
    by_name = {a.name: a for a in needing}
    passed = []
    for name in silent:
        a = by_name[name]
        parent = name.rpartition(".")[0]
        owner = f"its parent {parent!r} ({type(model.get_submodule(parent)).__name__})" if parent else "the model"
        reason = (f"{NOT_CALLED} ({owner} uses its weight without calling it), so "
                  f"{type(a.config).__name__} has no inputs to calibrate it on")
        if a.pattern == a.name:
            raise ApplyError(name, a.config, ValueError(f"{name!r} was {reason}"))
        own = list(model.get_submodule(name).parameters(recurse=False))
        share = sum(p.numel() * p.element_size() for p in own) / total
        passed.append(PassedOver(name, a.module_type, a.pattern, a.config, reason, any(p.dim() >= 2 for p in own),
                                 share))
    gone = set(silent)
    return [a for a in assignments if a.name not in gone], [a for a in needing if a.name not in gone], passed


def _share_tied_groups(groups, modules: dict[str, nn.Module], configs: dict[str, Config]) -> None:
    """Tied layers (all assigned the same config, which `Plan.resolve` guarantees) keep one stored copy;
    ``groups``: the model's `tie_groups`, taken before any layer was swapped."""
    for group in groups:
        if all(n in modules for n in group):
            try:
                share_tied(group, modules)
            except ValueError as e:
                raise ApplyError(group[-1], configs[group[-1]], e) from None


PASSED_OVER_SHARE = 0.01   # a passed-over module holding this share of the model's parameter bytes is warned about


def _warn_passed_over(passed) -> None:
    """A matched module that was not compressed is worth a warning when it computes with a weight matrix (a
    ``weight`` of 2+ dimensions: what a user expected "*" to take) or holds at least `PASSED_OVER_SHARE` of the
    model's parameter bytes, whatever its parameters are called (a mixture-of-experts block's fused 3-D expert
    tensors); the largest first, each with its share."""
    heavy = sorted((p for p in passed if p.holds_matrix or p.share >= PASSED_OVER_SHARE), key=lambda p: -p.share)
    if heavy:
        shown = "; ".join(f"{p.name} ({p.module_type}, {p.share:.1%} of the model's parameter bytes): {p.reason}"
                          for p in heavy[:3])
        more = f"; and {len(heavy) - 3} more" if len(heavy) > 3 else ""
        total = sum(p.share for p in heavy)
        warnings.warn(f"wb.apply passed over {len(heavy)} matched layer(s) holding {total:.1%} of the model's "
                      f"parameter bytes: {shown}{more} (wb.applied_report(model) lists every layer)", stacklevel=3)


def build_skeleton(model: nn.Module, plans: Sequence[Plan], values: bool = True) -> nn.Module:
    """A deep copy of ``model`` with the compressed *structure* of ``plans`` (values to be loaded).
    ``values=False``: the copy's parameters and persistent buffers are meta tensors (nothing of ``model``'s
    weights is copied; what `wb.load` fills from a file), non-persistent buffers are copied."""
    _check_module(model)
    target = copy.deepcopy(model) if values else empty_copy(model)
    for plan in plans:
        for stage in plan.stages:   # the stages' structure, in order (values come from the file)
            stage_handler_for(stage).skeleton(target, stage)
        canonicalize_for(target, plan)   # the same rewriting as `apply`, from the same plan
        assignments = plan.resolve(target)
        modules = {a.name: skeleton_layer(a.name, target.get_submodule(a.name), a.config) for a in assignments}
        for group in tie_groups(target):   # the same sharing as `apply`, so the file's single copy fills both
            if all(n in modules for n in group):
                _tie_skeleton(group, modules)
        swap_layers(target, modules)
        record_plan(target, (*applied_plans(target), plan))
    return target


def _tie_skeleton(group, modules: dict[str, nn.Module]) -> None:
    first = modules[group[0]]
    ref = dict(first.named_parameters(recurse=False)) | dict(first.named_buffers(recurse=False))
    for name in group[1:]:
        other = modules[name]
        for key, t in [*other.named_parameters(recurse=False), *other.named_buffers(recurse=False)]:
            r = ref.get(key)
            if r is not None and r.shape == t.shape and r.dtype == t.dtype:
                if key in other._parameters and isinstance(r, nn.Parameter):
                    other._parameters[key] = r
                elif key in other._buffers:
                    other._buffers[key] = r
