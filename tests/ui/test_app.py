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
    expected = {"quantize": "WeightOnly", "prune": "Magnitude", "low-rank": "SVD", "cast": "Cast"}
    for technique, cls in expected.items():
        app.technique.value = technique
        visible = {w.description for w in (app.bits, app.group, app.method, app.sparsity, app.energy, app.dtype)
                   if w.layout.display != "none"}
        assert visible, technique
        if technique == "quantize":
            app.method.value = "hqq"
        if technique == "prune":
            app.sparsity.value = 0.7
        if technique == "low-rank":
            app.energy.value = 0.8
        if technique == "cast":
            app.dtype.value = "float16"
        app.set_button.click()
        config = app.session.assigned["fc3"]
        assert type(config).__name__ == cls, app.status.value
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
    app.session.assigned["fc2"] = wb.quant.WeightOnly(bits=4, group_size=7)  # bypass the check: fails on apply
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
