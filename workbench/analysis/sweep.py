"""`sweep` and `pareto`: one table across every technique, with the Pareto-optimal rows marked.

`sweep` applies each plan to (a copy of) the model and measures it with `wb.measure`: one row per plan
with every quality metric, latency, size, peak memory, the kernel paths that ran and the plan's JSON.
Rows are computed by an executor (in-process by default; a process pool or Ray give the same quality
numbers - latencies are measured wherever the job ran, with the thread count recorded in ``threads``).
``path=`` persists the table (``.csv``, or ``.parquet`` when pyarrow is installed); `load_results`
reads it back with the metric directions restored, so a report can redraw the fronts later.

`pareto(df, x, y)` marks the rows no other row beats on both ``x`` (lower is better by default) and
``y`` (direction from the task's metric).
"""
from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
from torch import nn

from workbench.analysis.executors import Executor, InProcess, get_executor
from workbench.plans.plan import Plan
from workbench.plans.registry import config_to_dict, handler_for
from workbench.tasks.base import Task, check_model

__all__ = ["sweep", "pareto", "higher_is_better", "save_results", "load_results"]

JSON_COLUMNS = ("plans", "kernels", "dtypes")


@dataclass(frozen=True)
class _SweepOptions:
    quick: bool
    calibration: object
    batch_size: int | None
    threads: int | None


def _as_plans(plans) -> list[tuple[str, Plan]]:
    if isinstance(plans, Plan):
        raise TypeError("sweep needs several plans: pass a mapping label -> Plan (or a list of plans)")
    if isinstance(plans, Mapping):
        items = list(plans.items())
    elif isinstance(plans, (list, tuple)):
        items = [(f"plan {i}", p) for i, p in enumerate(plans)]
    else:
        raise TypeError(f"plans must be a mapping label -> Plan or a list of plans, got {type(plans).__name__}")
    if not items:
        raise ValueError("plans is empty: give at least one plan")
    out = []
    for label, plan in items:
        if not isinstance(label, str) or not label:
            raise ValueError(f"plan labels must be non-empty strings, got {label!r}")
        if isinstance(plan, Mapping) and not isinstance(plan, Plan):
            plan = Plan(plan)
        if not isinstance(plan, Plan):
            raise TypeError(f"plan {label!r} is a {type(plan).__name__}, not a wb.Plan")
        out.append((label, plan))
    return out


def apply_with_task(model: nn.Module, task: Task, plan: Plan, calibration, progress: bool = False) -> nn.Module:
    """`wb.apply` with calibration drawn from ``task`` when the plan needs it (``calibration``: a number of
    samples of the task's calibration split, or input batches)."""
    from workbench.plans.apply import apply

    batches = None
    if any(handler_for(c).needs_calibration(c) for c in plan.values() if c is not None):
        if calibration is None:
            raise ValueError("the plan needs calibration data; pass calibration=<samples>")
        batches = task.calibration(calibration) if isinstance(calibration, int) else calibration
    return apply(model, plan, calibration=batches, progress=progress)


def _measure_plan(model: nn.Module, task: Task, label: str, plan: Plan | None, opts: _SweepOptions) -> dict:
    """Executor job: apply ``plan`` and measure; one row."""
    from workbench.measurement.metrics import measure

    t0 = time.perf_counter()
    compressed = model
    if plan is not None:
        try:
            compressed = apply_with_task(model, task, plan, opts.calibration)
        except Exception as e:
            raise ValueError(f"sweep plan {label!r}: {e}") from e
    # the speedup over the unchanged model is measured side by side in this job (the reference row against a
    # copy of itself reads ~1.0x with its interval: what noise alone looks like)
    m = measure(compressed, task, quick=opts.quick, batch_size=opts.batch_size, threads=opts.threads,
                progress=False, baseline=model)
    return _row(m, label, plan, time.perf_counter() - t0)


def _row(m, label: str, plan: Plan | None, seconds: float) -> dict:
    """A sweep table row from a plan's `Metrics`."""
    row = m.to_dict()
    for col in JSON_COLUMNS:
        row[col] = json.dumps(row[col])
    kinds = sorted({c.kind for c in plan.values() if c is not None}) if plan is not None else []
    row.update(label=label, techniques=",".join(kinds) or "none", plan=plan.to_json() if plan is not None else "",
               sweep_seconds=seconds)
    return row


def sweep(model: nn.Module, task: Task | str, plans: Mapping[str, Plan] | Sequence[Plan], *,
          baseline: str | None = "reference", quick: bool = False, calibration: int | Sequence | None = 64,
          batch_size: int | None = None, threads: int | None = None, executor: Executor | str | None = None,
          path: str | Path | None = None, progress: bool = True, measured: Mapping[str, object] | None = None):
    """Measure each plan (and, unless ``baseline=None``, the unchanged model) on ``task``: one row per plan, columns
    ``pareto_size`` / ``pareto_latency`` marking the fronts of the primary metric against size and latency. Plans
    that give the same model (the same layers with the same configs, e.g. a report's plan and the uniform plan it
    equals) are measured once: the first one's row, the others' labels in ``same_as``. ``path``: also write the
    table there (see `save_results`). Interrupting returns (and saves) the rows measured so far with
    ``df.attrs["complete"] = False``. ``measured``: label -> the `wb.Metrics` a plan already has (measured with
    ``baseline=model``), used as its row instead of measuring it again - so a report that shows a plan's paired
    speedup above shows the same numbers in its table."""
    from tqdm.auto import tqdm

    from workbench import tasks
    from workbench.measurement.table import MetricsTable

    check_model(model)
    if isinstance(task, str):
        task = tasks.load(task)
    if not isinstance(task, Task):
        raise TypeError(f"expected a wb.tasks.Task or a task name, got {type(task).__name__}")
    items: list[tuple[str, Plan | None]] = list(_as_plans(plans))
    if baseline is not None:
        if baseline in dict(items):
            raise ValueError(f"a plan is labelled {baseline!r}, the baseline's label; pass baseline=<another label>")
        items.insert(0, (baseline, None))
    same: dict[str, list[str]] = {}   # label -> labels of the plans that are the same model (measured once)
    seen: dict[str, str] = {}
    for label, plan in items:  # resolve up front: a typo fails before anything is measured
        if plan is not None:
            try:
                key = json.dumps(sorted((a.name, config_to_dict(a.config) if a.config is not None else None)
                                        for a in plan.resolve(model)), default=str)
            except ValueError as e:
                raise ValueError(f"sweep plan {label!r}: {e}") from None
            if key in seen:   # the same layers with the same configs as an earlier plan: one row, both labels
                same.setdefault(seen[key], []).append(label)
                continue
            seen[key] = label
    items = [(label, plan) for label, plan in items if not any(label in v for v in same.values())]
    opts = _SweepOptions(quick, calibration, batch_size, threads)
    runner = get_executor(executor)
    given = dict(measured or {})
    unknown = sorted(set(given) - {label for label, _ in items} - {v for vs in same.values() for v in vs})
    if unknown:
        raise ValueError(f"sweep: measured= names {unknown}, which are not plans of this sweep")
    for label, metrics in given.items():
        if getattr(metrics, "speedup", None) is None:
            raise ValueError(f"sweep: measured[{label!r}] has no paired speedup: measure it with baseline=model")
    rows: dict[int, dict] = {}
    for i, (label, plan) in enumerate(items):   # rows the caller already measured
        metrics = given.get(label) or next((given[o] for o in same.get(label, []) if o in given), None)
        if metrics is not None:
            rows[i] = _row(metrics, label, plan, 0.0)
    jobs = [(model, task, label, plan, opts) for i, (label, plan) in enumerate(items) if i not in rows]
    index = [i for i in range(len(items)) if i not in rows]
    complete = True
    bar = tqdm(total=len(jobs), desc=f"sweep ({len(jobs)} plans)", leave=False, disable=not progress)
    try:
        for j, row in runner.imap(_measure_plan, jobs):
            rows[index[j]] = row
            bar.set_postfix_str(row["label"][:30])
            bar.update()
    except KeyboardInterrupt:
        complete = False
        warnings.warn(f"sweep interrupted after {len(rows)} of {len(jobs)} plans; returning those", stacklevel=2)
    finally:
        bar.close()
    df = MetricsTable([rows[i] for i in sorted(rows)])   # (a DataFrame, formatted with units on screen)
    if len(df):
        df["same_as"] = [", ".join(same.get(label, [])) for label in df["label"]]
        first = ["label", "techniques"]
        df = df[first + [c for c in df.columns if c not in first]]
    df.attrs.update(task=task.name, primary=task.primary.name, complete=complete,
                    higher_is_better={m.name: m.higher_is_better for m in task.metrics},
                    executor=repr(runner) if not isinstance(runner, InProcess) else "inprocess")
    _mark_fronts(df)
    if path is not None:
        save_results(df, path)
    return df


def _mark_fronts(df) -> None:
    if not len(df):
        return
    primary = df.attrs["primary"]
    df["pareto_size"] = pareto(df, "size_bytes", primary)
    # the speed front from each row's paired speedup over the same reference, not from latencies each measured
    # in its own rounds minutes apart (a busy minute would put a plan off the front)
    if "speedup" in df.columns and df["speedup"].notna().all():
        df["pareto_latency"] = pareto(df, "speedup", primary, x_lower_is_better=False)
    else:
        df["pareto_latency"] = pareto(df, "latency_ms", primary)


def higher_is_better(df, column: str) -> bool:
    """Whether a higher ``column`` is better in a results table ``df``: the table's own record
    (``df.attrs["higher_is_better"]``), the known cost columns (size, latency, memory, loss: lower), else the
    metric of the table's task; a ValueError where none tells."""
    known = df.attrs.get("higher_is_better", {})
    if column in known:
        return bool(known[column])
    if column in ("size_bytes", "latency_ms", "latency_p90_ms", "peak_memory_bytes", "loss"):
        return False
    if "task" in df.columns and len(df):
        from workbench import tasks

        try:
            return tasks.load(str(df["task"].iloc[0])).metric(column).higher_is_better
        except (KeyError, ValueError):
            pass
    raise ValueError(f"cannot tell whether higher {column!r} is better; pass y_higher_is_better=True/False")


def pareto(df, x: str, y: str, *, x_lower_is_better: bool = True, y_higher_is_better: bool | None = None):
    """A boolean Series: True for rows that no other row dominates (at least as good on ``x`` and ``y``
    and strictly better on one). Rows with a missing value are never on the front."""
    import pandas as pd

    for col in (x, y):
        if col not in df.columns:
            raise KeyError(f"pareto: no column {col!r}; columns: {list(df.columns)}")
    if y_higher_is_better is None:
        y_higher_is_better = higher_is_better(df, y)
    a = df[x].to_numpy(dtype=float) * (1 if x_lower_is_better else -1)   # both: lower is better
    b = df[y].to_numpy(dtype=float) * (-1 if y_higher_is_better else 1)
    ok = np.isfinite(a) & np.isfinite(b)
    front = np.zeros(len(df), dtype=bool)
    ia, ib = a[ok], b[ok]
    dominated = np.zeros(len(ia), dtype=bool)
    for start in range(0, len(ia), 1024):  # (chunk, n) comparisons
        sa, sb = ia[start:start + 1024, None], ib[start:start + 1024, None]
        weakly = (ia[None, :] <= sa) & (ib[None, :] <= sb)
        strictly = (ia[None, :] < sa) | (ib[None, :] < sb)
        dominated[start:start + 1024] = (weakly & strictly).any(axis=1)
    front[np.flatnonzero(ok)] = ~dominated
    return pd.Series(front, index=df.index, name=f"pareto({x}, {y})")


def save_results(df, path: str | Path) -> Path:
    """Write a sweep table: ``.parquet`` (needs pyarrow) or ``.csv``; the metric directions and task go
    into a ``<path>.meta.json`` beside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        try:
            df.to_parquet(path, index=False)
        except ImportError as e:
            raise ImportError(f"writing {path} needs pyarrow (pip install pyarrow), or use a .csv path") from e
    elif path.suffix == ".csv":
        df.to_csv(path, index=False)
    else:
        raise ValueError(f"{path}: results are written as .csv or .parquet")
    meta = {k: v for k, v in df.attrs.items() if isinstance(v, (str, int, float, bool, dict, list))}
    Path(str(path) + ".meta.json").write_text(json.dumps(meta, indent=1))
    return path


def load_results(path: str | Path):
    """Read a table written by `save_results` (or `sweep(path=...)`), attributes included."""
    import pandas as pd

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no results file at {path}")
    df = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path, keep_default_na=True)
    meta_path = Path(str(path) + ".meta.json")
    if meta_path.exists():
        df.attrs.update(json.loads(meta_path.read_text()))
    if "plan" in df.columns:
        df["plan"] = df["plan"].fillna("")
    return df


def plan_of(row) -> Plan | None:
    """The `Plan` of one sweep row (None for the baseline)."""
    text = row["plan"]
    return Plan.from_json(text) if isinstance(text, str) and text else None



