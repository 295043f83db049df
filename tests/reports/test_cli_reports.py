"""The `workbench` command, recorded notebook metrics, and standalone HTML reports."""
import subprocess
import sys
from pathlib import Path

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


def _papermill_like_notebook(path):
    """A notebook as papermill leaves it: the declared parameters, the injected ones, maths, a chart, a widget."""
    import plotly.graph_objects as go

    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell('model_name = "digits-cnn"   # any of wb.models.names()\nquick = False  # '
                                       'fewer timing runs\nthreads = 2')
    params.metadata["tags"] = ["parameters"]
    injected = nbformat.v4.new_code_cell("# Parameters\nquick = True\n")
    injected.metadata["tags"] = ["injected-parameters"]
    text = nbformat.v4.new_markdown_cell("Error $\\hat w - w$, shell `$HOME $PATH`, 5$ or 6$.\n\n"
                                         "$$p_i = \\frac{e^{z_i}}{\\sum_j e^{z_j}}$$")
    chart = nbformat.v4.new_code_cell("fig.show()")
    chart.outputs = [
        nbformat.v4.new_output("display_data", data={
            "application/vnd.plotly.v1+json": go.Figure(go.Scatter(x=[1, 2, 3], y=[3, 1, 4])).to_plotly_json(),
            "text/plain": "fig"}),
        nbformat.v4.new_output("display_data", data={
            "application/vnd.jupyter.widget-view+json": {"model_id": "ab", "version_major": 2, "version_minor": 0},
            "text/plain": "progress-bar-fallback"})]
    nb.cells = [text, params, injected, chart]
    nb.metadata["papermill"] = {"parameters": {"quick": True}}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    nbformat.write(nb, str(path))
    return path


def test_report_html_is_standalone_with_one_parameter_table(tmp_path):
    import re

    page = to_html(_papermill_like_notebook(tmp_path / "n.ipynb"), tmp_path / "out" / "n.html").read_text()
    assert re.findall(r"<script[^>]*\bsrc=", page) == []          # nothing loaded: no require.js, MathJax, widgets
    assert "MathJax.Hub" not in page and "require.min.js" not in page and "embed-amd" not in page
    assert page.count("<math") == 2 and 'display="block"' in page  # inline and display maths, pre-rendered
    assert "<code>$HOME $PATH</code>" in page and "5$ or 6$" in page  # code and prices are not maths
    assert page.count("<details class=\"wb-code\">") == 1   # the code cell folded (parameter cells are the table)
    table = page[page.index("wb-parameters"):page.index("</table>")]
    assert table.count("<tr>") == 4 and "<th>default</th>" in table   # header + three parameters, once
    assert re.search(r"class=\"changed\"><code>True</code></td><td><code>False</code>", table)
    assert "fewer timing runs" in table and "# Parameters" not in page
    assert "progress-bar-fallback" not in page and "Plotly.newPlot" in page


def test_parameter_rows_list_undeclared_injected_values():
    from workbench.reports.html import parameter_rows

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("a = 1  # one\nb = [1,\n     2]  # a list")
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell]
    nb.metadata["papermill"] = {"parameters": {"b": [3], "extra": "x"}}
    assert parameter_rows(nb) == [("a", "1", "1", "one"), ("b", "[3]", "[1,\n     2]", "a list"),
                                  ("extra", "'x'", "", "(not declared in the notebook)")]


def test_one_reports_folder_and_browser_urls(tmp_path, monkeypatch):
    from workbench.reports import browser_url, reports_dir

    monkeypatch.delenv("WORKBENCH_REPORTS", raising=False)
    assert reports_dir() == Path(wb.__file__).resolve().parents[1] / "reports"   # whatever the working folder
    monkeypatch.setenv("WORKBENCH_REPORTS", str(tmp_path))
    assert reports_dir() == tmp_path
    page = tmp_path / "sub dir" / "r.html"
    monkeypatch.setenv("WORKBENCH_FILES_ROOT", str(tmp_path))
    monkeypatch.setenv("WORKBENCH_FILES_URL", "/voila/files/")
    assert browser_url(page) == "/voila/files/sub%20dir/r.html"
    assert browser_url("/elsewhere/r.html") == "file:///elsewhere/r.html"   # outside what the server serves


def test_browser_url_under_the_jupyter_server_that_started_the_kernel(tmp_path, monkeypatch):
    """In JupyterLab the Report link is the server's /files/ URL (the page itself, scripts running), found from
    the runtime file of the server whose process started this kernel."""
    import json
    import os

    from workbench.reports import browser_url

    monkeypatch.delenv("WORKBENCH_FILES_ROOT", raising=False)
    monkeypatch.delenv("WORKBENCH_FILES_URL", raising=False)
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    (runtime / "jpserver-1.json").write_text(json.dumps({"pid": os.getppid(), "root_dir": str(tmp_path),
                                                         "base_url": "/user/me/"}))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    assert browser_url(tmp_path / "reports" / "r.html") == "/user/me/files/reports/r.html"
