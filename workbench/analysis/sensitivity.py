"""`sensitivity`: what each single-layer change costs in quality, bytes and (optionally) latency.

For every layer x candidate config, only that layer is changed and the task's metric is measured on the
changed model (the task's quick subset by default). Everything is a measurement on the real model:

- the quality change is the task's own metric (``loss`` > 0 means worse, whatever the metric's direction);
- the size change is the real bytes of the new layer against the old one;
- with ``latency=True``, the layer's own forward time on the inputs it receives at the task's latency batch.

What makes it fast: the model is copied once and each candidate layer is swapped in and out of that
copy (the caller's model is never touched); the blocks that run before the changed layer are replayed
from a recording of the reference evaluation instead of being recomputed (`replay.PrefixReplay`, exact);
calibration inputs are recorded once for all layers. Rows are cached on disk as they are measured
(keyed by the model's fingerprint, task, metric, options and config; see `cache`), so an interrupted run
keeps its partial results and a rerun only measures what is missing - from cache it is near-instant.
"""
from __future__ import annotations

import copy
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from workbench.analysis import candidates as cands_mod
from workbench.analysis.cache import ResultCache, cache_dir, fingerprint, key_of
from workbench.analysis.executors import Executor, InProcess, get_executor
from workbench.analysis.replay import PrefixReplay
from workbench.measurement.footprint import size_bytes
from workbench.measurement.latency import num_threads, time_forward
from workbench.plans.apply import Recorded, build, normalize_calibration, undo
from workbench.plans.plan import Assignment, layer_matcher
from workbench.plans.registry import Config, config_to_dict, handler_for
from workbench.plans.sequential import Pipeline
from workbench.tasks.base import Task, check_model, model_device

__all__ = ["sensitivity", "select_layers", "layer_latencies", "COLUMNS"]

COLUMNS = ["layer", "type", "candidate", "kind", "status", "metric", "base", "value", "loss", "size_before",
           "size_after", "latency_before_ms", "latency_after_ms", "seconds", "config"]
CACHE_VERSION = 1


@dataclass(frozen=True)
class _Options:
    metric: str
    quick: bool
    calibration: Any          # an int (task samples) or a list of batches
    latency: bool
    batch_size: int
    replay: bool


def select_layers(model: nn.Module, candidates: Sequence[tuple[str, Config]], layers=None) -> list[str]:
    """The layers to study: ``layers`` (names or plan patterns, in model order) or, by default, every
    module that at least one candidate can change (not nested in another such module)."""
    names = [n for n, _ in model.named_modules() if n]
    modules = dict(model.named_modules())

    def supported(name: str) -> bool:
        return any(handler_for(c).supports(modules[name], c) for _, c in candidates)

    if layers is None:
        out: list[str] = []
        for n in names:
            if supported(n) and not any(n.startswith(o + ".") for o in out):
                out.append(n)
        if not out:
            raise ValueError(f"no layer of {type(model).__name__} is supported by any candidate "
                             f"({', '.join(lbl for lbl, _ in candidates)})")
        return out
    if isinstance(layers, str):
        layers = [layers]
    chosen: set[str] = set()
    for pattern in layers:
        match = layer_matcher(pattern)
        hits = [n for n in names if match(n)]
        if not hits:
            some = ", ".join(n for n in names if not list(modules[n].children()))[:300]
            raise ValueError(f"layer {pattern!r} is not in {type(model).__name__}; some layer names: {some}")
        usable = [n for n in hits if supported(n)]
        if not usable:
            types = sorted({type(modules[n]).__name__ for n in hits})
            raise ValueError(f"layer {pattern!r} ({', '.join(types)}) is not supported by any candidate")
        chosen.update(usable)
    return [n for n in names if n in chosen]


def _calibration_batches(task: Task, calibration, model: nn.Module):
    if calibration is None:
        return None
    return normalize_calibration(task.calibration(calibration) if isinstance(calibration, int) else calibration, model)


def _calibration_key(calibration) -> Any:
    if calibration is None or (isinstance(calibration, int) and not isinstance(calibration, bool)):
        return calibration
    import hashlib

    h = hashlib.blake2b(digest_size=12)
    for batch in ([calibration] if isinstance(calibration, torch.Tensor) else calibration):
        for t in ((batch,) if isinstance(batch, torch.Tensor) else
                  [batch[k] for k in sorted(batch)] if isinstance(batch, dict) else batch):
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _layer_inputs(model: nn.Module, layers: Sequence[str], batch) -> dict[str, tuple]:
    """The inputs each of ``layers`` receives (first call) when ``model`` runs on ``batch``."""
    from workbench.tasks.inputs import call, to_device

    device = model_device(model)
    records: dict[str, tuple] = {}
    handles = []
    for name in layers:
        def hook(_m, args, _n=name):
            records.setdefault(_n, tuple(a.detach() for a in args if isinstance(a, torch.Tensor)))
        handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
    try:
        with torch.inference_mode():
            call(model, to_device(batch, device))
    finally:
        for h in handles:
            h.remove()
    return records


def _time_layer(module: nn.Module, inputs: tuple) -> float:
    return time_forward(module, inputs, warmup=2, min_runs=5, max_runs=50, budget_s=0.25).median_ms


def layer_latencies(model: nn.Module, task: Task, layers: Sequence[str], batch_size: int | None = None,
                    threads: int | None = None) -> dict[str, float]:
    """Median forward time (ms) of each layer on the inputs it receives at the task's latency batch."""
    inputs = _layer_inputs(model, layers, task.example_inputs(batch_size or task.default_batch_size))
    with num_threads(threads):
        return {n: _time_layer(model.get_submodule(n), inputs[n]) for n in layers if n in inputs}


def _loss(base: float, value: float, higher_is_better: bool) -> float:
    return base - value if higher_is_better else value - base


class _Session:
    """One working copy of the model with everything recorded that single-layer evaluations reuse."""

    def __init__(self, model: nn.Module, task: Task, candidates, layers: list[str], opts: _Options):
        self.task, self.candidates, self.layers, self.opts = task, candidates, layers, opts
        self.work = copy.deepcopy(model).eval()
        self.higher = task.metric(opts.metric).higher_is_better
        self.replay = PrefixReplay(self.work, layers) if opts.replay else None
        if self.replay is not None:
            self.base = self.replay.record(self._evaluate)
            self.replay_status = self.replay.status
        else:
            self.base = self._evaluate()
            self.replay_status = "off: replay=False"
        self.recorded = Recorded(self.work, [], progress=False)   # each layer's inputs, recorded once for all
        needing = [c for _, c in candidates if handler_for(c).needs_calibration(c)]
        if needing:
            batches = _calibration_batches(task, opts.calibration, self.work)
            if not batches:
                raise ValueError(f"candidate(s) {[cands_mod.label(c) for c in needing]} need calibration data; "
                                 f"pass calibration=<number of samples> or a list of batches")
            self.recorded = Recorded(self.work, batches, progress=False)
            self.recorded.inputs(layers)
        self.latency_inputs: dict[str, tuple] = {}
        if opts.latency:
            self.latency_inputs = self._layer_inputs(task.example_inputs(opts.batch_size))

    def _evaluate(self) -> float:
        quality = self.task.evaluate(self.work, quick=self.opts.quick)
        if self.opts.metric not in quality:
            raise RuntimeError(f"task {self.task.name!r} did not report metric {self.opts.metric!r} "
                               f"(it reported {sorted(quality)}){' with quick=True' if self.opts.quick else ''}")
        return float(quality[self.opts.metric])

    def _layer_inputs(self, batch) -> dict[str, tuple]:
        return _layer_inputs(self.work, self.layers, batch)

    def _time(self, module: nn.Module, layer: str) -> float:
        inputs = self.latency_inputs.get(layer)
        return float("nan") if inputs is None else _time_layer(module, inputs)

    def rows(self, layer: str, todo: set[str] | None = None) -> Iterator[tuple[str, dict]]:
        """``(candidate label, row)`` for each candidate (only those in ``todo`` when given)."""
        original = self.work.get_submodule(layer)
        size_before = size_bytes(original)
        lat_before = self._time(original, layer) if self.opts.latency else float("nan")
        for lbl, config in self.candidates:
            if todo is not None and lbl not in todo:
                continue
            t0 = time.perf_counter()
            row = {"layer": layer, "type": type(original).__name__, "kind": config.kind,
                   "metric": self.opts.metric, "base": self.base, "value": float("nan"), "loss": float("nan"),
                   "size_before": size_before, "size_after": float("nan"), "latency_before_ms": lat_before,
                   "latency_after_ms": float("nan"), "config": json.dumps(config_to_dict(config))}
            handler = handler_for(config)
            if not handler.supports(original, config):
                row["status"] = "unsupported"
            else:
                swapped: list = []   # the one layer changed, built by wb.apply's applier from the recorded inputs
                try:
                    new = build(self.work, [Assignment(layer, row["type"], layer, config)], self.recorded.batches,
                                Pipeline.ORIGINAL, recorded=self.recorded, progress=False,
                                swapped=swapped).done[layer].module
                except Exception as e:  # recorded per row: one unsuitable layer must not stop the analysis
                    undo(self.work, swapped)
                    row["status"] = f"error: {type(e).__name__}: {e}"
                else:
                    try:
                        if self.replay is not None:
                            with self.replay.skip_before(layer):
                                value = self._evaluate()
                        else:
                            value = self._evaluate()
                    finally:
                        undo(self.work, swapped)
                    row.update(status="ok", value=value, loss=_loss(self.base, value, self.higher),
                               size_after=size_bytes(new),
                               latency_after_ms=self._time(new, layer) if self.opts.latency else float("nan"))
            row["seconds"] = time.perf_counter() - t0
            yield lbl, row


def _job(model, task, candidates, layers, opts, todo) -> tuple[float, str, list[tuple[str, str, dict]]]:
    """Executor job: measure ``todo[layer]`` candidates for ``layers`` on a fresh session."""
    session = _Session(model, task, candidates, layers, opts)
    rows = [(layer, lbl, row) for layer in layers for lbl, row in session.rows(layer, todo[layer])]
    return session.base, session.replay_status, rows


def sensitivity(model: nn.Module, task: Task | str, candidates: Sequence[Config] | Mapping[str, Config],
                layers: Sequence[str] | str | None = None, *, metric: str | None = None, quick: bool = True,
                calibration: int | Sequence | None = 32, latency: bool = False, batch_size: int | None = None,
                threads: int | None = None, cache: bool | str = True, executor: Executor | str | None = None,
                replay: bool = True, progress: bool = True):
    """One row per layer x candidate: the quality loss, bytes and (``latency=True``) layer latency of
    changing only that layer. See the module docstring.

    ``layers``: names or plan patterns (default: every layer some candidate supports).
    ``metric``: the task metric (default: its primary; other metrics need ``quick=False``).
    ``calibration``: samples of the task's calibration split (or explicit batches) for candidates that
    need them. ``cache``: True (``$WORKBENCH_CACHE``), a directory, or False. ``executor``: where the
    measurements run ("inprocess", "process", "ray" or an `Executor`); results are the same.
    Interrupting (Ctrl-C / the notebook's stop button) returns the rows measured so far, with
    ``df.attrs["complete"] = False``; they are cached, so running again resumes.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    from workbench import tasks

    check_model(model)
    if isinstance(task, str):
        task = tasks.load(task)
    if not isinstance(task, Task):
        raise TypeError(f"expected a wb.tasks.Task or a task name, got {type(task).__name__}")
    tasks.check_fit(model, task)  # issue 16: a model that cannot run the task fails here, in one line
    cand = cands_mod.normalize(candidates)
    metric = metric or task.primary.name
    spec = task.metric(metric)  # raises, naming the task's metrics, if it has no such metric
    if quick and spec is not task.primary:
        raise ValueError(f"metric {metric!r} is not evaluated on the quick subset (only {task.primary.name!r} "
                         f"is); pass quick=False")
    layer_names = select_layers(model, cand, layers)
    bs = batch_size or task.default_batch_size
    opts = _Options(metric, quick, calibration, latency, bs, replay)
    runner = get_executor(executor)

    store = ResultCache(None)
    fp = fingerprint(model)
    if cache:
        folder = cache_dir() if cache is True else Path(cache)
        store = ResultCache(folder / "sensitivity" / f"{fp}-{task.name}.jsonl")
    common = {"v": CACHE_VERSION, "fp": fp, "task": task.name, "metric": metric, "quick": quick,
              "calibration": _calibration_key(calibration),
              "latency": [bs, threads or torch.get_num_threads(), str(model_device(model))] if latency else None}

    def key(layer: str, config: Config) -> str:
        calibrated = handler_for(config).needs_calibration(config)
        return key_of({**common, "calibration": common["calibration"] if calibrated else None, "layer": layer,
                       "config": config_to_dict(config)})

    results: dict[tuple[str, str], dict] = {}
    todo: dict[str, set[str]] = {}
    for layer in layer_names:
        for lbl, config in cand:
            hit = store.get(key(layer, config))
            if hit is not None:
                results[(layer, lbl)] = hit
            else:
                todo.setdefault(layer, set()).add(lbl)
    configs = dict(cand)
    base = next((r["base"] for r in results.values()), float("nan"))
    status = "cached"
    complete = True
    total = sum(len(v) for v in todo.values())
    bar = tqdm(total=total, desc=f"sensitivity ({len(layer_names)} layers x {len(cand)})", leave=False,
               disable=not progress or total == 0)

    def keep(layer: str, lbl: str, row: dict) -> None:
        results[(layer, lbl)] = row
        store.put(key(layer, configs[lbl]), row)
        bar.update()

    try:
        with num_threads(threads if isinstance(runner, InProcess) else None):
            if todo and isinstance(runner, InProcess):
                session = _Session(model, task, cand, [n for n in layer_names if n in todo], opts)
                base, status = session.base, session.replay_status
                for layer in layer_names:
                    if layer in todo:
                        for lbl, row in session.rows(layer, todo[layer]):
                            keep(layer, lbl, row)
            elif todo:
                pending = [n for n in layer_names if n in todo]
                n_jobs = min(len(pending), runner.workers)
                chunks = [pending[i::n_jobs] for i in range(n_jobs)]
                jobs = [(model, task, cand, chunk, opts, {n: todo[n] for n in chunk}) for chunk in chunks]
                for _, (b, st, rows) in runner.imap(_job, jobs):
                    base, status = b, st
                    for layer, lbl, row in rows:
                        keep(layer, lbl, row)
    except KeyboardInterrupt:
        complete = False
        warnings.warn(f"sensitivity interrupted: {len(results)} of {len(layer_names) * len(cand)} rows measured; "
                      f"they are cached - run again to resume", stacklevel=2)
    finally:
        bar.close()

    rows = []
    for layer in layer_names:
        for lbl, _ in cand:
            if (layer, lbl) in results:
                rows.append({**results[(layer, lbl)], "candidate": lbl})
    df = pd.DataFrame(rows, columns=COLUMNS)
    df.attrs.update(model=type(model).__name__, fingerprint=fp, task=task.name, metric=metric,
                    higher_is_better=spec.higher_is_better, quick=quick, base=base, complete=complete,
                    replay=status, candidates={lbl: json.dumps(config_to_dict(c)) for lbl, c in cand})
    return df
