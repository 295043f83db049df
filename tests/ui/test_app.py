"""wb.ui.Workbench driven in-process (set .value, .click()) - every control, without a browser."""
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
    assert [o[1] for o in app.layers.options] == ["fc1", "fc2", "fc3"]
    assert len(app.size_chart.data[0].x) == 1       # the reference, measured when the workbench is built
    assert app.size_chart.layout.xaxis.title.text == "size (MiB, lower is better)"
    app.apply_button.click()
    assert "nothing changed" in app.status.value and len(app.session.history) == 1
    app.pattern.value = "fc[12]"
    app.select_button.click()
    assert app.layers.value == ("fc1", "fc2")
    app.technique.value = "quantize"
    app.bits.value, app.group.value, app.method.value = 4, 32, "rtn"
    app.set_button.click()
    assert "2 layer(s) set" in app.status.value and "(2 changed)" in app.apply_button.description
    app.apply_button.click()
    assert "error" not in app.status.value.lower(), app.status.value
    sizes = list(app.size_chart.data[0].x)
    assert len(sizes) == 2 and sizes[1] < 0.5 * sizes[0]           # the new point is smaller
    assert len(app.latency_chart.data[0].x) == 2
    assert list(app.size_chart.data[2].x) == [sizes[1]]             # "latest" marker
    assert len(app.size_chart.data[1].x) >= 1                       # Pareto front drawn
    assert app.roofline_chart.data and app.size_figure.data         # the other views updated
    rows = app.session.layer_rows()
    assert rows.loc[0, "technique"] == "WeightOnly(group_size=32)"
    # clicking the reference point restores its (empty) plan; apply brings the full-size model back
    _click_point(app.size_chart, 0)
    assert app.session.assigned == {} and "restored plan 0" in app.status.value
    app.apply_button.click()
    assert app.size_chart.data[0].x[2] == pytest.approx(sizes[0])


def test_every_technique_control(app):
    app.layers.value = ("fc3",)
    expected = {"quantize": "WeightOnly", "w8a8": "Static", "prune": "Magnitude", "low-rank": "SVD", "cast": "Cast"}
    for technique, cls in expected.items():
        app.technique.value = technique
        controls = (app.bits, app.group, app.method, app.activations, app.kernel, app.observer, app.sparsity,
                    app.energy, app.rank, app.dtype)
        visible = {w.description for w in controls if w.layout.display != "none"}
        assert visible, technique
        if technique == "w8a8":
            assert app.kernel.layout.display != "none" and app.observer.layout.display == "none"
            app.activations.value = "static"
            assert app.observer.layout.display != "none" and app.kernel.layout.display == "none"
            app.observer.value = "percentile"
        if technique == "quantize":
            app.method.value = "hqq"
        if technique == "prune":
            app.sparsity.value = 0.7
        if technique == "low-rank":
            app.energy.value = 0.8
            app.rank.value = 5
        if technique == "cast":
            app.dtype.value = "float16"
        app.set_button.click()
        config = app.session.assigned["fc3"]
        assert type(config).__name__ == cls, app.status.value
        if technique == "w8a8":
            assert config.observer == "percentile"
        if technique == "low-rank":
            assert config.rank == 5
    assert str(app.session.assigned["fc3"].dtype) == "torch.float16"
    app.technique.value = "none"
    app.set_button.click()
    assert "fc3" not in app.session.assigned
    app.undo_button.click()
    assert type(app.session.assigned["fc3"]).__name__ == "Cast"
    app.redo_button.click()
    assert "fc3" not in app.session.assigned


def test_errors_are_shown_not_raised(app):
    app.layers.value = ()
    app.set_button.click()
    assert "select one or more layers" in app.status.value and "#b00020" in app.status.value
    app.layers.value = ("fc2",)
    app.technique.value = "quantize"
    app.bits.value, app.group.value = 4, 128
    app.set_button.click()
    app.session.assigned["fc2"] = wb.quant.WeightOnly(bits=4, group_size=7, symmetric=False, method="hqq")  # bypass the check: fails on apply
    app.apply_button.click()
    assert "ApplyError" in app.status.value and "fc2" in app.status.value
    assert len(app.session.history) == 1 and not app.apply_button.disabled and app.progress_label.value == "failed"
    app.group.value = 32
    app.layers.value = ("fc3",)   # fc3 has 128 inputs: fine; a conv with 9 would be refused when set
    app.set_button.click()
    assert "#b00020" not in app.status.value
    app.pattern.value = "nothing*"
    app.select_button.click()
    assert "no editable layer matches" in app.status.value


def test_plan_json_export_import_and_sensitivity(app):
    app.layers.value = ("fc1",)
    app.technique.value = "prune"
    app.set_button.click()
    app.export_button.click()
    exported = json.loads(app.plan_text.value)
    assert exported["entries"][0]["pattern"] == "fc1"
    app.technique.value = "none"
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
    monkeypatch.chdir(tmp_path)  # reports/ is written under the current directory
    app.report_button.click()
    assert "plan is empty" in app.status.value
    app.session.set("fc*", wb.quant.WeightOnly(bits=4, group_size=32))
    app.report_button.click()
    assert "report written" in app.status.value, app.status.value
    page = tmp_path / "reports" / "plan_report_digits-mlp.html"
    assert page.exists() and str(page.name) in app.report_link.value
    rec = wb.reports.recorded(tmp_path / "reports" / "plan_report_digits-mlp.ipynb")
    assert rec["layers"] == 3 and 0.1 < rec["size_ratio"] < 0.25


def test_cancel_button_stops_an_apply_and_changes_nothing(app):
    app.layers.value = ("fc1",)
    app.technique.value = "quantize"
    app.set_button.click()
    before = app.session.work.fc1
    # the user presses Cancel while the apply is under way (here: as soon as its progress bar moves)
    app.progress.observe(lambda change: app.cancel_button.click(), names="value")
    app.apply_button.click()
    assert "cancelled" in app.status.value and app.progress_label.value == "cancelled"
    assert app.session.work.fc1 is before and len(app.session.history) == 1
    assert app.session.changed == ["fc1"] and not app.apply_button.disabled
