"""Lesson 13 (wb.teach.qat): the STE helpers agree with the package, `train_with_curve` trains exactly as
`fit_classifier`, the exercise checks name typical mistakes, and the figures build."""
import copy

import pytest
import torch

import workbench as wb

T = wb.teach.qat
X = torch.tensor([-1.3, -0.6, -0.2, 0.1, 0.3, 0.7, 1.2])


def test_fake_quantize_and_ste_gradient_on_a_2_bit_grid():
    assert T.fake_quantize(X, 0.5, 2).tolist() == [-1.0, -0.5, 0.0, 0.0, 0.5, 0.5, 0.5]
    # clamped where round(x / s) leaves [-2, 1]: -1.3 (code -3) and 1.2 (code 2); 0.7 rounds to code 1
    assert T.ste_gradient(X, 0.5, 2).tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert T.fake_quantize(torch.tensor([0.3]), 0.1, 8).item() == pytest.approx(0.3)


def test_ste_curve_and_figure():
    curve = T.ste_curve(bits=2, scale=0.5, n=401)
    assert list(curve.columns) == ["x", "fake", "grad"] and len(curve) == 401
    assert set(curve["fake"].round(6)) == {-1.0, -0.5, 0.0, 0.5}
    assert set(curve["grad"]) == {0.0, 1.0}
    inside = curve[(curve["x"] > -1.2) & (curve["x"] < 0.7)]
    assert (inside["grad"] == 1.0).all()
    fig = T.ste_figure(curve, bits=2, scale=0.5)
    assert [t.name for t in fig.data] == ["identity", "int2 grid, scale 0.5", "STE gradient",
                                         "true derivative of round()"]
    assert fig.layout.xaxis.title.text == "x" and fig.layout.yaxis2.title.text == "gradient"
    assert len(fig.layout.shapes) == 4   # the clamped regions, on both panels


@pytest.fixture(scope="module")
def digits():
    return wb.models.load("digits-cnn"), wb.tasks.load("digits")


def test_train_with_curve_is_fit_classifier(digits):
    model, task = digits
    plan = T.qat_plan(["conv*", "fc*"], 2)
    a, b = wb.qat.prepare(model, plan), wb.qat.prepare(model, plan)
    history = wb.training.fit_classifier(a, task, epochs=1, lr=1e-3, progress=False)
    curve = T.train_with_curve(b, task, epochs=1, lr=1e-3, eval_every=5)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert sum(curve.loss) / len(curve.loss) == pytest.approx(history[0], rel=0.05)  # per-batch vs per-sample mean
    assert curve.steps_per_epoch == len(curve.loss) == 20
    assert curve.eval_steps == [0, 5, 10, 15, 20] and len(curve.accuracy) == 5
    ptq = task.evaluate(wb.apply(model, plan, progress=False))["accuracy"]
    assert curve.accuracy[0] == pytest.approx(ptq, abs=2 / 540)   # step 0 is the PTQ model (fake == real)
    assert not b.training
    fig = T.curves_figure([curve], fp32=0.996, ptq=ptq)
    assert len(fig.data) == 2 and fig.layout.yaxis.type == "log" and fig.layout.xaxis2.title.text == "epoch"


def test_ptq_vs_qat_and_bits_figure(digits):
    model, task = digits
    table = T.ptq_vs_qat(model, task, ["conv*", "fc*"], [2], epochs=1, lr=1e-3)
    assert list(table.columns) == ["bits", "fp32", "ptq", "qat", "lsq", "size_ratio"]
    row = table.iloc[0]
    assert row["ptq"] < row["fp32"] - 0.1 and row["qat"] > row["ptq"] + 0.1 and row["lsq"] > row["ptq"] + 0.1
    assert row["size_ratio"] < 0.1
    fig = T.bits_figure(table)
    assert [t.name for t in fig.data] == ["PTQ (RTN)", "QAT (STE)", "QAT + LSQ"] and list(fig.data[0].x) == ["int2"]


def test_lsq_scales_and_zero_gradient_fraction(digits):
    model, task = digits
    plan = T.qat_plan(["conv*", "fc*"], 2)
    ste = wb.qat.prepare(model, plan)
    with pytest.raises(ValueError, match="learnable_scales=True"):
        T.lsq_scales(ste.conv2)
    lsq = wb.qat.prepare(model, plan, learnable_scales=True)
    scales = T.lsq_scales(lsq.conv2)
    assert len(scales) == 64
    # before training the learned scales start at min-max (up to fp32 rounding)
    torch.testing.assert_close(torch.tensor(scales["learned_scale"].to_numpy()),
                               torch.tensor(scales["minmax_scale"].to_numpy()))
    with torch.no_grad():
        lsq.conv2.weight_scale.mul_(0.5)       # a smaller step clamps more weights
    before = T.zero_gradient_fraction(ste.conv2)
    after = T.zero_gradient_fraction(lsq.conv2)
    assert 0.0 <= before < 0.05 < after < 1.0
    assert lsq.conv2.weight.grad is None     # the probe works on a copy
    fig = T.lsq_scales_figure(T.lsq_scales(lsq.conv2))
    assert len(fig.data) == 2 and "100%" in fig.layout.title.text


# --- exercise checks -------------------------------------------------------------------------------------------

def test_fake_quantize_check():
    right = (X / 0.5).round().clamp(-2, 1) * 0.5
    assert T.check_fake_quantize(right, X, 0.5, bits=2).passed
    assert T.check_fake_quantize(..., X, 0.5, bits=2).status == "not attempted"
    fb = T.check_fake_quantize((X / 0.5).round() * 0.5, X, 0.5, bits=2)
    assert fb.status == "failed" and "clamped" in fb.hint and "values differ" in fb.message
    assert "integer codes" in T.check_fake_quantize((X / 0.5).round().clamp(-2, 1), X, 0.5, bits=2).hint
    assert "floor" in T.check_fake_quantize((X / 0.5).floor().clamp(-2, 1) * 0.5, X, 0.5, bits=2).hint
    assert "[-2, 1]" in T.check_fake_quantize((X / 0.5).round().clamp(-1, 1) * 0.5, X, 0.5, bits=2).hint


def test_ste_gradient_check():
    codes = (X / 0.5).round()
    assert T.check_ste_gradient(((codes >= -2) & (codes <= 1)).float(), X, 0.5, bits=2).passed
    assert "not every value" in T.check_ste_gradient(torch.ones(7), X, 0.5, bits=2).hint
    assert "derivative 0" in T.check_ste_gradient(torch.zeros(7), X, 0.5, bits=2).hint
    xs = X / 0.5
    fb = T.check_ste_gradient(((xs >= -2) & (xs <= 1)).float(), X, 0.5, bits=2)   # clamps before rounding
    assert fb.status == "failed" and "rounded" in fb.hint
    assert "shape (7,)" in T.check_ste_gradient(torch.ones(3), X, 0.5, bits=2).message


def test_recovered_check():
    assert T.check_recovered(0.75, fp32=1.0, ptq=0.6, qat=0.9).passed
    assert T.check_recovered(torch.tensor(0.75), fp32=1.0, ptq=0.6, qat=0.9).passed
    assert "divide it by what PTQ lost" in T.check_recovered(0.3, fp32=1.0, ptq=0.6, qat=0.9).hint
    assert "relative to fp32" in T.check_recovered(0.9, fp32=1.0, ptq=0.6, qat=0.9).hint
    assert "not a percentage" in T.check_recovered(75.0, fp32=1.0, ptq=0.6, qat=0.9).hint
    assert T.check_recovered(..., fp32=1.0, ptq=0.6, qat=0.9).status == "not attempted"


def test_checks_are_counted_in_the_summary():
    wb.teach.reset()
    T.check_recovered(0.75, fp32=1.0, ptq=0.6, qat=0.9)
    T.check_ste_gradient(torch.ones(7), X, 0.5, bits=2)
    assert wb.teach.summary() == {"exercises": 2, "passed": 1, "failed": 1, "not_attempted": 0}
    wb.teach.reset()


def test_train_with_curve_leaves_other_models_alone(digits):
    model, task = digits
    before = copy.deepcopy(model.state_dict())
    qm = wb.qat.prepare(model, T.qat_plan(["fc*"], 4))
    T.train_with_curve(qm, task, epochs=1, lr=1e-3, eval_every=100)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
