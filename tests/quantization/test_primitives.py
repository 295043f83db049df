"""Quantization numerics: agreement with PyTorch, error bounds, round trips, granularities."""
import warnings

import pytest
import torch

from workbench.quantization import packing
from workbench.quantization.primitives import (
    PerChannel,
    PerGroup,
    PerTensor,
    PerToken,
    choose_qparams,
    dequantize_affine,
    dequantize_packed,
    fake_quantize,
    float8_dequantize,
    float8_quantize,
    from_groups,
    nf4_codebook,
    nf4_dequantize,
    nf4_quantiles,
    nf4_quantize,
    qrange,
    quantize_affine,
    sqnr,
    to_groups,
)


@pytest.fixture
def w():
    return torch.randn(48, 96, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("axis", [0, 1])
def test_int8_per_channel_is_bit_identical_to_torch(w, symmetric, axis):
    q, scale, zp = quantize_affine(w, 8, PerChannel(axis), symmetric=symmetric)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's quantized tensors are deprecated but still the reference
        ref = torch.quantize_per_channel(w, scale.flatten().double(), zp.flatten().long(), axis, torch.qint8)
    assert torch.equal(ref.int_repr(), q)
    fq = torch.fake_quantize_per_channel_affine(w, scale.flatten(), zp.flatten(), axis, -128, 127)
    assert torch.equal(fq, dequantize_affine(q, scale, zp, PerChannel(axis)))


def test_qparams_match_torch_observer(w):
    obs = torch.ao.quantization.PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_affine)
    obs(w)
    ref_scale, ref_zp = obs.calculate_qparams()
    scale, zp = choose_qparams(to_groups(w, PerChannel(0)), 8, symmetric=False)
    torch.testing.assert_close(scale.flatten(), ref_scale, rtol=0, atol=0)
    assert torch.equal(zp.flatten().long(), ref_zp.long())


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("gran", [PerTensor(), PerChannel(0), PerGroup(32), PerToken()], ids=repr)
def test_round_trip_error_is_at_most_half_a_step(w, bits, symmetric, gran):
    q, scale, zp = quantize_affine(w, bits, gran, symmetric=symmetric)
    qmin, qmax = qrange(bits, True)
    assert q.min() >= qmin and q.max() <= qmax and q.shape == w.shape
    err = to_groups((dequantize_affine(q, scale, zp, gran) - w).abs(), gran)
    assert (err <= scale / 2 + 1e-6).all()  # the range covers every value: only rounding error
    # finer granularity never does worse than per-tensor
    if not isinstance(gran, PerTensor):
        per_tensor = sqnr(w, fake_quantize(w, bits, PerTensor(), symmetric))
        assert sqnr(w, fake_quantize(w, bits, gran, symmetric)) >= per_tensor - 1e-9


def test_sqnr_grows_about_6db_per_bit(w):
    s4, s8 = (sqnr(w, fake_quantize(w, b, PerChannel(0), symmetric=True)) for b in (4, 8))
    assert 20 < s8 - s4 < 28  # ~6.02 dB per bit


def test_unsigned_and_asymmetric_ranges():
    x = torch.rand(4, 16) + 1.0  # all positive
    q, scale, zp = quantize_affine(x, 4, PerChannel(0), symmetric=False, signed=False)
    assert q.dtype == torch.uint8 and q.min() >= 0 and q.max() <= 15
    assert (zp == 0).all()  # the range includes 0, so min maps to qmin


def test_granularity_views_round_trip(w):
    for gran in (PerTensor(), PerChannel(0), PerChannel(1), PerChannel(-1), PerGroup(16), PerToken()):
        assert torch.equal(from_groups(to_groups(w, gran), w.shape, gran), w)
    x = torch.randn(2, 3, 8)
    assert to_groups(x, PerToken()).shape == (6, 8)
    assert to_groups(x, PerChannel(1)).shape == (3, 16)


def test_bad_arguments(w):
    with pytest.raises(ValueError, match="group_size 64 does not divide the last dimension 96"):
        quantize_affine(w, 4, PerGroup(64))
    with pytest.raises(ValueError, match="supports 2 to 8 bits, got 1"):
        quantize_affine(w, 1, PerTensor())
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        PerGroup(0)
    with pytest.raises(TypeError, match="floating-point"):
        quantize_affine(torch.ones(3, dtype=torch.int32), 8, PerTensor())


def test_nf4_codebook_matches_qlora():
    published = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                 -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                 0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236328, 1.0]
    torch.testing.assert_close(nf4_codebook(), torch.tensor(published), rtol=0, atol=1e-6)
    assert torch.equal(nf4_codebook(), nf4_quantiles())   # the constants are the derivation's fp32 values


def test_nf4_beats_int4_on_normal_weights(w):
    codes, scale = nf4_quantize(w, 32)
    assert codes.dtype == torch.uint8 and codes.max() <= 15
    nf4 = sqnr(w, nf4_dequantize(codes, scale, 32))
    int4 = sqnr(w, fake_quantize(w, 4, PerGroup(32), symmetric=True))
    assert nf4 > int4  # NF4 is information-theoretically suited to normal weights


@pytest.mark.parametrize("dtype, min_sqnr", [(torch.float8_e4m3fn, 28), (torch.float8_e5m2, 22)])
def test_float8(w, dtype, min_sqnr):
    q, scale = float8_quantize(w * 1000, PerChannel(0), dtype)
    assert q.dtype == dtype and torch.isfinite(q.float()).all()
    back = float8_dequantize(q, scale, PerChannel(0))
    assert sqnr(w * 1000, back) > min_sqnr
    assert q.float().abs().max() == torch.finfo(dtype).max  # each row's max maps to the largest finite value


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_identity(bits):
    codes = torch.randint(0, 1 << bits, (5, 7, 24), dtype=torch.uint8)
    packed = packing.pack(codes, bits)
    assert packed.shape == (5, 7, 24 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(packing.unpack(packed, bits), codes)


def test_pack_layout_and_errors():
    assert packing.pack(torch.tensor([[1, 2]]), 4).tolist() == [[0x21]]  # low nibble first
    assert packing.pack(torch.tensor([[3, 0, 1, 2]]), 2).tolist() == [[0b10_01_00_11]]
    odd = torch.randint(0, 16, (3, 9), dtype=torch.uint8)          # e.g. a 1x3x3 conv kernel per row
    assert packing.pack(odd, 4).shape == (3, 5)
    assert torch.equal(packing.unpack(packing.pack(odd, 4), 4, 9), odd)
    with pytest.raises(ValueError, match="packing supports"):
        packing.pack(torch.zeros(3, 6, dtype=torch.uint8), 3)


@pytest.mark.parametrize("bits,slot,K,g", [(4, 4, 70, 32), (3, 4, 64, 64), (2, 2, 9, 4), (8, 8, 33, 33)])
def test_dequantize_packed_is_the_stored_weight_elementwise(bits, slot, K, g):
    """One decode for every grouped format: checked element by element against the definition, with a short last
    group, stored zero points, a symmetric mid-point, a codebook and fp64."""
    rows, G = 3, -(-K // g)
    gen = torch.Generator().manual_seed(bits * 100 + K)
    codes = torch.randint(0, 1 << bits, (rows, K), generator=gen, dtype=torch.uint8)
    scale = torch.rand(rows, G, generator=gen) + 0.1
    zero = torch.randint(0, 1 << bits, (rows, G), generator=gen).to(torch.uint8)
    q = packing.pack(codes, slot)
    lut = torch.randn(1 << slot, generator=gen)
    for z, table, dtype in [(zero, None, torch.float32), (float(1 << (bits - 1)), None, torch.float64),
                            (None, lut, torch.float32)]:
        w = dequantize_packed(q, slot, K, scale, g, z, table, dtype)
        assert w.shape == (rows, K) and w.dtype == dtype
        for n in range(rows):
            for k in range(K):
                u, s = int(codes[n, k]), scale[n, k // g].to(dtype)
                if table is not None:
                    expect = table[u].to(dtype) * s
                else:
                    expect = (u - (float(z[n, k // g]) if isinstance(z, torch.Tensor) else z)) * s
                assert w[n, k] == expect, (n, k)
    with pytest.raises(ValueError, match="zero points"):
        dequantize_packed(q, slot, K, scale, g)
