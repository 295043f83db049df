"""Quantized modules follow ``.to()``: ``kernel="auto"`` is chosen again on the new device, an explicit kernel is
kept; the Triton W8A8 path keeps its codes K-major, through save / load too."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.quantization.modules import W8A8Linear, WeightOnlyLinear
from workbench_kernels._common import INTERPRET, triton_available


def _wo(kernel="auto"):
    torch.manual_seed(0)
    return WeightOnlyLinear.from_float(nn.Linear(64, 32), wb.quant.WeightOnly(bits=8).format(), kernel=kernel)


def test_auto_kernel_is_chosen_again_after_a_device_move():
    m = _wo()
    assert m.kernel == "cpu"                        # the CPU fast path on the CPU
    m.to("meta")
    assert m.kernel == "reference"                  # no fast path on the meta device
    m.to_empty(device="cpu")
    assert m.kernel == "cpu"
    m.half()                                        # a dtype change is not a move: nothing re-chosen
    assert m.kernel == "cpu"


def test_explicit_kernel_is_kept_across_moves():
    m = _wo(kernel="reference")
    m.to("meta")
    assert m.kernel == "reference" and m.kernel_request == "reference"
    w = W8A8Linear.from_float(nn.Linear(64, 32), kernel="reference")
    assert w.kernel == "reference"                  # as asked, not the auto choice of the constructor


@pytest.mark.skipif(not triton_available("cpu" if INTERPRET else "cuda"), reason="needs Triton (GPU or interpreter)")
def test_w8a8_triton_codes_are_k_major_and_survive_save_load(tmp_path):
    device = "cpu" if INTERPRET else "cuda"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 40), nn.ReLU(), nn.Linear(40, 24)).to(device)
    q = wb.apply(model, {"*": wb.quant.Dynamic(kernel="triton")}, progress=False)
    layer = q[0]
    assert layer.kernel == "triton" and layer.qweight_t.shape == (48, 40)
    assert layer.qweight_t.t().is_contiguous()      # K-major: the transposed view of (out, in) codes
    x = torch.randn(5, 48, device=device)
    with torch.no_grad():
        y = q(x)
        ref = q[2].set_kernel("reference")(torch.relu(layer.set_kernel("reference")(x)))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    path = wb.save(q, tmp_path / "q.safetensors")
    back = wb.load(path, base=model)
    with torch.no_grad():
        torch.testing.assert_close(back(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quantized_on_the_cpu_then_moved_to_the_gpu_runs_the_gpu_path():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(3, 64)
    for cfg in (wb.quant.WeightOnly(bits=8), wb.quant.WeightOnly(bits=4, group_size=32), wb.quant.Dynamic()):
        q = wb.apply(model, {"*": cfg}, progress=False)
        with torch.no_grad():
            expected = q(x)
        q.cuda()
        assert {m.kernel for m in q.modules() if hasattr(m, "kernel")} == {"triton"}, cfg
        if isinstance(q[0], W8A8Linear):
            assert q[0].qweight_t.t().is_contiguous()
        with torch.no_grad():
            torch.testing.assert_close(q(x.cuda()).cpu(), expected, rtol=2e-3, atol=2e-3)
