"""Lesson 40 (mixed precision): the format limits, the autocast wrapper and table, gradient underflow counts,
the GradScaler trace, the exercise checks (right answers pass, typical mistakes are explained), the figures."""

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.teach import precision as L


@pytest.fixture(autouse=True)
def _fresh_results():
    wb.teach.reset()
    yield
    wb.teach.reset()


def test_format_table():
    t = L.format_table()
    assert t.loc["fp16", "smallest subnormal"] == 2.0 ** -24 and t.loc["bf16", "smallest subnormal"] == 2.0 ** -133
    assert t.loc["fp16", "largest"] == 65504 and t.loc["fp16", "smallest normal"] == 2.0 ** -14
    assert list(t["exponent bits"]) == [8, 8, 5] and list(t["mantissa bits"]) == [23, 7, 10]
    assert torch.tensor(2.0 ** -24).half() != 0 and torch.tensor(2.0 ** -26).half() == 0


def test_autocast_wrapper_and_table():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    wrapped = L.Autocast(model, "bf16")
    out = wrapped(x)
    assert out.dtype == torch.float32 and torch.allclose(out, model(x), atol=0.1)
    assert all(p.dtype == torch.float32 for p in wrapped.parameters())
    table = L.autocast_table(model, (x,), torch.bfloat16)
    assert list(table["layer"]) == ["0", "1", "2"]
    assert table["output"][0] == table["output"][2] == "bfloat16" and set(table["weights"]) == {"float32"}
    assert table["output"][1] == table["input"][1]               # on the CPU LayerNorm follows its input's dtype
    with pytest.raises(ValueError, match="unknown dtype"):
        L.Autocast(model, "fp8")


def test_underflow_and_overflow_fractions():
    v = torch.tensor([1e-9, 1e-6, 1e-3, 1.0, 0.0])
    assert L.underflow_fraction(v) == 0.25                                   # 1e-9 of 4 non-zero values
    assert L.underflow_fraction(v, scale=2.0 ** 16) == 0.0
    assert L.overflow_fraction(v, scale=2.0 ** 16) == 1 / 5                  # 65536 > 65504
    assert L.underflow_fraction(v, "bf16") == 0.0
    table = L.scale_table(v, scales=(1.0, 2.0 ** 16))
    assert list(table.index) == ["2^0", "2^16"] and table.iloc[0, 0] == 0.25


def test_gradient_magnitudes_of_a_real_model():
    model = wb.models.load("digits-mlp")
    task = wb.tasks.load("digits")
    x, y = task.calibration(32)[0][0], task.calibration_labels(32)
    grads = L.gradient_magnitudes(model, x, y)
    assert grads["weights"].numel() == sum(p.numel() for p in model.parameters())
    assert grads["activations"].numel() == 32 * (256 + 128 + 10) and (grads["activations"] >= 0).all()
    assert all(p.grad is None for p in model.parameters())                  # nothing left behind
    fig = L.gradient_histogram(grads, scale=2.0 ** 16)
    assert [t.name.split(" ")[0] for t in fig.data] == ["activations", "weights", "activations"]
    assert "log2" in fig.layout.xaxis.title.text and fig.layout.yaxis.title.text == "fraction of values"
    assert sum(fig.data[0].y) == pytest.approx(1.0)


def test_scale_trace_halves_and_skips_on_overflow():
    trace = L.scale_trace(wb.models.load("digits-mlp"), wb.tasks.load("digits"), steps=12, init_scale=2.0 ** 40,
                          growth_interval=1000)
    assert trace["skipped"].iloc[0] and trace["scale"].iloc[0] == 2.0 ** 40
    assert trace["scale"].is_monotonic_decreasing and trace["scale"].iloc[-1] < 2.0 ** 40
    fig = L.scale_trace_figure(trace)
    assert fig.data[1].name.startswith("step skipped") and len(fig.data[1].x) == int(trace["skipped"].sum())
    assert fig.layout.yaxis.title.text == "log2(loss scale)"


def _bf16_by_hand(x, ties="even"):
    """fp32 -> bf16 on the unsigned bit pattern in int64, as a learner may write it; ``ties``: "even", "away" (add
    half a step) or "truncate"."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if ties == "even":
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
    elif ties == "away":
        bits = bits + 0x8000
    kept = bits & 0xFFFF0000
    return torch.where(kept >= 2 ** 31, kept - 2 ** 32, kept).to(torch.int32).view(torch.float32)


def test_check_bf16_round():
    torch.manual_seed(0)
    x = torch.cat([torch.randn(4096) * 0.05, torch.tensor(L.HALFWAY)])
    assert L.check_bf16_round(x.to(torch.bfloat16).float(), x).passed
    assert L.check_bf16_round(_bf16_by_hand(x), x).passed                        # the bits, another way round
    assert L.check_bf16_round(..., x).status == "not attempted"
    fb = L.check_bf16_round(_bf16_by_hand(x, "truncate"), x)
    assert fb.status == "failed" and "truncates" in fb.hint and "values differ" in fb.message
    fb = L.check_bf16_round(_bf16_by_hand(x, "away"), x)                        # wrong only at the ties
    assert fb.status == "failed" and "half to *even*" in fb.hint and "2 of 4102 values differ" in fb.message
    assert "view them as torch.float32" in L.check_bf16_round(x.view(torch.int32), x).hint
    assert "as float32" in L.check_bf16_round(x.to(torch.bfloat16), x).hint
    assert list(x.to(torch.bfloat16).float()[-6:-2]) == [1.0, 1.015625, -1.0, -0.75390625]   # the ties go to even


def test_check_underflow_fractions():
    v = torch.tensor([0.0, 0.0, 2.0 ** -26, 2.0 ** -25, 1.2 * 2.0 ** -25, 2.0 ** -24, 2.0 ** -20, 1e-3, -2.0 ** -26])
    scales = [1.0, 2.0, 2.0 ** 8]
    expected = [L.underflow_fraction(v, torch.float16, s) for s in scales]
    assert expected == [3 / 7, 2 / 7, 0.0]         # 2^-25 rounds to 0 (a tie, to even); 1.2 x 2^-25 up to 2^-24
    nz = v[v != 0].abs()
    assert L.check_underflow_fractions([float((nz * s <= 2.0 ** -25).float().mean()) for s in scales], v, scales).passed
    assert L.check_underflow_fractions([float(((v * s).half() == 0)[v != 0].float().mean()) for s in scales],
                                       v, scales).passed                      # by casting, the same counts
    assert L.check_underflow_fractions(..., v, scales).status == "not attempted"
    fb = L.check_underflow_fractions([float((nz * s < 2.0 ** -14).float().mean()) for s in scales], v, scales)
    assert fb.status == "failed" and "subnormals as lost" in fb.hint
    assert "round *up*" in L.check_underflow_fractions([float((nz * s < 2.0 ** -24).float().mean()) for s in scales],
                                                       v, scales).hint
    with_zeros = [float(((v.abs() * s <= 2.0 ** -25) & (v != 0)).float().mean()) for s in scales]
    assert "zeros included" in L.check_underflow_fractions(with_zeros, v, scales).hint
    assert "change with the scale" in L.check_underflow_fractions([3 / 7] * 3, v, scales).hint


PEAKS = [0.002, 0.05, 0.002, 0.002, 0.02, 0.03, 0.015, 0.008, 0.003, 0.002, 0.001, 0.002, 0.001, 0.004, 0.004,
         0.009, 0.0005, 0.002, 0.002, 0.006, 0.007, 0.012, 0.012, 0.004, 0.001]


def _scaler_by_hand(peaks, init_scale, interval, *, reset_on_skip=True, record_after=False):
    scale, good, scales, skipped = init_scale, 0, [], []
    for peak in peaks:
        overflow = peak * scale > 65504.0
        if not record_after:
            scales.append(scale)
        if overflow:
            scale, good = scale / 2, 0 if reset_on_skip else good
        else:
            good += 1
            if good == interval:
                scale, good = scale * 2, 0
        if record_after:
            scales.append(scale)
        skipped.append(overflow)
    return scales, skipped


def test_grad_scaler_trace_is_a_real_grad_scaler():
    scales, skipped = L.grad_scaler_trace(PEAKS, 2.0 ** 24, 10)
    assert scales[:3] == [2.0 ** 24, 2.0 ** 24, 2.0 ** 23] and skipped[:2] == [False, True]   # 0.05 x 2^24 > 65504
    assert all(b == a / 2 for a, b, s in zip(scales, scales[1:], skipped) if s)        # a skip halves
    assert sum(skipped) >= 3 and max(scales) == 2.0 ** 24


def test_check_grad_scaler():
    assert L.check_grad_scaler(_scaler_by_hand(PEAKS, 2.0 ** 24, 10), PEAKS, 2.0 ** 24, 10).passed
    assert L.check_grad_scaler(..., PEAKS, 2.0 ** 24, 10).status == "not attempted"
    fb = L.check_grad_scaler(_scaler_by_hand(PEAKS, 2.0 ** 24, 10, reset_on_skip=False), PEAKS, 2.0 ** 24, 10)
    assert fb.status == "failed" and "*in a row*" in fb.hint and "expected" in fb.message
    after = _scaler_by_hand(PEAKS, 2.0 ** 24, 10, record_after=True)
    assert "the step *used*" in L.check_grad_scaler(after, PEAKS, 2.0 ** 24, 10).hint
    assert "off by one" in L.check_grad_scaler(_scaler_by_hand(PEAKS, 2.0 ** 24, 11), PEAKS, 2.0 ** 24, 10).hint
    never = ([2.0 ** 24 * 2 ** (i // 10) for i in range(len(PEAKS))], [False] * len(PEAKS))
    assert "no step overflowed" in L.check_grad_scaler(never, PEAKS, 2.0 ** 24, 10).hint
    assert "return the pair" in L.check_grad_scaler(_scaler_by_hand(PEAKS, 2.0 ** 24, 10)[0], PEAKS, 2.0 ** 24,
                                                    10).hint
