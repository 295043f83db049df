"""Quantization numerics: pure functions, one place. Every kernel reference here, and every quantized module and
algorithm of the workbench (through `workbench.quantization.primitives`), calls these.

Integer affine quantization of a tensor ``x`` with ``b`` bits maps each value to

    q = clamp(round(x * (1 / scale)) + zero_point, qmin, qmax)        x_hat = (q - zero_point) * scale

with ``round`` half-to-even and the reciprocal taken in fp32, exactly as PyTorch's
``quantize_per_channel`` / ``fake_quantize_per_channel_affine`` do (a test checks bit-identity).
Ranges: signed ``[-2^(b-1), 2^(b-1) - 1]``, unsigned ``[0, 2^b - 1]``; b = 2..8.

Granularity says which values share a (scale, zero_point):

- `PerTensor()`: one pair for the whole tensor;
- `PerChannel(axis)`: one pair per index along ``axis`` (weights: axis 0, the output channel);
- `PerGroup(group_size)`: one pair per ``group_size`` consecutive values along the last (input) axis;
- `PerToken()`: one pair per row of the last axis (activations: each token its own scale).

Every granularity is a view of the tensor as ``(groups, values_per_group)``; the qparams are computed
on that view (``to_groups`` / ``from_groups``). Floating formats: float8 e4m3fn / e5m2 with a scale, and
NF4 (QLoRA's 16-value normal-float codebook, derived here from normal quantiles).

Activations of W8A8 layers are quantized to int8 by `quantize_per_token` (dynamic) or `quantize_per_tensor`
(a calibrated scale); the modules' reference paths and every kernel's PyTorch reference call these two.
Weight formats store their scales rounded to fp16 (`fp16_scale`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from workbench_kernels.packing import unpack

__all__ = [
    "EPS", "PerTensor", "PerChannel", "PerGroup", "PerToken", "Granularity",
    "qrange", "to_groups", "from_groups", "choose_qparams", "quantize", "dequantize", "fake_quantize",
    "quantize_affine", "dequantize_affine", "float8_quantize", "float8_dequantize", "FLOAT8_DTYPES",
    "nf4_codebook", "nf4_quantiles", "nf4_codes", "nf4_quantize", "nf4_dequantize", "dequantize_packed",
    "fp16_scale", "E2M1_MAX", "MX_BLOCK", "NVFP4_BLOCK", "E8M0_NAN", "e2m1_values", "e2m1_codes", "e8m0_to_float",
    "mx_scale", "mx_quantize", "nvfp4_global_scale", "nvfp4_quantize",
    "quantize_per_token", "quantize_per_tensor", "sqnr",
]

EPS = torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class PerTensor:
    pass


@dataclass(frozen=True)
class PerChannel:
    axis: int = 0


@dataclass(frozen=True)
class PerGroup:
    group_size: int = 128

    def __post_init__(self):
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {self.group_size!r}")


@dataclass(frozen=True)
class PerToken:
    pass


Granularity = PerTensor | PerChannel | PerGroup | PerToken


def qrange(bits: int, signed: bool) -> tuple[int, int]:
    """(qmin, qmax) of a ``bits``-bit integer."""
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"integer quantization supports 2 to 8 bits, got {bits!r}")
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)


def to_groups(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """View ``x`` as ``(groups, values_per_group)`` for ``granularity`` (a copy only for PerChannel(axis != -1))."""
    if isinstance(granularity, PerTensor):
        return x.reshape(1, -1)
    if isinstance(granularity, PerToken):
        return x.reshape(-1, x.shape[-1])
    if isinstance(granularity, PerChannel):
        axis = granularity.axis % x.ndim
        return x.movedim(axis, 0).reshape(x.shape[axis], -1)
    if isinstance(granularity, PerGroup):
        g = granularity.group_size
        if x.shape[-1] % g:
            raise ValueError(f"group_size {g} does not divide the last dimension {x.shape[-1]} of a tensor "
                             f"of shape {tuple(x.shape)}")
        return x.reshape(-1, g)
    raise TypeError(f"unknown granularity {granularity!r}")


def from_groups(xg: torch.Tensor, shape: torch.Size | tuple[int, ...], granularity: Granularity) -> torch.Tensor:
    """Inverse of `to_groups`."""
    if isinstance(granularity, PerChannel):
        axis = granularity.axis % len(shape)
        moved = (shape[axis], *shape[:axis], *shape[axis + 1:])
        return xg.reshape(moved).movedim(0, axis)
    return xg.reshape(shape)


def choose_qparams(xg: torch.Tensor, bits: int, symmetric: bool = True, signed: bool = True,
                   min_val: torch.Tensor | None = None, max_val: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point (each ``(groups, 1)``) for grouped values ``xg`` ``(groups, K)``.

    Follows PyTorch's observers: the range always includes 0; symmetric uses
    ``scale = max|x| / ((qmax - qmin) / 2)`` and zero point 0 (signed) or the mid-point (unsigned);
    asymmetric uses ``scale = (max - min) / (qmax - qmin)``, ``zero_point = qmin - round(min / scale)``.
    ``min_val`` / ``max_val`` override the ranges (clipping searches and observers pass them).
    """
    qmin, qmax = qrange(bits, signed)
    lo = xg.amin(dim=1, keepdim=True) if min_val is None else min_val.reshape(-1, 1)
    hi = xg.amax(dim=1, keepdim=True) if max_val is None else max_val.reshape(-1, 1)
    lo = torch.clamp(lo.float(), max=0.0)
    hi = torch.clamp(hi.float(), min=0.0)
    if symmetric:
        amax = torch.maximum(-lo, hi)
        scale = torch.clamp(amax / ((qmax - qmin) / 2), min=EPS)
        zp = torch.full_like(scale, 0 if signed else (qmin + qmax + 1) // 2, dtype=torch.int32)
    else:
        scale = torch.clamp((hi - lo) / float(qmax - qmin), min=EPS)
        zp = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax).to(torch.int32)
    return scale, zp


def quantize(xg: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int,
             dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """Integer codes of grouped values (see the module docstring); ``dtype`` must hold [qmin, qmax]."""
    q = torch.round(xg.float() * (1.0 / scale)) + zero_point
    return torch.clamp(q, qmin, qmax).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return ((q.to(torch.int32) - zero_point).float() * scale).to(dtype)


def fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` as a weight format stores it: rounded to fp16, held in fp32, and at least fp16's smallest
    normal (an all-zero group must not get a zero scale). Codes are computed from this rounded scale, so the
    stored scale and the codes agree."""
    return scale.to(torch.float16).float().clamp(min=torch.finfo(torch.float16).tiny)


def _storage_dtype(qmin: int) -> torch.dtype:
    return torch.int8 if qmin < 0 else torch.uint8


def quantize_affine(x: torch.Tensor, bits: int, granularity: Granularity, symmetric: bool = True,
                    signed: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x``: returns (codes shaped like ``x``, scale ``(groups, 1)``, zero_point ``(groups, 1)``)."""
    if not x.is_floating_point():
        raise TypeError(f"can only quantize floating-point tensors, got {x.dtype}")
    xg = to_groups(x, granularity)
    scale, zp = choose_qparams(xg, bits, symmetric, signed)
    qmin, qmax = qrange(bits, signed)
    q = quantize(xg, scale, zp, qmin, qmax, _storage_dtype(qmin))
    return from_groups(q, x.shape, granularity), scale, zp


def dequantize_affine(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, granularity: Granularity,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    qg = to_groups(q, granularity)
    return from_groups(dequantize(qg, scale, zero_point, dtype), q.shape, granularity)


def fake_quantize(x: torch.Tensor, bits: int, granularity: Granularity, symmetric: bool = True,
                  signed: bool = True) -> torch.Tensor:
    """quantize -> dequantize in one step (same dtype as ``x``); no gradient rule (see QAT for the STE)."""
    q, scale, zp = quantize_affine(x, bits, granularity, symmetric, signed)
    return dequantize_affine(q, scale, zp, granularity, x.dtype)


# --- float8 -----------------------------------------------------------------------------------------

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def float8_quantize(x: torch.Tensor, granularity: Granularity = PerChannel(0),
                    dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values shaped like ``x``, fp32 scale ``(groups, 1)``) with ``x ~ values * scale``; the scale maps
    each group's max magnitude to the format's largest finite value."""
    if dtype not in FLOAT8_DTYPES:
        raise ValueError(f"float8 dtype must be one of {FLOAT8_DTYPES}, got {dtype}")
    fmax = torch.finfo(dtype).max
    xg = to_groups(x.float(), granularity)
    # divided by a tensor: on CUDA a Python-number divisor becomes a multiplication by its rounded reciprocal
    # (1 ulp off IEEE division on some rows); the Triton kernels divide exactly, as the CPU does
    scale = torch.clamp(xg.abs().amax(dim=1, keepdim=True) / torch.tensor(fmax, device=x.device), min=EPS)  # (G, 1)
    q = torch.clamp(xg / scale, -fmax, fmax).to(dtype)
    return from_groups(q, x.shape, granularity), scale


def float8_dequantize(q: torch.Tensor, scale: torch.Tensor, granularity: Granularity,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    qg = to_groups(q, granularity)
    return from_groups((qg.float() * scale).to(dtype), q.shape, granularity)


# --- NF4 ----------------------------------------------------------------------------------------------

@functools.cache
def nf4_quantiles() -> torch.Tensor:
    """The NF4 codebook derived (QLoRA, Dettmers et al. 2023): quantiles of N(0, 1) with an exact zero, 8 positive
    and 7 negative levels, normalised to [-1, 1]; fp32, ascending. `nf4_codebook` holds its values as constants."""
    from scipy.stats import norm

    offset = 0.9677083  # QLoRA's choice: the outermost quantile, (1 - 1/(2*15) + 1 - 1/(2*16)) / 2
    pos = norm.ppf(torch.linspace(offset, 0.5, 9)[:-1].numpy())
    neg = -norm.ppf(torch.linspace(offset, 0.5, 8)[:-1].numpy())
    values = torch.tensor(sorted([*pos.tolist(), 0.0, *neg.tolist()]), dtype=torch.float64)
    return (values / values.abs().max()).float()


# `nf4_quantiles()` as fp32 constants (a test checks they are equal): no scipy call in a layer's forward, which
# torch.compile could not trace (the compiled decode step fell back to eager for NF4 models)
_NF4_VALUES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
               -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
               0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
               0.7229568362236023, 1.0)


def nf4_codebook() -> torch.Tensor:
    """The 16 NF4 values, fp32, ascending (`nf4_quantiles`)."""
    return torch.tensor(_NF4_VALUES, dtype=torch.float32)


def nf4_codes(xg: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 of grouped values ``xg`` ``(G, g)`` with absmax scales ``(G, 1)``: the index of the
    nearest codebook entry to ``x / scale``."""
    book = nf4_codebook().to(xg.device)
    normed = (xg.float() / scale).unsqueeze(-1)                   # (G, g, 1)
    return (normed - book).abs().argmin(dim=-1).to(torch.uint8)   # (G, g)


def nf4_quantize(x: torch.Tensor, group_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes 0..15 shaped like ``x``, absmax scale ``(groups, 1)``); per-group along the last axis."""
    gran = PerGroup(group_size)
    xg = to_groups(x.float(), gran)
    scale = torch.clamp(xg.abs().amax(dim=1, keepdim=True), min=EPS)
    return from_groups(nf4_codes(xg, scale), x.shape, gran), scale


def nf4_dequantize(codes: torch.Tensor, scale: torch.Tensor, group_size: int | None = 64,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Codebook values times the group's scale; ``group_size=None``: ``codes`` are already grouped ``(G, g)``."""
    if group_size is None:
        return (nf4_codebook().to(codes.device)[codes.long()] * scale).to(dtype)
    gran = PerGroup(group_size)
    return from_groups(nf4_dequantize(to_groups(codes, gran), scale, None, dtype), codes.shape, gran)


# --- block-scaled floating point: OCP MX v1.0 (MXFP4, MXFP8) and NVIDIA's NVFP4 ---------------------------------

# E2M1 (FP4): sign, 2 exponent bits (bias 1), 1 mantissa bit; no Inf, no NaN. Codes 0-7 are the magnitudes, code
# 8 + c is -magnitude(c) (code 8 is -0).
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E2M1_EMAX = 2        # the largest normal's exponent: 6 = 1.5 * 2^2
E4M3_EMAX = 8        # float8 e4m3fn: 448 = 1.75 * 2^8
E8M0_NAN = 255       # the E8M0 code of a NaN scale (every element of its block decodes to NaN)
MX_BLOCK = 32        # values sharing one E8M0 scale in every MX format
NVFP4_BLOCK = 16     # values sharing one e4m3 scale in NVFP4


def e2m1_values() -> torch.Tensor:
    """The 16 values of the E2M1 codes, fp32, indexed by code (8 is -0.0)."""
    return torch.tensor([*_E2M1_MAGNITUDES, *(-v for v in _E2M1_MAGNITUDES)], dtype=torch.float32)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes of ``x``: round to nearest, ties to the even code (the one whose mantissa bit is 0), and
    magnitudes above 6 (and infinities) saturate to 6, as MX conversion specifies. A negative value keeps its sign
    when it rounds to zero (code 8, -0). NaN has no E2M1 code: it becomes 0 (an MX block holding a NaN carries a
    NaN scale instead, `mx_scale`)."""
    a = x.float().abs()
    # the magnitude code counts the thresholds passed; at a tie ">" keeps the even code below, ">=" takes the
    # even code above: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5))
    code = torch.where(torch.isnan(a), torch.zeros_like(code), code)
    return code | (x < 0).to(torch.uint8) << 3


def e8m0_to_float(code: torch.Tensor) -> torch.Tensor:
    """fp32 value of E8M0 scale codes (uint8): 2^(code - 127), exactly (2^-127 is an fp32 subnormal); 255 is NaN."""
    c = code.to(torch.int32)
    bits = torch.where(c == 0, torch.full_like(c, 1 << 22), c << 23)      # exponent field c, or the subnormal 2^-127
    bits = torch.where(c == E8M0_NAN, torch.full_like(c, 0x7FC00000), bits)
    return bits.view(torch.float32)


def mx_scale(amax: torch.Tensor, elem_emax: int) -> torch.Tensor:
    """The E8M0 scale codes (uint8) of blocks whose largest magnitude is ``amax`` (fp32), for elements whose largest
    normal has exponent ``elem_emax`` (E2M1: 2, E4M3: 8), as OCP MX v1.0 defines it: the shared exponent is
    floor(log2(amax)) - elem_emax, clamped to E8M0's range [-127, 127]; a block of zeros gets the smallest scale
    2^-127 and a block holding a NaN or an infinity the NaN scale (255)."""
    a = amax.float()
    _, e = torch.frexp(a)                               # a = m * 2^e, 0.5 <= m < 1: floor(log2(a)) = e - 1, exactly
    code = torch.clamp(e.to(torch.int32) - 1 - elem_emax + 127, 0, 254)
    code = torch.where(a == 0, torch.zeros_like(code), code)
    return torch.where(torch.isfinite(a), code, torch.full_like(code, E8M0_NAN)).to(torch.uint8)


def mx_quantize(x: torch.Tensor, element: str = "e2m1") -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX quantization of grouped values ``x`` ``(G, 32)`` (fp32): (element codes: uint8 E2M1 codes or float8
    e4m3fn values, ``(G, 32)``; E8M0 scale codes ``(G, 1)``). Each value is divided by its block's scale 2^shared
    (exact) and converted to the element format, round to nearest even, saturating at the largest normal (6 or 448)."""
    if element not in ("e2m1", "e4m3"):
        raise ValueError(f"MX element must be 'e2m1' or 'e4m3', got {element!r}")
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    amax = torch.where(torch.isnan(xf).any(dim=-1, keepdim=True), torch.full_like(amax, float("nan")), amax)
    code = mx_scale(amax, E2M1_EMAX if element == "e2m1" else E4M3_EMAX)
    scale = e8m0_to_float(code)
    scaled = torch.where(torch.isfinite(scale), xf / scale, torch.zeros_like(xf))
    if element == "e2m1":
        return e2m1_codes(scaled), code
    fmax = torch.finfo(torch.float8_e4m3fn).max
    return torch.clamp(scaled, -fmax, fmax).to(torch.float8_e4m3fn), code


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor scale (fp32, ``(1,)``) for a tensor whose largest magnitude is ``amax``: 448 * 6 / amax,
    which maps the largest block scale to e4m3's largest value (1 for a tensor of zeros; at most fp32's largest).
    Values decode as ``e2m1 * (e4m3 block scale / global scale)``."""
    a = amax.float().reshape(1)
    scale = torch.clamp((E2M1_MAX * torch.finfo(torch.float8_e4m3fn).max) / a, max=torch.finfo(torch.float32).max)
    return torch.where(a > 0, scale, torch.ones_like(a))   # (below amax ~8e-36 the quotient is clamped, not inf)


def nvfp4_quantize(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 quantization of grouped values ``x`` ``(G, 16)`` (fp32) under ``global_scale`` (`nvfp4_global_scale`):
    (uint8 E2M1 codes ``(G, 16)``, float8 e4m3fn block scales ``(G, 1)``). The block scale is amax / 6 times the
    global scale, rounded to e4m3 (nearest even, at most 448); each value is divided by the scale it decodes with,
    e4m3 / global scale in fp32, and rounded to E2M1 (nearest even, saturating at 6)."""
    xf = x.float()
    fmax = torch.finfo(torch.float8_e4m3fn).max
    block = torch.clamp(xf.abs().amax(dim=-1, keepdim=True) / E2M1_MAX * global_scale, max=fmax)
    s8 = block.to(torch.float8_e4m3fn)
    s = s8.float() / global_scale
    codes = e2m1_codes(torch.where(s > 0, xf / s, torch.zeros_like(xf)))
    return codes, s8


def dequantize_packed(qweight: torch.Tensor, bits: int, K: int, scale: torch.Tensor, group_size: int,
                      zero: torch.Tensor | float | None = None, lut: torch.Tensor | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The stored weight ``(rows, K)`` of a grouped low-bit format, computed in ``dtype``: every weight format, every
    kernel's PyTorch reference and the modules decode with this one function.

    ``qweight`` holds the codes ``u`` packed ``bits`` per slot along the last dimension (`packing.pack`; 3-bit codes
    sit in 4-bit slots), ``scale`` is ``(rows, G)`` with ``G = ceil(K / group_size)`` (a short last group), and

        w[n, k] = (u[n, k] - z[n, k // g]) * s[n, k // g]    or, with a codebook ``lut``:    lut[u[n, k]] * s[n, k // g]

    ``zero`` is the stored zero points ``(rows, G)`` or one number (a symmetric format's mid-point ``2^(b-1)``)."""
    rows, G = qweight.shape[0], scale.shape[-1]
    codes = unpack(qweight, bits, K)                                                   # (rows, K) uint8
    if G * group_size != K:
        codes = torch.nn.functional.pad(codes, (0, G * group_size - K))
    codes = codes.reshape(rows, G, group_size)
    if lut is not None:
        values = lut.to(device=codes.device, dtype=dtype)[codes.long()]
    elif zero is None:
        raise ValueError("dequantize_packed needs the zero points (a tensor or a number) or a codebook (lut)")
    else:
        values = codes.to(dtype) - (zero.to(dtype).reshape(rows, G, 1) if isinstance(zero, torch.Tensor) else zero)
    return (values * scale.to(dtype).reshape(rows, G, 1)).reshape(rows, G * group_size)[:, :K]


# --- int8 activations (W8A8) ----------------------------------------------------------------------------

_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per-token quantization of activations: (codes (M, K) int8, scale (M, 1) fp32).

    The same numbers as ``choose_qparams(x, 8, symmetric=True)`` + ``quantize`` (a test checks), in fewer
    passes over the activations: scale = max|x| / 127.5 per row, codes = clamp(round(x / scale)). A row
    holding NaN or Inf gets a NaN scale (so NaN outputs)."""
    xg = to_groups(x, PerToken()).float()                          # (M, K)
    lo, hi = xg.amin(dim=1, keepdim=True), xg.amax(dim=1, keepdim=True)  # (aminmax(dim) is 10x slower here)
    amax = torch.maximum(-lo, hi)
    # divided by a tensor, not the Python number: CUDA's division by a scalar multiplies by its rounded
    # reciprocal (1 ulp off IEEE division on some rows, so codes off by one); the CPU and the kernels divide
    scale = (amax / torch.full_like(amax, 127.5)).clamp_(min=EPS)
    scale = torch.where(torch.isfinite(scale), scale, float("nan"))
    r = xg * (1.0 / scale)                                         # |r| <= 127.5
    # round half to even by adding and removing 1.5 * 2^23 (fp32's ulp is 1 there): the same result as
    # torch.round for |r| < 2^22, and several times faster than aten::round on the CPU
    r.add_(_ROUND_MAGIC).sub_(_ROUND_MAGIC)
    return r.clamp_(-128, 127).to(torch.int8), scale


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of activations with a calibrated scale: (codes (M, K), scale (M, 1)); a row
    holding NaN or Inf gets a NaN scale (so NaN outputs), as in the per-token case."""
    xg = to_groups(x, PerToken()).float()                          # (M, K)
    scale = scale.float().reshape(1, 1)                            # fp32 even after module.half()
    q = quantize(xg, scale, torch.zeros(1, 1, dtype=torch.int32), -128, 127, torch.int8)
    return q, torch.where(torch.isfinite(xg).all(dim=1, keepdim=True), scale, float("nan"))


def sqnr(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(||ref|| / ||ref - approx||)."""
    ref = reference.detach().double()
    noise = (ref - approx.detach().double()).norm()
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(ref.norm() / noise))
