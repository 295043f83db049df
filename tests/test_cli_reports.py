"""The `workbench` command, recorded notebook metrics, and standalone HTML reports."""
import subprocess
import sys

import nbformat
import torch

import workbench as wb
from workbench.cli import main
from workbench.reports import METRICS_MIME, recorded, to_html


def test_cli_measure_with_plan(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    wb.Plan({"fc*": wb.precision.Cast(torch.bfloat16)}).save(plan)
    assert main(["measure", "--model", "digits-mlp", "--plan", str(plan), "--quick", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "baseline" in out and "plan.json" in out and "accuracy" in out and "size_ratio" in out


def test_cli_errors_are_clear(capsys):
    assert main(["measure", "--model", "nope"]) == 2
    assert "unknown model 'nope'; available models:" in capsys.readouterr().err
    assert main(["report", "missing.ipynb"]) == 2
    assert "notebook missing.ipynb does not exist" in capsys.readouterr().err


def test_cli_entry_point_lists_models():
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "models"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "minilm" in out.stdout and "digits-cnn" in out.stdout


def test_parse_parameter_values():
    from workbench.cli import _parse_value
    assert _parse_value("3") == 3 and _parse_value("True") is True and _parse_value("fc*") == "fc*"
    assert _parse_value("[1, 2]") == [1, 2]


def test_recorded_and_html_with_offline_plotly(tmp_path):
    import plotly.graph_objects as go

    fig = go.Figure(go.Scatter(x=[1, 2], y=[3, 4]))
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [
        nbformat.v4.new_output("display_data", data={METRICS_MIME: {"acc": 0.5}, "text/plain": "acc = 0.5"}),
        nbformat.v4.new_output("display_data", data={"application/vnd.plotly.v1+json": fig.to_plotly_json(),
                                                     "text/plain": "fig"}),
        nbformat.v4.new_output("display_data", data={METRICS_MIME: {"acc": 0.75, "n": 3}, "text/plain": ""}),
    ]
    nb.cells = [cell]
    path = tmp_path / "n.ipynb"
    nbformat.write(nb, str(path))
    assert recorded(path) == {"acc": 0.75, "n": 3}
    html = to_html(path, tmp_path / "n.html").read_text()
    assert "Plotly.newPlot" in html
    assert len(html) > 1_000_000  # plotly.js itself is inlined: the report works with no network
    assert "cdn.plot.ly" not in html.split("Plotly.newPlot")[0][-2000:]
