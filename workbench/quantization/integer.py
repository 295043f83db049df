"""Integer-only arithmetic for int8 layers (Jacob et al. 2018; gemmlowp / TFLite's requantization).

A quantized layer with input ``x = s_x (q_x - z_x)``, weights ``w = s_w (q_w - z_w)`` and output
``y = s_y (q_y - z_y)`` computes, for output channel ``c``::

    q_y = z_y + M_c * (sum_k (q_x[k] - z_x) (q_w[c, k] - z_w) + q_b[c])      M_c = s_x s_w[c] / s_y

with no float at run time:

- the sum is an int8 x int8 -> int32 accumulation; expanded into four terms
  ``sum q_x q_w - z_w sum q_x - z_x sum q_w + K z_x z_w``, the last two depend only on the weights and the
  (static) input zero point, so they are computed once (`zero_point_offset`) and added to the bias;
- the bias is stored as int32 at the accumulator's scale ``s_x s_w`` (`quantize_bias`);
- the real multiplier ``M`` is a fixed-point int32 ``M0`` with ``2^30 <= M0 < 2^31`` and a right shift
  (``M ~= M0 2^-shift``, `quantize_multiplier`), applied as an int64 product and a rounding right shift
  (`rounding_right_shift`, ties away from zero as gemmlowp's ``RoundingDivideByPOT``);
- a ReLU after the layer is the clamp's lower bound ``z_y`` (the code of real 0).

`IntegerLinear` holds one layer's integer tensors (made from float weights by `IntegerLinear.from_float`);
`integer_linear` / `integer_conv2d` run it on int8 codes. Convolutions are lowered to the same matmul by
`im2col`, which pads with the input zero point (the code of real 0), not with code 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workbench.quantization import primitives as P

__all__ = ["quantize_multiplier", "rounding_right_shift", "multiply_by_quantized_multiplier", "quantize_bias",
           "zero_point_offset", "integer_accumulate", "requantize", "IntegerLinear", "integer_linear",
           "im2col", "integer_conv2d", "code_dtype"]

_INT32 = (-(1 << 31), (1 << 31) - 1)


def quantize_multiplier(m: torch.Tensor | float, bits: int = 31) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m0, shift)``, int64 tensors shaped like ``m``, with ``m ~= m0 * 2^-shift`` and
    ``2^(bits-1) <= m0 < 2^bits`` (``bits=31``: an int32 Q31 mantissa, as gemmlowp / TFLite store it; fewer
    bits show what a coarse multiplier costs). Every ``m`` must be positive and below ``2^bits``."""
    m = torch.as_tensor(m, dtype=torch.float64)
    if not isinstance(bits, int) or not 1 <= bits <= 31:
        raise ValueError(f"quantize_multiplier: bits must be an int in 1..31, got {bits!r}")
    if not bool(torch.isfinite(m).all()) or not bool((m > 0).all()):
        raise ValueError(f"quantize_multiplier: multipliers must be positive and finite, got min {float(m.min())}")
    mantissa, exponent = torch.frexp(m)                         # m = mantissa * 2^exponent, mantissa in [0.5, 1)
    m0 = torch.round(mantissa * (1 << bits)).to(torch.int64)
    carry = m0 == (1 << bits)                                   # mantissa rounded up to 1.0
    m0 = torch.where(carry, m0 // 2, m0)
    exponent = exponent.to(torch.int64) + carry.to(torch.int64)
    shift = bits - exponent
    if bool((shift < 0).any()):
        raise ValueError(f"quantize_multiplier: a multiplier of {float(m.max()):g} needs a left shift; "
                         f"the largest supported is below 2^{bits}")
    return m0, shift


def rounding_right_shift(x: torch.Tensor, shift: torch.Tensor | int) -> torch.Tensor:
    """``x / 2^shift`` rounded to the nearest integer, ties away from zero, for integer ``x`` (int64 result);
    ``shift >= 0`` broadcasts against ``x``."""
    if x.is_floating_point():
        raise TypeError(f"rounding_right_shift takes integer tensors, got {x.dtype}")
    x = x.to(torch.int64)
    shift = torch.as_tensor(shift, dtype=torch.int64)
    if bool((shift < 0).any()):
        raise ValueError("rounding_right_shift: shifts must be >= 0")
    half = torch.where(shift > 0, torch.bitwise_left_shift(torch.ones_like(shift), (shift - 1).clamp(min=0)), 0)
    magnitude = torch.bitwise_right_shift(x.abs() + half, shift)
    return torch.where(x < 0, -magnitude, magnitude)


def multiply_by_quantized_multiplier(acc: torch.Tensor, m0: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``acc * M`` rounded to an integer, with ``M = m0 2^-shift`` (`quantize_multiplier`): an int64 product
    (|acc| < 2^31 and m0 < 2^31 cannot overflow it) and a rounding right shift. ``m0`` / ``shift`` broadcast
    along the last axis of ``acc`` (one per output channel) or are scalars."""
    return rounding_right_shift(acc.to(torch.int64) * m0.to(torch.int64), shift)


def quantize_bias(bias: torch.Tensor, input_scale: float | torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The float bias as int32 at the accumulator's scale ``s_x * s_w`` (one per output channel)."""
    scale = torch.as_tensor(input_scale, dtype=torch.float64) * weight_scale.double().reshape(-1)
    q = torch.round(bias.double().reshape(-1) / scale)
    if bool((q < _INT32[0]).any()) or bool((q > _INT32[1]).any()):
        raise ValueError("quantize_bias: the bias does not fit int32 at scale s_x * s_w")
    return q.to(torch.int32)


def zero_point_offset(q_w: torch.Tensor, input_zero_point: int, weight_zero_point: torch.Tensor | int = 0
                      ) -> torch.Tensor:
    """The weight-only terms of the zero-point expansion, ``K z_x z_w - z_x sum_k q_w[c, k]`` (int32, one per
    output channel of ``q_w`` ``(C, K)``): known when the layer is converted, so folded into its bias."""
    zx = int(input_zero_point)
    zw = torch.as_tensor(weight_zero_point, dtype=torch.int32).reshape(-1)
    k = q_w.shape[1]
    return (k * zx * zw - zx * q_w.to(torch.int32).sum(dim=1)).to(torch.int32)


def integer_accumulate(q_x: torch.Tensor, input_zero_point: int, q_w: torch.Tensor,
                       weight_zero_point: torch.Tensor | int = 0) -> torch.Tensor:
    """``sum_k (q_x[n, k] - z_x)(q_w[c, k] - z_w)`` as int32 ``(N, C)`` for codes ``q_x`` ``(N, K)`` and
    ``q_w`` ``(C, K)``, computed as the four-term expansion: an int32 matmul of the raw codes, the input
    row sums times ``z_w`` and the weight-only `zero_point_offset`."""
    qx, qw = q_x.to(torch.int32), q_w.to(torch.int32)
    zw = torch.as_tensor(weight_zero_point, dtype=torch.int32).reshape(-1)
    acc = qx @ qw.T                                                     # (N, C) int32
    if bool((zw != 0).any()):
        acc = acc - qx.sum(dim=1, keepdim=True) * zw                    # depends on the input: run time
    return acc + zero_point_offset(qw, input_zero_point, zw)


def code_dtype(qmin: int, qmax: int) -> torch.dtype:
    """The smallest integer dtype holding codes in [qmin, qmax]."""
    if -128 <= qmin and qmax <= 127:
        return torch.int8
    if 0 <= qmin and qmax <= 255:
        return torch.uint8
    return torch.int32


def requantize(acc: torch.Tensor, m0: torch.Tensor, shift: torch.Tensor, output_zero_point: int, qmin: int,
               qmax: int) -> torch.Tensor:
    """Output codes ``clamp(z_y + acc * M, qmin, qmax)`` from the int32 accumulator (bias included). A fused
    ReLU passes ``qmin = z_y``."""
    q = multiply_by_quantized_multiplier(acc, m0, shift) + int(output_zero_point)
    return q.clamp(qmin, qmax).to(code_dtype(qmin, qmax))


@dataclass(frozen=True)
class IntegerLinear:
    """One int8 layer, integers only: codes of the weights ``(C, K)`` (symmetric per output channel, so
    ``z_w = 0``), the int32 bias with the zero-point offset folded in, the per-channel multipliers and the
    output clamp. ``input_*`` / ``output_*`` are the static activation qparams; ``weight_scale`` and
    ``bias_float`` are kept only to build float references."""

    weight: torch.Tensor            # (C, K) int8
    weight_scale: torch.Tensor      # (C,) float32
    bias: torch.Tensor              # (C,) int32: quantize_bias(b) + zero_point_offset
    multiplier: torch.Tensor        # (C,) int64 m0
    shift: torch.Tensor             # (C,) int64
    input_scale: float
    input_zero_point: int
    output_scale: float
    output_zero_point: int
    qmin: int
    qmax: int
    bias_float: torch.Tensor        # (C,) float32

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, input_scale: float, input_zero_point: int,
                   output_scale: float, output_zero_point: int, relu: bool = False, bits: int = 8,
                   multiplier_bits: int = 31) -> "IntegerLinear":
        """Quantize a float layer: ``weight`` ``(C, ...)`` symmetric per output channel with ``bits`` bits
        (`primitives.quantize_affine`), the bias to int32, ``M = s_x s_w / s_y`` to fixed point."""
        w = weight.detach().float().reshape(weight.shape[0], -1)                # (C, K)
        q_w, s_w, _ = P.quantize_affine(w, bits, P.PerChannel(0), symmetric=True)
        s_w = s_w.reshape(-1)
        b = torch.zeros(w.shape[0]) if bias is None else bias.detach().float().reshape(-1)
        q_b = quantize_bias(b, input_scale, s_w) + zero_point_offset(q_w, input_zero_point)
        m0, shift = quantize_multiplier(float(input_scale) * s_w.double() / float(output_scale), multiplier_bits)
        qmin, qmax = P.qrange(8, True)
        return cls(q_w, s_w, q_b.to(torch.int32), m0, shift, float(input_scale), int(input_zero_point),
                   float(output_scale), int(output_zero_point), int(output_zero_point) if relu else qmin, qmax, b)


def integer_linear(q_x: torch.Tensor, layer: IntegerLinear) -> torch.Tensor:
    """Output codes ``(N, C)`` of ``layer`` for input codes ``q_x`` ``(N, K)``: int32 accumulation of the raw
    codes, the precomputed bias (zero-point terms included), fixed-point requantization and the clamp."""
    if q_x.is_floating_point():
        raise TypeError(f"integer_linear takes integer codes, got {q_x.dtype}")
    if q_x.shape[-1] != layer.weight.shape[1]:
        raise ValueError(f"integer_linear: input has {q_x.shape[-1]} features, the layer expects "
                         f"{layer.weight.shape[1]}")
    acc = q_x.to(torch.int32) @ layer.weight.to(torch.int32).T + layer.bias      # (N, C) int32
    return requantize(acc, layer.multiplier, layer.shift, layer.output_zero_point, layer.qmin, layer.qmax)


def im2col(q_x: torch.Tensor, kernel_size: tuple[int, int], padding: int, pad_value: int) -> torch.Tensor:
    """Patches of ``q_x`` ``(N, C, H, W)`` for a stride-1 convolution: ``(N * Ho * Wo, C * kh * kw)``, in the
    order of ``weight.reshape(out, -1)``. The border is padded with ``pad_value`` (the input zero point: the
    code of real 0)."""
    kh, kw = kernel_size
    x = F.pad(q_x.to(torch.int32), (padding, padding, padding, padding), value=int(pad_value))
    n, c = x.shape[:2]
    patches = x.unfold(2, kh, 1).unfold(3, kw, 1)                  # (N, C, Ho, Wo, kh, kw)
    ho, wo = patches.shape[2:4]
    return patches.permute(0, 2, 3, 1, 4, 5).reshape(n * ho * wo, c * kh * kw)


def integer_conv2d(q_x: torch.Tensor, layer: IntegerLinear, kernel_size: tuple[int, int], padding: int
                   ) -> torch.Tensor:
    """Output codes ``(N, C_out, Ho, Wo)`` of a stride-1, ungrouped Conv2d held as an `IntegerLinear` (its
    weight flattened to ``(C_out, C_in * kh * kw)``), for input codes ``q_x`` ``(N, C_in, H, W)``."""
    n, _, h, w = q_x.shape
    cols = im2col(q_x, kernel_size, padding, layer.input_zero_point)   # (N * Ho * Wo, C_in * kh * kw)
    ho, wo = h + 2 * padding - kernel_size[0] + 1, w + 2 * padding - kernel_size[1] + 1
    out = integer_linear(cols, layer)                                   # (N * Ho * Wo, C_out)
    return out.reshape(n, ho, wo, -1).permute(0, 3, 1, 2).contiguous()
