"""wb.search reads its verification with the sampling error: on the evaluation the user reads (the full test set
by default), each plan's quality "value ± error", a difference inside the combined error is a tie, and the cheaper
plan wins a tie."""
import math

import numpy as np
import pytest

import workbench as wb
from workbench.analysis import Budget
from workbench.analysis.search import _recommend
from workbench.measurement.sampling import combined_halfwidth

CANDS = {"int8": wb.quant.WeightOnly(bits=8, group_size=None), "int4": wb.quant.WeightOnly(bits=4, group_size=16),
         "int2": wb.quant.WeightOnly(bits=2, group_size=16)}


def row(plan, measured, error, cost, fits=True):
    return {"plan": plan, "measured": measured, "measured_error": error, "_cost": cost, "fits": fits}


def test_a_tie_recommends_the_cheaper_plan_and_says_tie():
    rows = [row("searched", 0.9722, 0.014, 32_776), row("uniform int4", 0.9759, 0.013, 33_096)]
    best, why = _recommend(rows, higher=True, unit="bytes")
    assert best["plan"] == "searched"   # measured lower, but inside the error and cheaper
    assert "ties uniform int4 (0.9722 vs 0.9759, ±0.019) and costs less (32,776 vs 33,096 bytes)" in why
    assert "tie" in why and why.startswith("recommended: 'searched' (0.9722 ± 0.014, 32,776 bytes)")
    # the same two plans at the same cost: the better measured one
    rows = [row("searched", 0.9722, 0.014, 33_096), row("uniform int4", 0.9759, 0.013, 33_096)]
    best, why = _recommend(rows, higher=True, unit="bytes")
    assert best["plan"] == "uniform int4" and "ties searched (0.9759 vs 0.9722, ±0.019) at the same cost" in why


def test_a_clear_win_names_the_winner_even_when_it_costs_more():
    rows = [row("searched", 0.974, 0.010, 94_012), row("uniform int2", 0.470, 0.031, 51_196)]
    best, why = _recommend(rows, higher=True, unit="bytes")
    assert best["plan"] == "searched"
    assert "beats uniform int2 (0.9740 vs 0.4700, ±0.033)" in why and "tie" not in why


def test_lower_is_better_metrics_and_latency_units():
    rows = [row("searched", 12.0, 0.3, 4.0), row("uniform int4", 12.2, 0.3, 3.0), row("uniform int2", 19.0, 0.5, 2.0)]
    best, why = _recommend(rows, higher=False, unit="ms")
    assert best["plan"] == "uniform int4"   # ties the lower perplexity, and is faster
    assert "ties searched (12.2000 vs 12.0000, ±0.42) and costs less (3 vs 4 ms)" in why
    assert "beats uniform int2" in why


def test_a_cheap_plan_beaten_by_another_is_not_recommended():
    """C ties B but A beats C beyond the error: B (the cheapest plan nothing beats) is recommended."""
    rows = [row("A", 0.975, 0.010, 100), row("B", 0.962, 0.012, 80), row("C", 0.950, 0.010, 60)]
    assert combined_halfwidth(0.010, 0.010) < 0.975 - 0.950            # A beats C
    assert abs(0.962 - 0.950) <= combined_halfwidth(0.012, 0.010)      # B ties C
    best, why = _recommend(rows, higher=True, unit="bytes")
    assert best["plan"] == "B"
    assert "ties 'C'" in why and "beaten beyond the sampling error by A" in why


def test_over_budget_and_unknown_errors():
    rows = [row("searched", 0.95, 0.01, 100), row("bigger", 0.99, 0.01, 120, fits=False)]
    best, why = _recommend(rows, higher=True, unit="bytes")
    assert best["plan"] == "searched" and "which is over the budget" in why
    # no sampling error stated: any difference counts, as before
    nan = float("nan")
    rows = [row("searched", 0.95, nan, 80), row("uniform int4", 0.951, nan, 100)]
    best, why = _recommend(rows, higher=True, unit="bytes")
    assert best["plan"] == "uniform int4" and "no sampling error stated" in why and "tie" not in why


@pytest.fixture(scope="module")
def digits_setup(tmp_path_factory):
    model, task = wb.models.load("digits-mlp"), wb.tasks.load("digits")
    table = wb.sensitivity(model, task, CANDS, cache=tmp_path_factory.mktemp("c"), progress=False)   # quick
    uniform = wb.apply(model, {"*": CANDS["int4"]}, progress=False)
    budget = sum(wb.size_bytes(m) for m in uniform.modules() if isinstance(m, wb.quant.WeightOnlyLinear))
    return model, task, table, budget


def check_recommendation(report):
    """The returned plan is the cheapest of those that fit and that no other plan beats beyond the combined
    error; every tied plan is named as a tie."""
    v = report.verified
    assert v["chosen"].sum() == 1 and v.loc[v["chosen"], "vs_recommended"].item() == "recommended"
    fit = v[v["fits"]]

    def beaten(i):
        return any(fit.loc[j, "measured"] - fit.loc[i, "measured"]
                   > combined_halfwidth(fit.loc[j, "measured_error"], fit.loc[i, "measured_error"]) for j in fit.index)

    eligible = [i for i in fit.index if not beaten(i)]
    cheapest = min(fit.loc[eligible, "measured_cost"])
    chosen = v[v["chosen"]].iloc[0]
    assert chosen["measured_cost"] == cheapest
    for _, r in v[v["vs_recommended"] == "tie"].iterrows():
        h = combined_halfwidth(r["measured_error"], chosen["measured_error"])
        assert abs(r["measured"] - chosen["measured"]) <= h
        assert f"ties {r['plan']} ({chosen['measured']:.4f} vs {r['measured']:.4f}, ±" in report.recommendation


def test_search_verifies_on_the_full_evaluation_by_default(digits_setup):
    """The issue's case: int8 / int4 g16 / int2 g16 at uniform int4's bytes, verified on the full test set (540
    digits), each plan with its error; the knapsack's plan and uniform int4 differ inside it: a tie."""
    model, task, table, budget = digits_setup
    plan, report = wb.search(model, task, CANDS, budget, table=table, progress=False)
    assert report.evaluation == "full" and report.measured.quick is False and report.base_quick is True
    full = wb.measure(wb.apply(model, plan, progress=False), task, progress=False)
    assert report.measured_quality == full.primary_value and report.measured_error == full.primary_error
    v = report.verified.set_index("plan")
    assert {"measured_error", "vs_recommended"} <= set(v.columns) and np.isfinite(v["measured_error"]).all()
    assert v.loc["uniform int4", "measured"] == pytest.approx(
        wb.measure(wb.apply(model, {"*": CANDS["int4"]}, progress=False), task, progress=False).primary_value)
    assert (v["vs_recommended"] == "tie").any()   # 540 samples: +-0.013 or more each
    check_recommendation(report)
    text = str(report)
    assert f"measured {report.measured_quality:.4f} ± " in text and "(the full evaluation)" in text
    assert "(the quick subset, as the sensitivity)" in text and "<- recommended" in text
    assert "ties " in text and "cheaper plan wins a tie" in text
    assert not math.isnan(report.summary().loc["measured", "accuracy ± (95 %)"])


def test_search_verify_quick_and_both(digits_setup):
    model, task, table, budget = digits_setup
    plan, quick = wb.search(model, task, CANDS, budget, table=table, verify="quick", progress=False)
    assert quick.evaluation == "quick" and quick.measured.quick is True
    assert quick.measured_quality == wb.measure(wb.apply(model, plan, progress=False), task, quick=True,
                                                progress=False).primary_value
    assert "(the quick subset)" in str(quick)
    check_recommendation(quick)
    _, both = wb.search(model, task, CANDS, budget, table=table, verify="both", progress=False)
    assert both.evaluation == "full" and both.measured.quick is False and both.measured_quick.quick is True
    v = both.verified.set_index("plan")
    # the quick column is the quick verification's measurement, the main one the full evaluation's
    assert v["measured_quick"].to_dict() == quick.verified.set_index("plan")["measured"].to_dict()
    assert np.isfinite(v["measured_quick_error"]).all() and "quick subset" in str(both)
    check_recommendation(both)
    with pytest.raises(ValueError, match="verify must be"):
        wb.search(model, task, CANDS, budget, table=table, verify="fast", progress=False)
    _, none = wb.search(model, task, CANDS, budget, table=table, verify=False, progress=False)
    assert none.evaluation == "" and "not measured (verify=False)" in str(none)


def test_search_names_a_clear_winner():
    """mnist1d-cnn at uniform int4's bytes: uniform int2 loses half its accuracy - far outside the error."""
    model, task = wb.models.load("mnist1d-cnn"), wb.tasks.load("mnist1d")
    cands = {f"int{b}": wb.quant.WeightOnly(bits=b, group_size=None) for b in (8, 4, 2)}
    table = wb.sensitivity(model, task, cands, cache=False, progress=False)
    int4 = int(table[table.candidate == "int4"]["size_after"].sum())
    _, report = wb.search(model, task, cands, Budget.size(int4), table=table, progress=False)
    v = report.verified.set_index("plan")
    assert v.loc["uniform int2", "vs_recommended"] == "worse"
    assert "beats uniform int2 (" in report.recommendation
    check_recommendation(report)
