"""wb.search (exact multiple-choice knapsack + verification), wb.sweep / wb.pareto, persistence, plots."""
import itertools
import json

import numpy as np
import pandas as pd
import pytest

import workbench as wb
from workbench.analysis import Budget, solve
from workbench.measurement.sampling import combined_halfwidth

INT8 = wb.quant.WeightOnly(bits=8, group_size=None)
INT4 = wb.quant.WeightOnly(bits=4, group_size=16)
INT2 = wb.quant.WeightOnly(bits=2, group_size=16)
CANDS = {"int8": INT8, "int4": INT4, "int2": INT2}


def brute_pareto(a, b):
    """Minimise both: a row is on the front unless another is <= on both and < on one."""
    out = []
    for i in range(len(a)):
        if not (np.isfinite(a[i]) and np.isfinite(b[i])):
            out.append(False)
            continue
        out.append(not any(np.isfinite(a[j]) and np.isfinite(b[j]) and a[j] <= a[i] and b[j] <= b[i]
                           and (a[j] < a[i] or b[j] < b[i]) for j in range(len(a))))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_pareto_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = 200
    df = pd.DataFrame({"size_bytes": rng.integers(0, 30, n).astype(float),  # many ties
                       "quality": rng.integers(0, 30, n).astype(float)})
    df.loc[rng.choice(n, 5, replace=False), "quality"] = np.nan
    got = wb.pareto(df, "size_bytes", "quality", y_higher_is_better=True)
    assert got.tolist() == brute_pareto(df["size_bytes"].to_numpy(), -df["quality"].to_numpy())
    got = wb.pareto(df, "size_bytes", "quality", y_higher_is_better=False, x_lower_is_better=False)
    assert got.tolist() == brute_pareto(-df["size_bytes"].to_numpy(), df["quality"].to_numpy())


def test_pareto_needs_a_direction():
    df = pd.DataFrame({"size_bytes": [1.0, 2.0], "mystery": [1.0, 2.0]})
    with pytest.raises(ValueError, match="higher 'mystery' is better"):
        wb.pareto(df, "size_bytes", "mystery")
    with pytest.raises(KeyError, match="no column 'nope'"):
        wb.pareto(df, "size_bytes", "nope")


@pytest.mark.parametrize("seed", range(8))
def test_knapsack_is_exact(seed):
    rng = np.random.default_rng(seed)
    options = {f"l{i}": [(f"c{j}", float(rng.normal()), float(rng.integers(1, 20))) for j in range(3)]
               for i in range(5)}
    limit = float(rng.integers(20, 60))
    best = None
    for combo in itertools.product(*(range(3) for _ in options)):
        picks = [options[f"l{i}"][j] for i, j in enumerate(combo)]
        if sum(p[2] for p in picks) <= limit:
            key = (round(sum(p[1] for p in picks), 9), sum(p[2] for p in picks))
            best = key if best is None or key < best else best
    if best is None:
        with pytest.raises(ValueError, match="smallest achievable"):
            solve(options, limit)
        return
    chosen = solve(options, limit)
    picks = [next(o for o in options[layer] if o[0] == c) for layer, c in chosen.items()]
    assert sum(p[1] for p in picks) == pytest.approx(best[0], abs=1e-7)
    assert sum(p[2] for p in picks) <= limit


@pytest.fixture(scope="module")
def mlp_table(tmp_path_factory):
    model, task = wb.models.load("digits-mlp"), wb.tasks.load("digits")
    table = wb.sensitivity(model, task, CANDS, quick=False, cache=tmp_path_factory.mktemp("c"), progress=False)
    return model, task, table


def test_search_respects_budget_and_reports_measurements(mlp_table):
    model, task, table = mlp_table
    plan, report = wb.search(model, task, CANDS, Budget.size_fraction(0.12), table=table, quick=False,
                             progress=False)
    assert report.limit == pytest.approx(0.12 * table.groupby("layer")["size_before"].first().sum())
    assert report.predicted_cost <= report.limit
    assert report.measured_cost == report.predicted_cost  # sizes are exact measurements
    assert report.measured is not None and report.measured_quality == report.measured.quality["accuracy"]
    compressed = wb.apply(model, plan, progress=False)
    assert sum(wb.size_bytes(compressed.get_submodule(n)) for n in ("fc1", "fc2", "fc3")) <= report.limit
    summary = report.summary()
    assert list(summary.index) == ["reference", "predicted", "measured"]
    assert "predicted" in str(report)
    # the search is at least as good (predicted) as every uniform plan that fits the same budget
    for label in wb.analysis.uniform_plans(table):
        rows = table[table.candidate == label]
        if rows["size_after"].sum() <= report.limit:
            assert report.choices["loss"].sum() <= rows["loss"].sum() + 1e-12


def test_search_errors(mlp_table):
    model, task, table = mlp_table
    with pytest.raises(ValueError, match=r"below the smallest achievable total 20,488"):
        wb.search(model, task, CANDS, 10_000, table=table, verify=False)
    with pytest.raises(ValueError, match="different model"):
        other = wb.apply(model, {"fc1": INT8}, progress=False)
        wb.search(other, task, CANDS, 50_000, table=table, verify=False)
    with pytest.raises(ValueError, match="no measured latency_ms"):
        wb.search(model, task, CANDS, Budget.latency_fraction(0.5), table=table, verify=False)
    with pytest.raises(ValueError, match="fraction"):
        Budget(2.0, relative=True)
    with pytest.raises(ValueError, match="resource"):
        Budget(1.0, resource="joules")
    with pytest.raises(TypeError, match="wb.Budget"):
        wb.search(model, task, CANDS, 0.5, table=table)


def test_search_without_keep_uses_a_candidate_everywhere(mlp_table):
    model, task, table = mlp_table
    plan, report = wb.search(model, task, CANDS, Budget.size_fraction(1.0), table=table, keep=False,
                             verify=False)
    assert set(plan) == {"fc1", "fc2", "fc3"} and "keep" not in set(report.choices["option"])


def test_sweep_table_persistence_and_plots(mlp_table, tmp_path):
    model, task, table = mlp_table
    plans = wb.analysis.uniform_plans(table)
    path = tmp_path / "sweep.csv"
    df = wb.sweep(model, task, plans, path=path, progress=False)
    assert list(df["label"]) == ["reference", "int8", "int4", "int2"]
    assert df.loc[0, "techniques"] == "none" and df.loc[1, "techniques"] == "quant.WeightOnly"
    assert df["size_bytes"].is_monotonic_decreasing
    assert df["pareto_size"].tolist() == wb.pareto(df, "size_bytes", "accuracy").tolist()
    assert df["pareto_size"].iloc[-1]  # the smallest is always on the size front
    again = wb.analysis.load_results(path)
    assert again.attrs["higher_is_better"] == {"accuracy": True}
    pd.testing.assert_series_equal(again["accuracy"], df["accuracy"])
    assert wb.analysis.plan_of(again.iloc[2]) == plans["int4"]
    assert json.loads(again.loc[2, "kernels"])  # kernel paths recorded per row
    fig = wb.plots.frontier(again)
    assert fig.data[-1].name == "Pareto front" and "lower is better" in fig.layout.xaxis.title.text
    front = df[df.pareto_size].sort_values("size_bytes")
    assert list(fig.data[-1].x) == pytest.approx(list(front["size_bytes"] / 2**20))
    import plotly.graph_objects as go

    assert len(go.FigureWidget(fig).data) == len(fig.data)  # usable as a live widget
    heat = wb.plots.sensitivity_heatmap(table)
    assert np.asarray(heat.data[0].z).shape == (3, 3)
    roof = wb.plots.roofline(df)
    assert [t.name for t in roof.data] == ["measured speedup (95% interval)", "byte-ratio ceiling"]
    assert df["speedup_low"].le(df["speedup"]).all() and df["speedup"].le(df["speedup_high"]).all()
    assert np.allclose(roof.data[1].y, df["size_bytes"].iloc[0] / df["size_bytes"].iloc[1:])
    int4 = wb.apply(model, plans["int4"], progress=False)
    sizes = wb.plots.size_breakdown(int4)
    assert [t.name for t in sizes.data] == ["float16", "float32", "uint8"]
    assert list(sizes.data[0].y) == ["fc2", "fc1", "fc3"]  # largest first
    total = sum(sum(t.x) for t in sizes.data) * 2**20
    assert total == pytest.approx(wb.size_bytes(int4))


def test_sweep_bad_input(mlp_table):
    model, task, _ = mlp_table
    with pytest.raises(ValueError, match="sweep plan 'typo'.*fc9"):
        wb.sweep(model, task, {"typo": wb.Plan({"fc9": INT8})}, progress=False)
    with pytest.raises(ValueError, match="empty"):
        wb.sweep(model, task, {}, progress=False)
    with pytest.raises(ValueError, match="baseline's label"):
        wb.sweep(model, task, {"reference": wb.Plan({"fc1": INT8})}, progress=False)
    with pytest.raises(ValueError, match=r"\.csv or \.parquet"):
        wb.analysis.save_results(pd.DataFrame({"a": [1]}), "out.xlsx")


def test_search_without_a_table_never_loses_to_a_uniform_candidate(digits_mlp, digits_task):
    """The additive prediction can pick a plan worse than the obvious uniform one; the search measures the
    uniform candidates that fit (on the full evaluation) and returns a plan that none of them beats beyond the
    sampling error (tests/analysis/test_search_sampling.py: ties go to the cheaper plan)."""
    cands = {"int8": wb.quant.WeightOnly(bits=8, group_size=None), "int4": wb.quant.WeightOnly(bits=4, group_size=16),
             "int2": wb.quant.WeightOnly(bits=2, group_size=16)}
    uniform = wb.apply(digits_mlp, {"*": cands["int4"]}, progress=False)
    budget = sum(wb.size_bytes(m) for m in uniform.modules() if isinstance(m, wb.quant.WeightOnlyLinear))
    plan, report = wb.search(digits_mlp, digits_task, cands, budget, progress=False, cache=False)
    uniform_m = wb.measure(uniform, digits_task, progress=False)   # the full evaluation, as the search verifies
    h = combined_halfwidth(report.measured_error, uniform_m.primary_error)
    assert report.evaluation == "full" and report.measured_quality >= uniform_m.primary_value - h
    assert report.measured_cost <= budget
    v = report.verified
    assert "uniform int4" in set(v["plan"]) and v["chosen"].sum() == 1
    assert {"predicted", "measured", "measured_error", "predicted_cost", "measured_cost"} <= set(v.columns)
