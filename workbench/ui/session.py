"""`Session`: the state behind the interactive workbench, free of widgets (so it is tested directly).

A session owns one working copy of the user's model (the user's model is never touched) and the
per-layer assignment ``layer -> config`` the user is editing. `apply_and_measure` is incremental: only
layers whose config changed since the last apply are rebuilt - each from the *original* layer, so
changing a layer twice never compounds - and swapped into the working copy, all or nothing; then the
working copy is measured (quick mode by default) and the result appended to the history. Every plan
tried stays in the history; `restore` brings one back; `undo` / `redo` walk the edits.
"""
from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from workbench.plans.apply import PLANS_ATTR, ApplyError
from workbench.plans.plan import Plan, _matcher
from workbench.plans.registry import Config, handler_for
from workbench.tasks.base import Task, check_model

__all__ = ["Session", "Entry", "LAYER_TYPES", "Cancelled"]

LAYER_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding)


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


class Session:
    """See the module docstring. ``quick``: measure on the task's quick subset (the default);
    ``calibration``: samples for configs that need calibration; ``threads``: CPU threads for measuring."""

    def __init__(self, model: nn.Module, task: Task | str, *, quick: bool = True, calibration: int = 32,
                 threads: int | None = None, batch_size: int | None = None):
        from workbench import tasks

        check_model(model)
        self.task = tasks.load(task) if isinstance(task, str) else task
        if not isinstance(self.task, Task):
            raise TypeError(f"expected a wb.tasks.Task or a task name, got {type(task).__name__}")
        tasks.check_fit(model, self.task)  # issue 16: a model that cannot run the task fails here, in one line
        self.original = model
        self.work = copy.deepcopy(model).eval()
        self._inputs: dict[str, list] = {}
        self.quick, self.calibration, self.threads, self.batch_size = quick, calibration, threads, batch_size
        modules = dict(model.named_modules())
        self.layer_names = [n for n, m in model.named_modules() if n and type(m) in LAYER_TYPES]
        if not self.layer_names:
            raise ValueError(f"{type(model).__name__} has no Linear, Conv or Embedding layer to edit")
        self._modules = {n: modules[n] for n in self.layer_names}
        self.assigned: dict[str, Config] = {}
        self.applied: dict[str, Config] = {}
        self.history: list[Entry] = []
        self._undo: list[dict[str, Config]] = []
        self._redo: list[dict[str, Config]] = []
        self.sensitivity = None  # a wb.sensitivity table, when computed

    # --- editing ---------------------------------------------------------------------------------
    def select(self, pattern: str) -> list[str]:
        """The editable layers matching an exact name, a glob or a ``re:`` pattern."""
        match = _matcher(pattern)
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
            try:  # the structure alone (no values, no calibration): catches e.g. a group size that does not divide
                handler.skeleton(name, module, config)
            except Exception as e:
                # a structure that depends on the weights (e.g. SVD by energy) has no skeleton: build the layer
                # itself when that needs no calibration data
                if handler.needs_calibration(config):
                    raise ValueError(f"{type(config).__name__} cannot be applied to layer {name!r}: {e}") from None
                try:
                    handler.apply(name, module, config, None)
                except Exception as e2:
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
        new = {}
        for a in plan.resolve(self.original):
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
        """Calibration samples for configs that need them; changing it drops the recorded layer inputs."""
        return self._calibration

    @calibration.setter
    def calibration(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"calibration must be a positive number of samples, got {n!r}")
        self._calibration = n
        self._inputs.clear()

    def _calibration_inputs(self, names: list[str]) -> dict[str, list]:
        from workbench.plans.apply import _capture_inputs, normalize_calibration

        missing = [n for n in names if n not in self._inputs]
        if missing:
            batches = normalize_calibration(self.task.calibration(self.calibration), self.original)
            self._inputs.update(_capture_inputs(self.original, missing, batches, progress=False))
        return {n: self._inputs[n] for n in names}

    def estimate(self):
        """The calibration estimate (`wb.analysis.estimate_calibration`) of the layers that need one now."""
        from workbench.analysis.estimate import estimate_calibration

        plan = Plan([(n, self.assigned[n]) for n in self.changed if n in self.assigned])
        needing = [n for n, c in plan.items() if handler_for(c).needs_calibration(c)]
        if not needing:
            return None
        sub = Plan([(n, plan[n]) for n in needing])
        return estimate_calibration(self.original, sub, self.task.calibration(self.calibration), inplace=True)

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

        changed = self.changed
        needing = [n for n in changed if n in self.assigned
                   and handler_for(self.assigned[n]).needs_calibration(self.assigned[n])]
        report("calibrating" if needing else "applying", 0.0)
        inputs = self._calibration_inputs(needing) if needing else {}
        replacements: dict[str, nn.Module] = {}
        for i, name in enumerate(changed):
            report(f"applying {name}", 0.1 + 0.6 * i / max(1, len(changed)))
            original = self._modules[name]
            config = self.assigned.get(name)
            if config is None:
                replacements[name] = original
                continue
            try:
                replacements[name] = handler_for(config).apply(name, original, config, inputs.get(name))
            except Exception as e:
                raise ApplyError(name, config, e) from e
        report("measuring", 0.7)
        previous = {n: self.work.get_submodule(n) for n in replacements}
        for name, module in replacements.items():
            self.work.set_submodule(name, module)
        plan = self.plan
        object.__setattr__(self.work, PLANS_ATTR, (plan,) if len(plan) else ())
        try:
            metrics = measure(self.work, self.task, quick=self.quick, threads=self.threads,
                              batch_size=self.batch_size, progress=False, name=type(self.original).__name__)
        except BaseException:
            for name, module in previous.items():  # measuring failed or was interrupted: back to before
                self.work.set_submodule(name, module)
            object.__setattr__(self.work, PLANS_ATTR, (Plan(self.applied),) if self.applied else ())
            raise
        self.applied = dict(self.assigned)
        entry = Entry(label or self.describe(), plan, metrics)
        self.history.append(entry)
        report("done", 1.0)
        return entry

    def describe(self, assignment: Mapping[str, Config] | None = None) -> str:
        """A short label of an assignment, e.g. ``"fc1: WeightOnly(bits=8); 2 more"``."""
        from workbench.analysis.candidates import label

        assignment = self.assigned if assignment is None else assignment
        if not assignment:
            return "reference"
        items = [f"{n}: {label(c)}" for n, c in assignment.items()]
        return items[0] + (f"; {len(items) - 1} more" if len(items) > 1 else "")

    def layer_rows(self):
        """A DataFrame of the editable layers: type, shape, parameters, current assignment, bytes now,
        and the sensitivity loss of the assigned config when a table has been computed."""
        import json

        import pandas as pd

        from workbench.analysis.candidates import label
        from workbench.measurement.footprint import size_bytes
        from workbench.plans.registry import config_to_dict

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
            rows.append({"layer": n, "type": type(m).__name__,
                         "shape": "x".join(map(str, weight.shape)) if isinstance(weight, torch.Tensor) else "",
                         "params": sum(p.numel() for p in m.parameters()),
                         "technique": label(config) if config is not None else "none",
                         "bytes": size_bytes(self.work.get_submodule(n)),
                         "loss": losses.get(key, float("nan")) if key else float("nan")})
        return pd.DataFrame(rows)
