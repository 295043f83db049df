"""Int4 weight-only GEMM: ``y = x @ W.T + b`` with ``W`` stored two codes per byte and scaled per group.

The storage is `workbench.quantization.formats.IntFormat(4, g, symmetric, float_zero)` as the package keeps it
(consumed directly, never repacked). For an ``nn.Linear`` with ``out = N``, ``in = K``:

- ``qweight`` uint8 ``(N, ceil(K / 2))``: byte ``j`` of a row holds code ``2j`` in its low nibble and code
  ``2j + 1`` in its high nibble (unsigned codes ``u`` in 0..15);
- ``scale`` ``(N, K // g)`` (fp16); ``zero`` absent (symmetric: zero = 8), uint8 codes ``(N, K // g)``
  (asymmetric) or fp16 ``(N, K // g)`` (HQQ's float zero points)::

    W[n, k] = (u[n, k] - zero[n, k // g]) * scale[n, k // g]

  or, for a table format (E2M1 codes of MXFP4 / NVFP4: ``lut`` the 16 fp32 values, ``scale`` the fp32 block scales,
  no zero), ``W[n, k] = lut[u[n, k]] * scale[n, k // g]``: each code's value gathered from the table in registers
    y[m, n] = sum_k x[m, k] W[n, k] + bias[n]

Blocking (the shape of Triton's matmul tutorial). Program ``(pid, pid_k)`` owns the output tile
``y[BLOCK_M rows, BLOCK_N columns]`` (tiles in grouped order for L2 reuse) and the K-tiles
``pid_k, pid_k + SPLIT_K, ...``. Each step of the loop:

1. loads the activation tile ``(BLOCK_M, BLOCK_K)`` and splits it into its even and odd columns;
2. loads the packed tile ``(BLOCK_K / 2, BLOCK_N)`` once -- each byte a (low, high) pair of codes; both tiles
   are software-pipelined (``num_stages`` asynchronous copies in flight);
3. dequantizes both nibble planes in registers. When the K-tile lies inside one group (``g % BLOCK_K == 0``,
   the common case: g = 64 or 128, one (scale, zero) per column, fetched a step ahead) it forms ``u - z`` in
   x's dtype -- exact for integer zero points -- and applies the scale to the ``(BLOCK_M, BLOCK_N)`` partial
   product in fp32 when that is smaller than the weight tile (decode), to the weights otherwise. When the
   K-tile spans groups (g smaller than it, or not a multiple) it gathers (scale, zero) per row:
   ``w = (u - z) * s`` in fp32;
4. accumulates ``dot(x_even, W_low) + dot(x_odd, W_high)`` in fp32.

Pairing the nibble planes with the even / odd activation columns means the codes are never interleaved back
into k order, and each weight byte is read from memory once per row-tile of x.

At decode sizes the kernel would be bound by instruction issue rather than memory if each code went through
an int-to-float conversion (a quarter-rate instruction). On a GPU with fp16/bf16 activations
`_unpack_nibbles_fast` (inline PTX) instead ORs the code into the mantissa of a power of two and subtracts
it: about 2 instructions a weight rather than 7, as counted in the sm_90 machine code.

Two families of autotune configs (`_autotune_configs`), keyed on (M bucket, N, K, g):

- ``M <= 64`` (decode, the target: memory-bound on the 0.5 byte/value weight read): BLOCK_M 16/32/64 follows
  the M bucket, BLOCK_N 64..256 x BLOCK_K 64..256 trade programs against bytes in flight (BLOCK_K 32 only
  for g = 32), and SPLIT_K 1/2/4/8 splits the K loop when there are few output tiles (N / BLOCK_N below the
  SM count, e.g. N = 4096). Partial sums are added atomically into a zeroed fp32 buffer (the autotuner
  re-zeroes it between benchmark runs), then cast to x's dtype.
- ``M > 64`` (prefill): an ordinary tiled GEMM (BLOCK_M 64/128, no split) writing x's dtype directly.

``tl.dot`` gets fp16/bf16 operands on a GPU (fp32 operands in IEEE precision when x is fp32). Under the Triton
interpreter bf16 operands are widened to fp32 (its bf16 ``tl.dot`` is wrong), the PTX unpacking is replaced
by plain integer ops, and one small config runs. Tests: ``python -m pytest tests/kernels/test_int4_weight_only.py``
(they also compile the kernel for sm_90 without a GPU, with the ptxas that ships with Triton).
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
    graph_bench,
    launch_split_k,
    m_bucket,
    split_k_configs,
)
from workbench_kernels.numerics import dequantize_packed

__all__ = ["int4_weight_only_mm", "launch", "reference", "SMALL_M"]

OP = "int4_weight_only_mm"
X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ZERO_DTYPES = (torch.uint8, *FLOAT_DTYPES)


# ----------------------------------------------------------------------------------------------- configs
_DECODE_TILES = [(64, 128, 4, 4), (128, 128, 4, 4), (128, 64, 4, 5), (64, 256, 4, 3), (128, 256, 8, 3),
                 (256, 64, 8, 4), (128, 32, 4, 6), (256, 32, 8, 5)]     # (BLOCK_N, BLOCK_K, warps, stages)


def _autotune_configs(small_m: bool) -> list:
    return split_k_configs(small_m, _DECODE_TILES)


def _prune(configs: list, named_args: dict, **kwargs) -> list:
    """Drop configs whose BLOCK_M does not fit the M bucket, that split K into more parts than K-tiles, or
    (when another config avoids it) whose K-tile spans several groups (the slower gathered dequantization);
    the BLOCK_K = 32 tiles are there for g = 32 only."""
    args = {**named_args, **kwargs}
    g = args["GROUP_SIZE"]
    fit = fit_m_bucket(configs, args["M_BUCKET"], args["K"])
    one_group = [c for c in fit if g % c.kwargs["BLOCK_K"] == 0 and (c.kwargs["BLOCK_K"] >= 64 or g < 64)]
    return one_group or fit or configs[:1]


# ------------------------------------------------------------------------------------------------ kernel
@triton.jit
def _group_params(scale_ptrs, zero_ptrs, mask, HAS_ZERO: tl.constexpr):
    """(scale, zero point) of the groups at the given pointers, in fp32."""
    s = tl.load(scale_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZERO:
        z = tl.load(zero_ptrs, mask=mask, other=0).to(tl.float32)
    else:
        z = tl.full(s.shape, 8.0, tl.float32)        # symmetric 4-bit codes are offset by 2^(4-1)
    return s, z


@triton.jit
def _unpack_nibbles_fast(packed, dtype: tl.constexpr):
    """(low, high) nibbles of uint8 ``packed`` as exact fp16 / bf16 codes, by bit operations (GPU only).

    Four bytes per call: ``prmt`` moves bytes 0, 1 (2, 3) into the two 16-bit halves of a register, ``lop3``
    keeps one nibble per half and ORs in the bits of M (1024 in fp16, 128 in bf16) -- giving M + code
    exactly, as the code lands in M's mantissa -- and a packed FMA subtracts M. No int-to-float conversion:
    those run at a quarter of the ALU rate and would make the decode kernel compute-bound."""
    if dtype == tl.float16:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t01, t23, s01, s23, one, negm;
            mov.b32 one, 0x3C003C00;
            mov.b32 negm, 0xE400E400;
            prmt.b32 t01, $4, 0, 0x4140;
            prmt.b32 t23, $4, 0, 0x4342;
            shr.u32 s01, t01, 4;
            shr.u32 s23, t23, 4;
            lop3.b32 t01, t01, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 t23, t23, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 s01, s01, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 s23, s23, 0x000F000F, 0x64006400, 0xEA;
            fma.rn.f16x2 $0, t01, one, negm;
            fma.rn.f16x2 $1, t23, one, negm;
            fma.rn.f16x2 $2, s01, one, negm;
            fma.rn.f16x2 $3, s23, one, negm;
            }
            """,
            constraints="=r,=r,=r,=r,r", args=[packed], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t01, t23, s01, s23, one, negm;
            mov.b32 one, 0x3F803F80;
            mov.b32 negm, 0xC300C300;
            prmt.b32 t01, $4, 0, 0x4140;
            prmt.b32 t23, $4, 0, 0x4342;
            shr.u32 s01, t01, 4;
            shr.u32 s23, t23, 4;
            lop3.b32 t01, t01, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 t23, t23, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 s01, s01, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 s23, s23, 0x000F000F, 0x43004300, 0xEA;
            fma.rn.bf16x2 $0, t01, one, negm;
            fma.rn.bf16x2 $1, t23, one, negm;
            fma.rn.bf16x2 $2, s01, one, negm;
            fma.rn.bf16x2 $3, s23, one, negm;
            }
            """,
            constraints="=r,=r,=r,=r,r", args=[packed], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def _int4_weight_only_mm_kernel(
        # pointers: x (M, K), qweight (N, ceil(K/2)) uint8, scale / zero (N, K // GROUP_SIZE), bias (N,),
        # c (M, N) (fp32 when SPLIT_K > 1)
        x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, c_ptr, lut_ptr,
        # sizes (KP = ceil(K / 2) bytes a packed row); M_BUCKET only keys the autotuner
        M, N, K, KP, M_BUCKET,
        # strides (zero has scale's shape and strides)
        stride_xm, stride_xk, stride_wn, stride_wj, stride_sn, stride_sg, stride_cm, stride_cn,
        # what to compute: DOT_FP32 for fp32 operands, FAST_UNPACK for the PTX nibble unpacking (GPU, fp16/bf16)
        GROUP_SIZE: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
        FAST_UNPACK: tl.constexpr, HAS_LUT: tl.constexpr,
        # blocking
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        GROUP_M: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK_K // 2
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    # grouped ordering: GROUP_M row-tiles share the weight column-tiles they read while those sit in L2
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tl.swizzle2d(pid // num_pid_n, pid % num_pid_n, tl.cdiv(M, BLOCK_M), num_pid_n, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_j = tl.arange(0, HALF)                    # packed rows: byte j holds k = 2j (low) and 2j + 1 (high)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk  # (BLOCK_M, BLOCK_K)
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_j[:, None] * stride_wj  # (HALF, BLOCK_N)
    s_ptrs = scale_ptr + offs_n[None, :].to(tl.int64) * stride_sn                            # (1, BLOCK_N)
    z_ptrs = zero_ptr + offs_n[None, :].to(tl.int64) * stride_sn
    dot_dtype = tl.float32 if DOT_FP32 else x_ptr.dtype.element_ty
    PRECISION: tl.constexpr = "ieee" if DOT_FP32 else "tf32"      # (tf32 is the default; fp16/bf16 ignore it)

    ONE_GROUP: tl.constexpr = GROUP_SIZE % BLOCK_K == 0   # every K-tile lies inside one group
    if ONE_GROUP:  # (s, z) of the first K-tile; each step then fetches the next one's a step ahead
        grp = tl.minimum(pid_k * BLOCK_K, K - 1) // GROUP_SIZE * stride_sg     # clamped: always in bounds
        s, z = _group_params(s_ptrs + grp, z_ptrs + grp, n_mask[None, :], HAS_ZERO)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        k0, j0 = kt * BLOCK_K, kt * HALF
        a = tl.load(x_ptrs + k0 * stride_xk, mask=m_mask[:, None] & (k0 + offs_k[None, :] < K), other=0.0)
        a_even, a_odd = tl.split(tl.reshape(a.to(dot_dtype), (BLOCK_M, HALF, 2)))        # (BLOCK_M, HALF) x 2
        # the mask on the packed index j (not on k < K) keeps the load vectorizable and pipelined
        packed = tl.load(w_ptrs + j0 * stride_wj, mask=(j0 + offs_j[:, None] < KP) & n_mask[None, :], other=0)
        if ONE_GROUP:
            # codes minus the zero point in the dot's dtype (exact for integer zero points), then the group's
            # scale: on the (BLOCK_M, BLOCK_N) partial product when that has fewer entries than the weight tile
            # (decode), else on the weights
            if HAS_LUT:   # a table format (E2M1): each code's value, gathered from the 16-entry table
                d_lo = tl.load(lut_ptr + (packed & 0xF)).to(dot_dtype)
                d_hi = tl.load(lut_ptr + (packed >> 4)).to(dot_dtype)
            elif FAST_UNPACK:
                u_lo, u_hi = _unpack_nibbles_fast(packed, dot_dtype)                      # (HALF, BLOCK_N)
                zd = z.to(dot_dtype)
                d_lo, d_hi = u_lo - zd, u_hi - zd
            else:
                d_lo = ((packed & 0xF).to(tl.float32) - z).to(dot_dtype)
                d_hi = ((packed >> 4).to(tl.float32) - z).to(dot_dtype)
            if BLOCK_M <= BLOCK_K:
                part = tl.dot(a_even, d_lo, input_precision=PRECISION)
                part = tl.dot(a_odd, d_hi, part, input_precision=PRECISION)
                acc += part * s
            else:
                sd = s.to(dot_dtype)
                acc = tl.dot(a_even, d_lo * sd, acc, input_precision=PRECISION)
                acc = tl.dot(a_odd, d_hi * sd, acc, input_precision=PRECISION)
            # prefetch the next K-tile's (s, z): these small strided loads are not software-pipelined like the
            # tiles above, so their latency would otherwise stall every step (clamped in bounds: after the last
            # step the values go unused)
            grp = tl.minimum(k0 + SPLIT_K * BLOCK_K, K - 1) // GROUP_SIZE * stride_sg
            s, z = _group_params(s_ptrs + grp, z_ptrs + grp, n_mask[None, :], HAS_ZERO)
        else:  # the K-tile spans groups (g smaller than BLOCK_K, or not a multiple of it): (s, z) per row
            k_even = (k0 + 2 * offs_j)[:, None]                                          # (HALF, 1)
            grp = k_even // GROUP_SIZE * stride_sg
            s, z = _group_params(s_ptrs + grp, z_ptrs + grp, (k_even < K) & n_mask[None, :], HAS_ZERO)
            if HAS_LUT:
                w_lo = (tl.load(lut_ptr + (packed & 0xF)) * s).to(dot_dtype)
            else:
                w_lo = (((packed & 0xF).to(tl.float32) - z) * s).to(dot_dtype)
            if GROUP_SIZE % 2 == 1:     # an odd group size can end between the two codes of a byte
                grp = (k_even + 1) // GROUP_SIZE * stride_sg
                s, z = _group_params(s_ptrs + grp, z_ptrs + grp, (k_even + 1 < K) & n_mask[None, :], HAS_ZERO)
            if HAS_LUT:
                w_hi = (tl.load(lut_ptr + (packed >> 4)) * s).to(dot_dtype)
            else:
                w_hi = (((packed >> 4).to(tl.float32) - z) * s).to(dot_dtype)
            acc = tl.dot(a_even, w_lo, acc, input_precision=PRECISION)
            acc = tl.dot(a_odd, w_hi, acc, input_precision=PRECISION)

    if HAS_BIAS:  # added once, by the first K-split
        b = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc += b[None, :] * (pid_k == 0).to(tl.float32)
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    c_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
    else:  # partial sums into the zeroed fp32 buffer; only the sum after the kernel matters: relaxed order
        tl.atomic_add(c_ptrs, acc, mask=c_mask, sem="relaxed")


_KEY = ["M_BUCKET", "N", "K", "GROUP_SIZE", "HAS_ZERO", "HAS_BIAS", "HAS_LUT"]
_kernel_small_m = triton.autotune(configs=_autotune_configs(small_m=True), key=_KEY, reset_to_zero=["c_ptr"],
                                  do_bench=graph_bench,
                                  prune_configs_by={"early_config_prune": _prune})(_int4_weight_only_mm_kernel)
_kernel_large_m = triton.autotune(configs=_autotune_configs(small_m=False), key=_KEY,
                                  do_bench=graph_bench,
                                  prune_configs_by={"early_config_prune": _prune})(_int4_weight_only_mm_kernel)


# ---------------------------------------------------------------------------------------------- launcher
def _check_inputs(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                  group_size: int, bias: torch.Tensor | None, lut: torch.Tensor | None = None) -> tuple[int, int]:
    """Validate the arguments (also under fake tensors, so torch.compile reports the same errors); (N, K)."""
    check("x", x, dtypes=X_DTYPES, op=OP)
    if x.ndim < 1:
        raise ValueError(f"{OP}: x must have at least one dimension (..., K), got a scalar")
    K = x.shape[-1]
    check("qweight", qweight, dtypes=(torch.uint8,), ndim=2, op=OP)
    N = qweight.shape[0]
    if qweight.shape[1] != (K + 1) // 2:
        raise ValueError(f"{OP}: qweight must have shape (N, ceil(K / 2)) = (N, {(K + 1) // 2}) for "
                         f"K = x.shape[-1] = {K} (two codes per byte), got {tuple(qweight.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or K % group_size:
        raise ValueError(f"{OP}: group_size must be a positive int dividing K = x.shape[-1] = {K}, "
                         f"got {group_size!r}")
    check("scale", scale, dtypes=FLOAT_DTYPES, shape=(N, K // group_size), op=OP)
    if zero is not None:
        check("zero", zero, dtypes=ZERO_DTYPES, shape=(N, K // group_size), op=OP)
    if bias is not None:
        check("bias", bias, dtypes=FLOAT_DTYPES, shape=(N,), op=OP)
    if lut is not None:
        check("lut", lut, dtypes=(torch.float32,), shape=(16,), op=OP)
        if zero is not None:
            raise ValueError(f"{OP}: a table format (lut) has no zero points; got both")
    check_same_device(OP, x=x, qweight=qweight, scale=scale, zero=zero, bias=bias, lut=lut)
    return N, K


def launch(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
           group_size: int, bias: torch.Tensor | None = None, config: dict | None = None,
           lut: torch.Tensor | None = None) -> torch.Tensor:
    """Check, allocate, launch: ``(..., K) -> (..., N)`` in x's dtype (the custom op's implementation).

    ``config`` pins one configuration -- ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``SPLIT_K`` (and optionally
    ``num_warps``, ``num_stages``) -- instead of autotuning: for tests and benchmarks of a given blocking
    (each nibble plane is BLOCK_K / 2 deep, so BLOCK_K >= 32)."""
    N, K = _check_inputs(x, qweight, scale, zero, group_size, bias, lut)

    def call(kernel, x2, c, M):
        kernel(x2, qweight, scale, scale if zero is None else zero, scale if bias is None else bias, c,
               scale if lut is None else lut,
               M, N, K, qweight.shape[1], m_bucket(M),
               x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1), scale.stride(0),
               scale.stride(1), c.stride(0), c.stride(1),
               GROUP_SIZE=group_size, HAS_ZERO=zero is not None, HAS_BIAS=bias is not None,
               DOT_FP32=x.dtype == torch.float32 or (INTERPRET and x.dtype == torch.bfloat16),
               FAST_UNPACK=not INTERPRET and x.dtype != torch.float32, HAS_LUT=lut is not None, GROUP_M=8)

    return launch_split_k(OP, x, N, K, bias, config, (_kernel_small_m, _kernel_large_m),
                          _int4_weight_only_mm_kernel, min_block_k=32, call=call)


# --------------------------------------------------------------------------------------------- reference
def reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
              group_size: int, bias: torch.Tensor | None = None, lut: torch.Tensor | None = None) -> torch.Tensor:
    """The same math in PyTorch: dequantize to fp32, matmul in fp32, return x's dtype."""
    w = dequantize_packed(qweight, 4, x.shape[-1], scale, group_size, 8.0 if zero is None else zero,
                          lut=lut)                                                                 # (N, K)
    y = x.float() @ w.T                                                     # (..., N)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ------------------------------------------------------------------------------------------- custom op
# the schema is spelled out so that group_size is a plain int (it becomes a constexpr), never a SymInt
@torch.library.custom_op("workbench::int4_weight_only_mm", mutates_args=(),
                         schema="(Tensor x, Tensor qweight, Tensor scale, Tensor? zero, int group_size, "
                                "Tensor? bias=None, Tensor? lut=None) -> Tensor")
def _int4_weight_only_mm_op(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                            zero: torch.Tensor | None, group_size: int,
                            bias: torch.Tensor | None = None, lut: torch.Tensor | None = None) -> torch.Tensor:
    return launch(x, qweight, scale, zero, group_size, bias, lut=lut)


@_int4_weight_only_mm_op.register_fake
def _(x, qweight, scale, zero, group_size, bias=None, lut=None):
    N, _ = _check_inputs(x, qweight, scale, zero, group_size, bias, lut)
    return x.new_empty(*x.shape[:-1], N)


def int4_weight_only_mm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                        group_size: int, bias: torch.Tensor | None = None,
                        lut: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ W.T + bias`` with ``W[n, k] = (u[n, k] - zero[n, k // g]) * scale[n, k // g]`` (zero = 8 when
    None) or, with a 16-value table ``lut`` (E2M1 codes: MXFP4, NVFP4), ``W[n, k] = lut[u[n, k]] * scale[n, k // g]``;
    ``u`` the 4-bit codes packed two per byte in qweight ``(N, ceil(K / 2))``; x ``(..., K)`` -> ``(..., N)`` in x's
    dtype. Calls ``torch.ops.workbench.int4_weight_only_mm``."""
    return torch.ops.workbench.int4_weight_only_mm(x, qweight, scale, zero, group_size, bias, lut)
