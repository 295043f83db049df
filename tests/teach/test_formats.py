"""Lesson 10 (number formats): the format table and grids agree with PyTorch, round trips use the package's
primitives, the exercise checks pass the right answer and explain typical mistakes, the figures build."""
import math

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.quantization import primitives as P
from workbench.teach import formats as F
from workbench.teach.formats.checks import _decode_fields


@pytest.fixture(autouse=True)
def _fresh_results():
    wb.teach.reset()
    yield
    wb.teach.reset()


def heavy_tailed(n=4096, seed=0):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.05
    x[:3] = torch.tensor([4.0, -3.0, 2.5])  # a few outliers set a per-tensor scale
    return x


@pytest.mark.parametrize("name, dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2),
                                         ("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_table_and_grid_agree_with_torch(name, dtype):
    table = F.format_table()
    g = F.grid(name)
    info = torch.finfo(dtype)
    assert table.loc[name, "largest"] == info.max == g.max().item()
    assert table.loc[name, "smallest normal"] == info.smallest_normal
    assert table.loc[name, "smallest non-zero"] == g[1].item()          # the smallest subnormal
    assert table.loc[name, "relative step"] == info.eps
    assert torch.equal(g, torch.sort(g).values) and len(torch.unique(g)) == len(g)
    assert torch.equal(g.float().to(dtype).double(), g)                  # every grid value is representable


def test_grid_sizes_and_integers():
    assert [len(F.grid(n)) for n in ("e4m3", "e5m2", "fp16", "bf16")] == [127, 124, 31744, 32640]
    assert F.grid("int8").tolist() == list(range(128)) and F.grid("int4").max() == 7
    assert F.format_table().loc["int8", "largest"] == 127
    with pytest.raises(ValueError, match="at most 16 bits"):
        F.grid("fp32")


def test_format_of_accepts_aliases_and_dtypes():
    assert F.format_of("bfloat16").name == "bf16" == F.format_of(torch.bfloat16).name
    assert F.format_of("torch.float8_e4m3fn").name == "e4m3"
    with pytest.raises(ValueError, match="unknown format"):
        F.format_of("int5")


def test_bit_layout():
    top = F.bit_layout(448, "e4m3")
    assert top["bits"] == "0 1111 110" and top["stored"] == 448 and top["exponent"] == 15
    one = F.bit_layout(1.0, "bf16")
    assert one["bits"] == "0 01111111 0000000" and one["formula"].startswith("+2^(127-127)")
    tiny = F.bit_layout(0.001, "e4m3")
    assert tiny["exponent"] == 0 and "subnormal" in tiny["formula"] and tiny["stored"] == 2 ** -9
    assert F.bit_layout(-3.3, "fp16")["sign"] == 1
    with pytest.raises(ValueError, match="integer"):
        F.bit_layout(1.0, "int8")


def test_cast_and_quantize_dequantize_use_the_primitives():
    x = heavy_tailed()
    assert torch.equal(F.quantize_dequantize(x, "int8"), P.fake_quantize(x, 8, P.PerTensor()))
    q, scale = P.float8_quantize(x, P.PerTensor(), torch.float8_e5m2)
    assert torch.equal(F.quantize_dequantize(x, "e5m2"), P.float8_dequantize(q, scale, P.PerTensor()))
    assert torch.equal(F.quantize_dequantize(x, "bf16"), x.bfloat16().float())
    scale8 = x.abs().max() / 127.5
    assert (F.quantize_dequantize(x, "int8") - x).abs().max() <= scale8 / 2 + 1e-7   # the rounding bound
    assert torch.isinf(F.cast(torch.tensor([7e4]), "fp16")).all()
    assert F.cast(torch.tensor([1e-9]), "fp16").item() == 0
    with pytest.raises(ValueError, match="needs a scale"):
        F.cast(x, "int8")


def test_error_table_measures_range_and_precision():
    x = heavy_tailed()
    t = F.error_table({"x": x}).set_index("format")
    assert t.loc["fp16", "sqnr_db"] > t.loc["bf16", "sqnr_db"] > t.loc["int8", "sqnr_db"] > t.loc["int4", "sqnr_db"]
    assert t.loc["e4m3", "sqnr_db"] > t.loc["int8", "sqnr_db"]           # log grid beats uniform on heavy tails
    assert t.loc["int4", "flushed"] > 0.9 and t.loc["e4m3", "flushed"] < 0.01
    p = torch.tensor([0.5, 1e-3, 1e-9, 1e-20])
    c = F.error_table({"p": p, "e": torch.tensor([1.0, 1e5])}, ("fp16", "bf16", "e4m3"), scaled=False)
    c = c.set_index(["tensor", "format"])
    assert c.loc[("p", "fp16"), "flushed"] == 0.5 and c.loc[("p", "bf16"), "flushed"] == 0
    assert c.loc[("e", "fp16"), "overflowed"] == 0.5 and c.loc[("e", "bf16"), "overflowed"] == 0
    assert c.loc[("e", "e4m3"), "overflowed"] == 0.5                       # saturated at 448 counts as overflow
    assert math.isnan(c.loc[("e", "fp16"), "sqnr_db"])


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2)

    def forward(self, x, mask=None):
        return self.b(torch.relu(self.a(x)))


def test_layer_inputs_records_and_stops_at_the_layer():
    model = _Tiny()
    ran_b = []
    model.b.register_forward_hook(lambda *args: ran_b.append(True))
    x = torch.randn(2, 5, 4)                                               # (B, T, features)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    got = F.layer_inputs(model, "b", [(x, mask)], mask_index=1)
    expected = torch.relu(model.a(x)).detach()
    assert not ran_b                                                       # nothing after the layer ran
    assert [tuple(g.shape) for g in got] == [(3, 3), (5, 3)]               # padding dropped
    assert torch.allclose(got[0], expected[0, :3]) and torch.allclose(got[1], expected[1])
    assert len(F.layer_inputs(model, "a", [(x,)])) == 2
    assert not model.a._forward_pre_hooks                                  # hook removed


def test_check_int8_round_trip():
    x = heavy_tailed()
    step = x.abs().max() / 127.5
    assert F.check_int8_round_trip(P.fake_quantize(x, 8, P.PerTensor()), x).passed
    restricted = (x / (x.abs().max() / 127)).round().clamp(-128, 127) * (x.abs().max() / 127)
    fb = F.check_int8_round_trip(restricted, x)
    assert fb.status == "failed" and "restricted range" in fb.hint
    z = torch.tensor([127.5, -3.0, 1.0, 0.4])                        # scale 1: max|z| is exactly 127.5 steps
    fb = F.check_int8_round_trip(z.round(), z)                       # 127.5 rounds to 128, beyond qmax
    assert fb.status == "failed" and "no clamp" in fb.hint
    y = -x                                                           # min(y) = -4 is further from 0 than max(y)
    fb = F.check_int8_round_trip((y / (y.max() / 127.5)).round().clamp(-128, 127) * (y.max() / 127.5), y)
    assert fb.status == "failed" and "largest *magnitude*" in fb.hint
    assert "integer codes" in F.check_int8_round_trip((x / step).round().clamp(-128, 127), x).hint
    assert F.check_int8_round_trip(..., x).status == "not attempted"


def test_check_e4m3_decode():
    codes = torch.arange(256)
    assert F.check_e4m3_decode(codes.to(torch.uint8).view(torch.float8_e4m3fn).float(), codes).passed
    assert "subnormal" in F.check_e4m3_decode(_decode_fields(codes, subnormals=False), codes).hint
    assert "bias" in F.check_e4m3_decode(_decode_fields(codes, bias=8), codes).hint
    fb = F.check_e4m3_decode(_decode_fields(codes, nan_top=False), codes)
    assert fb.status == "failed" and "NaN" in fb.hint and "expected nan, found 480" in fb.message
    assert "IEEE" in F.check_e4m3_decode(_decode_fields(codes, inf_top=True), codes).hint
    assert "sign bit" in F.check_e4m3_decode(_decode_fields(codes).abs(), codes).hint


def test_check_loses_small_values():
    p = torch.softmax(torch.tensor([[20.0, 0.0, -5.0], [1.0, 2.0, 3.0]]), dim=-1)
    assert F.check_loses_small_values("fp16", p).passed
    assert F.check_loses_small_values(torch.float16, p).passed
    assert F.check_loses_small_values("float16", p).passed
    fb = F.check_loses_small_values("bf16", p)
    assert fb.status == "failed" and "fp16 flushes 2 of 6" in fb.hint and "bf16 flushes 0" in fb.hint


def test_check_fp16_exp_limit():
    assert F.check_fp16_exp_limit(math.log(65504)).passed
    assert "log10" in F.check_fp16_exp_limit(math.log10(65504)).hint
    assert "largest fp16 value itself" in F.check_fp16_exp_limit(65504).hint
    assert wb.teach.summary() == {"exercises": 1, "passed": 0, "failed": 1, "not_attempted": 0}


def test_figures_build():
    fig = F.spacing_figure(("int8", "e4m3", "fp16"))
    assert [t.name for t in fig.data] == ["int8", "e4m3", "fp16"]
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log" and fig.layout.title.text
    assert all(len(t.x) <= 2001 for t in fig.data)                        # thinned: the notebook stays small
    x = heavy_tailed()
    fig = F.grid_figure(("int4", "e4m3"), x=x, x_label="w")
    assert len(fig.data) == 3 and fig.data[0].fill == "tozeroy"
    assert len(fig.data[1].x) == 7 and max(fig.data[2].x) == 1.0         # int4: 7 positive values, scaled to 1
    assert "magnitude" in fig.layout.xaxis2.title.text
    fig = F.magnitude_error_figure(("fp16", "bf16"), tensors={"x": x})
    assert [t.name for t in fig.data] == ["fp16", "bf16", "|x|"]
    worst = dict(zip(fig.data[0].x, fig.data[0].y, strict=True))
    assert max(v for k, v in worst.items() if 1e-3 < k < 1e4) < 2 ** -10  # fp16 inside its range: ~2^-11
    assert worst[max(worst)] == 1.0                                        # overflowed beyond 65504
    table = F.error_table({"x": x}, ("int8", "bf16"))
    fig = F.error_bars_figure(table)
    assert [t.name for t in fig.data] == ["int8", "bf16"] and "SQNR" in fig.layout.yaxis.title.text
