"""The notebooks as a regression suite: every notebook in notebooks/ runs headless under papermill with the
parameters of its golden file (data/golden/NAME.json) and its recorded metrics are compared with the goldens.

Rules for every notebook: it only calls the package (no `def`, `class` or `lambda`), has exactly one cell tagged
`parameters`, is committed without outputs, and (except the live dashboard) shows charts in its HTML report.
"""
import ast
import warnings
from pathlib import Path

import nbformat

import pytest

from workbench import goldens
from workbench.reports import recorded
from workbench.teach import strip
from workbench.cli import main

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
DASHBOARDS = {"app"}  # a live Voila dashboard: widgets only, no static charts in its HTML
SCREENS = {"00_start_here", "90_report"}   # they record the paired speedup their chart, table and verdict show


def test_every_notebook_has_a_golden_file():
    assert NOTEBOOKS, "no notebooks found"
    have = {g.notebook for g in goldens.load_all()}
    assert {p.stem for p in NOTEBOOKS} == have, "every notebook needs data/golden/NAME.json (and only those)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_rules(path):
    """The committed notebook is the lesson's source: stripped (no outputs, no execution counts, no run-time
    metadata), one `parameters` cell, no definitions (workbench.teach.strip checks and fixes)."""
    broken = strip.problems(path)
    assert not broken, "\n".join(broken) + "\n(after editing in JupyterLab: python -m workbench.teach.strip notebooks)"
    nb = nbformat.read(str(path), as_version=4)
    params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    golden = goldens.load(path.stem)
    declared = {t.id for n in ast.walk(ast.parse(params[0].source)) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    unknown = set(golden.parameters) - declared
    assert not unknown, f"{path.name}: the golden file sets parameters the notebook does not declare: {unknown}"


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_matches_its_goldens(path, tmp_path):
    """Through the CLI, as `workbench report NOTEBOOK -p name value ...` runs it; then the golden comparison."""
    golden = goldens.load(path.stem)
    params = dict(golden.parameters)
    if path.stem == "00_start_here":
        params["out_file"] = str(tmp_path / "model.safetensors")
    argv = ["report", str(path), "--out", str(tmp_path), "--name", path.stem]
    for key, value in params.items():
        argv += ["-p", key, repr(value)]
    assert main(argv) == 0
    out_nb, out_html = tmp_path / f"{path.stem}.ipynb", tmp_path / f"{path.stem}.html"
    found = recorded(out_nb)
    failures = goldens.compare(golden, found)
    assert not failures, "\n".join(failures)
    for line in goldens.not_applicable(golden, found):   # hardware-conditional metrics, said out loud
        warnings.warn(line, stacklevel=1)
    if path.stem not in DASHBOARDS:  # the report shows charts without a kernel: plotly.js inlined
        assert out_html.stat().st_size > 1_000_000 and "Plotly.newPlot" in out_html.read_text()
    _screen_agrees(nbformat.read(str(out_nb), as_version=4), found, path.stem)


def _screen_agrees(nb, found: dict, name: str) -> None:
    """The numbers one screen shows agree with each other: where a notebook records the paired speedup, its
    comparison chart's speed panel, its comparison table and its printed verdict show that same number (one
    regime: no latency measured apart beside it)."""
    from workbench.measurement.table import format_value

    if name not in SCREENS:
        return
    ratio = found["speedup"]
    figures = [o["data"]["application/vnd.plotly.v1+json"] for c in nb.cells for o in c.get("outputs", [])
               if "application/vnd.plotly.v1+json" in o.get("data", {})]
    panels = [f for f in figures if any(str(a.get("text", "")).startswith("speedup over")
                                        for a in f["layout"].get("annotations", []))]
    assert panels, f"{name}: no comparison chart with the paired speedup panel"
    for fig in panels:
        assert fig["data"][1]["y"][1] == pytest.approx(ratio, rel=1e-9), f"{name}: chart vs recorded speedup"
    tables = [o["data"]["text/html"] for c in nb.cells for o in c.get("outputs", [])
              if "speedup_verdict" in o.get("data", {}).get("text/html", "")]
    assert tables and all(f">{format_value('speedup', ratio)}</td>" in t for t in tables), \
        f"{name}: the comparison table shows another speedup than the chart"
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert f"{ratio:.2f}x" in printed, f"{name}: the printed verdict shows another speedup"
