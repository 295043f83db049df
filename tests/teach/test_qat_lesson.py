"""Lesson 13 (wb.teach.qat): the STE helpers agree with the package, `train_with_curve` trains exactly as
`fit_classifier`, the exercise checks name typical mistakes, and the figures build."""
import copy
import math

import pytest
import torch

import workbench as wb
from workbench.quantization.primitives import fp16_scale

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

XS = [-2.0, -1.6, -0.6, -0.2, 0.1, 0.4, 0.7, 1.0, 1.2]     # the lesson's x: codes clamped at both ends
UPSTREAM = torch.tensor([0.8, -1.1, 0.3, 1.7, -0.4, 0.9, -1.6, 0.6, 1.3])


def _leaf():
    return torch.tensor(XS, requires_grad=True)


def _ste(x, s=0.3, z=1, qmin=-4, qmax=3):
    """A right implementation, written differently from the worked solution: a custom autograd function."""
    class Round(torch.autograd.Function):
        @staticmethod
        def forward(ctx, u):
            return u.round()

        @staticmethod
        def backward(ctx, g):
            return g

    return (torch.clamp(Round.apply(x / s) + z, qmin, qmax) - z) * s


def test_ste_reference_is_the_package_forward_and_backward():
    values, grad = T.ste_reference(_leaf(), 0.3, 1, 3)
    assert values.tolist() == pytest.approx([-1.5, -1.5, -0.6, -0.3, 0.0, 0.3, 0.6, 0.6, 0.6])
    # codes round(x / 0.3) + 1: -6 and -4 (-1.6 rounds onto the grid), ..., 3 (0.7 rounds onto it), 4 and 5
    assert grad.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def test_ste_fake_quantize_check_passes_a_right_implementation_and_checks_the_gradient():
    x = _leaf()
    assert T.check_ste_fake_quantize(_ste(x), x, 0.3, 1, bits=3).passed
    assert T.check_ste_fake_quantize(_ste(x), x, 0.3, 1, bits=3).passed        # the graph is kept for a re-run
    assert T.check_ste_fake_quantize(..., x, 0.3, 1, bits=3).status == "not attempted"
    u = x / 0.3
    plain = ((u.round() + 1).clamp(-4, 3) - 1) * 0.3                         # right values, round()'s zero gradient
    fb = T.check_ste_fake_quantize(plain, x, 0.3, 1, bits=3)
    assert fb.status == "failed" and "derivative is 0" in fb.hint and "item 1" in fb.message
    whole = x + (plain - x).detach()                                           # the STE around the clamp too
    assert "every value got a gradient" in T.check_ste_fake_quantize(whole, x, 0.3, 1, bits=3).hint
    v = (u + 1).clamp(-4, 3)
    clamp_first = (v + (v.round() - v).detach() - 1) * 0.3                     # clamps before it rounds
    fb = T.check_ste_fake_quantize(clamp_first, x, 0.3, 1, bits=3)
    assert fb.status == "failed" and "*rounded* code" in fb.hint
    assert "no gradient" in T.check_ste_fake_quantize(_ste(x).detach(), x, 0.3, 1, bits=3).hint
    with torch.no_grad():
        assert "no gradient" in T.check_ste_fake_quantize(_ste(x), x, 0.3, 1, bits=3).hint


def test_ste_fake_quantize_check_names_forward_slips():
    x = _leaf()
    r = x / 0.3 + (torch.round(x / 0.3) - x / 0.3).detach()
    no_zero = r.clamp(-4, 3) * 0.3
    fb = T.check_ste_fake_quantize(no_zero, x, 0.3, 1, bits=3)
    assert fb.status == "failed" and "zero point is missing" in fb.hint and "item 0" in fb.message
    assert "subtract the zero point" in T.check_ste_fake_quantize((r + 1).clamp(-4, 3) * 0.3, x, 0.3, 1, 3).hint
    assert "top code" in T.check_ste_fake_quantize(((r + 1).clamp(-4, 4) - 1) * 0.3, x, 0.3, 1, 3).hint
    assert "unsigned" in T.check_ste_fake_quantize(((r + 1).clamp(0, 7) - 1) * 0.3, x, 0.3, 1, 3).hint
    assert "one more negative code" in T.check_ste_fake_quantize(((r + 1).clamp(-3, 3) - 1) * 0.3, x, 0.3, 1, 3).hint
    assert "clamped" in T.check_ste_fake_quantize(r * 0.3, x, 0.3, 1, 3).hint
    assert "a tensor like x" in T.check_ste_fake_quantize([0.0] * 9, x, 0.3, 1, 3).hint
    with pytest.raises(ValueError, match="requires grad"):
        T.check_ste_fake_quantize(no_zero, torch.tensor(XS), 0.3, 1, 3)


def _lsq_by_hand(x, s, z, qmin, qmax, upstream, *, scale_gradient=True, code_constant=False, clamp=True):
    u = x.detach() / s
    code = u.round() + z
    inside = (code >= qmin) & (code <= qmax) if clamp else torch.ones_like(code, dtype=torch.bool)
    d = (u.round() if code_constant else u.round() - u).where(inside, code.clamp(qmin, qmax) - z)
    g = 1 / math.sqrt(x.numel() * qmax) if scale_gradient else 1.0
    return float((upstream * d).sum() * g)


def test_lsq_step_gradient_is_autograd_through_the_package_lsq_layer():
    """The helper is what a QAT layer with learnable_scales computes: the same gradient reaches its scale."""
    torch.manual_seed(0)
    layer = wb.qat.prepare(torch.nn.Sequential(torch.nn.Linear(16, 1, bias=False)),
                           T.qat_plan(["0"], 3, symmetric=True), learnable_scales=True)[0]
    w = layer.weight.detach()[0]
    s = float(fp16_scale(layer.weight_scale.detach().abs() + 1e-12)[0, 0])     # the grid it trains on
    up = torch.randn(16)
    (layer.fake_weight()[0] * up).sum().backward()
    expected = T.lsq_step_gradient(w, s, 0, 3, up)
    assert float(layer.weight_scale.grad[0, 0]) == pytest.approx(expected, rel=1e-5)
    assert _lsq_by_hand(w, s, 0, -4, 3, up) == pytest.approx(expected, rel=1e-4)   # float32 either way


def test_lsq_step_gradient_check():
    x = torch.tensor(XS)
    right = _lsq_by_hand(x, 0.3, 1, -4, 3, UPSTREAM)
    assert T.check_lsq_step_gradient(right, x, 0.3, 1, 3, UPSTREAM).passed
    assert T.check_lsq_step_gradient(torch.tensor(right), x, 0.3, 1, 3, UPSTREAM).passed
    assert T.check_lsq_step_gradient(..., x, 0.3, 1, 3, UPSTREAM).status == "not attempted"
    fb = T.check_lsq_step_gradient(_lsq_by_hand(x, 0.3, 1, -4, 3, UPSTREAM, scale_gradient=False),
                                   x, 0.3, 1, 3, UPSTREAM)
    assert fb.status == "failed" and "before LSQ's scaling" in fb.hint and "expected" in fb.message
    constant = _lsq_by_hand(x, 0.3, 1, -4, 3, UPSTREAM, code_constant=True)
    assert "moves with s too" in T.check_lsq_step_gradient(constant, x, 0.3, 1, 3, UPSTREAM).hint
    unclamped = _lsq_by_hand(x, 0.3, 1, -4, 3, UPSTREAM, clamp=False)
    assert "clamped values count differently" in T.check_lsq_step_gradient(unclamped, x, 0.3, 1, 3, UPSTREAM).hint
    u = x / 0.3
    code = u.round() + 1
    ends_without_zero = (u.round() - u).where((code >= -4) & (code <= 3), code.clamp(-4, 3))
    fb = T.check_lsq_step_gradient(float((UPSTREAM * ends_without_zero).sum() / math.sqrt(27)), x, 0.3, 1, 3, UPSTREAM)
    assert "minus the zero point" in fb.hint
    assert "sign is flipped" in T.check_lsq_step_gradient(-right, x, 0.3, 1, 3, UPSTREAM).hint


def test_code_usage_check():
    torch.manual_seed(0)
    w = torch.randn(16, 8, 3, 3)
    usage = T.code_usage(w, 2, symmetric=True)
    assert T.check_code_usage([usage[c] for c in (-2, -1, 0, 1)], w, 2).passed
    rows = w.reshape(16, -1)
    s = rows.abs().amax(dim=1, keepdim=True) / 1.5

    def counts(codes):
        return [int((codes == c).sum()) for c in (-2, -1, 0, 1)]

    assert T.check_code_usage(torch.tensor(counts((rows / s).round().clamp(-2, 1))), w, 2).passed
    fb = T.check_code_usage(counts((rows / (rows.abs().max() / 1.5)).round().clamp(-2, 1)), w, 2)
    assert fb.status == "failed" and "whole tensor" in fb.hint and "expected" in fb.message
    narrow = counts((rows / (rows.abs().amax(dim=1, keepdim=True) / 1)).round().clamp(-2, 1))
    assert "(qmax - qmin) / 2 = 1.5" in T.check_code_usage(narrow, w, 2).hint
    assert "must be clamped" in T.check_code_usage(counts((rows / s).round()), w, 2).hint
    per_input = w.abs().amax(dim=(0, 2, 3), keepdim=True) / 1.5
    assert "*input* channel" in T.check_code_usage(counts((w / per_input).round().clamp(-2, 1)), w, 2).hint
    assert T.check_code_usage(..., w, 2).status == "not attempted"


def test_checks_are_counted_in_the_summary():
    wb.teach.reset()
    x = _leaf()
    T.check_ste_fake_quantize(_ste(x), x, 0.3, 1, bits=3)
    T.check_lsq_step_gradient(0.0, torch.tensor(XS), 0.3, 1, 3, UPSTREAM)
    assert wb.teach.summary() == {"exercises": 2, "passed": 1, "failed": 1, "not_attempted": 0}
    wb.teach.reset()


def test_train_with_curve_leaves_other_models_alone(digits):
    model, task = digits
    before = copy.deepcopy(model.state_dict())
    qm = wb.qat.prepare(model, T.qat_plan(["fc*"], 4))
    T.train_with_curve(qm, task, epochs=1, lr=1e-3, eval_every=100)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
