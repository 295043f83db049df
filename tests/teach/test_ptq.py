"""Lesson 12 (wb.teach.ptq): the GPTQ step-through is the package's GPTQ, the AWQ grid is the package's search,
the exercise checks accept the right answer and name typical mistakes, and the figures build."""
import pytest
import torch

import workbench as wb
from workbench.quantization import formats as fm
from workbench.quantization.awq import awq_search
from workbench.quantization.gptq import gptq_quantize
from workbench.quantization.smoothquant import activation_absmax, smoothing_factors
from workbench.teach.ptq.checks import _alpha_search

P = wb.teach.ptq
LAYER = "h.1.mlp.c_fc"   # tiny-lm: 192 -> 768


@pytest.fixture(scope="module")
def lm():
    return wb.models.load("tiny-lm")


@pytest.fixture(scope="module")
def lm_task():
    return wb.tasks.load("tiny-lm")


@pytest.fixture(scope="module")
def layer_data(lm, lm_task):
    X = P.layer_inputs(lm, LAYER, lm_task.calibration(4))
    X_held = P.layer_inputs(lm, LAYER, [lm_task.example_inputs(2)])
    return lm.get_submodule(LAYER), X, X_held


def test_layer_inputs_are_the_layers_inputs(lm, lm_task, layer_data):
    linear, X, _ = layer_data
    assert X.shape == (4 * 128, 192) and X.dtype == torch.float32
    assert P.layer_inputs(lm, LAYER, lm_task.calibration(4), max_tokens=100).shape == (100, 192)
    with pytest.raises(AttributeError):
        P.layer_inputs(lm, "h.1.nothing", lm_task.calibration(1))
    assert lm.training is False


@pytest.mark.parametrize("bits, group_size", [(4, 64), (3, 64), (4, None)])
def test_gptq_trace_ends_on_the_package_result(layer_data, bits, group_size):
    linear, X, _ = layer_data
    W = linear.weight.detach()
    fmt = fm.IntFormat(bits, group_size)
    trace = P.gptq_trace(W, X, bits=bits, group_size=group_size, block_size=128, every=16, rows=8)
    package = fm.decode(gptq_quantize(W, [(X,)], fmt), fmt, W.shape[1])
    assert torch.equal(trace.weight, package)
    assert torch.equal(trace.rtn_weight, fm.decode(fm.encode(W, fmt), fmt, W.shape[1]))
    assert trace.columns[0] == 0 and trace.columns[-1] == W.shape[1] and trace.gptq_error[0] == 0.0
    # the recorded end points are the true relative output errors of the final weights
    assert trace.gptq_error[-1] == pytest.approx(P.relative_output_error(X, W, package), rel=1e-4)
    assert trace.rtn_error[-1] == pytest.approx(P.relative_output_error(X, W, trace.rtn_weight), rel=1e-4)
    assert trace.gptq_error[-1] < 0.6 * trace.rtn_error[-1]
    # RTN's partial error only grows; the heatmap frames start at zero and end on the final change
    assert all(b >= a - 1e-12 for a, b in zip(trace.rtn_error[:-1], trace.rtn_error[1:], strict=True))
    assert trace.updates[0].abs().max() == 0 and trace.updates[-1].shape == (8, W.shape[1])
    torch.testing.assert_close(trace.updates[-1], (package - W)[:8], rtol=0, atol=1e-6)
    df = trace.to_frame()
    assert list(df.columns) == ["columns quantized", "rtn", "gptq"] and len(df) == len(trace.columns)


def test_gptq_trace_refuses_a_group_size_that_does_not_divide(layer_data):
    linear, X, _ = layer_data
    with pytest.raises(ValueError, match="does not divide"):
        P.gptq_trace(linear.weight, X, group_size=50)


def test_awq_grid_is_the_package_search(layer_data):
    linear, X, _ = layer_data
    table, x_mean, s = P.awq_grid(linear.weight, X, bits=3, group_size=64)
    _, package_s, package_alpha = awq_search(linear.weight, [(X,)], fm.IntFormat(3, 64))
    assert list(table["alpha"]) == pytest.approx([i / 20 for i in range(21)])
    assert table.loc[table["error"].idxmin(), "alpha"] == package_alpha
    assert torch.equal(s, package_s)
    torch.testing.assert_close(x_mean, X.abs().mean(dim=0))
    with pytest.raises(ValueError, match="at most 4096"):
        P.awq_grid(linear.weight, X.repeat(9, 1))


def test_layer_errors_uses_every_method(layer_data):
    linear, X, X_held = layer_data
    errors = P.layer_errors(linear, X, X_held, bits=3, group_size=64, smooth_alpha=0.5)
    assert list(errors["method"]) == ["W3 rtn", "W3 gptq", "W3 awq", "W8A8", "W8A8 + SmoothQuant 0.5"]
    assert (errors[["calibration", "held_out"]] > 0).all().all()
    cal = dict(zip(errors["method"], errors["calibration"], strict=True))
    assert cal["W3 gptq"] < cal["W3 rtn"] and cal["W3 awq"] <= cal["W3 rtn"] and cal["W8A8"] < cal["W3 gptq"]
    assert 0.0 <= errors.attrs["awq_alpha"] <= 1.0 and errors.attrs["awq_scales"].shape == (192,)
    fig = P.layer_errors_figure(errors)
    assert len(fig.data) == 2 and fig.layout.yaxis.type == "log"


def test_smoothing_view_matches_the_package(layer_data):
    linear, X, _ = layer_data
    view = P.smoothing_view(X, linear.weight, 0.5)
    s = smoothing_factors(activation_absmax([(X,)], 192), linear.weight, 0.5)
    assert len(view) == 192
    torch.testing.assert_close(torch.tensor(view["s"].to_numpy()), s)
    # the product is unchanged, so act_after * weight_after == act_before * weight_before per channel
    torch.testing.assert_close(torch.tensor((view["act_after"] * view["weight_after"]).to_numpy()),
                               torch.tensor((view["act_before"] * view["weight_before"]).to_numpy()), rtol=1e-5, atol=0)
    assert view["act_after"].max() / view["act_after"].median() < view["act_before"].max() / view["act_before"].median()
    fig = P.smoothing_figure(view, 0.5)
    assert len(fig.data) == 4 and "SmoothQuant" in fig.layout.title.text


def test_gptq_and_awq_figures_build(layer_data):
    linear, X, _ = layer_data
    trace = P.gptq_trace(linear.weight, X, bits=3, rows=8)
    fig = P.gptq_error_figure(trace)
    assert [t.name.split(":")[0] for t in fig.data] == ["RTN", "GPTQ"]
    assert "columns" in fig.layout.xaxis.title.text and "error" in fig.layout.yaxis.title.text
    heat = P.gptq_update_figure(trace)
    assert heat.data[0].type == "heatmap" and not heat.frames
    assert [st.label for st in heat.layout.sliders[0].steps] == [str(c) for c in trace.frame_columns]
    assert trace.frame_columns == [0, 64, 128, 192]
    table, x_mean, s = P.awq_grid(linear.weight, X, bits=3)
    fig = P.awq_loss_figure(table)
    assert len(fig.data) == 3 and fig.layout.xaxis.title.text.startswith("alpha")
    fig = P.awq_scales_figure(x_mean, s, 0.5)
    assert len(fig.data) == 2 and len(fig.data[0].y) == 192


def test_measure_plans_table_and_figure(digits_task):
    mlp = wb.models.load("digits-mlp")
    plans = {"W4 rtn": wb.Plan({"fc*": wb.quant.WeightOnly(4, 32)}),
             "W3 rtn": wb.Plan({"fc*": wb.quant.WeightOnly(3, 32)}),
             "W8A8": wb.Plan({"fc*": wb.quant.Dynamic()})}
    df = P.measure_plans(mlp, digits_task, plans, calibration=None)
    assert list(df["label"]) == ["fp32", "W4 rtn", "W3 rtn", "W8A8"]
    assert df.attrs["primary"] == "accuracy" and df.loc[0, "size_ratio"] == 1.0
    assert (df["size_ratio"].iloc[1:] < 0.5).all()
    table = P.method_table(df, "accuracy")
    assert list(table.index) == ["rtn"] and list(table.columns) == [3, 4]
    fig = P.results_figure({"digits-mlp": df})
    assert list(fig.data[0].x) == ["W4 rtn", "W3 rtn", "W8A8"] and fig.layout.yaxis.type == "log"


def test_ptq_plans_labels():
    plans = P.ptq_plans("h.*", [4, 3], 64, 0.5)
    assert list(plans) == ["W4 rtn", "W4 gptq", "W4 awq", "W3 rtn", "W3 gptq", "W3 awq", "W8A8", "W8A8 + SmoothQuant"]
    assert plans["W3 awq"]["h.*"].method.value == "awq" and plans["W8A8 + SmoothQuant"]["h.*"].smooth_alpha == 0.5


# --- exercise checks -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def toy(layer_data):
    linear, X, _ = layer_data
    return P.gptq_block(linear.weight, X, bits=3)


def _gptq_by_hand(block, *, factor=None, sign=1.0, clamp=True, from_original=False, divide=True):
    """GPTQ on the block as a learner writes it (float64, inverse by cholesky_inverse); keywords make the slips."""
    H = block.H + block.damp * block.H.diagonal().mean() * torch.eye(block.H.shape[0], dtype=torch.float64)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True) if factor is None \
        else factor
    W = block.W.clone()
    for j in range(W.shape[1]):
        q = ((block.W if from_original else W)[:, j] / block.scale).round()
        q = (q.clamp(block.qmin, block.qmax) if clamp else q) * block.scale
        e = (W[:, j] - q) / (U[j, j] if divide else 1.0)
        W[:, j] = q
        W[:, j + 1:] -= sign * torch.outer(e, U[j, j + 1:])
    return W


@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_block_reference_is_the_package_gptq(layer_data, bits):
    linear, X, _ = layer_data
    block = P.gptq_block(linear.weight, X, bits=bits)
    assert block.W.shape == block.H.shape == (8, 8) and block.scale.shape == (8,)
    assert (block.qmin, block.qmax) == (-2 ** (bits - 1), 2 ** (bits - 1) - 1)
    fmt = fm.IntFormat(bits, None)
    package = fm.decode(gptq_quantize(block.W.float(), [(X[:, :8],)], fmt), fmt, 8)
    torch.testing.assert_close(P.gptq_block_reference(block).float(), package, rtol=0, atol=1e-6)
    rtn = fm.decode(fm.encode(block.W.float(), fmt), fmt, 8)
    assert (package - rtn).abs().max() > 0.5 * block.scale.min()        # the feedback changes rounding decisions


def test_gptq_block_check(toy):
    assert P.check_gptq_block(_gptq_by_hand(toy), toy).passed
    assert P.check_gptq_block(_gptq_by_hand(toy).float(), toy).passed                     # float32 is fine too
    assert P.check_gptq_block(..., toy).status == "not attempted"
    fb = P.check_gptq_block(_gptq_by_hand(toy, sign=-1.0), toy)
    assert fb.status == "failed" and "wrong sign" in fb.hint and "values differ" in fb.message
    rtn = (toy.W / toy.scale[:, None]).round().clamp(toy.qmin, toy.qmax) * toy.scale[:, None]
    assert "round-to-nearest" in P.check_gptq_block(rtn, toy).hint
    assert "as the feedback of the earlier ones" in P.check_gptq_block(_gptq_by_hand(toy, from_original=True), toy).hint
    of_h = torch.linalg.cholesky(toy.H + toy.damp * toy.H.diagonal().mean() * torch.eye(8, dtype=torch.float64),
                                 upper=True)
    assert "*inverse* Hessian" in P.check_gptq_block(_gptq_by_hand(toy, factor=of_h), toy).hint
    assert "clamp the codes" in P.check_gptq_block(_gptq_by_hand(toy, clamp=False), toy).hint
    assert "1 / U[j, j]" in P.check_gptq_block(_gptq_by_hand(toy, divide=False), toy).hint
    lower = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(
        toy.H + toy.damp * toy.H.diagonal().mean() * torch.eye(8, dtype=torch.float64))))
    assert "*upper* factor" in P.check_gptq_block(_gptq_by_hand(toy, factor=lower), toy).hint
    fb = P.check_gptq_block(toy.W[:, 1:], toy)
    assert fb.status == "failed" and "shape (8, 8)" in fb.message and "whole block" in fb.hint


def _awq_layer():
    """A small layer whose inputs have a few large channels, as AWQ expects (fast: 48 x 64, 256 tokens)."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(48, 64, generator=g) * 0.05
    X = torch.randn(256, 64, generator=g) * torch.where(torch.arange(64) % 16 == 3, 20.0, 1.0)
    return W, X


def test_awq_alpha_check():
    W, X = _awq_layer()
    grid, _, _ = P.awq_grid(W, X, bits=3, group_size=16)
    best = float(grid.loc[grid["relative_error"].idxmin(), "alpha"])
    assert 0 < best                                                  # the salient channels make alpha > 0 pay
    assert P.check_awq_alpha(best, W, X, bits=3, group_size=16).passed
    on_weights = _alpha_search(W, X, fm.IntFormat(3, 16), X.abs().mean(0), on_weights=True)
    assert on_weights != best
    fb = P.check_awq_alpha(on_weights, W, X, bits=3, group_size=16)
    assert fb.status == "failed" and "error of the *weights*" in fb.hint
    worst = float(grid.loc[grid["relative_error"].idxmax(), "alpha"])
    assert "largest* error" in P.check_awq_alpha(worst, W, X, bits=3, group_size=16).hint
    assert P.check_awq_alpha(None, W, X, bits=3, group_size=16).status == "not attempted"


def test_smoothing_check(layer_data):
    linear, X, _ = layer_data
    W = linear.weight.detach()
    act, w = X.abs().amax(dim=0), W.abs().amax(dim=0)
    for alpha in (0.5, 0.8):
        s = act ** alpha / w ** (1 - alpha)
        assert P.check_smoothing((X / s, W * s), X, W, alpha).passed
        torch.testing.assert_close((X / s) @ (W * s).T, X @ W.T, rtol=1e-4, atol=1e-4)   # the same product
    s = act ** 0.8 / w ** 0.2
    assert "other way" in P.check_smoothing((X * s, W / s), X, W, 0.8).hint
    swapped = act ** 0.2 / w ** 0.8
    assert "swapped" in P.check_smoothing((X / swapped, W * swapped), X, W, 0.8).hint
    assert "X Wᵀ changes" in P.check_smoothing((X / s, W), X, W, 0.8).hint
    fb = P.check_smoothing(s, X, W, 0.8)
    assert fb.status == "failed" and "return the pair" in fb.hint


def test_best_method_check():
    import pandas as pd

    table = pd.DataFrame({3: [0.91, 0.945, 0.959], 4: [0.977, 0.989, 0.988]}, index=["rtn", "gptq", "awq"])
    assert P.check_best_method("awq", table, bits=3).passed
    assert P.check_best_method("AWQ", table, bits=3).passed
    fb = P.check_best_method("gptq", table, bits=3)
    assert fb.status == "failed" and "expected 'awq'" in fb.message and "gptq measured 0.9450" in fb.hint
    assert "0.959" not in P.check_best_method(..., table, bits=3).hint      # the hint does not give it away
    perplexity = pd.DataFrame({3: [3.99, 3.89, 3.94]}, index=["rtn", "gptq", "awq"])
    assert P.check_best_method("gptq", perplexity, bits=3, higher_is_better=False).passed
    assert "lower is better" in P.check_best_method("awq", perplexity, bits=3, higher_is_better=False).hint
    assert "lowest" in P.check_best_method(None, perplexity, bits=3, higher_is_better=False).hint
