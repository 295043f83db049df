"""Fused fake quantization for QAT: quantize -> dequantize in one pass, straight-through backward in another.

The math (``workbench.quantization.qat.fake_quantize_ste``, bit for bit in fp32)::

    g = index // group_size                       one (scale, zero) per group_size consecutive values of a row
    r = round_half_even(x * (1 / scale[g]))       reciprocal in fp32, as `primitives.quantize`
    t = r + zero[g]
    x_hat = (clamp(t, qmin, qmax) - zero[g]) * scale[g]
    dL/dx = where(qmin <= t <= qmax, (dL/dx_hat * scale[g]) * (1 / scale[g]), 0)    straight-through

(the gradient is written in autograd's order of operations so it equals the gradient through
``fake_quantize_ste`` exactly, not just to rounding). Per-channel is ``group_size=None`` (one pair per row,
``scale`` ``(R, 1)``); per-group has ``scale`` ``(R, K // group_size)``; ``x`` is ``(..., K)`` with R rows.
Gradients reach ``x`` only: the kernel does not produce gradients for ``scale`` / ``zero`` and refuses to
run when ``scale`` or ``zero`` requires grad (LSQ's learnable scales keep the PyTorch path,
``fake_quantize_ste``).

Blocking: the tensor is contiguous, so the group of flat element ``i`` is ``i // group_size`` (rows are
``K`` long and ``K`` is a multiple of ``group_size``): both kernels are 1-D element-wise loops, one program
per ``BLOCK`` elements, loading each element's scale / zero by group index (a gather that stays in L1: a
block touches ``BLOCK / group_size`` groups). The group size is a compile-time constant (one compilation per
distinct value, a handful per model), so the per-element division is a multiply-shift. The forward reads x
once and writes x_hat once; the backward recomputes the clamp mask from x instead of storing one (one extra
read of x, no mask tensor kept alive between forward and backward). Memory-bound, so the autotune space is
only the block size and warps, keyed on the element count rounded to a power of two and the group size.
Rounding uses ``libdevice.rint`` on the GPU and the 1.5 * 2^23 trick in the interpreter (no libdevice there);
FP fusion is off so nothing is contracted into an FMA and the GPU result matches PyTorch's.
"""
from __future__ import annotations

import torch

from workbench_kernels._common import INTERPRET, cdiv, check, check_same_device, configs, require_triton

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # the reference and op registrations still work; launching raises in require_triton
    triton = None

__all__ = ["fake_quantize", "fake_quantize_backward", "reference"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _elementwise_configs() -> list:
    full = [{"BLOCK": 1024, "num_warps": 4}, {"BLOCK": 2048, "num_warps": 8}, {"BLOCK": 4096, "num_warps": 8}]
    return configs(full, {"BLOCK": 128}, num_stages=1)


if triton is not None:
    _USE_RINT = tl.constexpr(not INTERPRET)

    @triton.jit
    def _grid_values(x_ptr, s_ptr, z_ptr, offs, mask, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr):
        """Load one block's x, scale, zero (fp32) and return (x, scale, zero, t = round(x / s) + zero)."""
        g = offs // GROUP                                       # division by a constant: a multiply-shift
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + g, mask=mask, other=1.0)
        if HAS_ZERO:
            z = tl.load(z_ptr + g, mask=mask, other=0).to(tl.float32)
        else:
            z = tl.zeros_like(x)
        v = x * tl.math.div_rn(1.0, s)
        if _USE_RINT:
            r = libdevice.rint(v)
        else:  # the interpreter has no libdevice; exact for |v| < 2^22, and larger |v| clamp anyway
            r = (v + 12582912.0) - 12582912.0
        return x, s, z, r + z

    @triton.autotune(configs=_elementwise_configs(), key=["N_BUCKET", "GROUP"])
    @triton.jit
    def _fake_quant_fwd_kernel(
        x_ptr, s_ptr, z_ptr, y_ptr,      # x, x_hat: (n,) flat; scale, zero: (n // GROUP,)
        n, qmin, qmax,                   # qmin / qmax as fp32
        N_BUCKET,                        # only keys the autotuner
        GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x, s, z, t = _grid_values(x_ptr, s_ptr, z_ptr, offs, mask, GROUP, HAS_ZERO)
        q = tl.clamp(t, qmin, qmax, propagate_nan=tl.PropagateNan.ALL)   # NaN stays NaN, as torch.clamp
        y = (q - z) * s
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.autotune(configs=_elementwise_configs(), key=["N_BUCKET", "GROUP"])
    @triton.jit
    def _fake_quant_bwd_kernel(
        dy_ptr, x_ptr, s_ptr, z_ptr, dx_ptr,   # dy, x, dx: (n,) flat; scale, zero: (n // GROUP,)
        n, qmin, qmax,
        N_BUCKET,
        GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x, s, z, t = _grid_values(x_ptr, s_ptr, z_ptr, offs, mask, GROUP, HAS_ZERO)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        inside = (t >= qmin) & (t <= qmax)                      # clamp passes the gradient at its ends too
        dx = tl.where(inside, (dy * s) * tl.math.div_rn(1.0, s), 0.0)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# --- launchers -------------------------------------------------------------------------------------------

def _check(op: str, x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, qmin: int, qmax: int,
           group_size: int | None) -> int:
    """Validate the arguments; return the group size in use."""
    check("x", x, dtypes=_FLOAT_DTYPES, op=op)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have shape (..., K) with K >= 1, got {tuple(x.shape)}")
    K = x.shape[-1]
    g = K if group_size is None else group_size
    if (group_size is not None and not isinstance(group_size, int)) or g < 1 or K % g:
        raise ValueError(f"{op}: group_size must be a positive divisor of the last dimension K = {K}, "
                         f"got {group_size!r}")
    if not (isinstance(qmin, int) and isinstance(qmax, int) and qmin < qmax):
        raise ValueError(f"{op}: qmin < qmax must be ints, got qmin={qmin!r}, qmax={qmax!r}")
    groups = (x.numel() // K, K // g)                                    # (R, groups per row)
    check("scale", scale, dtypes=(torch.float32,), shape=groups, op=op)
    if zero is not None:
        check("zero", zero, dtypes=(torch.float32, torch.int32), shape=groups, op=op)
    check_same_device(op, x=x, scale=scale, zero=zero)
    return g


def _launch(kernel, out: torch.Tensor, tensors: tuple, zero: torch.Tensor | None, qmin: int, qmax: int,
            group: int) -> torch.Tensor:
    n = out.numel()
    if n == 0:
        return out
    grid = lambda meta: (cdiv(n, meta["BLOCK"]),)  # noqa: E731
    kernel[grid](*tensors, zero if zero is not None else tensors[-1], out, n, float(qmin), float(qmax),
                 triton.next_power_of_2(n), GROUP=group, HAS_ZERO=zero is not None, enable_fp_fusion=False)
    return out


@torch.library.custom_op("workbench::fake_quantize", mutates_args=())
def fake_quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, qmin: int, qmax: int,
                  group_size: int | None = None) -> torch.Tensor:
    """x_hat = (clamp(round(x / scale) + zero, qmin, qmax) - zero) * scale in x's dtype (math in fp32), with
    a straight-through gradient for x. ``scale`` / ``zero``: ``(R, K // group_size)``, ``(R, 1)`` per channel
    (``group_size=None``); ``zero=None`` means 0."""
    op = "fake_quantize"
    group = _check(op, x, scale, zero, qmin, qmax, group_size)
    require_triton(op, x.device)
    return _launch(_fake_quant_fwd_kernel, torch.empty_like(x), (x, scale), zero, qmin, qmax, group)


@fake_quantize.register_fake
def _(x, scale, zero, qmin, qmax, group_size=None):
    _check("fake_quantize", x, scale, zero, qmin, qmax, group_size)
    return torch.empty_like(x)


def _check_backward(op: str, grad: torch.Tensor, x: torch.Tensor) -> None:
    check("grad", grad, dtypes=(x.dtype,), shape=tuple(x.shape), op=op)


@torch.library.custom_op("workbench::fake_quantize_backward", mutates_args=())
def fake_quantize_backward(grad: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                           qmin: int, qmax: int, group_size: int | None = None) -> torch.Tensor:
    """dL/dx of `fake_quantize` given dL/dx_hat ``grad`` (same shape and dtype as ``x``)."""
    op = "fake_quantize_backward"
    group = _check(op, x, scale, zero, qmin, qmax, group_size)
    _check_backward(op, grad, x)
    require_triton(op, x.device)
    return _launch(_fake_quant_bwd_kernel, torch.empty_like(x), (grad, x, scale), zero, qmin, qmax, group)


@fake_quantize_backward.register_fake
def _(grad, x, scale, zero, qmin, qmax, group_size=None):
    _check("fake_quantize_backward", x, scale, zero, qmin, qmax, group_size)
    _check_backward("fake_quantize_backward", grad, x)
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    x, scale, zero, qmin, qmax, group_size = inputs
    for name, t in (("scale", scale), ("zero", zero)):
        if t is not None and t.requires_grad:
            raise ValueError(f"fake_quantize: {name} requires grad, but the kernel only differentiates x "
                             f"(learnable scales: use workbench.quantization.qat.fake_quantize_ste)")
    ctx.save_for_backward(x, scale, zero)
    ctx.qrange = (qmin, qmax, group_size)


def _backward(ctx, grad):
    x, scale, zero = ctx.saved_tensors
    qmin, qmax, group_size = ctx.qrange
    dx = fake_quantize_backward(grad.contiguous(), x, scale, zero, qmin, qmax, group_size)
    return dx, None, None, None, None, None


torch.library.register_autograd("workbench::fake_quantize", _backward, setup_context=_setup_context)


# --- reference -------------------------------------------------------------------------------------------

def reference(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, qmin: int, qmax: int,
              group_size: int | None = None) -> torch.Tensor:
    """`fake_quantize` in PyTorch, with the same straight-through gradient (autograd through it equals the
    kernel's backward)."""
    K = x.shape[-1]
    g = K if group_size is None else group_size
    xg = x.float().reshape(-1, g)                                      # (R * K / g, g)
    s = scale.reshape(-1, 1)                                           # (R * K / g, 1)
    z = torch.zeros_like(s) if zero is None else zero.reshape(-1, 1).float()
    xs = xg * (1.0 / s)
    rounded = xs + (torch.round(xs) - xs).detach()                     # round forward, identity backward
    return ((torch.clamp(rounded + z, qmin, qmax) - z) * s).reshape(x.shape).to(x.dtype)
