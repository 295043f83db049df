"""kernels/workbench_kernels/w8a8.py: per-token quantization and the W8A8 GEMM against the package's numbers.

Under the interpreter (no GPU) everything runs on the CPU; codes, scales and fp32 / fp16 outputs must match
`W8A8Linear` exactly (K <= 1024 keeps its fp32 reference matmul exact). The interpreter's fp32 -> bf16 cast
truncates instead of rounding, so bf16 outputs are compared to within one bf16 ulp.
"""
import pytest
import torch
from torch import nn

from workbench.quantization.modules import W8A8Linear
from workbench.quantization.primitives import quantize_per_token as module_quantize_per_token
from workbench_kernels import w8a8
from workbench_kernels._common import INTERPRET, triton_available

DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not triton_available(DEVICE), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
gpu_only = pytest.mark.gpu   # compiled kernels on a GPU (conftest skips it without one or under the interpreter)


def _layer(K: int, N: int, bias: bool, seed: int = 0) -> W8A8Linear:
    torch.manual_seed(seed)
    return W8A8Linear.from_float(nn.Linear(K, N, bias=bias)).to(DEVICE)


def _x(shape, dtype=torch.float32, seed=1) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randn(shape) * 3
    x[..., 0] = 40.0  # an outlier channel, as in real activations
    return x.to(DEVICE, dtype)


@pytest.mark.parametrize("shape", [(1, 32), (5, 80), (33, 80), (2, 3, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_per_token_equals_module(shape, dtype):
    x = _x(shape, dtype)
    q, s = w8a8.quantize_per_token(x)
    q_mod, s_mod = module_quantize_per_token(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (q.shape[0], 1)
    assert torch.equal(q, q_mod) and torch.equal(s, s_mod)
    q_ref, s_ref = w8a8.quantize_per_token_reference(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


def test_quantize_per_token_zero_row_and_ties():
    x = torch.zeros(3, 40)
    x[1, :4] = torch.tensor([127.5, 0.5, 1.5, -2.5])  # scale 1: ties round to even
    x[2] = 1e-30                                       # below eps: scale clamps
    q, s = w8a8.quantize_per_token(x.to(DEVICE))
    assert torch.equal(q[0].cpu(), torch.zeros(40, dtype=torch.int8))
    assert q[1, :4].tolist() == [127, 0, 2, -2]
    assert s[0].item() == s[2].item() == torch.finfo(torch.float32).eps


@pytest.mark.parametrize("M", [1, 5, 33, 65])
@pytest.mark.parametrize("K,N", [(32, 16), (80, 48)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_w8a8_mm_equals_module_fp32(M, K, N, bias, fused):
    layer = _layer(K, N, bias)
    x = _x((M, K))
    y = w8a8.w8a8_mm(x, layer.qweight_t, layer.scale, layer.bias, fused=fused)
    with torch.no_grad():
        expected = layer(x)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    assert torch.equal(y, expected)
    assert torch.equal(w8a8.reference(x, layer.qweight_t, layer.scale, layer.bias), expected)


@pytest.mark.parametrize("fused", [True, False])
def test_w8a8_mm_fp16_exact_bf16_within_one_ulp(fused):
    layer = _layer(80, 48, bias=True)
    for dtype in (torch.float16, torch.bfloat16):
        x = _x((33, 80), dtype)
        y = w8a8.w8a8_mm(x, layer.qweight_t, layer.scale, layer.bias, fused=fused)
        with torch.no_grad():
            expected = layer(x)
        assert y.dtype == dtype
        if dtype == torch.float16:
            assert torch.equal(y, expected)
        else:  # same fp32 value; bf16 cast rounds on the GPU, truncates in the interpreter
            torch.testing.assert_close(y, expected, rtol=2 ** -7, atol=0)


def test_fused_and_two_kernel_paths_agree_and_default_choice():
    layer = _layer(80, 48, bias=True)
    x = _x((2, 40, 80), torch.float16)  # M = 80 > FUSED_MAX_M: the default is the two-kernel path
    y_fused = w8a8.w8a8_mm(x, layer.qweight_t, layer.scale, layer.bias, fused=True)
    y_two = w8a8.w8a8_mm(x, layer.qweight_t, layer.scale, layer.bias, fused=False)
    y_default = w8a8.w8a8_mm(x, layer.qweight_t, layer.scale, layer.bias)
    assert y_fused.shape == (2, 40, 48)
    assert torch.equal(y_fused, y_two) and torch.equal(y_fused, y_default)


def test_k_major_weight_view():
    """The transpose of an (N, K) row-major weight (K-major, Hopper's preferred int8 layout) gives the same y."""
    layer = _layer(80, 48, bias=False)
    w_nk = layer.qweight_t.t().contiguous()                  # (N, K)
    x = _x((5, 80))
    assert torch.equal(w8a8.w8a8_mm(x, w_nk.t(), layer.scale), w8a8.w8a8_mm(x, layer.qweight_t, layer.scale))


def test_empty_batch():
    layer = _layer(32, 16, bias=True)
    y = w8a8.w8a8_mm(torch.empty(0, 32, device=DEVICE), layer.qweight_t, layer.scale, layer.bias)
    assert y.shape == (0, 16)


def test_bad_inputs_name_the_argument():
    layer = _layer(32, 16, bias=True)
    w, s, b = layer.qweight_t, layer.scale, layer.bias
    x = _x((4, 32))
    with pytest.raises(TypeError, match="x must have dtype"):
        w8a8.w8a8_mm(x.to(torch.int32), w, s, b)
    with pytest.raises(ValueError, match="x must be contiguous"):
        w8a8.w8a8_mm(_x((32, 4)).t(), w, s, b)
    with pytest.raises(ValueError, match="qweight_t"):
        w8a8.w8a8_mm(_x((4, 48)), w, s, b)
    with pytest.raises(TypeError, match="qweight_t must have dtype"):
        w8a8.w8a8_mm(x, w.float(), s, b)
    with pytest.raises(ValueError, match="qweight_t must be a contiguous"):
        w8a8.w8a8_mm(x, torch.zeros(32, 32, dtype=torch.int8, device=DEVICE)[:, ::2], s, b)
    with pytest.raises(ValueError, match="scale must have shape"):
        w8a8.w8a8_mm(x, w, s.reshape(16, 1), b)
    with pytest.raises(TypeError, match="scale must have dtype"):
        w8a8.w8a8_mm(x, w, s.half(), b)
    with pytest.raises(ValueError, match="bias must have shape"):
        w8a8.w8a8_mm(x, w, s, b[:8])
    with pytest.raises(TypeError, match="x must have dtype"):
        w8a8.quantize_per_token(torch.ones(4, 8, dtype=torch.int8, device=DEVICE))


def test_opcheck_and_compile():
    layer = _layer(32, 16, bias=True)
    bias = layer.bias.detach()  # an inference op: no autograd formula
    x = _x((3, 32))
    torch.library.opcheck(torch.ops.workbench.quantize_per_token.default, (x,))
    torch.library.opcheck(torch.ops.workbench.w8a8_mm.default, (x, layer.qweight_t, layer.scale, bias, True))
    torch.library.opcheck(torch.ops.workbench.w8a8_mm.default, (x, layer.qweight_t, layer.scale, None, False))

    def fn(x):
        return w8a8.w8a8_mm(torch.relu(x), layer.qweight_t, layer.scale, bias) * 2

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), fn(x))


@gpu_only
@pytest.mark.parametrize("fused", [True, False])
def test_gpu_bf16_llama_like_shape(fused):
    torch.manual_seed(0)
    K, N = 1024, 768
    w = torch.randint(-127, 128, (K, N), dtype=torch.int8, device="cuda")
    scale = torch.rand(1, N, device="cuda") * 1e-3
    bias = torch.randn(N, device="cuda")
    x = torch.randn(300, K, device="cuda", dtype=torch.bfloat16)
    y = w8a8.w8a8_mm(x, w, scale, bias, fused=fused)
    torch.testing.assert_close(y, w8a8.reference(x, w, scale, bias), rtol=2 ** -8, atol=0)
    x32 = x.float()
    assert torch.equal(w8a8.w8a8_mm(x32, w, scale, bias, fused=fused), w8a8.reference(x32, w, scale, bias))
