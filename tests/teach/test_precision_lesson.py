"""Lesson 40 (mixed precision): the format limits, the autocast wrapper and table, gradient underflow counts,
the GradScaler trace, the exercise checks (right answers pass, typical mistakes are explained), the figures."""
import math

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


def test_check_bytes_saved():
    layer = nn.Linear(192, 768)
    numel = 192 * 768 + 768
    assert L.check_bytes_saved(numel * 2, layer, torch.bfloat16).passed
    assert "weight only" in L.check_bytes_saved(192 * 768 * 2, layer).hint
    assert "number of values" in L.check_bytes_saved(numel, layer).hint
    assert "fp32 size" in L.check_bytes_saved(numel * 4, layer).hint
    assert "bits" in L.check_bytes_saved(numel * 16, layer).hint
    assert L.check_bytes_saved(..., layer).status == "not attempted"


def test_check_underflows():
    assert L.check_underflows(True, 1e-9).passed and L.check_underflows(False, 2.4e-6).passed
    assert L.check_underflows(torch.tensor(True), 1e-9).passed
    subnormal = L.check_underflows(True, 2.4e-6)
    assert subnormal.status == "failed" and "smallest *normal*" in subnormal.hint
    assert "True or False" in L.check_underflows(0.5, 1e-9).hint
    assert L.check_underflows(..., 1e-9).status == "not attempted"


def test_check_loss_scale():
    g = 1.75e-10
    expected = 2.0 ** math.ceil(math.log2(2.0 ** -14 / g))
    assert expected == 2.0 ** 19 and L.check_loss_scale(2 ** 19, g).passed
    assert "still below" in L.check_loss_scale(2 ** 18, g).hint
    assert "not the smallest" in L.check_loss_scale(2 ** 21, g).hint
    assert "power of two" in L.check_loss_scale(400000, g).hint
    assert "smallest subnormal" in L.check_loss_scale(2.0 ** math.ceil(math.log2(2.0 ** -24 / g)), g).hint
