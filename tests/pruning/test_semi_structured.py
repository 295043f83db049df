"""2:4 compressed storage: exact round trip, real bytes, the same outputs as the masked layer, save/load,
the CUDA semi-structured path chosen explicitly (and refused clearly where it cannot run)."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.pruning import SemiStructuredLinear, masks
from workbench.pruning.modules import _pack_positions, _unpack_positions


def test_positions_pack_round_trip():
    torch.manual_seed(0)
    mask = masks.nm_mask(torch.randn(5, 24), 2, 4)                 # 6 groups per row: an odd byte count too
    meta = _pack_positions(mask)
    assert meta.shape == (5, 3) and meta.dtype == torch.uint8
    pos = _unpack_positions(meta, 6)
    rebuilt = torch.zeros(5, 6, 4, dtype=torch.bool).scatter_(2, pos, True).reshape(5, 24)
    assert torch.equal(rebuilt, mask)


def test_compressed_weight_is_exact_and_smaller(tmp_path):
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(64, 32))
    masked = wb.apply(lin, {"0": wb.prune.NM(2, 4)})
    packed = wb.apply(lin, {"0": wb.prune.NM(2, 4, storage="2:4")})
    assert isinstance(packed[0], SemiStructuredLinear) and packed[0].kernel == "reference"
    dense_w = masked[0].weight * masked[0].mask
    assert torch.equal(packed[0].dense_weight(), dense_w)
    groups = packed[0].dense_weight().reshape(32, 16, 4)
    assert ((groups != 0).sum(-1) <= 2).all()
    # values (32 x 32 fp32) + positions (32 x 8 bytes) + bias: 0.52x the dense layer
    assert wb.size_bytes(packed) == 32 * 32 * 4 + 32 * 8 + 32 * 4
    assert wb.size_bytes(packed) / wb.size_bytes(lin) == pytest.approx((4352 + 128) / (64 * 32 * 4 + 128))
    x = torch.randn(3, 7, 64)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), masked(x))
    assert wb.prune.sparsity_of(packed) == {"0": 0.5}
    wb.save(packed, tmp_path / "p.safetensors")
    again = wb.load(tmp_path / "p.safetensors", base=lin)
    assert torch.equal(again[0].values, packed[0].values) and torch.equal(again[0].meta, packed[0].meta)


def test_finalize_to_2_4_after_fine_tuning():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    pruned = wb.apply(model, {"0": wb.prune.NM(2, 4), "2": wb.prune.NM(2, 4)})
    final = wb.prune.finalize(pruned, storage="2:4")
    assert all(isinstance(final[i], SemiStructuredLinear) for i in (0, 2))
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(final(x), pruned(x))
    magnitude = wb.apply(model, {"0": wb.prune.Magnitude(0.5)})
    with pytest.raises(ValueError, match="'0'.*exactly 2 kept weights in every group of 4"):
        wb.prune.finalize(magnitude, storage="2:4")


def test_bad_2_4_requests_are_refused():
    with pytest.raises(ValueError, match="NM\\(2, 4, storage='2:4'\\)"):
        wb.prune.NM(1, 4, storage="2:4")
    with pytest.raises(ValueError, match="NM\\(2, 4, storage='2:4'\\)"):
        wb.prune.Magnitude(0.5, storage="2:4")
    with pytest.raises(ValueError, match="conv1"):
        wb.apply(wb.models.load("digits-cnn"), {"conv1": wb.prune.NM(2, 4, storage="2:4")})
    layer = wb.apply(nn.Sequential(nn.Linear(64, 32)), {"0": wb.prune.NM(2, 4, storage="2:4")})[0]
    with pytest.raises(ValueError, match="kernel must be one of"):
        layer.set_kernel("cusparselt")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            layer.set_kernel("semi_structured")
        assert layer.kernel == "reference"                 # nothing half-changed


@pytest.mark.gpu   # torch.sparse semi-structured kernels need CUDA
def test_semi_structured_kernel_on_cuda():
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(256, 128)).cuda().half()
    packed = wb.apply(lin, {"0": wb.prune.NM(2, 4, storage="2:4")})
    ref = packed[0](x := torch.randn(64, 256, device="cuda", dtype=torch.half))
    fast = packed[0].set_kernel("semi_structured")(x)
    torch.testing.assert_close(fast, ref, rtol=1e-2, atol=1e-2)
    with pytest.raises(RuntimeError, match="fp16/bf16"):
        wb.apply(nn.Sequential(nn.Linear(256, 128)).cuda(), {"0": wb.prune.NM(2, 4, storage="2:4")})[0] \
            .set_kernel("semi_structured")
