"""Reports: metrics recorded inside notebooks, papermill runs, and standalone HTML with offline plots.

- `record(**values)` (in a notebook) displays the values under the ``application/vnd.workbench.metrics+json``
  mime type, so tests and the golden-metric suite read them back from the executed notebook.
  It shows them as a small table; `record_hidden(**values)` records without showing anything (a dashboard).
- `recorded(path)` reads them back.
- `run_notebook(path, parameters, out_dir)` executes a notebook with papermill into ``out_dir`` (default:
  `reports_dir()`, the one folder the CLI and the UI share) as .ipynb and renders it with `to_html` into a
  standalone .html that makes no network request (see `workbench.reports.html`).
- `report_stem(stem, key)` names a report ``<stem>-<8 hex of key's SHA-256>-<YYYYmmdd-HHMMSS>``: the hash makes
  reports of the same plan recognisable, the time keeps a rerun from overwriting an earlier one.
- `browser_url(path)` is the link a Jupyter / Voila page uses to open such a file with its scripts running; it
  raises `OutsideServerRoot` (saying where the file is) for a file the server cannot serve.
"""
from __future__ import annotations

import hashlib
import math
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from workbench.reports.html import OutsideServerRoot, browser_url, served_folder, to_html

__all__ = ["record", "record_hidden", "recorded", "run_notebook", "to_html", "browser_url", "reports_dir",
           "report_stem", "content_hash", "OutsideServerRoot", "METRICS_MIME", "served_folder"]

METRICS_MIME = "application/vnd.workbench.metrics+json"


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    raise TypeError(f"record() takes numbers, strings and booleans, got {type(value).__name__}")


def record(**values: Any) -> None:
    """Record named values as an output of the current notebook cell, shown as a table of the values."""
    import html

    from IPython.display import display

    data = {k: _jsonable(v) for k, v in values.items()}
    text = "\n".join(f"{k} = {v}" for k, v in data.items())
    rows = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>"
                   f"{html.escape(f'{v:.6g}' if isinstance(v, float) else str(v))}</td></tr>"
                   for k, v in data.items())
    display({METRICS_MIME: data, "text/plain": text,
             "text/html": f"<table class='wb-recorded'><caption>recorded values</caption>{rows}</table>"}, raw=True)


def record_hidden(**values: Any) -> None:
    """`record` with nothing shown (an empty HTML output): for dashboards, where a dump would be noise."""
    from IPython.display import display

    display({METRICS_MIME: {k: _jsonable(v) for k, v in values.items()}, "text/html": ""}, raw=True)


def recorded(path: str | os.PathLike) -> dict[str, Any]:
    """All values recorded by `record` in an executed notebook (later values win)."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    out: dict[str, Any] = {}
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if METRICS_MIME in data:
                out.update(data[METRICS_MIME])
    return out


def reports_dir() -> Path:
    """The one folder reports go to: ``$WORKBENCH_REPORTS``, else ``reports/`` at the repository root.

    The same for ``workbench report`` run from anywhere and for the workbench's Report button (whose kernel
    runs in ``notebooks/``), so a report is never split between two folders.
    """
    override = os.environ.get("WORKBENCH_REPORTS")
    return Path(override) if override else Path(__file__).resolve().parents[2] / "reports"


def content_hash(data: str | bytes, digits: int = 8) -> str:
    """The first ``digits`` hex digits of the SHA-256 of ``data`` (text as UTF-8)."""
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:digits]


def report_stem(stem: str, key: str | bytes, out_dir: str | os.PathLike | None = None,
                when: datetime | None = None) -> str:
    """A report's file stem: ``<stem>-<content_hash(key)>-<YYYYmmdd-HHMMSS>`` (local time, now by default).

    ``key`` is what the report is of (a plan's JSON, a run's parameters): the same key gives the same 8 hex
    digits, so the reports of one plan are recognisable; the time keeps a rerun from overwriting the last one.
    With ``out_dir``, a ``-2``, ``-3`` ... suffix is added while a file of that stem exists there (two runs in
    one second).
    """
    base = f"{stem}-{content_hash(key)}-{(when or datetime.now()).strftime('%Y%m%d-%H%M%S')}"
    if out_dir is None:
        return base
    folder, name, i = Path(out_dir), base, 1
    while any((folder / f"{name}{suffix}").exists() for suffix in (".ipynb", ".html", ".plan.json")):
        i += 1
        name = f"{base}-{i}"
    return name


def run_notebook(notebook: str | os.PathLike, parameters: dict[str, Any] | None = None,
                 out_dir: str | os.PathLike | None = None, name: str | None = None,
                 html: bool = True, timeout: int = 1800) -> tuple[Path, Path | None]:
    """Execute ``notebook`` with papermill into ``out_dir`` (default `reports_dir()`); returns (.ipynb, .html or None).

    The files are ``<name>.ipynb`` and ``<name>.html`` (default: the notebook's stem, replaced on each run; the
    CLI and the Report button pass a `report_stem`, unique per run).

    Raises papermill's ``PapermillExecutionError`` (naming the failing cell) if a cell fails; the
    executed notebook with the error is still written.
    """
    import papermill as pm

    notebook = Path(notebook)
    if not notebook.is_file():
        raise FileNotFoundError(f"notebook {notebook} does not exist")
    out_dir = reports_dir() if out_dir is None else Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = name or notebook.stem
    out_nb = out_dir / f"{stem}.ipynb"
    pm.execute_notebook(str(notebook), str(out_nb), parameters=parameters or {}, kernel_name="python3",
                        cwd=str(notebook.parent), progress_bar=False, execution_timeout=timeout)
    out_html = to_html(out_nb, out_dir / f"{stem}.html") if html else None
    return out_nb, out_html
