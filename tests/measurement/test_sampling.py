"""Sampling error of quality metrics and slowdown reasons, where the user looks: `Metrics`, `wb.compare`, the
workbench's status line. The intervals are checked by their coverage on simulated data, not by their formulas."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import workbench as wb
from workbench.measurement import sampling
from workbench.measurement.speedup import Speedup


def _coverage(draw, halfwidth, truth, trials=1500, seed=0):
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(trials):
        estimate, h = halfwidth(draw(rng))
        hits += abs(estimate - truth) <= h
    return hits / trials


@pytest.mark.parametrize("p", [0.5, 0.9, 0.97])
def test_accuracy_error_covers_the_true_accuracy_95_percent_of_the_time(p):
    n = 256   # the quick subset of the classification tasks

    def estimate(k):
        return k / n, sampling.wilson_halfwidth(int(k), n)

    cov = _coverage(lambda rng: rng.binomial(n, p), estimate, p)
    assert 0.92 <= cov <= 0.99, cov


def test_wilson_is_not_zero_at_a_perfect_score():
    # the normal approximation would claim +-0 for 256 / 256: Wilson does not
    assert 0.005 < sampling.wilson_halfwidth(256, 256) < 0.02
    assert sampling.wilson_halfwidth(250, 256) > sampling.wilson_halfwidth(2500, 2560)
    with pytest.raises(ValueError, match="successes"):
        sampling.wilson_halfwidth(5, 4)


def test_mean_and_perplexity_errors_cover_the_truth():
    cov = _coverage(lambda rng: rng.gamma(2.0, 0.5, size=32),
                    lambda v: (v.mean(), sampling.mean_halfwidth(v)), 1.0)
    assert 0.92 <= cov <= 0.98, cov
    # perplexity = exp(mean window loss); truth exp(1.3)
    cov = _coverage(lambda rng: rng.normal(1.3, 0.2, size=16),
                    lambda v: (math.exp(v.mean()), sampling.perplexity_halfwidth(v)), math.exp(1.3))
    assert 0.92 <= cov <= 0.98, cov
    assert math.isnan(sampling.mean_halfwidth([1.0]))


def test_measure_states_the_sampling_error_of_the_quick_subset(digits_mlp, digits_task):
    quick = wb.measure(digits_mlp, digits_task, quick=True, threads=1, progress=False)
    full = wb.measure(digits_mlp, digits_task, threads=1, progress=False)
    n = digits_task.quick_samples
    correct = round(quick.primary_value * n)
    assert quick.primary_error == pytest.approx(sampling.wilson_halfwidth(correct, n))
    assert 0.005 < quick.primary_error < 0.05
    assert full.primary_error < quick.primary_error          # 540 test images vs 256
    assert quick.to_dict()["accuracy_error"] == quick.primary_error
    assert f"+- {quick.primary_error:.2g}" in str(quick)


def test_perplexity_error_of_tiny_lm():
    model, task = wb.models.load("tiny-lm"), wb.tasks.load("tiny-lm")
    values, errors = task.evaluate_with_error(model, quick=True)
    assert values == task.evaluate(model, quick=True)
    assert 0 < errors["perplexity"] < 0.2 * values["perplexity"]


def test_compare_labels_a_difference_inside_the_error(digits_mlp, digits_task):
    base = wb.measure(digits_mlp, digits_task, quick=True, threads=1, progress=False)
    same = dataclasses.replace(base, quality={"accuracy": base.primary_value - 0.5 * base.primary_error})
    worse = dataclasses.replace(base, quality={"accuracy": base.primary_value - 0.2})
    unknown = dataclasses.replace(base, quality_error={})
    df = wb.compare(base, same, worse, unknown)
    assert list(df.columns[:4]) == ["model", "accuracy", "accuracy_error", "quality_change"]
    change = list(df["quality_change"])
    assert change[0] == "reference"
    assert change[1].startswith("within sampling error")
    assert change[2].startswith("worse by 0.2")
    assert "states no sampling error" in change[3]


def _slower(m, **changes):
    s = Speedup(0.5, 0.45, 0.55, 2.0, 1.0, 20, 1)
    return dataclasses.replace(m, speedup=s, **changes)


def test_slowdown_reasons_in_the_compare_table(digits_mlp, digits_task):
    base = wb.measure(digits_mlp, digits_task, quick=True, threads=1, progress=False)
    # the int2 reference path decodes every weight on every call: measured ~3x slower side by side
    small = wb.apply(digits_mlp, wb.Plan({"*": wb.quant.WeightOnly(bits=2, group_size=16, kernel="reference")}))
    m = wb.measure(small, digits_task, quick=True, threads=1, progress=False, baseline=digits_mlp)
    assert m.speedup.slower, str(m.speedup)
    df = wb.compare(base, m)
    assert df["slowdown_reason"].iloc[0] == ""
    assert "reference path" in df["slowdown_reason"].iloc[1] and "slower" in df["slowdown_reason"].iloc[1]
    # what is said for the other known causes, and when no cause is known
    bf16 = _slower(base, dtypes={"bfloat16": 100}, batch_size=1)
    assert "bf16 layers on a CPU at batch 1" in wb.measurement.slowdown_note(bf16)
    fp16 = _slower(base, dtypes={"float16": 100})
    assert "fp16 layers on a CPU" in wb.measurement.slowdown_note(fp16)
    assert "no known cause" in wb.measurement.slowdown_note(_slower(base))
    # the CPU weight-only kernel at batch 64 (digits-mlp's 64-wide layers: measured 0.54x fp32 on an AVX2 CPU),
    # and fp16 scales of integer codes are not "fp16 layers"
    cpu_path = _slower(base, kernels={"WeightOnlyLinear:cpu": 3}, dtypes={"uint8": 200, "float16": 100})
    note = wb.measurement.slowdown_note(cpu_path)
    assert "CPU weight-only kernel at batch" in note and "fp16 layers" not in note
    assert wb.measurement.slowdown_note(base) == ""
    # measured separately (no baseline=): a slower ratio is still explained, and said to be separate
    apart = dataclasses.replace(m, speedup=None)
    note = wb.compare(base, apart)["slowdown_reason"].iloc[1]
    if apart.latency_ms > 1.03 * base.latency_ms:
        assert "measured separately" in note and "reference path" in note


def test_session_status_line_says_why_a_point_is_slower(digits_mlp, digits_task):
    from workbench.ui.session import Session

    s = Session(digits_mlp, digits_task, threads=1)
    s.set(s.select("*"), wb.quant.WeightOnly(bits=2, group_size=16, kernel="reference"))
    entry = s.apply_and_measure()
    assert entry.speedup.slower, str(entry.speedup)
    assert "reference path" in entry.status and "slower" in entry.status
    assert f"accuracy={entry.quality:.4f} +- " in entry.status
