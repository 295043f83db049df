"""Figures of the analysis tables as a person reads them: the sensitivity heatmap marks cells that did not run
(grey, a cross, the status in the hover - never white, which reads as "no loss"); the roofline chart names long
plans "plan 1", "plan 2", ... with the plan in the hover, and one wide interval does not flatten the bars."""
import pandas as pd
import pytest

import workbench as wb


def test_heatmap_marks_cells_that_did_not_run():
    table = pd.DataFrame({"layer": ["fc1", "fc1", "fc2", "fc2"], "candidate": ["int8", "int2", "int8", "int2"],
                          "status": ["ok", "ok", "ok", "error: ValueError: bad shape"],
                          "loss": [0.0, 0.2, 0.01, float("nan")]})
    table.attrs["metric"] = "accuracy"
    fig = wb.plots.sensitivity_heatmap(table)
    assert len(fig.data) == 2
    failed = fig.data[1]
    assert failed.name == "did not run" and failed.texttemplate == "✕" and failed.showscale is False
    assert [list(r) for r in failed.z] == [[None, None], [None, 1.0]]             # only the failed cell
    assert failed.text[1][1] == "error: ValueError: bad shape"
    assert fig.data[0].z[0][0] == 0.0                                            # a zero loss stays a value
    ok = table.assign(status="ok", loss=[0.0, 0.2, 0.01, 0.3])
    assert len(wb.plots.sensitivity_heatmap(ok).data) == 1


def test_roofline_short_labels_with_the_plan_in_the_hover_and_a_clipped_axis():
    long = "WeightOnly · 4 bits · group 32 · rtn on fc1; Magnitude · 50% sparse on fc2"
    df = pd.DataFrame({"label": ["reference", long, "int8"], "size_bytes": [1000, 300, 260],
                       "latency_ms": [1.0, 0.9, 0.8], "speedup": [1.0, 1.1, 1.25],
                       "speedup_low": [1.0, 0.3, 1.2], "speedup_high": [1.0, 15.0, 1.3],
                       "speedup_verdict": ["baseline", "no measurable change", "1.25x faster"]})
    fig = wb.plots.roofline(df)
    measured = fig.data[0]
    assert list(measured.x) == ["plan 1", "plan 2"]                              # no rotated sentence under a bar
    assert measured.customdata[0] == long.replace("; ", "<br>") and measured.customdata[1] == "int8"
    assert fig.layout.xaxis.tickangle == 0
    tallest = max(1.25, 1000 / 260)
    assert tuple(fig.layout.yaxis.range) == pytest.approx((0, 2 * tallest))      # 15x is cut at the edge
    short = wb.plots.roofline(df.assign(label=["reference", "int4", "int8"]))
    assert list(short.data[0].x) == ["int4", "int8"]                             # short labels stay themselves
