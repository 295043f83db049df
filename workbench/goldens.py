"""Golden metrics: the notebooks as a regression suite.

Each notebook ``notebooks/NAME.ipynb`` has ``data/golden/NAME.json``::

    {"notebook": "10_number_formats",
     "parameters": {"solutions": true},                   # papermill parameters for the regression run
     "metrics": [{"metric": "int8_rmse", "value": 0.0031, "tolerance": 0.0005, "direction": "lower"}, ...]}

``direction`` says which change is a regression: ``"higher"`` (higher is better: fails when the value found is
below ``value - tolerance``), ``"lower"`` (fails above ``value + tolerance``) or ``"equal"`` (fails when it
differs by more than ``tolerance``; strings and booleans must be equal). Improvements never fail; refresh the
goldens deliberately to lock them in.

    workbench goldens                      # run every notebook, compare, exit 1 on a regression
    workbench goldens 10_number_formats    # some of them
    workbench goldens --update             # rewrite the values from a fresh run (tolerances and directions kept)

Nothing updates goldens automatically: `update` is only called by ``--update``.

Tolerances hold on every CPU. The machines that run the suite differ (AMX Xeons, AVX-512 Zen 4 / 5, AVX2-only
EPYCs) and each sums floats in its own order, so a tolerance is set from the values the notebooks give under every
CPU class this machine can emulate (`workbench_kernels.isa.EMULATED`), recorded beside it::

    workbench goldens --cpu-class avx2 --measure     # run as an AVX2-only CPU; store each value in "measured"

A metric's ``measured`` maps CPU class -> the value found there, ``why`` says what its tolerance rests on
(the measured spread, or the claim checked when a number is machine-dependent). `measured_problems` lists every
recorded value that the golden itself would reject: tests/test_goldens.py keeps that list empty.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.paths import data_dir

__all__ = ["GoldenMetric", "Golden", "golden_dir", "notebook_dir", "load", "load_all", "compare", "not_applicable",
           "run", "update", "record_measured", "measured_problems", "DIRECTIONS"]

DIRECTIONS = ("higher", "lower", "equal")


def golden_dir() -> Path:
    return data_dir() / "golden"


def notebook_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "notebooks"


@dataclass
class GoldenMetric:
    metric: str
    value: Any
    tolerance: float = 0.0
    direction: str = "equal"
    # checked only when the run recorded these values (e.g. {"cpu_int8_dot_product": true}: an int8 speedup
    # is a property of CPUs with an int8 dot-product instruction); otherwise reported as not applicable
    when: dict[str, Any] | None = None
    # the value found under each emulated CPU class (`workbench_kernels.isa.EMULATED`), by `record_measured`
    measured: dict[str, Any] | None = None
    why: str | None = None   # what the tolerance rests on, in words

    def __post_init__(self):
        if self.measured is not None and not isinstance(self.measured, dict):
            raise ValueError(f"golden metric {self.metric!r}: measured must map CPU classes to values, "
                             f"got {self.measured!r}")
        if self.why is not None and not isinstance(self.why, str):
            raise ValueError(f"golden metric {self.metric!r}: why must be a string, got {self.why!r}")
        if self.when is not None and not isinstance(self.when, dict):
            raise ValueError(f"golden metric {self.metric!r}: when must map recorded metrics to values, "
                             f"got {self.when!r}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"golden metric {self.metric!r}: direction must be one of {DIRECTIONS}, "
                             f"got {self.direction!r}")
        if not isinstance(self.tolerance, (int, float)) or self.tolerance < 0:
            raise ValueError(f"golden metric {self.metric!r}: tolerance must be a number >= 0, got {self.tolerance!r}")
        numeric = isinstance(self.value, (int, float)) and not isinstance(self.value, bool)
        if self.direction != "equal" and not numeric:
            raise ValueError(f"golden metric {self.metric!r}: direction {self.direction!r} needs a number, "
                             f"got {self.value!r}")

    def check(self, found: Any) -> str | None:
        """None if ``found`` is acceptable, else why not (in words)."""
        numeric = isinstance(self.value, (int, float)) and not isinstance(self.value, bool)
        if not numeric:
            return None if found == self.value else "differs"
        if isinstance(found, bool) or not isinstance(found, (int, float)) or not math.isfinite(found):
            return "is not a finite number"
        if self.direction == "higher" and found < self.value - self.tolerance:
            return f"dropped by {self.value - found:.4g} (allowed {self.tolerance:g}; higher is better)"
        if self.direction == "lower" and found > self.value + self.tolerance:
            return f"rose by {found - self.value:.4g} (allowed {self.tolerance:g}; lower is better)"
        if self.direction == "equal" and abs(found - self.value) > self.tolerance:
            return f"moved by {found - self.value:+.4g} (allowed ±{self.tolerance:g})"
        return None


@dataclass
class Golden:
    notebook: str
    metrics: list[GoldenMetric]
    parameters: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    def to_json(self) -> dict:
        return {"notebook": self.notebook, "parameters": self.parameters,
                "metrics": [{"metric": m.metric, "value": m.value, "tolerance": m.tolerance,
                             "direction": m.direction, **({"when": m.when} if m.when else {}),
                             **({"measured": m.measured} if m.measured else {}), **({"why": m.why} if m.why else {})}
                            for m in self.metrics]}


def load(name_or_path: str | os.PathLike) -> Golden:
    """The golden file of notebook ``name`` (or a path to one). Plain JSON: nothing is unpickled."""
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = golden_dir() / f"{Path(name_or_path).stem}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no golden file {path}; write one (see workbench.goldens) for notebook "
                                f"{path.stem!r}")
    try:
        raw = json.loads(path.read_text())
        metrics = [GoldenMetric(**m) for m in raw["metrics"]]
        golden = Golden(raw["notebook"], metrics, dict(raw.get("parameters", {})), path)
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"golden file {path} is malformed: {e}") from e
    if golden.notebook != path.stem:
        raise ValueError(f"golden file {path} names notebook {golden.notebook!r}, expected {path.stem!r}")
    names = [m.metric for m in metrics]
    if len(set(names)) != len(names):
        raise ValueError(f"golden file {path} lists a metric twice: {names}")
    return golden


def load_all() -> list[Golden]:
    return [load(p) for p in sorted(golden_dir().glob("*.json"))]


def not_applicable(golden: Golden, recorded: dict[str, Any]) -> list[str]:
    """The metrics whose ``when`` condition this run does not meet, each with the condition and what was found."""
    return [f"{golden.notebook}: metric {m.metric!r} not checked: it holds when {m.when}, this run recorded "
            f"{ {k: recorded.get(k) for k in m.when} }" for m in golden.metrics if not _applies(m, recorded)]


def _applies(m: GoldenMetric, recorded: dict[str, Any]) -> bool:
    return not m.when or all(recorded.get(k) == v for k, v in m.when.items())


def compare(golden: Golden, recorded: dict[str, Any]) -> list[str]:
    """One message per regression: notebook, metric, expected (with direction and tolerance) and found. A metric
    whose ``when`` condition the run does not meet is not compared (`not_applicable` lists those); a condition
    metric that was not recorded at all is a regression."""
    failures = []
    for m in golden.metrics:
        missing = [k for k in (m.when or {}) if k not in recorded]
        if missing:
            failures.append(f"{golden.notebook}: metric {m.metric!r} is checked when {m.when}, but {missing} "
                            f"was not recorded")
            continue
        if not _applies(m, recorded):
            continue
        if m.metric not in recorded:
            failures.append(f"{golden.notebook}: metric {m.metric!r} was not recorded (expected {m.value!r}); "
                            f"recorded: {sorted(recorded)}")
            continue
        found = recorded[m.metric]
        why = m.check(found)
        if why:
            failures.append(f"{golden.notebook}: metric {m.metric!r} expected {m.value!r} ({m.direction}, "
                            f"tolerance {m.tolerance:g}), found {found!r}: {why}")
    return failures


def run(golden: Golden, out_dir: str | os.PathLike, html: bool = False,
        parameters: dict[str, Any] | None = None) -> tuple[dict[str, Any], Path, Path | None]:
    """Execute the golden's notebook with its parameters (plus ``parameters``); (recorded, .ipynb, .html)."""
    from workbench.reports import recorded, run_notebook

    notebook = notebook_dir() / f"{golden.notebook}.ipynb"
    nb, page = run_notebook(notebook, {**golden.parameters, **(parameters or {})}, out_dir=out_dir, html=html)
    return recorded(nb), nb, page


def update(golden: Golden, recorded: dict[str, Any]) -> Golden:
    """Rewrite the golden's values from ``recorded`` (tolerances and directions kept) and save it."""
    missing = [m.metric for m in golden.metrics if m.metric not in recorded]
    if missing:
        raise ValueError(f"{golden.notebook}: cannot update, the run did not record {missing}")
    for m in golden.metrics:
        m.value = recorded[m.metric]
    _save(golden)
    return golden


def _save(golden: Golden) -> None:
    path = golden.path or golden_dir() / f"{golden.notebook}.json"
    path.write_text(json.dumps(golden.to_json(), indent=2) + "\n")


def record_measured(golden: Golden, cpu_class: str, recorded: dict[str, Any]) -> Golden:
    """Store each value of ``recorded`` as found under ``cpu_class`` (values, tolerances and directions kept) and
    save the golden; metrics whose ``when`` condition this run does not meet are left as they are."""
    from workbench_kernels.isa import EMULATED

    if cpu_class not in EMULATED:
        raise ValueError(f"unknown CPU class {cpu_class!r}; one of {', '.join(EMULATED)}")
    missing = [m.metric for m in golden.metrics if _applies(m, recorded) and m.metric not in recorded]
    if missing:
        raise ValueError(f"{golden.notebook}: cannot record, the run did not record {missing}")
    for m in golden.metrics:
        if _applies(m, recorded):
            m.measured = {**(m.measured or {}), cpu_class: recorded[m.metric]}
    _save(golden)
    return golden


def measured_problems(golden: Golden) -> list[str]:
    """One message per value recorded under some CPU class that this golden would reject (a tolerance narrower
    than the spread measured across CPU classes)."""
    return [f"{golden.notebook}: metric {m.metric!r} expected {m.value!r} ({m.direction}, tolerance {m.tolerance:g}) "
            f"but {found!r} was measured as {cpu_class}: {why}"
            for m in golden.metrics for cpu_class, found in (m.measured or {}).items()
            if (why := m.check(found))]
