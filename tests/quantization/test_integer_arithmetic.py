"""`wb.quant.integer`: fixed-point multipliers, the rounding shift, the zero-point expansion, the int32 bias and
integer Linear / Conv2d layers checked against float references on PyTorch's own layers."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench.quantization import integer as I
from workbench.quantization import primitives as P


def test_quantize_multiplier_is_a_31_bit_mantissa_and_a_shift():
    m = torch.tensor([1e-6, 3.1e-4, 0.0123, 0.25, 0.4999, 0.75, 1.0, 3.7])
    m0, shift = I.quantize_multiplier(m)
    assert m0.dtype == shift.dtype == torch.int64
    assert bool(((m0 >= 2 ** 30) & (m0 < 2 ** 31)).all())
    approx = m0.double() * torch.pow(2.0, -shift.double())
    assert float(((approx - m.double()) / m.double()).abs().max()) <= 2.0 ** -31
    assert I.quantize_multiplier(0.25) == (torch.tensor(2 ** 30), torch.tensor(32))   # 2^30 * 2^-32


def test_quantize_multiplier_carry_and_coarse_mantissas():
    m0, shift = I.quantize_multiplier(torch.tensor([1 - 2.0 ** -40]))       # rounds up to 2^31: carried
    assert int(m0) == 2 ** 30 and int(shift) == 30
    for bits in (1, 4, 8):
        m = torch.rand(200, generator=torch.Generator().manual_seed(bits), dtype=torch.float64) * 0.9 + 0.01
        m0, shift = I.quantize_multiplier(m, bits)
        assert bool(((m0 >= 2 ** (bits - 1)) & (m0 < 2 ** bits)).all())
        rel = ((m0.double() * torch.pow(2.0, -shift.double()) - m) / m).abs().max()
        assert float(rel) <= 2.0 ** -bits
    with pytest.raises(ValueError, match="positive"):
        I.quantize_multiplier(torch.tensor([0.5, 0.0]))
    with pytest.raises(ValueError, match="bits"):
        I.quantize_multiplier(0.5, bits=32)


def test_rounding_right_shift_rounds_to_nearest_with_ties_away_from_zero():
    x = torch.arange(-4096, 4097)
    for n in (0, 1, 3, 7):
        exact = x.double() / 2 ** n
        expected = torch.sign(exact) * torch.floor(exact.abs() + 0.5)
        assert torch.equal(I.rounding_right_shift(x, n), expected.long())
    got = I.rounding_right_shift(torch.tensor([[-6, 6], [5, -5]]), torch.tensor([2, 1]))   # per-column shifts
    assert got.tolist() == [[-2, 3], [1, -3]]                     # -1.5, 3, 1.25, -2.5
    with pytest.raises(TypeError, match="integer"):
        I.rounding_right_shift(torch.tensor([1.0]), 1)


def test_multiplying_by_the_quantized_multiplier_matches_the_real_product():
    g = torch.Generator().manual_seed(0)
    acc = torch.randint(-2 ** 30, 2 ** 30, (64, 16), generator=g, dtype=torch.int64)
    m = torch.rand(16, generator=g, dtype=torch.float64) * 1e-3 + 1e-6
    m0, shift = I.quantize_multiplier(m)
    got = I.multiply_by_quantized_multiplier(acc, m0, shift)
    assert float((got.double() - acc.double() * m).abs().max()) <= 0.5 + 1e-3        # at most a rounding apart


def test_accumulator_expansion_and_offset_match_the_direct_product():
    g = torch.Generator().manual_seed(1)
    q_x = torch.randint(-128, 128, (9, 37), generator=g, dtype=torch.int8)
    q_w = torch.randint(0, 256, (5, 37), generator=g, dtype=torch.int32).to(torch.uint8)
    for z_x, z_w in ((-128, 0), (3, 117), (-7, 255)):
        direct = (q_x.long() - z_x) @ (q_w.long() - z_w).T
        assert torch.equal(I.integer_accumulate(q_x, z_x, q_w, z_w).long(), direct)
        offset = I.zero_point_offset(q_w, z_x, z_w)
        assert offset.shape == (5,) and torch.equal(offset.long(), 37 * z_x * z_w - z_x * q_w.long().sum(1))


def test_quantize_bias_is_int32_at_the_accumulator_scale():
    b = torch.tensor([0.5, -1.25, 3e-3])
    q = I.quantize_bias(b, 0.01, torch.tensor([0.1, 0.2, 0.001]))
    assert q.dtype == torch.int32 and q.tolist() == [500, -625, 300]
    with pytest.raises(ValueError, match="int32"):
        I.quantize_bias(torch.tensor([1e3]), 1e-5, torch.tensor([1e-5]))


def _qparams(t):
    s, z = P.choose_qparams(t.detach().reshape(1, -1), 8, symmetric=False)
    return float(s), int(z)


def _fake_codes(y, s, z, relu):
    y = F.relu(y) if relu else y
    return torch.clamp(torch.round(y / s) + z, -128, 127)


@pytest.mark.parametrize("relu", [False, True])
def test_integer_linear_matches_the_fake_quant_linear_to_one_code(relu):
    torch.manual_seed(0)
    lin = nn.Linear(48, 20)                                   # a layer we did not build
    x = torch.randn(200, 48)
    (sx, zx), (sy, zy) = _qparams(x), _qparams(F.relu(lin(x)) if relu else lin(x))
    layer = I.IntegerLinear.from_float(lin.weight, lin.bias, sx, zx, sy, zy, relu=relu)
    q_x = P.quantize(x.reshape(1, -1), torch.tensor([[sx]]), torch.tensor([[zx]]), -128, 127).reshape(x.shape)
    got = I.integer_linear(q_x, layer)
    assert got.dtype == torch.int8
    w_hat = layer.weight.double() * layer.weight_scale.double()[:, None]
    ref = _fake_codes(F.linear((q_x.double() - zx) * sx, w_hat, lin.bias.detach().double()), sy, zy, relu)
    diff = (got.double() - ref).abs()
    assert float(diff.max()) <= 1 and float((diff > 0).double().mean()) < 0.02
    if relu:
        assert int(got.min()) >= zy
    with pytest.raises(TypeError, match="integer codes"):
        I.integer_linear(x, layer)
    with pytest.raises(ValueError, match="48"):
        I.integer_linear(q_x[:, :40], layer)


def test_integer_conv2d_pads_with_the_zero_point_and_matches_the_float_conv():
    torch.manual_seed(1)
    conv = nn.Conv2d(3, 8, 3, padding=1)
    x = torch.rand(4, 3, 7, 5) * 2 + 0.5                      # all positive: zero-padding with code 0 would be wrong
    y = conv(x)
    (sx, zx), (sy, zy) = _qparams(x), _qparams(y)
    layer = I.IntegerLinear.from_float(conv.weight, conv.bias, sx, zx, sy, zy)
    q_x = P.quantize(x.reshape(1, -1), torch.tensor([[sx]]), torch.tensor([[zx]]), -128, 127).reshape(x.shape)
    got = I.integer_conv2d(q_x, layer, (3, 3), padding=1)
    assert got.shape == (4, 8, 7, 5)
    w_hat = (layer.weight.double() * layer.weight_scale.double()[:, None]).reshape(conv.weight.shape)
    ref = _fake_codes(F.conv2d((q_x.double() - zx) * sx, w_hat, conv.bias.detach().double(), padding=1), sy, zy, False)
    assert float((got.double() - ref).abs().max()) <= 1
    cols = I.im2col(q_x, (3, 3), 1, zx)
    assert cols.shape == (4 * 7 * 5, 27) and int(cols[0, 0]) == zx      # the corner patch starts in the padding
