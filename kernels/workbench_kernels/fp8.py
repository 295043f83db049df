"""fp8 (e4m3fn) scaled GEMM with row-wise scales for Hopper (sm_90): fp8 operands, fp32 accumulation.

The math::

    y[m, n] = (sum_k a[m, k] * b[n, k]) * scale_a[m] * scale_b[n] + bias[n]      a, b fp8; sum in fp32

``a`` ``(M, K)`` fp8 with ``scale_a`` fp32 ``(M, 1)`` (one scale per row / token); ``b`` ``(N, K)`` fp8 with
``scale_b`` fp32 ``(N, 1)``: exactly how `workbench.quantization.formats.FP8Format` stores a Linear weight
(``qweight`` ``(out, in)``, ``scale`` ``(out, 1)``, from ``primitives.float8_quantize``). The output is
bf16, fp16 or fp32. `quantize_rowwise` is the matching PyTorch quantizer (``scale = amax / finfo.max`` per
row, clamped below at fp32 eps), `quantize_rowwise_kernel` the same numbers in one Triton launch, and
`fp8_linear` chains that and the GEMM for a float input ``(..., K)``.

Blocking (Triton tutorial 03): one program computes a ``BLOCK_M x BLOCK_N`` tile of ``y``, programs in
groups of ``GROUP_M`` row blocks for L2 reuse of ``b``. The main loop walks K in ``BLOCK_K`` steps with
``acc += tl.dot(a_tile, b_tile^T)``; ``b`` ``(N, K)`` row-major is K-major, the layout Hopper's fp8 wgmma
requires for both operands, so no transpose is materialised. Hopper's fp8 MMA accumulates in reduced
precision and Triton never promotes by default on sm_90, so the dot is called with
``max_num_imprecise_acc=BLOCK_K``: each tile's partial sum is added into the fp32 register accumulator.
The epilogue applies ``scale_a`` per row, ``scale_b`` per column and the bias, then casts once.

Autotune space (GPU): BLOCK_M 64/128/256 (256 only with BLOCK_N 128), BLOCK_N 64/128/256 (128 x 256 excluded: it
spills with the promotion accumulator), BLOCK_K 128 (fp8 wgmma takes K = 32 per instruction; 128 bytes per row is
a full swizzled smem line), 4/8 warps, 3-4 stages; keyed on M rounded up to a power of two, N, K. Compiled ahead of time
for sm_90 every config lowers to ``wgmma ... f32.e4m3.e4m3`` without spills. Below sm_90 the launcher
raises (sm_89 has fp8 MMA too, but this kernel is tuned and checked for Hopper only); the interpreter runs
it on the CPU for tests (fp8 ``tl.dot`` works there).
"""
from __future__ import annotations

import torch

from workbench_kernels._common import INTERPRET, cdiv, check, check_same_device, configs, graph_bench, require_triton
from workbench_kernels.numerics import EPS, FLOAT8_DTYPES, PerChannel, float8_quantize

try:
    import triton
    import triton.language as tl
except ImportError:  # the references and op registrations still work; launching raises in require_triton
    triton = None

__all__ = ["fp8_scaled_mm", "fp8_linear", "quantize_rowwise", "quantize_rowwise_kernel", "reference",
           "uses_cublas", "MIN_CAPABILITY"]

FP8_DTYPES = FLOAT8_DTYPES
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_CAPABILITY = (9, 0)


def _gemm_configs() -> list:
    full = [
        # no 128 x 256 tile and no 128 x 128 tile on 4 warps: with the fp32 promotion accumulator beside the
        # MMA accumulator they spill registers on sm_90 (checked by compiling ahead of time)
        {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4},
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
        {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
        {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
        {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
    ]
    for c in full:
        c["GROUP_M"] = 8
    return configs(full, {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2})


if triton is not None:
    _INTERPRET_CAST = tl.constexpr(INTERPRET)

    @triton.autotune(configs=_gemm_configs(), key=["M_BUCKET", "N", "K"], do_bench=graph_bench)
    @triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
    @triton.jit
    def _fp8_scaled_mm_kernel(
        # pointers: A (M, K) fp8, B (N, K) fp8, s_a (M,) fp32, s_b (N,) fp32, bias (N,), Y (M, N)
        a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, y_ptr,
        # sizes; M_BUCKET (next power of two of M) only keys the autotuner
        M, N, K, M_BUCKET,
        # strides
        stride_am, stride_ak, stride_bn, stride_bk, stride_ym, stride_yn,
        # meta-parameters: INT64 offsets when a tensor has 2^31 elements or more; EVEN_K: no K remainder
        HAS_BIAS: tl.constexpr, INT64: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        # grouped ordering: GROUP_M row blocks walk the column blocks together (b tiles reused in L2)
        pid = tl.program_id(0)
        grid_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = tl.swizzle2d(pid // grid_n, pid % grid_n, tl.cdiv(M, BLOCK_M), grid_n, GROUP_M)

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                  # (BLOCK_M,)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                  # (BLOCK_N,)
        # loads wrap past the last row / column (valid duplicates, never stored): no M / N masks, and with
        # EVEN_K no mask at all, so the pipelined copies stay unpredicated
        offs_m, offs_n = rows % M, cols % N
        if INT64:
            offs_m, offs_n = offs_m.to(tl.int64), offs_n.to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)

        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak   # (BLOCK_M, BLOCK_K)
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn   # (BLOCK_K, BLOCK_N) = B^T
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_left = K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

        s_a = tl.load(sa_ptr + offs_m)
        s_b = tl.load(sb_ptr + offs_n)
        y = acc * s_a[:, None] * s_b[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))

    @triton.jit
    def _round_to_fp8_grid(v, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
        """fp32 ``v`` (within the fp8 range) rounded half to even onto the fp8 grid, in fp32. For the
        interpreter only, whose fp32 -> fp8 cast drops the carry when rounding up crosses a power of two
        (124.3 -> 64 in e4m3): after this the cast is exact. The step is 2^(max(e, MIN_EXP) - MANT_BITS) for
        v's exponent e (subnormals share the smallest step); v / step is exact and below 2^(MANT_BITS + 1), so
        the 1.5 * 2^23 add / subtract rounds it half to even."""
        e = ((v.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
        step = ((tl.maximum(e, MIN_EXP) - MANT_BITS + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        return ((v / step + 12582912.0) - 12582912.0) * step

    @triton.jit
    def _quantize_rowwise_kernel(
        x_ptr, q_ptr, s_ptr,            # x (M, K) float, q (M, K) fp8, scales (M,) fp32
        M, K, stride_xm, stride_xk, stride_qm, stride_qk,
        FMAX: tl.constexpr, EPS_: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """One program: BLOCK_M rows. Pass 1 over K: absmax -> scale = max(amax / fmax, eps); pass 2:
        clamp(x / scale, +-fmax) cast to fp8 (round to nearest even). IEEE divisions, as `quantize_rowwise`."""
        offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = m_mask[:, None] & (k0 + offs_k[None, :] < K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k[None, :]) * stride_xk, mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        scale = tl.maximum(tl.math.div_rn(amax, FMAX), EPS_)                             # (BLOCK_M,)
        tl.store(s_ptr + offs_m, scale, mask=m_mask)
        for k0 in range(0, K, BLOCK_K):
            mask = m_mask[:, None] & (k0 + offs_k[None, :] < K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k[None, :]) * stride_xk, mask=mask, other=0.0)
            v = tl.math.div_rn(x.to(tl.float32), scale[:, None])
            v = tl.minimum(tl.maximum(v, -FMAX), FMAX)
            if _INTERPRET_CAST:
                v = _round_to_fp8_grid(v, MANT_BITS, MIN_EXP)
            tl.store(q_ptr + offs_m[:, None] * stride_qm + (k0 + offs_k[None, :]) * stride_qk,
                     v.to(q_ptr.dtype.element_ty), mask=mask)


# --- launcher --------------------------------------------------------------------------------------------

def _check(op: str, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
           bias: torch.Tensor | None, out_dtype: torch.dtype) -> None:
    check("a", a, dtypes=FP8_DTYPES, ndim=2, op=op)
    check("b", b, dtypes=FP8_DTYPES, ndim=2, op=op)
    (M, K), (N, Kb) = a.shape, b.shape
    if K != Kb:
        raise ValueError(f"{op}: a is (M, K) = {(M, K)} and b is (N, K) = {(N, Kb)}: K differs")
    if K == 0:
        raise ValueError(f"{op}: K must be >= 1, got a of shape {(M, K)}")
    check("scale_a", scale_a, dtypes=(torch.float32,), shape=(M, 1), op=op)
    check("scale_b", scale_b, dtypes=(torch.float32,), shape=(N, 1), op=op)
    if bias is not None:
        check("bias", bias, dtypes=OUT_DTYPES, shape=(N,), op=op)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"{op}: out_dtype must be one of bfloat16, float16, float32; got {out_dtype}")
    check_same_device(op, a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)


def _require_sm90(op: str, device: torch.device) -> None:
    require_triton(op, device)
    if not INTERPRET and device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < MIN_CAPABILITY:
            raise RuntimeError(f"{op}: the fp8 kernel targets Hopper (sm_90) or newer; {device} is "
                               f"sm_{cap[0]}{cap[1]}. Dequantize and use a float matmul there "
                               f"(workbench_kernels.fp8.reference computes the same numbers).")


@torch.library.custom_op("workbench::fp8_scaled_mm", mutates_args=())
def fp8_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``y (M, N) = (a @ b^T) * scale_a * scale_b^T + bias`` in ``out_dtype``; a (M, K), b (N, K) fp8."""
    op = "fp8_scaled_mm"
    _check(op, a, b, scale_a, scale_b, bias, out_dtype)
    _require_sm90(op, a.device)
    M, K = a.shape
    N = b.shape[0]
    y = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return y
    grid = lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _fp8_scaled_mm_kernel[grid](
        a, b, scale_a, scale_b, bias if bias is not None else scale_a, y,
        M, N, K, triton.next_power_of_2(M),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, INT64=max(a.numel(), b.numel(), y.numel()) >= 2**31, enable_fp_fusion=True)
    return y


@fp8_scaled_mm.register_fake
def _(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16):
    _check("fp8_scaled_mm", a, b, scale_a, scale_b, bias, out_dtype)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """A Linear with an `FP8Format` weight and dynamically fp8-quantized activations: x (..., K) float,
    ``qweight`` (N, K) fp8, ``scale`` (N, 1) -> (..., N) in x's dtype. The activations are quantized by
    `quantize_rowwise_kernel` (one Triton launch; the same numbers as `quantize_rowwise`)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in OUT_DTYPES:
        raise TypeError(f"fp8_linear: x must be a bfloat16, float16 or float32 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    check("qweight", qweight, dtypes=FP8_DTYPES, ndim=2, op="fp8_linear")
    check("scale", scale, dtypes=(torch.float32,), shape=(qweight.shape[0], 1), op="fp8_linear")
    a, scale_a = quantize_rowwise_kernel(x.reshape(-1, x.shape[-1]), qweight.dtype)   # (M, K) fp8, (M, 1)
    if uses_cublas(x.dtype, qweight, bias):
        y = torch._scaled_mm(a, qweight.t(), scale_a=scale_a,
                             scale_b=scale.reshape(1, -1), bias=bias, out_dtype=x.dtype)
    else:
        y = fp8_scaled_mm(a, qweight, scale_a, scale, bias, x.dtype)                # (M, N)
    return y.reshape(*x.shape[:-1], qweight.shape[0])


def uses_cublas(out_dtype: torch.dtype, qweight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `fp8_linear` runs its GEMM through ``torch._scaled_mm`` (cuBLASLt, row-wise scales) instead of
    `fp8_scaled_mm`: on a real GPU (not the interpreter), for bf16 activations (row-wise scaling in
    ``_scaled_mm`` produces bf16) and e4m3 weights, with a bf16 bias or none. Measured on an H100 (graph-timed,
    the same Triton quantizer in front of both): cuBLASLt 0.77-0.86x the Triton GEMM's time at M >= 1024 on
    Llama shapes and within a few percent at M <= 256 (docs/kernels.md, GPU, third pass)."""
    return (not INTERPRET and qweight.is_cuda and out_dtype == torch.bfloat16
            and qweight.dtype == torch.float8_e4m3fn and qweight.is_contiguous()
            and (bias is None or bias.dtype == torch.bfloat16)
            and torch.cuda.get_device_capability(qweight.device) >= (8, 9))


def quantize_rowwise_kernel(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rowwise` in one Triton launch (two passes over each row block: absmax, then quantize), bit for
    bit the same values and scales. In PyTorch the same work is ~6 kernels over fp32 copies of x: 143 us for
    2048 x 4096 bf16 on an H100, more than the fp8 GEMM it feeds."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"quantize_rowwise_kernel: dtype must be one of {FP8_DTYPES}, got {dtype}")
    check("x", x, dtypes=OUT_DTYPES, ndim=2, contiguous=False, op="quantize_rowwise_kernel")
    require_triton("quantize_rowwise_kernel", x.device)
    M, K = x.shape
    q = torch.empty((M, K), dtype=dtype, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, s.fill_(EPS)
    block_m = 1 if INTERPRET else 4
    block_k = min(triton.next_power_of_2(K), 64 if INTERPRET else 1024)
    _quantize_rowwise_kernel[(cdiv(M, block_m),)](
        x, q, s, M, K, x.stride(0), x.stride(1), q.stride(0), q.stride(1),
        FMAX=torch.finfo(dtype).max, EPS_=EPS, MANT_BITS=3 if dtype == torch.float8_e4m3fn else 2,
        MIN_EXP=-6 if dtype == torch.float8_e4m3fn else -14, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4)
    return q, s


# --- references ------------------------------------------------------------------------------------------

def quantize_rowwise(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 values (R, K), fp32 scale (R, 1))`` with ``x ~ values * scale`` per row of a 2-D ``x``: the
    numbers of ``primitives.float8_quantize(x, PerChannel(0), dtype)``."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"quantize_rowwise: dtype must be one of {FP8_DTYPES}, got {dtype}")
    check("x", x, ndim=2, contiguous=False, op="quantize_rowwise")
    return float8_quantize(x, PerChannel(0), dtype)


def reference(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`fp8_scaled_mm` in PyTorch: the fp8 values exactly in fp32, an fp32 matmul, the same epilogue."""
    y = (a.float() @ b.float().t()) * scale_a * scale_b.t()               # (M, N)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
