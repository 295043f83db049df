"""W8A8 GEMM: dynamic per-token int8 activations x int8 per-channel weights, int32 accumulation, fused rescale.

The math (the numbers of ``workbench.quantization.modules.W8A8Linear`` with ``static=False``)::

    s_x[m] = max(max_k |x[m, k]| / 127.5, eps)                  eps = torch.finfo(torch.float32).eps
    q_x[m, k] = clamp(round_half_even(x[m, k] * (1 / s_x[m])), -128, 127)       all in fp32
    y[m, n] = (sum_k q_x[m, k] * q_w[k, n]) * s_x[m] * s_w[n] + bias[n]        int32 sum, fp32 epilogue

``x`` is fp16 / bf16 / fp32 ``(..., K)``; the weight is the module's ``qweight_t`` int8 ``(K, N)`` (row-major,
or the transposed view of an ``(N, K)`` row-major tensor: K-major, which Hopper's int8 wgmma prefers) with
``scale`` fp32 ``(1, N)`` and an optional ``bias`` ``(N,)``; ``y`` has x's dtype.

Blocking (Triton tutorial 03): one program computes a ``BLOCK_M x BLOCK_N`` tile of ``y``. Programs are
ordered in groups of ``GROUP_M`` row blocks so that consecutive programs share weight columns in L2. The
main loop walks K in ``BLOCK_K`` steps: ``acc += tl.dot(a_tile_int8, w_tile_int8)`` into an int32
accumulator; the epilogue converts once to fp32, multiplies by ``s_x`` (per row) and ``s_w`` (per column),
adds the bias and stores in x's dtype. Two ways to get the int8 A tiles (same codes, bit for bit):

- fused (``fused=True``, default for M <= 64): the GEMM kernel reads the float activations. A prologue loop
  over the row block's K computes the per-row absmax and ``s_x``; the main loop quantizes each float A tile
  in registers just before the int8 ``tl.dot``. One launch, no int8 copy of x in memory: the right choice
  for decode-sized M, where the GEMM is bound by reading the weight and a second launch costs as much as
  the quantization itself.
- two kernels (``fused=False``, default for M > 64): `quantize_per_token` (memory-bound, reads x once,
  writes int8 codes + scales) then the GEMM on int8 operands. At prefill sizes (M = 2048, Llama shapes)
  the fused variant would redo the quantization (absmax pass + ~6 fp32 ops per element on the CUDA cores)
  in each of the N / BLOCK_N column programs, about as much CUDA-core time per K step as the int8 MMA
  takes, and would stream A as 16-bit (twice the bytes, twice the passes); the separate pass costs one
  read of x and one int8 write (estimated from bandwidth: ~8 us at 2048 x 4096 on an H100, about a tenth
  of the GEMM; not yet measured).

Rounding: ``libdevice.rint`` (round half to even) on the GPU; the interpreter has no libdevice, so there
the 1.5 * 2^23 add/subtract trick is used (exact for |v| < 2^22; |v| <= 127.5 here). Divisions use
``div_rn`` (IEEE, as PyTorch) and FP fusion is off for these kernels, so no multiply-add (the epilogue's
``acc * s_x * s_w + bias``) is contracted into an FMA: codes and scales equal the module's bit for bit, and
the fp32 output equals the module's reference whenever its fp32 matmul is exact (every partial sum < 2^24,
e.g. K <= 1024; past that the int32 kernel is the more exact of the two).

Autotune space (GPU): BLOCK_M 16..128 (the fused path tries only <= 64), BLOCK_N 64..256, BLOCK_K 128/256
(int8 MMA takes K = 32 per instruction; long K tiles amortise the loop), 4/8 warps, 3-5 stages; keyed on
(M rounded up to a power of two, N, K, fused) so serving with varying M does not re-tune for every M.
Compiled ahead of time for sm_90, BLOCK_M >= 64 lowers to wgmma (s32.s8.s8) with cp.async pipelining;
BLOCK_M 16/32 to mma.sync. The weight may be (K, N) row-major or K-major (see above): benchmark both.
"""
from __future__ import annotations

import torch

from workbench_kernels._common import INTERPRET, cdiv, check, check_same_device, configs, graph_bench, require_triton
from workbench_kernels.numerics import EPS
from workbench_kernels.numerics import quantize_per_token as _per_token

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # the references and op registrations still work; launching raises in require_triton
    triton = None

__all__ = ["quantize_per_token", "quantize_per_token_reference", "w8a8_mm", "reference", "FUSED_MAX_M"]

FUSED_MAX_M = 64  # fused=None picks the one-kernel path up to this many rows (see the docstring)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _gemm_configs() -> list:
    full = [
        # prefill / large M: int8 operands, big tiles
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4},
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
        {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
        {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
        {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3},
        # decode / small M (the fused path): weight-bandwidth bound, many column programs
        {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
        {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3},
        {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 5},
        {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4},
    ]
    for c in full:
        c["GROUP_M"] = 8
    return configs(full, {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2})


def _prune_configs(configs: list, named_args: dict, **kwargs) -> list:
    """The fused path only tries BLOCK_M <= 64: with 128 rows, the float A tiles plus their in-register
    quantization spill registers on sm_90 (checked by compiling for sm_90 ahead of time)."""
    if kwargs.get("QUANT_A"):
        return [c for c in configs if c.kwargs["BLOCK_M"] <= 64] or configs
    return configs


if triton is not None:
    _USE_RINT = tl.constexpr(not INTERPRET)
    _EPS = tl.constexpr(EPS)

    @triton.jit
    def _row_scale(amax):
        """Per-row scale from the row absmax: max(amax / 127.5, eps), IEEE division as PyTorch."""
        return tl.maximum(tl.math.div_rn(amax, 127.5), _EPS)

    @triton.jit
    def _quantize_tile(x, inv):
        """fp32 tile (R, C) times per-row 1/scale (R, 1) -> int8 codes, rounded half to even."""
        v = x * inv
        if _USE_RINT:
            r = libdevice.rint(v)
        else:  # the interpreter has no libdevice; exact for |v| < 2^22 (here |v| <= 127.5)
            r = (v + 12582912.0) - 12582912.0
        return tl.minimum(tl.maximum(r, -128.0), 127.0).to(tl.int8)

    @triton.jit
    def _rows_absmax(x_ptr, offs_m, M, K, stride_xm, stride_xk, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """max |x[m, :]| for the rows ``offs_m``, as fp32 (BLOCK_M,)."""
        offs_k = tl.arange(0, BLOCK_K)
        ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            mask = (offs_m[:, None] < M) & (offs_k[None, :] < K - k * BLOCK_K)
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            ptrs += BLOCK_K * stride_xk
        return amax

    @triton.jit
    def _quantize_per_token_kernel(
        x_ptr, q_ptr, s_ptr,            # x (M, K) float, codes (M, K) int8, scales (M,) fp32
        M, K,
        stride_xm, stride_xk, stride_qm, stride_qk,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """One program: BLOCK_M rows. Pass 1 over K: absmax -> scale; pass 2: quantize and store."""
        offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        scale = _row_scale(_rows_absmax(x_ptr, offs_m, M, K, stride_xm, stride_xk, BLOCK_M, BLOCK_K))
        inv = tl.math.div_rn(1.0, scale)[:, None]                       # (BLOCK_M, 1)
        tl.store(s_ptr + offs_m, scale, mask=offs_m < M)
        offs_k = tl.arange(0, BLOCK_K)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            cols = k * BLOCK_K + offs_k
            mask = (offs_m[:, None] < M) & (cols[None, :] < K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
            q = _quantize_tile(x.to(tl.float32), inv)
            tl.store(q_ptr + offs_m[:, None] * stride_qm + cols[None, :] * stride_qk, q, mask=mask)

    @triton.autotune(configs=_gemm_configs(), key=["M_BUCKET", "N", "K", "QUANT_A"], do_bench=graph_bench,
                     prune_configs_by={"early_config_prune": _prune_configs})
    @triton.jit
    def _w8a8_kernel(
        # pointers: A (M, K) float if QUANT_A else int8 codes; s_a (M,) fp32 (unused if QUANT_A);
        # W (K, N) int8; s_w (N,) fp32; bias (N,) (unused unless HAS_BIAS); Y (M, N)
        a_ptr, sa_ptr, w_ptr, sw_ptr, bias_ptr, y_ptr,
        # sizes; M_BUCKET (next power of two of M) only keys the autotuner
        M, N, K, M_BUCKET,
        # strides
        stride_am, stride_ak, stride_wk, stride_wn, stride_ym, stride_yn,
        # meta-parameters
        QUANT_A: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        # grouped ordering: GROUP_M row blocks walk the column blocks together (weight tiles reused in L2)
        pid = tl.program_id(0)
        grid_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = tl.swizzle2d(pid // grid_n, pid % grid_n, tl.cdiv(M, BLOCK_M), grid_n, GROUP_M)

        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # (BLOCK_M,)
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # (BLOCK_N,)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N

        if QUANT_A:  # fused prologue: this row block's per-token scales
            s_a = _row_scale(_rows_absmax(a_ptr, offs_m, M, K, stride_am, stride_ak, BLOCK_M, BLOCK_K))
            inv_a = tl.math.div_rn(1.0, s_a)[:, None]                   # (BLOCK_M, 1)
        else:
            s_a = tl.load(sa_ptr + offs_m, mask=m_mask, other=0.0)

        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak   # (BLOCK_M, BLOCK_K)
        w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn   # (BLOCK_K, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=m_mask[:, None] & (offs_k[None, :] < k_left), other=0)
            if QUANT_A:
                a = _quantize_tile(a.to(tl.float32), inv_a)
            w = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & n_mask[None, :], other=0)
            acc = tl.dot(a, w, acc, out_dtype=tl.int32)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk

        # epilogue: (acc * s_a) * s_w (+ bias), the module's order of operations
        s_w = tl.load(sw_ptr + offs_n, mask=n_mask, other=0.0)
        y = acc.to(tl.float32) * s_a[:, None] * s_w[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# --- launchers -------------------------------------------------------------------------------------------

def _quant_blocks(K: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps) for the quantization kernel: ~4K elements per program, whole rows when
    K <= 1024. Memory-bound, so a fixed rule rather than autotuning."""
    block_k = min(triton.next_power_of_2(K), 1024)
    return max(1, min(16, 4096 // block_k)), block_k, 4


def _launch_quantize(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x2.shape
    q = torch.empty((M, K), dtype=torch.int8, device=x2.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x2.device)
    if M == 0:
        return q, s
    block_m, block_k, warps = _quant_blocks(K)
    _quantize_per_token_kernel[(cdiv(M, block_m),)](
        x2, q, s, M, K, x2.stride(0), x2.stride(1), q.stride(0), q.stride(1),
        BLOCK_M=block_m, BLOCK_K=block_k, num_warps=warps, enable_fp_fusion=False)
    return q, s


def _check_x(op: str, x: torch.Tensor) -> None:
    check("x", x, dtypes=_FLOAT_DTYPES, op=op)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have shape (..., K) with K >= 1, got {tuple(x.shape)}")


@torch.library.custom_op("workbench::quantize_per_token", mutates_args=())
def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per-token quantization of ``x`` ``(..., K)`` (Triton kernel):
    ``(codes int8 (M, K), scale fp32 (M, 1))`` with M the product of the leading dims."""
    op = "quantize_per_token"
    _check_x(op, x)
    require_triton(op, x.device)
    return _launch_quantize(x.reshape(-1, x.shape[-1]))


@quantize_per_token.register_fake
def _(x):
    _check_x("quantize_per_token", x)
    M = x.numel() // x.shape[-1]
    return x.new_empty((M, x.shape[-1]), dtype=torch.int8), x.new_empty((M, 1), dtype=torch.float32)


def _check_mm(op: str, x: torch.Tensor, qweight_t: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None) -> None:
    _check_x(op, x)
    check("qweight_t", qweight_t, dtypes=(torch.int8,), ndim=2, contiguous=False, op=op)
    if not (qweight_t.is_contiguous() or qweight_t.t().is_contiguous()):
        raise ValueError(f"{op}: qweight_t must be a contiguous (K, N) tensor or the transpose of a contiguous "
                         f"(N, K) one; got strides {qweight_t.stride()}")
    K, N = qweight_t.shape
    if x.shape[-1] != K:
        raise ValueError(f"{op}: x has K = {x.shape[-1]} columns but qweight_t is (K, N) = {(K, N)}")
    check("scale", scale, dtypes=(torch.float32,), shape=(1, N), op=op)
    if bias is not None:
        check("bias", bias, dtypes=_FLOAT_DTYPES, shape=(N,), op=op)
    check_same_device(op, x=x, qweight_t=qweight_t, scale=scale, bias=bias)


@torch.library.custom_op("workbench::w8a8_mm", mutates_args=())
def w8a8_mm(x: torch.Tensor, qweight_t: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
            fused: bool | None = None) -> torch.Tensor:
    """``y (..., N) = quantize_per_token(x) @ qweight_t`` rescaled per row and column, plus ``bias``, in x's
    dtype. ``fused``: quantize inside the GEMM (True) or in a separate kernel first (False); None picks
    fused for M <= FUSED_MAX_M. Both give the same numbers."""
    op = "w8a8_mm"
    _check_mm(op, x, qweight_t, scale, bias)
    require_triton(op, x.device)
    K, N = qweight_t.shape
    x2 = x.reshape(-1, K)                                                # (M, K)
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*x.shape[:-1], N)
    fused = M <= FUSED_MAX_M if fused is None else fused
    if fused:
        a, s_a = x2, scale  # s_a is not read by the fused kernel; any fp32 pointer will do
    else:
        a, s_a = _launch_quantize(x2)                                    # (M, K) int8, (M, 1) fp32
    grid = lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _w8a8_kernel[grid](
        a, s_a, qweight_t, scale, bias if bias is not None else scale, y,
        M, N, K, triton.next_power_of_2(M),
        a.stride(0), a.stride(1), qweight_t.stride(0), qweight_t.stride(1), y.stride(0), y.stride(1),
        QUANT_A=fused, HAS_BIAS=bias is not None, enable_fp_fusion=False)
    return y.reshape(*x.shape[:-1], N)


@w8a8_mm.register_fake
def _(x, qweight_t, scale, bias=None, fused=None):
    _check_mm("w8a8_mm", x, qweight_t, scale, bias)
    return x.new_empty((*x.shape[:-1], qweight_t.shape[1]))


# --- references ------------------------------------------------------------------------------------------

def quantize_per_token_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's math in PyTorch: ``(codes int8 (M, K), scale fp32 (M, 1))`` - the package's one per-token
    quantizer, `workbench_kernels.numerics.quantize_per_token`."""
    return _per_token(x)


def reference(x: torch.Tensor, qweight_t: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """`w8a8_mm` in PyTorch (the module's reference path): fp32 matmul of the integer codes."""
    qx, sx = quantize_per_token_reference(x)
    y = (qx.float() @ qweight_t.float()) * sx * scale                     # (M, N)
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], qweight_t.shape[1]).to(x.dtype)
