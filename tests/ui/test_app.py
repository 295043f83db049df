"""wb.ui.Workbench driven in-process (set .value, .click()) - every control, without a browser."""
import html
import json

import pytest
from plotly.callbacks import Points

import workbench as wb


@pytest.fixture
def app(digits_mlp, digits_task):
    return wb.ui.Workbench(digits_mlp, digits_task, background=False,
                           candidates={"int8": wb.quant.WeightOnly(bits=8, group_size=None),
                                       "int2": wb.quant.WeightOnly(bits=2, group_size=16)})


def _click_point(fig, i):
    trace = fig.data[0]
    trace._dispatch_on_click(Points(point_inds=[i], xs=[trace.x[i]], ys=[trace.y[i]], trace_name=trace.name,
                                    trace_index=0), None)


def test_edit_apply_and_charts(app):
    assert app.layers.names == ["fc1", "fc2", "fc3"]
    table = app.layers.widget._dt_args["table_html"]
    for header in ("layer", "type", "shape", "params", "technique", "bytes before", "bytes after", "state"):
        assert f"<th>{header}</th>" in table
    assert len(app.size_chart.data[0].x) == 1       # the reference, measured when the workbench is built
    assert app.size_chart.layout.xaxis.title.text == "size (MiB, lower is better)"
    app.apply_button.click()
    assert "nothing changed" in app.status.value and len(app.session.history) == 1
    app.pattern.value = "fc[12]"
    app.select_button.click()
    assert app.layers.value == ("fc1", "fc2")
    app.choose(wb.quant.WeightOnly(bits=4, group_size=32))
    form = app.forms[wb.quant.WeightOnly]
    assert form["bits"].value == 4 and form["method"].value.value == "rtn"
    app.set_button.click()
    assert "2 layers set to WeightOnly · 4 bits · group 32 · rtn" in app.status.value, app.status.value
    assert "(2 changed)" in app.apply_button.description and "&lt;" not in app.status.value   # words, not reprs
    app.apply_button.click()
    assert "error" not in app.status.value.lower(), app.status.value
    sizes = list(app.size_chart.data[0].x)
    assert len(sizes) == 2 and sizes[1] < 0.5 * sizes[0]           # the new point is smaller
    assert len(app.latency_chart.data[0].x) == 2
    assert list(app.size_chart.data[2].x) == [sizes[1]]             # "current plan" marker
    for fig in (app.size_chart, app.latency_chart):                 # axes fitted to the data, not 0-1.5
        t = fig.data[0]
        plus, minus = t.error_x.array or [0] * len(t.x), t.error_x.arrayminus or [0] * len(t.x)
        xs = [*t.x, *(x + e for x, e in zip(t.x, plus)), *(x - e for x, e in zip(t.x, minus))]
        ye = t.error_y.array                                        # quality's sampling error, 95 % half-widths
        assert len(ye) == len(t.y) and all(e > 0 for e in ye) and t.error_y.visible
        assert list(ye) == pytest.approx([e.metrics.primary_error for e in app.session.history])
        ys = [*t.y, *(y + e for y, e in zip(t.y, ye)), *(y - e for y, e in zip(t.y, ye))]
        for values, axis in ((xs, fig.layout.xaxis), (ys, fig.layout.yaxis)):
            lo, hi = min(values), max(values)
            assert axis.range[0] <= lo and axis.range[1] >= hi, (axis.range, values)
            assert axis.range[1] - axis.range[0] <= 1.3 * (hi - lo) + 0.05 * abs(hi), (axis.range, values)
    assert "MiB" in app.size_chart.data[0].hovertemplate and "×" in app.latency_chart.data[0].hovertemplate
    assert app.size_chart.data[0].text[1].startswith("plan 1: WeightOnly · 4 bits · group 32 · rtn on fc1, fc2")
    assert len(app.size_chart.data[1].x) >= 1                       # Pareto front drawn
    assert app.roofline_chart.data and app.size_figure.data         # the other views updated
    rows = app.session.layer_rows()
    assert rows.loc[0, "technique"] == "WeightOnly · 4 bits · group 32 · rtn" and rows.loc[0, "state"] == "applied"
    assert rows.loc[0, "bytes_after"] < 0.2 * rows.loc[0, "bytes_before"]
    # Undo restores the technique and the bytes column (what the layer would hold), the model is re-applied later
    app.undo_button.click()
    rows = app.session.layer_rows()
    assert rows.loc[0, "technique"] == "none" and rows.loc[0, "bytes_after"] == rows.loc[0, "bytes_before"]
    assert rows.loc[0, "state"] == "to apply"
    shown = json.loads(app.layers.widget._dt_args["data_json"])
    assert shown[0][4] == "none" and shown[0][5] == shown[0][6]     # the grid shows the same
    app.redo_button.click()
    # clicking the reference point restores its (empty) plan; apply brings the full-size model back
    _click_point(app.size_chart, 0)
    assert app.session.assigned == {} and "restored plan 0" in app.status.value
    app.apply_button.click()
    assert app.size_chart.data[0].x[2] == pytest.approx(sizes[0])


def test_every_registered_technique_has_a_form(app):
    """The technique list is the registry: each config type gets a generated form that builds that config."""
    from workbench.plans.registry import registered_configs

    assert [v for _, v in app.technique.options][1:] == registered_configs()
    app.layers.value = ("fc3",)
    settable = {wb.quant.WeightOnly: {"bits": 2, "method": wb.quant.Method.GPTQ},
                wb.quant.Static: {"observer": "percentile"}, wb.prune.NM: {"n": 1, "m": 4},
                wb.lowrank.SVD: {"rank": "5"}, wb.precision.Cast: {"dtype": "float16"}, wb.prune.Random: {"seed": 3}}
    set_ok = []
    for cls in registered_configs():
        app.technique.value = cls
        form = app.forms[cls]
        assert app.form_box.children == (form.box,) and html.escape(form.help) in app.technique_help.value
        for field, value in settable.get(cls, {}).items():
            form[field].value = value
        app.set_button.click()
        if "#b00020" in app.status.value:   # a config that cannot take this layer (or needs a value) says so
            assert "ValueError" in app.status.value, app.status.value
            continue
        config = app.session.assigned["fc3"]
        assert type(config) is cls and app.session.layer_rows().loc[2, "technique"].startswith(cls.__name__)
        for field, value in settable.get(cls, {}).items():
            got = getattr(config, field)
            assert got == value or str(got).removeprefix("torch.") == str(value), (cls, field, got)
        set_ok.append(cls.__name__)
    # NF4, FP8, N:M and random pruning are reachable from the UI (issue 19)
    assert {"WeightOnly", "NF4", "FP8", "Dynamic", "Static", "SVD", "Magnitude", "Random", "NM", "Cast"} <= set(set_ok)
    app.technique.value = None
    app.set_button.click()
    assert "fc3" not in app.session.assigned and "the original layer" in app.status.value
    app.undo_button.click()
    assert app.session.assigned["fc3"] is not None
    app.redo_button.click()
    assert "fc3" not in app.session.assigned


def test_form_errors_name_the_field(app):
    app.layers.value = ("fc3",)
    app.technique.value = wb.lowrank.SVD
    app.forms[wb.lowrank.SVD]["rank"].value = "five"
    app.set_button.click()
    assert "SVD.rank takes an integer or none, got &#x27;five&#x27;" in app.status.value
    assert "fc3" not in app.session.assigned


def test_errors_are_shown_not_raised(app):
    app.layers.value = ()
    app.set_button.click()
    assert "select one or more layers" in app.status.value and "#b00020" in app.status.value
    app.layers.value = ("fc2",)
    app.choose(wb.quant.WeightOnly(bits=4, group_size=128))
    app.set_button.click()
    # bypass the check: fails on apply
    app.session.assigned["fc2"] = wb.quant.WeightOnly(bits=4, group_size=7, kernel="triton")
    app.apply_button.click()
    assert "ApplyError" in app.status.value and "fc2" in app.status.value
    assert len(app.session.history) == 1 and not app.apply_button.disabled and app.progress_label.value == "failed"
    app.forms[wb.quant.WeightOnly]["group_size"].value = "32"
    app.layers.value = ("fc3",)   # fc3 has 128 inputs: fine; a conv with 9 would be refused when set
    app.set_button.click()
    assert "#b00020" not in app.status.value
    app.pattern.value = "nothing*"
    app.select_button.click()
    assert "no editable layer matches" in app.status.value


def test_plan_json_export_import_and_sensitivity(app):
    app.layers.value = ("fc1",)
    app.technique.value = wb.prune.Magnitude
    app.set_button.click()
    app.export_button.click()
    exported = json.loads(app.plan_text.value)
    assert exported["entries"][0]["pattern"] == "fc1"
    app.technique.value = None
    app.set_button.click()
    app.import_button.click()
    assert type(app.session.assigned["fc1"]).__name__ == "Magnitude"
    app.plan_text.value = "{not json"
    app.import_button.click()
    assert "not valid JSON" in app.status.value
    app.layers.value = ("fc2", "fc3")
    app.sens_button.click()
    assert app.session.sensitivity is not None and len(app.session.sensitivity) == 4
    assert app.heatmap.data and app.heatmap.data[0].type == "heatmap"
    app.samples.value = 16
    assert app.session.calibration == 16


@pytest.mark.slow
def test_report_button_runs_the_plan_report(app, tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_REPORTS", str(tmp_path / "reports"))   # the one reports folder
    for name in ("WORKBENCH_FILES_ROOT", "WORKBENCH_FILES_URL"):           # no Voila server here
        monkeypatch.delenv(name, raising=False)
    app.report_button.click()
    assert "plan is empty" in app.status.value
    app.session.set("fc*", wb.quant.WeightOnly(bits=4, group_size=32))
    app.report_button.click()
    assert "report written" in app.status.value, app.status.value
    (page,) = (tmp_path / "reports").glob("plan_report_digits-mlp-*.html")   # <model>-<plan hash>-<time>
    assert page.as_uri() in app.report_link.value   # no Jupyter server here: a file URL
    rec = wb.reports.recorded(page.with_suffix(".ipynb"))
    assert rec["layers"] == 3 and 0.1 < rec["size_ratio"] < 0.25


def test_cancel_button_stops_an_apply_and_changes_nothing(app):
    app.layers.value = ("fc1",)
    app.technique.value = wb.quant.WeightOnly
    app.set_button.click()
    before = app.session.work.fc1
    # the user presses Cancel while the apply is under way (here: as soon as its progress bar moves)
    app.progress.observe(lambda change: app.cancel_button.click(), names="value")
    app.apply_button.click()
    assert "cancelled" in app.status.value and app.progress_label.value == "cancelled"
    assert app.session.work.fc1 is before and len(app.session.history) == 1
    assert app.session.changed == ["fc1"] and not app.apply_button.disabled


def test_export_model_button_writes_the_measured_model(app, tmp_path, monkeypatch):
    """Plan & export tab: the model as last applied goes to wb.export; unapplied changes and formats that cannot hold
    the model are refused in the status line, nothing written."""
    import numpy as np
    import onnxruntime as ort
    import torch

    monkeypatch.setenv("WORKBENCH_REPORTS", str(tmp_path / "reports"))
    assert app.tabs.get_title(4) == "Plan & export" and set(app.export_format.options) >= {"gguf", "onnx"}
    app.session.set("fc*", wb.quant.WeightOnly(bits=4, group_size=32))
    app.export_format.value = "onnx"
    app.export_model_button.click()
    assert "changes not yet applied (fc1, fc2, fc3)" in app.status.value, app.status.value
    assert not (tmp_path / "reports").exists()
    app.apply_button.click()
    app.export_model_button.click()
    folder = tmp_path / "reports" / "exports" / "digits-mlp-onnx"
    assert f"exported the model (onnx) to {folder}" in app.status.value, app.status.value
    assert "model.onnx" in app.export_link.value
    x = app.session.task.example_inputs(batch_size=4)[0]
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        ours = app.session.work(x).numpy()
    assert [i.name for i in session.get_inputs()] == ["input0"]
    theirs = session.run(None, {"input0": x.numpy()})[0]
    assert np.abs(theirs - ours).max() <= 1e-4 * max(1.0, np.abs(ours).max())
    app.export_model_button.click()   # the default folder is taken: a new one beside it
    assert (tmp_path / "reports" / "exports" / "digits-mlp-onnx-2" / "model.onnx").is_file()
    app.export_format.value = "gguf"
    app.export_model_button.click()
    assert "TypeError: gguf export needs a Hugging Face model" in app.status.value, app.status.value
    assert not (tmp_path / "reports" / "exports" / "digits-mlp-gguf").exists()


def test_speedup_axis_is_not_stretched_by_one_wide_interval():
    from workbench.ui.app import _clip_to_points, _fit

    points = [0.97, 1.02, 1.05]
    ends = [*points, 1.1, 1.08, 15.0, 0.9, 0.95, 0.2]    # one interval reaching to 15x, one down to 0.2x
    low, high = _fit(_clip_to_points(ends, points), floor=0.0)
    assert 0.0 <= low < 0.97 and 1.05 < high < 2.0          # the points fill the chart, 15x does not
    assert _clip_to_points([3.0, 2.5], [3.0]) == [3.0, 2.5]   # values within reach are kept


def test_sensitivity_candidates_are_chosen_in_the_ui_and_the_status_speaks_plainly(app):
    names = [c.description for c in app.sens_checks.children]
    assert names == list(app.candidates) and all(c.value for c in app.sens_checks.children)
    app.technique.value = wb.quant.WeightOnly
    app.forms[wb.quant.WeightOnly]["bits"].value = 2
    app.add_candidate_button.click()                                   # the technique above joins the candidates
    added = app.sens_checks.children[-1]
    assert added.description.startswith("WeightOnly · 2 bits") and added.value
    for c in app.sens_checks.children[:-1]:
        c.value = False                                                # only the new one runs
    app.layers.value = ("fc1",)
    app.sens_button.click()
    table = app.session.sensitivity
    assert list(table["candidate"].unique()) == [added.description] and len(table) == 1
    assert "sensitivity measured: 1 layer x 1 candidate" in app.status.value and "rows (" not in app.status.value
    for c in app.sens_checks.children:
        c.value = False
    app.sens_button.click()
    assert "tick at least one candidate" in app.status.value and "#b00020" in app.status.value


def test_a_slower_point_is_reported_in_amber_with_its_reason_below(app):
    app.layers.value = ("fc1", "fc2", "fc3")
    app.technique.value = wb.quant.WeightOnly
    app.forms[wb.quant.WeightOnly]["bits"].value = 2
    app.forms[wb.quant.WeightOnly]["kernel"].value = "reference"       # decodes every weight on every call: slower
    app.set_button.click()
    app.apply_button.click()
    app.wait()
    entry = app.session.history[-1]
    assert entry.speedup.slower or not entry.speedup.reliable, str(entry.speedup)
    assert "wb-status-warn" in app.status.value and "#1b5e20" not in app.status.value   # not the success colour
    if entry.speedup.slower:                                           # the why, below the headline
        assert "reference path" in app.status.value and "wb-help" in app.status.value
    else:                                                              # a busy machine: said, in amber too
        assert "no reliable reading" in app.status.value
