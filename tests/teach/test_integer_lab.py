"""Lab 14 (integer-only inference): the digits CNN in integers agrees with its fake-quant model to one code,
the tables measure what the lab says, and every exercise check rejects a plausible wrong implementation with
its specific hint while the worked solution passes."""
import functools

import pytest
import torch

import workbench as wb
from workbench.models.architectures import DigitsMLP
from workbench.quantization import integer as I
from workbench.teach import integer as L
from workbench.teach.integer.checks import _solution_rounding_shift


@pytest.fixture(autouse=True)
def _fresh():
    wb.teach.reset()
    wb.teach.use_solutions(False)
    yield
    wb.teach.reset()
    wb.teach.use_solutions(False)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Small integer matmuls run best on one thread (and do not fight the other tests for the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def lab(_one_thread):
    model = wb.models.load("digits-cnn")
    task = wb.tasks.load("digits")
    calibration = torch.cat([b[0] for b in task.calibration(128)])
    x = torch.from_numpy(task.split.x_test[:96])
    y = torch.from_numpy(task.split.y_test[:96])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    net = L.convert(model, calibration)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())     # the model is not changed
    return model, net, calibration, x, y, L.integer_forward(net, x)


def _solved(check, *args):
    """The check run with ``...`` under use_solutions(True): the worked solution's feedback."""
    wb.teach.use_solutions(True)
    try:
        return check(..., *args)
    finally:
        wb.teach.use_solutions(False)


def test_integer_model_matches_fake_quant_to_one_code_and_keeps_accuracy(lab):
    model, net, _, x, y, codes = lab
    lsb = L.layer_lsb_table(net, x, codes)
    assert list(lsb["layer"]) == list(L.LAYERS) and len(L.lsb_figure(lsb).data) == 2
    assert lsb["max_lsb"].max() <= 1 and lsb["differ"].max() < 0.01
    acc = L.accuracy_table(model, net, x, y, codes).set_index("model")
    assert acc.loc["integer-only", "accuracy"] >= acc.loc["fp32", "accuracy"] - 0.02
    assert acc.loc["integer-only", "same_prediction_as_fake_quant"] >= 0.99
    assert acc.loc["integer-only", "logit_sqnr_db"] > 30
    assert len(L.accuracy_figure(acc.reset_index()).data) == 2
    assert codes["fc1"].dtype == torch.int8 and int(codes["fc1"].min()) >= net.layers["fc1"].output_zero_point
    with pytest.raises(TypeError, match="digits-cnn"):
        L.convert(DigitsMLP(), x)


def test_multiplier_and_folding_studies_show_the_failures(lab):
    model, net, calibration, x, y, _ = lab
    mult = L.multiplier_table(net, x, y, bits=(31, 1), samples=48).set_index("variant")
    assert mult.loc["M0 in 31 bits", "max_lsb"] <= 1
    assert mult.loc["M0 in 1 bits", "max_lsb"] > 5                          # a power-of-two multiplier
    assert mult.loc["31 bits, truncating shift", "mean_signed_lsb"] < -0.1    # floor biases outputs down
    fold = L.folding_table(model, calibration, x, y, low_bits=3)
    assert len(L.folding_figure(fold).data) == 3
    fold = fold.set_index(["weights", "variant"])["logit_sqnr_db"]
    assert fold[("int8 per channel", "fold, then quantize")] > fold[("int8 per channel",
                                                                     "no folding: int8 before BatchNorm")]
    assert fold[("int3 per tensor", "fold, then quantize")] > fold[("int3 per tensor", "quantize, then fold")] + 2
    assert len(L.multiplier_figure(mult.reset_index()).data) == 3


def test_check_accumulator(lab):
    _, net, _, _, _, codes = lab
    q_x = L.layer_input(codes, "fc2")[:8]
    z_x = net.layers["fc2"].input_zero_point
    q_w, z_w = L.asymmetric_weights(net, "fc2")
    assert z_w != 0 and q_w.dtype == torch.uint8
    qx, qw = q_x.long(), q_w.long()
    missing = qx @ qw.T - z_w * qx.sum(1, keepdim=True) - z_x * qw.sum(1)     # forgot + K z_x z_w
    fb = L.check_accumulator(missing, q_x, z_x, q_w, z_w)
    assert fb.status == "failed" and "K z_x z_w term is missing" in fb.hint
    assert "raw codes" in L.check_accumulator(qx @ qw.T, q_x, z_x, q_w, z_w).hint
    assert _solved(L.check_accumulator, q_x, z_x, q_w, z_w).passed


def test_check_offset(lab):
    _, net, _, _, _, _ = lab
    q_w, z_w = L.asymmetric_weights(net, "fc2")
    z_x = net.layers["fc2"].input_zero_point
    fb = L.check_offset(-z_x * q_w.long().sum(1), q_w, z_x, z_w)
    assert fb.status == "failed" and "precomputed too" in fb.hint
    assert _solved(L.check_offset, q_w, z_x, z_w).passed


def test_check_int32_bias(lab):
    layer = lab[1].layers["conv2"]
    args = (layer.bias_float, layer.input_scale, layer.weight_scale, layer.output_scale)
    truncated = (layer.bias_float.double() / (layer.input_scale * layer.weight_scale.double())).to(torch.int32)
    fb = L.check_int32_bias(truncated, *args)
    assert fb.status == "failed" and "truncates" in fb.hint
    at_output = torch.round(layer.bias_float / layer.output_scale)
    assert "output's scale" in L.check_int32_bias(at_output, *args).hint
    assert _solved(L.check_int32_bias, *args).passed


def test_check_multiplier(lab):
    layer = lab[1].layers["conv2"]
    s_x, s_w, s_y = layer.input_scale, layer.weight_scale, layer.output_scale
    fb = L.check_multiplier(s_y / (s_x * s_w), s_x, s_w, s_y)
    assert fb.status == "failed" and "upside down" in fb.hint
    assert _solved(L.check_multiplier, s_x, s_w, s_y).passed


def test_check_quantize_multiplier():
    m = torch.tensor([3.1e-3, 0.0123, 0.49, 1 - 2.0 ** -40], dtype=torch.float64) * (1 + 1e-9)
    m[-1] = 1 - 2.0 ** -40
    mantissa, exponent = torch.frexp(m.double())
    truncated = (torch.trunc(mantissa * 2 ** 31).long(), 31 - exponent.long())
    fb = L.check_quantize_multiplier(truncated, m)
    assert fb.status == "failed" and "round the mantissa" in fb.hint
    no_fraction_bits = (torch.round(mantissa * 2 ** 31).long(), -exponent.long())
    assert "31 fraction bits" in L.check_quantize_multiplier(no_fraction_bits, m).hint
    assert _solved(L.check_quantize_multiplier, m).passed                     # the carry case included


def test_check_rounding_shift():
    x = torch.tensor([-12, -10, -7, -6, -5, -2, 0, 2, 5, 6, 7, 10, 12])
    fb = L.check_rounding_shift(x >> 2, x, 2)
    assert fb.status == "failed" and "floor" in fb.hint
    half_up = (x + 2) >> 2
    assert "away from zero" in L.check_rounding_shift(half_up, x, 2).hint
    assert _solved(L.check_rounding_shift, x, 2).passed
    assert L.check_rounding_shift(I.rounding_right_shift(x, 2), x, 2).passed


def test_check_requantize_relu(lab):
    _, net, _, _, _, codes = lab
    fc1 = net.layers["fc1"]
    acc = L.accumulator(net, "fc1", L.layer_input(codes, "fc1")[:16])
    args = (acc, fc1.multiplier, fc1.shift, fc1.output_zero_point)
    scaled = I.multiply_by_quantized_multiplier(acc, fc1.multiplier, fc1.shift)
    at_zero = (scaled + fc1.output_zero_point).clamp(0, 127).to(torch.int8)        # ReLU clamped at code 0
    fb = L.check_requantize_relu(at_zero, *args)
    assert fb.status == "failed" and "code of real 0" in fb.hint
    assert _solved(L.check_requantize_relu, *args).passed


def test_check_fold_bn(lab):
    model = lab[0]
    conv, bn = model.conv2, model.bn2
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        s = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        no_mean = (conv.weight * s.reshape(-1, 1, 1, 1), conv.bias * s + bn.bias)
    fb = L.check_fold_bn(no_mean, conv, bn)
    assert fb.status == "failed" and "running mean" in fb.hint
    assert _solved(L.check_fold_bn, conv, bn).passed
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())    # the model is left as it was


def test_check_integer_linear(lab):
    _, net, _, _, _, codes = lab
    q_in = L.layer_input(codes, "fc1")[:16]
    ex = L.linear_exercise(net, "fc1")
    acc = q_in.int() @ ex.weight.int().T + ex.bias_int32                      # forgot to subtract z_x
    wrong = I.requantize(acc, ex.multiplier, ex.shift, ex.output_zero_point, ex.output_zero_point, 127)
    fb = L.check_integer_linear(wrong, q_in, net, "fc1")
    assert fb.status == "failed" and "input zero point" in fb.hint
    assert _solved(L.check_integer_linear, q_in, net, "fc1").passed
    assert L.check_integer_linear(codes["fc1"][:16], q_in, net, "fc1").passed


def test_solution_sources_read_as_a_learner_writes_them():
    src = wb.teach.solution_source(_solution_rounding_shift)
    assert src.endswith("answer = torch.where(x < 0, -magnitude, magnitude)")
    fb = L.check_rounding_shift(torch.zeros(3, dtype=torch.long), torch.tensor([5, -5, 6]), 2)
    assert "Show solution" in fb._repr_html_()
    assert functools.partial                                                    # (imported for the partials above)
