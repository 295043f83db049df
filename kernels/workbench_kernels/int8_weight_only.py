"""Int8 weight-only GEMM: ``y = x @ W.T + b`` with ``W`` stored as uint8 codes and one fp16 scale per row.

The storage is `workbench.quantization.formats.IntFormat(8, None, symmetric=True)` as the package keeps it
(consumed directly, never repacked): ``qweight`` uint8 ``(N, K)`` holding unsigned codes ``u = q + 128`` and
``scale`` ``(N, 1)``, so for an ``nn.Linear`` with ``out = N``, ``in = K``::

    W[n, k] = (u[n, k] - 128) * scale[n]
    y[m, n] = scale[n] * sum_k x[m, k] * (u[n, k] - 128) + bias[n]

Blocking (the shape of Triton's matmul tutorial). Program ``(pid, pid_k)`` owns the output tile
``y[BLOCK_M rows, BLOCK_N columns]`` (tiles in grouped order, ``GROUP_M`` row-tiles at a time, for L2 reuse)
and the K-tiles ``pid_k, pid_k + SPLIT_K, ...``. Each step of the loop loads an activation tile
``(BLOCK_M, BLOCK_K)`` and a code tile ``(BLOCK_K, BLOCK_N)`` (read as ``W.T`` through strides; both
software-pipelined, ``num_stages`` asynchronous copies in flight), turns the codes in registers into
``u - 128`` -- exact in fp16 and bf16 -- in x's dtype, and accumulates ``tl.dot`` in fp32. The per-row scale
does not depend on k, so it is applied once to the accumulator after the loop, together with the bias. Each
weight byte is read once per row-tile of x.

On a GPU with fp16/bf16 activations the codes are converted by `_codes_fast` (inline PTX: the byte goes into
the mantissa of a power of two, and a subtraction finishes) rather than by int-to-float conversions, which
run at a quarter of the ALU rate: about 1 (fp16) or 2.5 (bf16) instructions a weight instead of 8, as counted
in the sm_90 machine code, which keeps decode memory-bound.

One row of x (``M = GEMV_M = 1``, decode) runs `_int8_gemv_kernel` instead: no ``tl.dot`` (whose tiles pad M
to 16 rows), each program streams BLOCK_N weight rows along K, decodes the codes to fp32 by bit operations
(`_codes_f32`), accumulates ``w * x`` elementwise and reduces along K once at the end, writing x's dtype
directly (no split-K buffer). On an H100 it took the 4096 x 14336 layer from 37 to 34 us (1.61x bf16).

Otherwise two families of autotune configs (`_autotune_configs`), keyed on (M bucket, N, K):

- ``M <= 64`` (decode): the weight read dominates and there are few output tiles (``N / BLOCK_N``, often
  fewer than an H100's 132 SMs), so the K loop is split ``SPLIT_K`` ways (1/2/4/8) over more programs. The
  partial sums are added atomically into an fp32 buffer (zeroed first; the autotuner re-zeroes it between
  benchmark runs) and cast to x's dtype after. BLOCK_M 16/32/64 follows the M bucket; BLOCK_N 64..256 and
  BLOCK_K 64..256 trade the number of programs against bytes in flight per program.
- ``M > 64`` (prefill): an ordinary tiled GEMM (BLOCK_M 64/128, no split) that writes x's dtype directly.

``tl.dot`` gets fp16/bf16 operands on a GPU (fp32 ones, in IEEE precision, when x is fp32). Under the Triton
interpreter bf16 operands are widened to fp32, because its bf16 ``tl.dot`` is wrong, the PTX conversion is
replaced by plain integer ops, and one small config runs. Run the tests with
``python -m pytest tests/kernels/test_int8_weight_only.py`` (they also compile the kernel for sm_90 without a
GPU, with the ptxas that ships with Triton).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench_kernels._common import (
    INTERPRET,
    SMALL_M,
    check,
    check_same_device,
    fit_m_bucket,
    gemv_configs,
    graph_bench,
    launch_split_k,
    m_bucket,
    split_k_configs,
)
from workbench_kernels.numerics import dequantize_packed

__all__ = ["int8_weight_only_mm", "launch", "reference", "SMALL_M"]

OP = "int8_weight_only_mm"
X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------- configs
_DECODE_TILES = [(64, 128, 4, 4), (128, 128, 4, 4), (128, 64, 4, 5), (64, 256, 4, 3), (256, 64, 8, 4),
                 (128, 256, 8, 3)]                                      # (BLOCK_N, BLOCK_K, warps, stages)


_GEMV_TILES = [(8, 256, 4, 3), (16, 256, 4, 3), (8, 512, 4, 2), (16, 512, 8, 2), (32, 128, 4, 4),
               (32, 256, 8, 3), (4, 512, 4, 3), (16, 128, 4, 4)]      # (BLOCK_N, BLOCK_K, warps, stages)


def _autotune_configs(small_m: bool) -> list:
    return split_k_configs(small_m, _DECODE_TILES)


def _prune(configs: list, named_args: dict, **kwargs) -> list:
    """Drop configs whose BLOCK_M does not fit the M bucket, or that split K into more parts than K-tiles."""
    args = {**named_args, **kwargs}
    return fit_m_bucket(configs, args["M_BUCKET"], args["K"]) or configs[:1]


# ------------------------------------------------------------------------------------------------ kernel
@triton.jit
def _codes_fast(u, dtype: tl.constexpr):
    """uint8 codes ``u`` -> exact ``u - 128`` in fp16 / bf16 by bit operations (GPU only), four per call.

    fp16: ``prmt`` puts two code bytes under the exponent byte 0x64 (giving 1024 + u in each half) and one
    packed subtraction of 1152 finishes. bf16 has too few mantissa bits for that, so each byte goes under the
    fp32 exponent of 2^23 (2^23 + u), an fp32 subtraction and a pack to bf16x2 follow. No int-to-float
    conversion: those run at a quarter of the ALU rate and would bound the decode kernel."""
    if dtype == tl.float16:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t01, t23, hi, bias;
            mov.b32 hi, 0x64646464;
            mov.b32 bias, 0x64806480;
            prmt.b32 t01, $2, hi, 0x4140;
            prmt.b32 t23, $2, hi, 0x4342;
            sub.f16x2 $0, t01, bias;
            sub.f16x2 $1, t23, bias;
            }
            """,
            constraints="=r,=r,r", args=[u], dtype=tl.float16, is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 f0, f1, f2, f3, hi;
            mov.b32 hi, 0x4B000000;
            prmt.b32 f0, $2, hi, 0x7650;
            prmt.b32 f1, $2, hi, 0x7651;
            prmt.b32 f2, $2, hi, 0x7652;
            prmt.b32 f3, $2, hi, 0x7653;
            sub.f32 f0, f0, 0f4B000080;
            sub.f32 f1, f1, 0f4B000080;
            sub.f32 f2, f2, 0f4B000080;
            sub.f32 f3, f3, 0f4B000080;
            cvt.rn.bf16x2.f32 $0, f1, f0;
            cvt.rn.bf16x2.f32 $1, f3, f2;
            }
            """,
            constraints="=r,=r,r", args=[u], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def _int8_weight_only_mm_kernel(
        # pointers: x (M, K), qweight (N, K) uint8, scale (N, 1), bias (N,), c (M, N) (fp32 when SPLIT_K > 1)
        x_ptr, w_ptr, scale_ptr, bias_ptr, c_ptr,
        # sizes; M_BUCKET only keys the autotuner
        M, N, K, M_BUCKET,
        # strides
        stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_cm, stride_cn,
        # what to compute: DOT_FP32 for fp32 operands, FAST_UNPACK for the PTX code conversion (GPU, fp16/bf16)
        HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, FAST_UNPACK: tl.constexpr,
        # blocking
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        GROUP_M: tl.constexpr,
):
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    # grouped ordering: GROUP_M row-tiles share the weight column-tiles they read while those sit in L2
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tl.swizzle2d(pid // num_pid_n, pid % num_pid_n, tl.cdiv(M, BLOCK_M), num_pid_n, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk  # (BLOCK_M, BLOCK_K)
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk  # (BLOCK_K, BLOCK_N)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        k0 = kt * BLOCK_K
        k_mask = k0 + offs_k < K
        a = tl.load(x_ptrs + k0 * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        # other=0, not 128: the masked rows meet zero activations anyway, and a non-zero fill would cost a
        # select per element after the asynchronous copy (which can only zero-fill)
        u = tl.load(w_ptrs + k0 * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0)
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), u.to(tl.float32) - 128.0, acc, input_precision="ieee")
        elif FAST_UNPACK:
            acc = tl.dot(a, _codes_fast(u, a.dtype), acc)
        else:  # u - 128 is an integer in [-128, 127]: exact in fp16 and bf16
            acc = tl.dot(a, u.to(a.dtype) - 128.0, acc)

    s = tl.load(scale_ptr + offs_n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)
    acc = acc * s[None, :]
    if HAS_BIAS:  # added once, by the first K-split
        b = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc += b[None, :] * (pid_k == 0).to(tl.float32)
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    c_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
    else:  # partial sums into the zeroed fp32 buffer; only the sum after the kernel matters: relaxed order
        tl.atomic_add(c_ptrs, acc, mask=c_mask, sem="relaxed")


@triton.jit
def _codes_f32(u):
    """uint8 codes -> exact fp32 ``u - 128``: the byte ORed into the mantissa of 2^23 (giving 2^23 + u), then
    one subtraction -- integer ops at full rate instead of a quarter-rate int-to-float conversion."""
    f = (u.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True)
    return f - 8388736.0                                                  # 2^23 + 128


@triton.jit
def _int8_gemv_kernel(
        # pointers: x (1, K), qweight (N, K) uint8, scale (N, 1), bias (N,), c (1, N) in x's dtype
        x_ptr, w_ptr, scale_ptr, bias_ptr, c_ptr,
        N, K,
        stride_xk, stride_wn, stride_wk, stride_sn, stride_cn,
        HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,     # one program owns BLOCK_N weight rows
):
    """GEMV for one row of x (decode): each program streams BLOCK_N rows of the weight along K (contiguous,
    coalesced), converts the codes in fp32 registers and accumulates ``w * x`` elementwise in a
    (BLOCK_N, BLOCK_K) fp32 tile -- one decode and one FMA per weight, no cross-thread work in the loop --
    reduced along K once at the end. No tl.dot (which pads M to 16 rows) and no split-K buffer."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk  # (BLOCK_N, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + offs_k < K
        w = _codes_f32(tl.load(w_ptrs + k0 * stride_wk, mask=n_mask[:, None] & k_mask[None, :], other=128))
        a = tl.load(x_ptr + (k0 + offs_k) * stride_xk, mask=k_mask, other=0.0).to(tl.float32)    # (BLOCK_K,)
        acc += w * a[None, :]
    y = tl.sum(acc, axis=1)                                                                     # (BLOCK_N,)
    y = y * tl.load(scale_ptr + offs_n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs_n * stride_cn, y.to(c_ptr.dtype.element_ty), mask=n_mask)


_KEY = ["M_BUCKET", "N", "K", "HAS_BIAS"]
_kernel_small_m = triton.autotune(configs=_autotune_configs(small_m=True), key=_KEY, reset_to_zero=["c_ptr"],
                                  do_bench=graph_bench,
                                  prune_configs_by={"early_config_prune": _prune})(_int8_weight_only_mm_kernel)
_kernel_large_m = triton.autotune(configs=_autotune_configs(small_m=False), key=_KEY,
                                  do_bench=graph_bench,
                                  prune_configs_by={"early_config_prune": _prune})(_int8_weight_only_mm_kernel)
_kernel_gemv = triton.autotune(configs=gemv_configs(_GEMV_TILES), key=["N", "K", "HAS_BIAS"],
                               do_bench=graph_bench)(_int8_gemv_kernel)


# ---------------------------------------------------------------------------------------------- launcher
def _check_inputs(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None) -> tuple[int, int]:
    """Validate the arguments (also under fake tensors, so torch.compile reports the same errors); (N, K)."""
    check("x", x, dtypes=X_DTYPES, op=OP)
    if x.ndim < 1:
        raise ValueError(f"{OP}: x must have at least one dimension (..., K), got a scalar")
    K = x.shape[-1]
    check("qweight", qweight, dtypes=(torch.uint8,), ndim=2, op=OP)
    N = qweight.shape[0]
    if qweight.shape[1] != K:
        raise ValueError(f"{OP}: qweight must have shape (N, K) with K = x.shape[-1] = {K}, got "
                         f"{tuple(qweight.shape)}")
    check("scale", scale, dtypes=FLOAT_DTYPES, shape=(N, 1), op=OP)
    if bias is not None:
        check("bias", bias, dtypes=FLOAT_DTYPES, shape=(N,), op=OP)
    check_same_device(OP, x=x, qweight=qweight, scale=scale, bias=bias)
    return N, K


def launch(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
           bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Check, allocate, launch: ``(..., K) -> (..., N)`` in x's dtype (the custom op's implementation).

    ``config`` pins one configuration -- ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``SPLIT_K`` (and optionally
    ``num_warps``, ``num_stages``) -- instead of autotuning: for tests and benchmarks of a given blocking."""
    N, K = _check_inputs(x, qweight, scale, bias)

    def call(kernel, x2, c, M):
        kernel(x2, qweight, scale, scale if bias is None else bias, c,
               M, N, K, m_bucket(M),
               x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1), scale.stride(0),
               c.stride(0), c.stride(1),
               HAS_BIAS=bias is not None,
               DOT_FP32=x.dtype == torch.float32 or (INTERPRET and x.dtype == torch.bfloat16),
               FAST_UNPACK=not INTERPRET and x.dtype != torch.float32, GROUP_M=8)

    def call_gemv(kernel, x2, c, M):
        kernel(x2, qweight, scale, scale if bias is None else bias, c, N, K,
               x2.stride(1), qweight.stride(0), qweight.stride(1), scale.stride(0), c.stride(1),
               HAS_BIAS=bias is not None)

    return launch_split_k(OP, x, N, K, bias, config, (_kernel_small_m, _kernel_large_m),
                          _int8_weight_only_mm_kernel, min_block_k=16, call=call, gemv=(_kernel_gemv, call_gemv))


# --------------------------------------------------------------------------------------------- reference
def reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same math in PyTorch: dequantize to fp32, matmul in fp32, return x's dtype."""
    w = dequantize_packed(qweight, 8, qweight.shape[1], scale, qweight.shape[1], 128.0)   # (N, K), one group
    y = x.float() @ w.T                                                     # (..., N)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ------------------------------------------------------------------------------------------- custom op
@torch.library.custom_op("workbench::int8_weight_only_mm", mutates_args=())
def _int8_weight_only_mm_op(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    return launch(x, qweight, scale, bias)


@_int8_weight_only_mm_op.register_fake
def _(x, qweight, scale, bias=None):
    N, _ = _check_inputs(x, qweight, scale, bias)
    return x.new_empty(*x.shape[:-1], N)


def int8_weight_only_mm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ ((qweight - 128) * scale).T + bias`` for x ``(..., K)``, qweight uint8 ``(N, K)``, scale
    ``(N, 1)``; returns ``(..., N)`` in x's dtype. Calls ``torch.ops.workbench.int8_weight_only_mm``."""
    return torch.ops.workbench.int8_weight_only_mm(x, qweight, scale, bias)
