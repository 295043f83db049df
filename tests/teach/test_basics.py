"""Lesson 11 (quantization basics): bytes measured from the stored format, error vs granularity / symmetry /
clipping, observers and calibration tables, the exercise checks (right answers pass, typical mistakes get a
specific hint) and the figures."""
import math

import pytest
import torch

import workbench as wb
from workbench.quantization import primitives as P
from workbench.teach import basics as B


@pytest.fixture(autouse=True)
def _fresh_results():
    wb.teach.reset()
    yield
    wb.teach.reset()


@pytest.fixture
def w():
    """A (32, 256) weight whose largest values sit in two rows (as in real layers with outlier channels)."""
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    w[3, 7], w[20, 100] = 2.0, -1.5
    return w


def one_sided(n=20000, seed=0):
    """GELU-like activations: nothing below -0.17, a long positive tail and a few outliers."""
    x = torch.nn.functional.gelu(torch.randn(n, generator=torch.Generator().manual_seed(seed)))
    x[:2] = torch.tensor([10.0, 9.0])
    return x


def test_bytes_per_weight_is_measured_from_the_stored_tensors(w):
    assert B.bytes_per_weight(w, 4, P.PerGroup(64)) == 4 / 8 + 2 / 64
    assert B.bytes_per_weight(w, 4, P.PerGroup(64), symmetric=False) == 4 / 8 + 3 / 64   # + uint8 zero point
    assert B.bytes_per_weight(w, 8, P.PerChannel(0)) == 1 + 2 / 256
    assert B.bytes_per_weight(w, 3, P.PerGroup(32)) == 4 / 8 + 2 / 32                    # 3 bits in 4-bit slots
    assert B.bytes_per_weight(w, 4, P.PerTensor()) == pytest.approx(0.5, abs=1e-3)
    with pytest.raises(ValueError, match="output channel"):
        B.bytes_per_weight(w, 8, P.PerChannel(1))


def test_granularity_table(w):
    t = B.granularity_table(w, bits=(8, 4), group_sizes=(16, 64, 100))          # 100 does not divide 256: skipped
    assert list(t["granularity"][t["bits"] == 4]) == ["per-tensor", "per-channel", "g16", "g64"]
    sq = t.set_index(["bits", "granularity"])["sqnr_db"]
    for b in (8, 4):
        assert sq[b, "per-tensor"] < sq[b, "per-channel"] < sq[b, "g64"] < sq[b, "g16"]
    assert sq[8, "g64"] > sq[4, "g64"] + 15                                        # ~6 dB per bit
    row = t[(t["bits"] == 4) & (t["granularity"] == "per-tensor")].iloc[0]
    assert row["sqnr_db"] == pytest.approx(P.sqnr(w, P.fake_quantize(w, 4, P.PerTensor())))
    assert row["values_per_scale"] == w.numel()


def test_symmetry_table_on_one_sided_values():
    x = one_sided()
    t = B.symmetry_table({"a": x}, bits=(8,)).set_index("scheme")
    assert t.loc["asymmetric", "sqnr_db"] > t.loc["symmetric", "sqnr_db"] + 4      # about one bit better
    assert t.loc["asymmetric", "codes_used"] > t.loc["symmetric", "codes_used"]
    assert t.loc["symmetric", "codes_used"] <= 129                                   # the negative half is unused


def test_clipping_curve_and_observers():
    x = one_sided()
    assert B.clip_mse(x, float(x.abs().max()), bits=6) == pytest.approx(
        B.mse(x, P.fake_quantize(x, 6, P.PerTensor())), rel=1e-6)                   # no clipping = min-max
    curve = B.clipping_curve(x, bits=6, points=40)
    assert list(curve.columns) == ["threshold", "mse", "clipped"]
    assert curve["threshold"].iloc[-1] == pytest.approx(float(x.abs().max()))
    assert curve["clipped"].iloc[-1] == 0 and curve["clipped"].iloc[0] > 0
    assert curve["mse"].min() < curve["mse"].iloc[-1] / 2                          # clipping the outliers pays
    samples = [x[:10000], x[10000:]]
    obs = B.observer_table(samples, x, bits=6)
    assert list(obs["observer"]) == list(B.OBSERVER_LABELS)
    assert list(obs["key"]) == ["minmax", "p99_9", "p99_99", "mse", "kl"]
    by = obs.set_index("observer")
    assert by.loc["min-max", "threshold"] == pytest.approx(float(x.abs().max()), rel=1e-5)
    assert by.loc["MSE", "mse"] < by.loc["min-max", "mse"]
    assert by.loc["percentile 99.9", "threshold"] < by.loc["percentile 99.99", "threshold"]
    with pytest.raises(ValueError, match="unknown observer"):
        B.fit_observer("median", samples)


def test_calibration_table():
    x = one_sided()
    pool = list(x.reshape(20, -1))
    t = B.calibration_table(pool, x, sizes=[1, 4, 20], labels=("min-max", "MSE"), repeats=2)
    assert len(t) == 3 * 2 * 2 and set(t["key"]) == {"minmax", "mse"}
    full = t[(t["samples"] == 20) & (t["observer"] == "min-max")]
    assert full["threshold"].nunique() == 1                                        # every draw is the whole pool
    again = B.calibration_table(pool, x, sizes=[1, 4, 20], labels=("min-max", "MSE"), repeats=2)
    assert t.equals(again)                                                          # seeded draws
    with pytest.raises(ValueError, match="outside 1..20"):
        B.calibration_table(pool, x, sizes=[21])


V11 = torch.tensor([-0.17, -0.05, 0.0, 0.12, 0.31, 0.58, 0.9, 2.4])   # the lesson's held-out values
LO, HI = -0.1, 0.59                                                     # its calibrated range


def _quantizer(v, lo, hi, qmin=0, qmax=15, *, steps=None, zero=None, clamp=True):
    """An asymmetric quantizer as a learner writes it; the keywords make its plausible slips."""
    s = (hi - lo) / (steps or qmax - qmin)
    z = qmin - round(lo / s) if zero is None else zero(lo, s)
    codes = torch.round(v / s) + z
    codes = codes.clamp(qmin, qmax) if clamp else codes
    return codes, (codes - z) * s


def test_check_asymmetric_quantizer_passes_the_package_grid():
    codes, x_hat = _quantizer(V11, LO, HI)
    assert B.check_asymmetric_quantizer((codes, x_hat), V11, LO, HI).passed
    assert B.check_asymmetric_quantizer([codes.to(torch.uint8), x_hat], V11, LO, HI).passed      # any integer dtype
    assert codes.tolist() == [0, 1, 2, 5, 9, 15, 15, 15]                 # clipped at both ends
    assert x_hat[2].item() == 0.0 and x_hat.min().item() == pytest.approx(-0.092)   # 0 exact; lo = -0.1 is not
    assert B.check_asymmetric_quantizer(..., V11, LO, HI).status == "not attempted"


def test_check_asymmetric_quantizer_names_plausible_wrong_implementations():
    fb = B.check_asymmetric_quantizer(_quantizer(V11, LO, HI, clamp=False), V11, LO, HI)
    assert fb.status == "failed" and "must be clipped" in fb.hint and "item 0" in fb.message
    assert "16 codes have 15 steps" in B.check_asymmetric_quantizer(_quantizer(V11, LO, HI, steps=16), V11, LO, HI).hint
    flipped = _quantizer(V11, LO, HI, zero=lambda lo, s: round(lo / s))
    assert "zero point's sign" in B.check_asymmetric_quantizer(flipped, V11, LO, HI).hint
    unrounded = _quantizer(V11, LO, HI, zero=lambda lo, s: -lo / s)
    assert "must be an integer" in B.check_asymmetric_quantizer(unrounded, V11, LO, HI).hint
    signed = _quantizer(V11, LO, HI, qmin=-8, qmax=7)                   # right values, signed codes
    assert "signed codes" in B.check_asymmetric_quantizer(signed, V11, LO, HI).hint
    codes, _ = _quantizer(V11, LO, HI)
    s = (HI - LO) / 15
    assert "subtract z" in B.check_asymmetric_quantizer((codes, codes * s), V11, LO, HI).hint
    assert "not the code" in B.check_asymmetric_quantizer((codes, codes), V11, LO, HI).hint
    own = _quantizer(V11, float(V11.min()), float(V11.max()))            # v's own min-max, not the calibration
    assert "calibrated in advance" in B.check_asymmetric_quantizer(own, V11, LO, HI).hint
    fb = B.check_asymmetric_quantizer(_quantizer(V11, LO, HI)[1], V11, LO, HI)
    assert fb.status == "failed" and "return the pair" in fb.hint


def test_check_best_clipping():
    curve = B.clipping_curve(one_sided(), points=30)
    best = curve["threshold"][curve["mse"].idxmin()]
    assert B.check_best_clipping(best, curve).passed
    assert B.check_best_clipping(best * 1.01, curve).passed                          # within one grid step
    assert "no clipping" in B.check_best_clipping(curve["threshold"].iloc[-1], curve).hint
    assert "smallest MSE itself" in B.check_best_clipping(curve["mse"].min(), curve).hint


def test_check_codes_used():
    x = one_sided()
    q, _, _ = P.quantize_affine(x, 8, P.PerTensor(), symmetric=True)
    qa, _, _ = P.quantize_affine(x, 8, P.PerTensor(), symmetric=False)
    assert B.check_codes_used(q.unique().numel(), x).passed
    assert "asymmetric" in B.check_codes_used(qa.unique().numel(), x).hint
    assert "every code" in B.check_codes_used(256, x).hint
    assert wb.teach.summary()["exercises"] == 1


def test_figures_build(w):
    t = B.granularity_table(w, bits=(8, 4), group_sizes=(16, 64))
    fig = B.granularity_figure(t)
    assert len(fig.data) == 4 and {tr.name for tr in fig.data} == {"int8", "int4"}
    assert fig.layout.xaxis.type == "log" and "bytes per weight" in fig.layout.xaxis2.title.text
    fig = B.symmetry_figure(B.symmetry_table({"a": one_sided()}))
    assert [tr.name for tr in fig.data] == ["symmetric", "asymmetric"] and len(fig.data[0].x) == 2
    x = one_sided()
    curve = B.clipping_curve(x, points=20)
    obs = B.observer_table([x], x, labels=("min-max", "MSE"))
    fig = B.clipping_figure(curve, obs)
    assert [tr.name for tr in fig.data][1:] == ["min-max", "MSE"]
    assert fig.layout.xaxis.type == "log" and "MSE" in fig.layout.yaxis.title.text
    calib = B.calibration_table(list(x.reshape(4, -1)), x, sizes=[1, 2], labels=("min-max",), repeats=2)
    fig = B.calibration_figure(calib)
    assert len(fig.data) == 4 and math.isclose(max(fig.data[1].x), 2)              # band + line per panel
