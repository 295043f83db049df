"""Every notebook in notebooks/ runs headless under papermill (small parameters) and records its metrics.

Notebooks only call the package: no `def` or `class`, exactly one cell tagged `parameters`.
"""
import ast
import json
from pathlib import Path

import nbformat
import pytest

from workbench.cli import main
from workbench.reports import recorded

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))

# Small parameters per notebook (the defaults are the full-size report), and checks on what it records.
SMALL = {
    "00_start_here": {"model_name": "digits-mlp", "task_name": "digits", "pattern": "fc*", "quick": True,
                      "threads": 1},
    "01_explorer": {"model_name": "digits-mlp", "task_name": "digits", "pattern": "fc*", "bits": 4,
                    "group_size": 32, "threads": 1},
    "app": {"model_name": "digits-mlp", "task_name": "digits", "threads": 1},
    "02_plan_report": {"model_name": "digits-mlp", "task_name": "digits", "quick": True, "threads": 1,
                       "calibration": 32},
}


def check_00_start_here(rec):
    assert rec["model"] == "digits-mlp" and rec["primary_metric"] == "accuracy"
    assert rec["baseline_primary"] >= 0.95
    assert abs(rec["compressed_primary"] - rec["baseline_primary"]) <= 0.01
    assert rec["size_ratio"] == pytest.approx(0.5)
    assert rec["reload_identical"] is True


def check_01_explorer(rec):
    assert rec["model"] == "digits-mlp" and rec["primary_metric"] == "accuracy" and rec["points"] == 2
    assert rec["reference_primary"] >= 0.95 and rec["reference_primary"] - rec["edited_primary"] <= 0.02
    assert 0.1 < rec["size_ratio"] < 0.25  # int4 g32: 4 bits + an fp16 scale per 32 weights (~0.16x)
    assert [e["pattern"] for e in json.loads(rec["plan"])["entries"]] == ["fc1", "fc2", "fc3"]


def check_app(rec):
    assert rec["model"] == "digits-mlp" and rec["points"] == 1 and rec["reference_primary"] >= 0.95


def check_02_plan_report(rec):
    assert rec["model"] == "digits-mlp" and rec["layers"] == 3
    assert rec["reference_primary"] - rec["plan_primary"] <= 0.02
    assert 0.1 < rec["size_ratio"] < 0.25 and rec["speedup"] > 0


STATIC_FIGURES = {"00_start_here", "01_explorer", "02_plan_report"}  # app.ipynb is a live dashboard (Voila), widgets only
CHECKS = {"00_start_here": check_00_start_here, "01_explorer": check_01_explorer, "app": check_app,
          "02_plan_report": check_02_plan_report}


def test_every_notebook_is_covered():
    assert NOTEBOOKS, "no notebooks found"
    assert {p.stem for p in NOTEBOOKS} == set(SMALL) == set(CHECKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_rules(path):
    nb = nbformat.read(str(path), as_version=4)
    params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1, f"{path.name}: expected exactly one cell tagged 'parameters', found {len(params)}"
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        tree = ast.parse(cell.source)
        defs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                                             ast.Lambda))]
        assert not defs, f"{path.name}: notebooks only call the package; found a definition in:\n{cell.source}"
        assert not cell.get("outputs"), f"{path.name}: commit notebooks without outputs"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_under_papermill(path, tmp_path):
    """Through the CLI, as `workbench report NOTEBOOK -p name value ...` runs it."""
    params = {**SMALL[path.stem], "out_file": str(tmp_path / "model.safetensors")}
    argv = ["report", str(path), "--out", str(tmp_path)]
    for key, value in params.items():
        argv += ["-p", key, repr(value)]
    assert main(argv) == 0
    out_nb, out_html = tmp_path / f"{path.stem}.ipynb", tmp_path / f"{path.stem}.html"
    CHECKS[path.stem](recorded(out_nb))
    assert out_html.stat().st_size > 1_000_000
    if path.stem in STATIC_FIGURES:  # the report shows charts without a kernel
        assert "Plotly.newPlot" in out_html.read_text()
