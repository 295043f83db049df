"""`wb.sweep` measures plans that give the same model once: a report's plan that equals one of the uniform plans
beside it is one row (the first label) with the other label in ``same_as``, never two rows whose latencies, taken
in different rounds, put one copy off the front."""
import pytest

import workbench as wb

INT8 = wb.quant.WeightOnly(bits=8)


def test_the_same_plan_under_two_labels_is_one_row(digits_mlp, digits_task):
    plans = {"plan": wb.Plan({"fc*": INT8}),                   # a glob ...
             "int8": wb.Plan({"fc1": INT8, "fc2": INT8, "fc3": INT8}),   # ... and the same layers by name
             "int4 fc1": wb.Plan({"fc1": wb.quant.WeightOnly(bits=4, group_size=32)})}
    df = wb.sweep(digits_mlp, digits_task, plans, quick=True, threads=1, progress=False)
    assert list(df["label"]) == ["reference", "plan", "int4 fc1"]
    assert list(df["same_as"]) == ["", "int8", ""]
    assert df["pareto_size"].tolist() == wb.pareto(df, "size_bytes", "accuracy").tolist()


def test_the_speed_front_comes_from_paired_speedups_and_is_drawn_with_them(digits_mlp, digits_task):
    import pandas as pd

    df = wb.sweep(digits_mlp, digits_task, {"int8": wb.Plan({"fc*": INT8})}, quick=True, threads=1,
                  progress=False)
    assert df["pareto_latency"].tolist() == wb.pareto(df, "speedup", "accuracy", x_lower_is_better=False).tolist()
    # a row timed during a busy minute (latency 100x) is not off the front when its paired speedup says it is fast
    rows = pd.DataFrame({"label": ["reference", "a", "b"], "techniques": ["none", "q", "q"],
                         "accuracy": [0.97, 0.96, 0.95], "size_bytes": [100, 30, 25],
                         "latency_ms": [1.0, 100.0, 0.9], "speedup": [1.0, 1.3, 1.1],
                         "speedup_low": [0.98, 1.2, 1.0], "speedup_high": [1.02, 1.4, 1.2]})
    rows.attrs.update(primary="accuracy", higher_is_better={"accuracy": True})
    from workbench.analysis.sweep import _mark_fronts

    _mark_fronts(rows)
    assert rows["pareto_latency"].tolist() == [True, True, False]
    fig = wb.plots.frontier(rows, x="speedup")
    assert fig.layout.xaxis.title.text.startswith("speedup over the reference")
    assert fig.data[1].name == "q" and list(fig.data[1].error_x.array) == pytest.approx([0.1, 0.1])
    assert "2 of 3 on the front" in fig.layout.title.text


def test_a_plan_already_measured_is_a_row_with_the_same_numbers(digits_mlp, digits_task):
    plan = wb.Plan({"fc*": INT8})
    small = wb.apply(digits_mlp, plan, progress=False)
    result = wb.measure(small, digits_task, quick=True, threads=1, baseline=digits_mlp)
    df = wb.sweep(digits_mlp, digits_task, {"plan": plan, "int8 by name": wb.Plan({"fc1": INT8, "fc2": INT8,
                                                                                    "fc3": INT8})},
                  quick=True, threads=1, progress=False, measured={"plan": result})
    row = df.set_index("label").loc["plan"]
    assert row["speedup"] == result.speedup.ratio and row["latency_ms"] == result.latency_ms   # not re-measured
    assert row["same_as"] == "int8 by name" and list(df["label"]) == ["reference", "plan"]
    with pytest.raises(ValueError, match="not plans of this sweep"):
        wb.sweep(digits_mlp, digits_task, {"plan": plan}, quick=True, progress=False, measured={"typo": result})
    apart = wb.measure(small, digits_task, quick=True, threads=1)
    with pytest.raises(ValueError, match="no paired speedup"):
        wb.sweep(digits_mlp, digits_task, {"plan": plan}, quick=True, progress=False, measured={"plan": apart})
