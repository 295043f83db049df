"""`Session`: the state behind the interactive workbench, free of widgets (so it is tested directly).

A session owns one working copy of the user's model (the user's model is never touched) and the
per-layer assignment ``layer -> config`` the user is editing. `apply_and_measure` builds with `wb.apply`'s
applier (`workbench.plans.apply.build`) and the same calibration ``pipeline`` (sequential by default), so the
working copy is what ``wb.apply(model, session.plan, calibration=task.calibration(n))`` returns. It is
incremental: only the layers a change reaches are rebuilt - those whose config changed and, calibrated block by
block, the calibrated layers after a changed block (with their blocks' other layers) - each from the *original*
layer, so changing a layer twice never compounds; they are swapped into the working copy all or nothing; then the
working copy is measured (quick mode by default) and the result appended to the history. Every plan tried stays
in the history; `restore` brings one back; `undo` / `redo` walk the edits.
"""
from __future__ import annotations

import copy
import math
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from workbench.plans.apply import ApplyError, Recorded, build, normalize_calibration, undo
from workbench.plans.layers import (
    canonical_targets,
    compressible_layers,
    record_plan,
    skeleton_layer,
    swap_layers,
    tie_groups,
    transform_layer,
)
from workbench.plans.plan import Assignment, Plan, layer_matcher
from workbench.plans.registry import Config, handler_for
from workbench.plans.sequential import Pipeline, find_blocks
from workbench.tasks.base import Task, check_model

__all__ = ["Session", "Entry", "Cancelled"]


class Cancelled(RuntimeError):
    """Raised inside `apply_and_measure` when its cancel event is set; nothing was changed."""


@dataclass(frozen=True)
class Entry:
    """One point of the history: the plan tried and what `wb.measure` found."""

    label: str
    plan: Plan
    metrics: object  # wb.Metrics

    @property
    def quality(self) -> float:
        return self.metrics.primary_value

    @property
    def speedup(self):
        """The `wb.Speedup` of this point over the unchanged model, measured side by side with it."""
        return self.metrics.speedup

    @property
    def headline(self) -> str:
        """This point in one line: quality with its sampling error, size, the side-by-side speed verdict."""
        m = self.metrics
        err = m.primary_error
        known = err is not None and not math.isnan(err)
        quality = f"{m.primary}={m.primary_value:.4f}" + (f" +- {err:.2g}" if known else "")
        pace = self.speedup.verdict if self.speedup is not None else f"{m.latency_ms:.3g} ms"
        return (f"{self.label}: {quality}, {m.size_bytes / 2**20:.3f} MiB, {pace} (batch {m.batch_size}, "
                f"{m.threads} thread{'' if m.threads == 1 else 's'})")

    @property
    def notes(self) -> list[str]:
        """What the user should read beside the headline: why the point is slower than the unchanged model
        (`wb.measurement.slowdown_note`) and why pruning left its size as it was (`size_note`)."""
        from workbench.measurement.metrics import slowdown_note

        return [n for n in (slowdown_note(self.metrics), self.size_note) if n]

    @property
    def status(self) -> str:
        """The workbench's status line for this point: `headline`, then its `notes`."""
        return " - ".join([self.headline, *self.notes])

    @property
    def size_note(self) -> str:
        """Why pruning left the bytes as they were, when it did: storage "mask" / "dense" keep every weight
        (zeros included); "" otherwise."""
        kept = sorted({c.storage for c in self.plan.values() if getattr(c, "storage", None) in ("mask", "dense")})
        if not kept:
            return ""
        return (f"pruning with storage {' / '.join(repr(k) for k in kept)} keeps every weight (the pruned ones "
                f"as zeros), so the size does not drop: storage 'csr' keeps only the kept weights and their column "
                f"indices (fewer bytes above 50 % sparsity for fp32 weights), '2:4' with NM(2, 4) 0.52x")


class Session:
    """See the module docstring. ``quick``: measure on the task's quick subset (the default);
    ``calibration``: samples for configs that need calibration; ``threads``: CPU threads for measuring;
    ``pipeline``: where calibrated layers' inputs come from, as for `wb.apply` (``"sequential"`` or
    ``"original"``)."""

    def __init__(self, model: nn.Module, task: Task | str, *, quick: bool = True, calibration: int = 32,
                 threads: int | None = None, batch_size: int | None = None,
                 pipeline: Pipeline | str = Pipeline.SEQUENTIAL):
        from workbench import tasks

        check_model(model)
        self.task = tasks.load(task) if isinstance(task, str) else task
        if not isinstance(self.task, Task):
            raise TypeError(f"expected a wb.tasks.Task or a task name, got {type(task).__name__}")
        tasks.check_fit(model, self.task)  # issue 16: a model that cannot run the task fails here, in one line
        self.original = model
        self.work = copy.deepcopy(model).eval()
        # The layers are listed and built from a view of the model with every Linear-in-disguise rewritten
        # (Hugging Face Conv1D -> Linear, MultiheadAttention -> q/k/v/out projections; parameters shared, read
        # only); the working copy rewrites a module only while the plan reaches it - the rule wb.apply and
        # wb.load follow, so a saved session reloads with the same structure.
        from workbench.models.canonical import canonicalize

        self._view = copy.deepcopy(model, {id(t): t for t in [*model.parameters(), *model.buffers()]})
        canonicalize(self._view)
        self._canonical_in_work: set[str] = set()
        self.pipeline = Pipeline.of(pipeline)
        self._recorded: Recorded | None = None   # the calibration batches and the layers' inputs recorded on them
        self._warned = False
        self.quick, self.calibration, self.threads, self.batch_size = quick, calibration, threads, batch_size
        modules = dict(self._view.named_modules())
        # every layer some registered technique can take (Linear, Conv and Embedding, their subclasses, ...)
        self.layer_names = compressible_layers(self._view)
        if not self.layer_names:
            raise ValueError(f"{type(model).__name__} has no layer that any technique can compress")
        self._modules = {n: modules[n] for n in self.layer_names}
        self._ties = {n: g for g in tie_groups(self._view) for n in g}
        self.assigned: dict[str, Config] = {}
        self.applied: dict[str, Config] = {}
        self._concrete: dict[str, Config] = {}   # layer -> the concrete config its current module was built with
        self.history: list[Entry] = []
        self._undo: list[dict[str, Config]] = []
        self._redo: list[dict[str, Config]] = []
        self.sensitivity = None  # a wb.sensitivity table, when computed
        self._skeleton_bytes: dict[tuple[str, Config], int | None] = {}

    # --- editing ---------------------------------------------------------------------------------
    def select(self, pattern: str) -> list[str]:
        """The editable layers matching an exact name, a glob or a ``re:`` pattern."""
        match = layer_matcher(pattern)
        hits = [n for n in self.layer_names if match(n)]
        if not hits:
            raise ValueError(f"no editable layer matches {pattern!r}; layers: {', '.join(self.layer_names[:8])}"
                             f"{', ...' if len(self.layer_names) > 8 else ''}")
        return hits

    def check(self, layers: Sequence[str], config: Config | None) -> None:
        for name in layers:
            if name not in self._modules:
                raise ValueError(f"{name!r} is not an editable layer of {type(self.original).__name__}")
            if config is None:
                continue
            handler = handler_for(config)
            module = self._modules[name]
            if not handler.supports(module, config):
                raise ValueError(f"{type(config).__name__} cannot be applied to layer {name!r} "
                                 f"({type(module).__name__})")
            group = self._ties.get(name)
            if group is not None and not all(n in layers or self.assigned.get(n) == config for n in group):
                others = ", ".join(repr(n) for n in group if n != name)
                raise ValueError(f"layer {name!r} shares its weight with {others}: select them together (one "
                                 f"stored copy), or compressing it alone would store the weight twice")
            try:  # the structure alone (no values, no calibration): catches e.g. a group size that does not divide
                skeleton_layer(name, module, config)
            except ApplyError as err:
                e = err.__cause__ or err
                # a structure that depends on the weights (e.g. SVD by energy) has no skeleton: build the layer
                # itself when that needs no calibration data
                if handler.needs_calibration(config):
                    raise ValueError(f"{type(config).__name__} cannot be applied to layer {name!r}: {e}") from None
                try:
                    transform_layer(name, module, config, None)
                except ApplyError as err2:
                    e2 = err2.__cause__ or err2
                    raise ValueError(f"{type(config).__name__} cannot be applied to layer {name!r}: {e2}") from None

    def set(self, layers: Sequence[str] | str, config: Config | None) -> None:
        """Assign ``config`` (None: leave unchanged) to ``layers``; nothing is assigned if any layer refuses."""
        layers = self.select(layers) if isinstance(layers, str) else list(layers)
        if not layers:
            raise ValueError("select at least one layer")
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"expected a technique config or None, got {type(config).__name__}")
        self.check(layers, config)
        new = dict(self.assigned)
        for name in layers:
            if config is None:
                new.pop(name, None)
            else:
                new[name] = config
        self._edit(new)

    def _edit(self, new: dict[str, Config]) -> None:
        if new != self.assigned:
            self._undo.append(dict(self.assigned))
            self._redo.clear()
            self.assigned = new

    def _step(self, source: list, target: list) -> bool:
        if not source:
            return False
        target.append(dict(self.assigned))
        self.assigned = source.pop()
        return True

    def undo(self) -> bool:
        return self._step(self._undo, self._redo)

    def redo(self) -> bool:
        return self._step(self._redo, self._undo)

    @property
    def can_undo(self) -> bool:
        return bool(self._undo)

    @property
    def can_redo(self) -> bool:
        return bool(self._redo)

    @property
    def plan(self) -> Plan:
        """The current assignment as a plan of exact layer names, in model order."""
        return Plan([(n, self.assigned[n]) for n in self.layer_names if n in self.assigned])

    def load_plan(self, plan: Plan | Mapping | str) -> None:
        """Replace the assignment with ``plan`` (a Plan, a mapping or plan JSON), resolved on the model."""
        if isinstance(plan, str):
            plan = Plan.from_json(plan)
        elif not isinstance(plan, Plan):
            plan = Plan(plan)
        if plan.stages:
            raise ValueError(f"the session edits per-layer techniques; this plan also has model-level stages "
                             f"({', '.join(repr(s) for s in plan.stages)}), which it cannot apply - use wb.apply")
        new = {}
        for a in plan.resolve(self._view):
            if a.name not in self._modules:
                raise ValueError(f"plan assigns {a.name!r}, which the workbench does not edit")
            new[a.name] = a.config
        self._edit(new)

    def restore(self, index: int) -> None:
        """Make history entry ``index`` the current assignment (apply it to see it measured again)."""
        self.load_plan(self.history[index].plan)

    @property
    def changed(self) -> list[str]:
        """Layers whose assignment differs from what the working copy holds."""
        return [n for n in self.layer_names if self.assigned.get(n) != self.applied.get(n)]

    # --- applying and measuring ------------------------------------------------------------------
    @property
    def calibration(self) -> int:
        """Calibration samples for configs that need them; changing it drops the recorded layer inputs and marks the
        calibrated layers applied so far as changed (the next apply calibrates them on the new samples)."""
        return self._calibration

    @calibration.setter
    def calibration(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"calibration must be a positive number of samples, got {n!r}")
        if getattr(self, "_calibration", n) != n:
            self.applied = {k: c for k, c in self.applied.items() if not handler_for(c).needs_calibration(c)}
        self._calibration = n
        self._recorded = None

    def _calibration_data(self) -> Recorded:
        """The calibration batches and, for the original pipeline, the layers' inputs recorded from the unchanged
        model on them (kept for the next apply; dropped when the number of samples changes)."""
        if self._recorded is None:
            batches = normalize_calibration(self.task.calibration(self.calibration), self._view)
            self._recorded = Recorded(self._view, batches, progress=False)
        return self._recorded

    def _to_rebuild(self, changed: list[str]) -> list[str]:
        """The layers an apply builds: the ``changed`` ones and, with the sequential pipeline, what makes the
        result the one `wb.apply` gives for the whole plan - a calibrated layer after a changed block was
        calibrated on that block's old outputs (rebuilt, with every assigned layer of its block, which
        `wb.apply` calibrates all unchanged; and the assigned layers outside the blocks, which are unchanged
        while the blocks are calibrated). Tied layers are rebuilt together."""
        calibrated = [n for n, c in self.assigned.items() if handler_for(c).needs_calibration(c)]
        rebuild = set(changed)
        blocks = find_blocks(self._view, calibrated) if calibrated and self.pipeline is Pipeline.SEQUENTIAL else None
        if blocks is not None:
            index = {b: i for i, b in enumerate(blocks.names)}
            where = {n: blocks.block_of(n) for n in self.layer_names}
            first = min((index[where[n]] for n in changed if where[n] is not None), default=None)
            stale = {n for n in calibrated if n not in rebuild and first is not None
                     and (where[n] is None or index[where[n]] > first)}
            if stale or any(n in calibrated for n in rebuild):
                redo_blocks = {where[n] for n in (stale | rebuild) & set(calibrated)}
                rebuild |= {n for n in self.assigned if where[n] is None or where[n] in redo_blocks}
        for group in tie_groups(self._view):
            if rebuild & set(group):
                rebuild |= set(group)
        return [n for n in self.layer_names if n in rebuild]

    def estimate(self):
        """The calibration estimate (`wb.analysis.estimate_calibration`) of the layers that need one now."""
        from workbench.plans.estimate import estimate_calibration

        needing = [n for n in self._to_rebuild(self.changed) if n in self.assigned
                   and handler_for(self.assigned[n]).needs_calibration(self.assigned[n])]
        if not needing:
            return None
        sub = Plan([(n, self.assigned[n]) for n in needing])   # (the session builds in its working copy: in place)
        return estimate_calibration(self.original, sub, self.task.calibration(self.calibration), inplace=True,
                                    pipeline=self.pipeline)

    def apply_and_measure(self, label: str | None = None, progress: Callable[[str, float], None] | None = None,
                          cancel: threading.Event | None = None) -> Entry:
        """Rebuild the changed layers, swap them in (all or nothing), measure; returns the new history entry.

        ``progress(message, fraction)`` is called as work proceeds; setting ``cancel`` stops before
        the swap (raising `Cancelled`) and leaves the working copy as it was."""
        from workbench.measurement.metrics import measure

        def report(message: str, fraction: float) -> None:
            if progress is not None:
                progress(message, fraction)
            if cancel is not None and cancel.is_set():
                raise Cancelled("cancelled; nothing was changed")

        canonical = self._canonical_swaps()
        # layers inside a module rewritten (or restored) now are rebuilt from the assignment as well
        inside = {n for n in self.layer_names if any(n.startswith(w + ".") for w in canonical)}
        restored = [w for w in canonical if w in self._canonical_in_work]   # back to the original module
        changed = [n for n in self.layer_names if (n in set(self.changed) or (n in inside and n in self.assigned))
                   and not any(n == w or n.startswith(w + ".") for w in restored)]
        restore_canonical = swap_layers(self.work, canonical)
        before = dict(self._concrete)
        canonical_before = set(self._canonical_in_work)
        swapped: list[dict[str, nn.Module]] = []
        try:
            rebuild = self._to_rebuild(changed)
            needing = [n for n in rebuild if n in self.assigned
                       and handler_for(self.assigned[n]).needs_calibration(self.assigned[n])]
            report("calibrating" if needing else "applying", 0.0)
            data = self._calibration_data() if needing else None
            # each layer is rebuilt from its original (changing a layer twice never compounds)
            swapped.append(swap_layers(self.work, {n: self._modules[n] for n in rebuild
                                                   if n not in inside or n in self.assigned}))
            todo = [Assignment(n, type(self._modules[n]).__name__, n, self.assigned[n]) for n in rebuild
                    if n in self.assigned]
            order = {a.name: i for i, a in enumerate(todo)}
            calibrated = [n for n, c in self.assigned.items() if handler_for(c).needs_calibration(c)]
            built = build(self.work, todo, data.batches if data is not None else [], self.pipeline, recorded=data,
                          groups=tie_groups(self._view), progress=False, swapped=swapped, calibrated=calibrated,
                          step=lambda name: report(f"applying {name}", 0.1 + 0.6 * order[name] / max(1, len(todo))))
            if built.fallback and not self._warned:
                self._warned = True
                warnings.warn(f"wb.ui.Session: {type(self.original).__name__} cannot be calibrated block by block "
                              f"({built.why}); its layers are calibrated from the original model's activations "
                              f"(pipeline='original')", stacklevel=2)
            report("measuring", 0.7)
            self._canonical_in_work = set(canonical_targets(self.original, self.plan))
            self._concrete.update({n: t.concrete for n, t in built.done.items()})
            record_plan(self.work, (self._recorded_plan(),) if self.assigned else ())
            # the speedup against the unchanged model is measured side by side, in the same paired rounds -
            # never against a reference point timed once, cold, at start-up
            metrics = measure(self.work, self.task, quick=self.quick, threads=self.threads,
                              batch_size=self.batch_size, progress=False, name=type(self.original).__name__,
                              baseline=self.original)
        except BaseException:   # building, measuring failed or was interrupted: back to before
            undo(self.work, swapped)
            swap_layers(self.work, restore_canonical)
            self._concrete = before
            self._canonical_in_work = canonical_before
            record_plan(self.work, (self._recorded_plan(self.applied),) if self.applied else ())
            raise
        self.applied = dict(self.assigned)
        entry = Entry(label or self.describe(), self.plan, metrics)
        self.history.append(entry)
        report("done", 1.0)
        return entry

    # --- exporting -----------------------------------------------------------------------------------
    def export(self, path, format: str = "compressed-tensors", base_folder=None):
        """Write the model as last applied and measured (`wb.export`) to the new folder ``path``; returns it.

        ``format``: a name of `wb.export.FORMATS` or an `ExportFormat`; ``"onnx"`` traces with one example batch of
        the session's task, its first dimension left free (inputs ``input0``, ``input1``, ...). ``base_folder``:
        where the model's tokenizer files are (default: the checkpoint folder the model was loaded from, when there
        is one). Refused while the plan has changes not yet applied - the file must hold the model whose numbers the
        charts show."""
        from pathlib import Path

        from workbench.export import ONNX, export

        if self.changed:
            raise ValueError(f"the plan has changes not yet applied ({', '.join(self.changed[:3])}"
                             f"{' ...' if len(self.changed) > 3 else ''}): Apply & measure first, so the exported "
                             f"model is the one measured")
        if format == "onnx":
            format = ONNX.for_task(self.task)
        if base_folder is None:
            source = getattr(getattr(self.original, "config", None), "_name_or_path", None)
            if source and Path(source).is_dir():
                base_folder = source
        return export(self.work, path, format=format, base_folder=base_folder)

    def _canonical_swaps(self) -> dict[str, nn.Module]:
        """Modules of the working copy to rewrite (newly reached by the plan) or restore (no longer reached)."""
        wanted = set(canonical_targets(self.original, self.plan))
        swaps = {}
        for name in wanted - self._canonical_in_work:   # its projections come from the view, fresh copies
            swaps[name] = copy.deepcopy(self._view.get_submodule(name))
        for name in self._canonical_in_work - wanted:
            swaps[name] = copy.deepcopy(self.original.get_submodule(name))
        return swaps

    def _recorded_plan(self, assignment: Mapping[str, Config] | None = None) -> Plan:
        """The plan `wb.save` records: each layer's concrete config (e.g. SVD's rank chosen by energy)."""
        assignment = self.assigned if assignment is None else assignment
        return Plan([(n, self._concrete.get(n, assignment[n])) for n in self.layer_names if n in assignment])

    def describe(self, assignment: Mapping[str, Config] | None = None) -> str:
        """The assignment in words, layers grouped by config, e.g. ``"WeightOnly · 4 bits · group 32 · rtn on
        fc1, fc2; Magnitude · 50% sparse on conv1"`` (``"reference"`` when empty)."""
        from workbench.ui.forms import describe

        assignment = self.assigned if assignment is None else assignment
        if not assignment:
            return "reference"
        groups: dict[Config, list[str]] = {}
        for name, config in assignment.items():
            groups.setdefault(config, []).append(name)
        return "; ".join(f"{describe(c)} on {', '.join(names[:3])}"
                         + (f" and {len(names) - 3} more" if len(names) > 3 else "") for c, names in groups.items())

    def _planned_bytes(self, name: str) -> int | None:
        """Bytes layer ``name`` holds under its assigned config: measured when applied, else from the
        technique's skeleton (its compressed structure, no values computed); None when only applying tells
        (e.g. SVD by energy, whose rank depends on the weights)."""
        from workbench.measurement.footprint import size_bytes

        config = self.assigned.get(name)
        if config is None:
            return size_bytes(self._modules[name])
        if self.applied.get(name) == config:
            return size_bytes(self.work.get_submodule(name))
        key = (name, config)
        if key not in self._skeleton_bytes:
            try:
                self._skeleton_bytes[key] = size_bytes(skeleton_layer(name, self._modules[name], config))
            except ApplyError:
                self._skeleton_bytes[key] = None
        return self._skeleton_bytes[key]

    def layer_rows(self):
        """A DataFrame of the editable layers: type, shape, parameters, the assigned technique in words, the
        bytes of the unchanged layer and under the assignment, whether it is applied, and the sensitivity
        loss of the assigned config when a table has been computed. Undo and redo move every column."""
        import json

        import pandas as pd

        from workbench.measurement.footprint import size_bytes
        from workbench.plans.registry import config_to_dict
        from workbench.ui.forms import describe

        losses = {}
        if self.sensitivity is not None and len(self.sensitivity):
            for _, r in self.sensitivity.iterrows():
                losses[(r["layer"], r["config"])] = r["loss"]
        rows = []
        for n in self.layer_names:
            m = self._modules[n]
            weight = getattr(m, "weight", None)
            config = self.assigned.get(n)
            key = (n, json.dumps(config_to_dict(config))) if config is not None else None
            after = self._planned_bytes(n)
            rows.append({"layer": n, "type": type(m).__name__,
                         "shape": "×".join(map(str, weight.shape)) if isinstance(weight, torch.Tensor) else "",
                         "params": sum(p.numel() for p in m.parameters()),
                         "technique": describe(config),
                         "bytes_before": size_bytes(m),
                         "bytes_after": after if after is not None else "after apply",
                         "state": ("to apply" if config != self.applied.get(n) else
                                   "applied" if config is not None else ""),
                         "loss": losses.get(key, float("nan")) if key else float("nan")})
        return pd.DataFrame(rows)
