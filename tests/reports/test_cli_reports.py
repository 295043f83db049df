"""The `workbench` command, recorded notebook metrics, and standalone HTML reports."""
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

import workbench as wb
from workbench.cli import main
from workbench.reports import METRICS_MIME, OutsideServerRoot, recorded, to_html


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
    with pytest.raises(OutsideServerRoot, match="outside the folder this server serves"):
        browser_url("/elsewhere/r.html")                          # outside what the server serves: no dead link
    monkeypatch.delenv("WORKBENCH_FILES_ROOT")
    monkeypatch.delenv("WORKBENCH_FILES_URL")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "no-servers"))
    assert browser_url("/elsewhere/r.html") == "file:///elsewhere/r.html"   # no server at all (a script): a file URL


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


def _jupyter_server_root(tmp_path, monkeypatch, root):
    """Pretend this process's parent is a Jupyter server serving ``root`` (its runtime file, as the kernel sees)."""
    import json
    import os

    monkeypatch.delenv("WORKBENCH_FILES_ROOT", raising=False)
    monkeypatch.delenv("WORKBENCH_FILES_URL", raising=False)
    runtime = tmp_path / "runtime"
    runtime.mkdir(exist_ok=True)
    (runtime / "jpserver-1.json").write_text(json.dumps({"pid": os.getppid(), "root_dir": str(root),
                                                         "base_url": "/"}))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))


def test_a_report_outside_the_jupyter_servers_folder_gets_words_not_a_dead_link(tmp_path, monkeypatch):
    """The old `make lab` served notebooks/ and the reports lay in reports/: the link was file://, which a page
    served over http may not open. Now there is no link, and the error says where the file is and what to do."""
    from workbench.reports import browser_url

    served = tmp_path / "notebooks"
    served.mkdir()
    _jupyter_server_root(tmp_path, monkeypatch, served)
    page = tmp_path / "reports" / "r.html"
    with pytest.raises(OutsideServerRoot) as e:
        browser_url(page)
    message = str(e.value)
    assert message.startswith(f"the report is outside this Jupyter server's folder {served.resolve()}")
    assert f"open {page.resolve()} from a file manager" in message and "`make lab`" in message
    assert e.value.path == page.resolve() and e.value.root == served.resolve()
    assert "file://" not in message
    _jupyter_server_root(tmp_path, monkeypatch, tmp_path)            # a server at the repository root (make lab)
    assert browser_url(page) == "/files/reports/r.html"


def test_the_report_button_says_where_a_report_outside_the_server_is(tmp_path, monkeypatch):
    """The Report button of a workbench whose Jupyter server cannot serve the reports folder: words, no link."""
    import types

    from workbench.ui.app import Workbench

    served = tmp_path / "notebooks"
    served.mkdir()
    _jupyter_server_root(tmp_path, monkeypatch, served)
    page = tmp_path / "reports" / "plan_report_x.html"
    said: list[str] = []
    fake = types.SimpleNamespace(session=types.SimpleNamespace(assigned={"fc1": object()}), background=False,
                                 report=lambda: (page.with_suffix(".ipynb"), page),
                                 _say=lambda message, **tone: said.append(message),
                                 report_link=types.SimpleNamespace(value=""))
    Workbench._on_report(fake)
    text = fake.report_link.value
    assert "<a " not in text and "file://" not in text
    assert "outside this Jupyter server&#x27;s folder" in text and str(page.resolve()) in text and "make lab" in text
    assert said[-1] == f"report written to {page}"
    _jupyter_server_root(tmp_path, monkeypatch, tmp_path)
    Workbench._on_report(fake)
    assert "<a href='/files/reports/plan_report_x.html' target='_blank'" in fake.report_link.value


def test_report_stems_are_unique_and_name_the_plan():
    from datetime import datetime

    from workbench.reports import content_hash, report_stem

    when = datetime(2025, 3, 4, 5, 6, 7)
    plan = '{"entries": []}'
    stem = report_stem("plan_report_digits-cnn", plan, when=when)
    assert stem == f"plan_report_digits-cnn-{content_hash(plan)}-20250304-050607"
    assert content_hash(plan) == "e3eb12da"                              # SHA-256's first 8 hex digits
    assert len(content_hash("x")) == 8 and content_hash("x") == content_hash(b"x") != content_hash("y")
    assert report_stem("r", "a", when=when) != report_stem("r", "b", when=when)          # another plan
    assert report_stem("r", "a", when=when) != report_stem("r", "a", when=datetime(2025, 3, 4, 5, 6, 8))


def test_report_stem_never_reuses_a_name_in_its_folder(tmp_path):
    from datetime import datetime

    from workbench.reports import report_stem

    when = datetime(2025, 3, 4, 5, 6, 7)
    first = report_stem("r", "plan", tmp_path, when)
    (tmp_path / f"{first}.html").write_text("")
    second = report_stem("r", "plan", tmp_path, when)                   # two runs in one second
    assert second == f"{first}-2"
    (tmp_path / f"{second}.plan.json").write_text("")
    assert report_stem("r", "plan", tmp_path, when) == f"{first}-3"


def test_cli_report_names_each_run_apart(tmp_path, monkeypatch, capsys):
    """`workbench report` writes <notebook>-<hash of the parameters, a plan file by its content>-<time>; --name
    still names the files."""
    import re

    import workbench.reports

    runs: list[dict] = []

    def fake_run(notebook, parameters=None, out_dir=None, name=None, **kwargs):
        runs.append({"notebook": notebook, "parameters": parameters, "out_dir": out_dir, "name": name})
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / f"{name}.html").write_text("")
        return Path(out_dir) / f"{name}.ipynb", Path(out_dir) / f"{name}.html"

    monkeypatch.setattr(workbench.reports, "run_notebook", fake_run)
    plan_a, plan_b = tmp_path / "a.json", tmp_path / "b.json"
    wb.Plan({"fc*": wb.quant.WeightOnly(bits=4)}).save(plan_a)
    wb.Plan({"fc*": wb.quant.WeightOnly(bits=4)}).save(plan_b)            # the same plan in another file
    out = tmp_path / "reports"
    for plan in (plan_a, plan_a, plan_b):
        assert main(["report", "nb/90_report.ipynb", "-p", "plan", str(plan), "--out", str(out)]) == 0
    names = [r["name"] for r in runs]
    assert all(re.fullmatch(r"90_report-[0-9a-f]{8}-\d{8}-\d{6}(-\d+)?", n) for n in names), names
    assert len(set(names)) == 3                                          # no run overwrote another
    assert len({n.split("-")[1] for n in names}) == 1                    # one plan, one hash
    wb.Plan({"fc*": wb.quant.WeightOnly(bits=8)}).save(plan_b)
    assert main(["report", "nb/90_report.ipynb", "-p", "plan", str(plan_b), "--out", str(out)]) == 0
    assert runs[-1]["name"].split("-")[1] != names[0].split("-")[1]       # another plan, another hash
    assert main(["report", "nb/90_report.ipynb", "--out", str(out), "--name", "mine"]) == 0
    assert runs[-1]["name"] == "mine" and "mine.html" in capsys.readouterr().out


def test_the_report_button_names_each_report_by_plan_and_time(digits_mlp, digits_task, tmp_path, monkeypatch):
    import re

    import workbench.reports

    runs: list[tuple[dict, str]] = []

    def fake_run(notebook, parameters=None, out_dir=None, name=None, **kwargs):
        runs.append((parameters, name))
        (Path(out_dir) / f"{name}.html").write_text("")
        return Path(out_dir) / f"{name}.ipynb", Path(out_dir) / f"{name}.html"

    monkeypatch.setattr(workbench.reports, "run_notebook", fake_run)
    monkeypatch.setenv("WORKBENCH_REPORTS", str(tmp_path))
    app = wb.ui.Workbench(digits_mlp, digits_task, background=False, reference=False)
    app.session.set("fc*", wb.quant.WeightOnly(bits=4, group_size=32))
    first, second = app.report(), app.report()
    assert first != second                                               # a rerun does not overwrite
    (p1, n1), (p2, n2) = runs
    stem = re.compile(r"plan_report_digits-mlp-([0-9a-f]{8})-\d{8}-\d{6}(-\d+)?")
    assert stem.fullmatch(n1) and stem.fullmatch(n2), (n1, n2)
    plan_hash = workbench.reports.content_hash(app.session.plan.to_json())
    assert stem.fullmatch(n1)[1] == stem.fullmatch(n2)[1] == plan_hash       # one plan, one hash
    assert p1["plan"] == str((tmp_path / f"{n1}.plan.json").resolve())  # the plan beside its report, same stem
    assert wb.Plan.read(p1["plan"]).to_json() == app.session.plan.to_json()
    app.report(name="fixed")
    assert runs[-1][1] == "fixed" and (tmp_path / "fixed.plan.json").exists()


def test_the_report_button_writes_where_the_browser_can_open_it(tmp_path, monkeypatch):
    """JupyterLab started in another folder than the repository (here: notebooks/): the Report button writes into
    reports/ of the folder the server serves, so its link opens; under `make lab` (the repository) and with no
    server, the one reports folder."""
    from workbench.reports import browser_url
    from workbench.ui.app import report_folder

    monkeypatch.setenv("WORKBENCH_REPORTS", str(tmp_path / "reports"))
    _jupyter_server_root(tmp_path, monkeypatch, tmp_path / "notebooks")
    folder = report_folder()
    assert folder == (tmp_path / "notebooks" / "reports").resolve()
    assert browser_url(folder / "r.html") == "/files/reports/r.html"
    _jupyter_server_root(tmp_path, monkeypatch, tmp_path)               # the server serves the reports folder
    assert report_folder() == (tmp_path / "reports").resolve()
