"""workbench_kernels/fp8.py: the fp8 row-wise scaled GEMM against its PyTorch reference, and `quantize_rowwise` against
`primitives.float8_quantize`. The interpreter runs the kernel on the CPU; on a GPU it needs sm_90.

Tolerances: the kernel and the reference sum the same exact fp8 products in fp32 in different orders, so
fp32 outputs agree to ~1e-6 relative (and exactly when every partial sum is an integer below 2^24); fp16 to
one ulp; bf16 to one ulp (the interpreter's fp32 -> bf16 cast truncates, the GPU rounds).
"""
import pytest
import torch

from workbench.quantization import formats as fm
from workbench.quantization.primitives import PerChannel, float8_quantize, sqnr
from workbench_kernels import fp8
from workbench_kernels._common import INTERPRET, triton_available

E4M3 = torch.float8_e4m3fn
if INTERPRET or not torch.cuda.is_available():
    DEVICE, CAN_RUN = "cpu", INTERPRET and triton_available("cpu")
else:
    DEVICE, CAN_RUN = "cuda", torch.cuda.get_device_capability() >= fp8.MIN_CAPABILITY
needs_kernel = pytest.mark.skipif(not CAN_RUN, reason="needs an sm_90+ GPU or TRITON_INTERPRET=1")
# fp32 output: 1e-5 under the interpreter (fp32 sums); on Hopper the fp8 MMA adds its products with fewer bits than
# fp32 (the kernel promotes into an fp32 accumulator once per K-tile), measured on an H100 up to 3e-4 absolute
# at these sizes (outputs ~1): hence 1e-3 there
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5) if INTERPRET else dict(rtol=2 ** -10, atol=1e-3),
       torch.float16: dict(rtol=2 ** -10, atol=1e-3), torch.bfloat16: dict(rtol=2 ** -7, atol=1e-2)}


def _operands(M, N, K, seed=0, bias=True, dtype_b=E4M3):
    torch.manual_seed(seed)
    x, w = torch.randn(M, K, device=DEVICE), torch.randn(N, K, device=DEVICE) * 0.05
    a, scale_a = fp8.quantize_rowwise(x)
    b, scale_b = fp8.quantize_rowwise(w, dtype_b)
    return a, b, scale_a, scale_b, (torch.randn(N, device=DEVICE) if bias else None)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantize_rowwise_equals_float8_quantize(dtype):
    x = torch.randn(33, 80) * 5
    x[3] = 0.0
    q, s = fp8.quantize_rowwise(x, dtype)
    q_ref, s_ref = float8_quantize(x, PerChannel(0), dtype)
    assert q.dtype == dtype and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


@needs_kernel
@pytest.mark.parametrize("M", [1, 5, 33])
@pytest.mark.parametrize("N,K", [(16, 32), (48, 80)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scaled_mm_matches_reference(M, N, K, out_dtype):
    a, b, scale_a, scale_b, bias = _operands(M, N, K, bias=M != 5)
    y = fp8.fp8_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)
    assert y.dtype == out_dtype and y.shape == (M, N)
    torch.testing.assert_close(y, fp8.reference(a, b, scale_a, scale_b, bias, out_dtype), **TOL[out_dtype])


@needs_kernel
def test_integer_valued_operands_are_exact():
    """Small integers in fp8: every partial sum is exact in fp32, so the blocked kernel must equal the
    reference bit for bit (checks the indexing and masking of every tile)."""
    torch.manual_seed(0)
    M, N, K = 65, 48, 80
    a = torch.randint(-8, 9, (M, K), device=DEVICE).float().to(E4M3)
    b = torch.randint(-8, 9, (N, K), device=DEVICE).float().to(E4M3)
    scale_a = torch.full((M, 1), 0.5, device=DEVICE)
    scale_b = torch.arange(1, N + 1, device=DEVICE, dtype=torch.float32).reshape(N, 1) / 4
    bias = torch.arange(N, device=DEVICE, dtype=torch.float32)
    y = fp8.fp8_scaled_mm(a, b, scale_a, scale_b, bias, torch.float32)
    assert torch.equal(y, fp8.reference(a, b, scale_a, scale_b, bias, torch.float32))


@needs_kernel
def test_e5m2_weights():
    a, b, scale_a, scale_b, bias = _operands(5, 48, 80, dtype_b=torch.float8_e5m2)
    y = fp8.fp8_scaled_mm(a, b, scale_a, scale_b, bias, torch.float32)
    torch.testing.assert_close(y, fp8.reference(a, b, scale_a, scale_b, bias, torch.float32), **TOL[torch.float32])


@needs_kernel
def test_fp8_linear_with_fp8format_weight():
    """An `FP8Format`-encoded Linear weight used directly: close to the float layer (fp8 SQNR)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(80, 48).to(DEVICE)
    t = fm.encode(lin.weight.detach(), fm.FP8Format())
    x = torch.randn(2, 7, 80, device=DEVICE, dtype=torch.float16)
    y = fp8.fp8_linear(x, t["qweight"], t["scale"], lin.bias.detach())
    assert y.shape == (2, 7, 48) and y.dtype == torch.float16
    assert sqnr(lin(x.float()), y) > 25


def test_bad_inputs_name_the_argument():
    a, b, scale_a, scale_b, bias = _operands(5, 16, 32)
    with pytest.raises(TypeError, match="a must have dtype"):
        fp8.fp8_scaled_mm(a.float(), b, scale_a, scale_b)
    with pytest.raises(ValueError, match="K differs"):
        fp8.fp8_scaled_mm(a, b[:, :16].contiguous(), scale_a, scale_b)
    with pytest.raises(ValueError, match="b must be contiguous"):
        fp8.fp8_scaled_mm(a, torch.cat([b, b], 1)[:, ::2], scale_a, scale_b)
    with pytest.raises(ValueError, match="scale_a must have shape"):
        fp8.fp8_scaled_mm(a, b, scale_a.reshape(1, 5), scale_b)
    with pytest.raises(TypeError, match="scale_b must have dtype"):
        fp8.fp8_scaled_mm(a, b, scale_a, scale_b.half())
    with pytest.raises(ValueError, match="bias must have shape"):
        fp8.fp8_scaled_mm(a, b, scale_a, scale_b, bias[:3])
    with pytest.raises(TypeError, match="out_dtype"):
        fp8.fp8_scaled_mm(a, b, scale_a, scale_b, None, torch.int32)


@needs_kernel
def test_opcheck_and_compile():
    a, b, scale_a, scale_b, bias = _operands(3, 16, 32)
    # opcheck's test_schema multiplies the inputs, which PyTorch does not implement for fp8 on the CPU;
    # the other checks (fake impl, dynamic shapes under AOT dispatch, autograd registration) run
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    op = torch.ops.workbench.fp8_scaled_mm.default
    torch.library.opcheck(op, (a, b, scale_a, scale_b, bias, torch.float32), test_utils=utils)
    torch.library.opcheck(op, (a, b, scale_a, scale_b, None, torch.bfloat16), test_utils=utils)

    def fn(a):
        return fp8.fp8_scaled_mm(a, b, scale_a, scale_b, bias, torch.float32).relu()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(a), fn(a))


@pytest.mark.gpu
@pytest.mark.skipif(CAN_RUN, reason="needs a CUDA GPU below sm_90")
def test_below_sm90_raises_clearly():
    a, b, scale_a, scale_b, _ = _operands(4, 16, 32)
    with pytest.raises(RuntimeError, match="sm_90"):
        fp8.fp8_scaled_mm(a, b, scale_a, scale_b)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M, K", [(1, 80), (7, 130), (5, 3)])
def test_quantize_rowwise_kernel_is_bit_identical(M, K, x_dtype, dtype):
    """The Triton quantizer against the PyTorch one: same fp8 bits and scales, ragged K (not a multiple of
    its K-tile), a zero row, values past the fp8 range after scaling never (the row max maps to fmax)."""
    torch.manual_seed(0)
    x = (torch.randn(M, K, device=DEVICE) * 7).to(x_dtype)
    x[M // 2] = 0.0
    q, s = fp8.quantize_rowwise_kernel(x, dtype)
    q_ref, s_ref = fp8.quantize_rowwise(x, dtype)
    assert q.dtype == dtype and q.shape == (M, K) and s.shape == (M, 1)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@needs_kernel
def test_quantize_rowwise_kernel_refuses_bad_input():
    with pytest.raises(ValueError, match="dtype"):
        fp8.quantize_rowwise_kernel(torch.zeros(2, 4, device=DEVICE), torch.int8)
    with pytest.raises(TypeError, match="x must have dtype"):
        fp8.quantize_rowwise_kernel(torch.zeros(2, 4, device=DEVICE, dtype=torch.int32))


@pytest.mark.skipif(INTERPRET or not CAN_RUN, reason="needs an sm_90+ GPU (no interpreter)")
@pytest.mark.parametrize("M", [1, 64, 1024])
def test_fp8_linear_cublas_route_matches_the_triton_gemm(M):
    """bf16 activations with an e4m3 weight take ``torch._scaled_mm``; the same codes and scales through the
    Triton GEMM give the same outputs up to bf16 rounding of the result."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 384).to(DEVICE, torch.bfloat16)
    t = fm.encode(lin.weight.detach().float(), fm.FP8Format())
    x = torch.randn(M, 512, device=DEVICE, dtype=torch.bfloat16)
    bias = lin.bias.detach()
    assert fp8.uses_cublas(x.dtype, t["qweight"], bias)
    y = fp8.fp8_linear(x, t["qweight"], t["scale"], bias)
    a, scale_a = fp8.quantize_rowwise_kernel(x, t["qweight"].dtype)
    y_triton = fp8.fp8_scaled_mm(a, t["qweight"], scale_a, t["scale"], bias, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == (M, 384)
    torch.testing.assert_close(y.float(), y_triton.float(), rtol=2 ** -7, atol=1e-2)
    assert not fp8.uses_cublas(torch.float16, t["qweight"], None)       # row-wise _scaled_mm: bf16 out only
