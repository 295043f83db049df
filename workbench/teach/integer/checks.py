"""Lab 14's exercises: worked solutions (``_solution_*``), their checks (``check_*``) and what only they use."""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
from torch import nn

from workbench.models.fuse import fold_pair
from workbench.quantization import integer as I
from workbench.teach import Feedback, check
from workbench.teach.integer.figures import QMAX, QMIN, IntegerCNN

__all__ = ["linear_exercise", "LinearExercise", "check_accumulator", "check_offset", "check_int32_bias",
           "check_multiplier", "check_quantize_multiplier", "check_rounding_shift", "check_requantize_relu",
           "check_fold_bn", "check_integer_linear"]


# --- exercises: worked solutions (as a learner writes them) and checks ----------------------------------

def _solution_accumulator(q_x, z_x, q_w, z_w):
    qx, qw = q_x.to(torch.int32), q_w.to(torch.int32)
    k = qx.shape[1]
    answer = qx @ qw.T - z_w * qx.sum(1, keepdim=True) - z_x * qw.sum(1) + k * z_x * z_w
    return answer


def check_accumulator(answer, q_x: torch.Tensor, z_x: int, q_w: torch.Tensor, z_w: int) -> Feedback:
    """Exercise 1: ``sum_k (q_x - z_x)(q_w - z_w)`` ``(N, C)`` from the four-term expansion."""
    expected = (q_x.to(torch.int64) - z_x) @ (q_w.to(torch.int64) - z_w).T
    qx, qw = q_x.to(torch.int64), q_w.to(torch.int64)
    k = qx.shape[1]
    raw = qx @ qw.T - z_w * qx.sum(1, keepdim=True) - z_x * qw.sum(1)
    mistakes = [(raw, f"the K z_x z_w term is missing: subtracting z_w sum q_x and z_x sum q_w removes the "
                      f"product z_x z_w twice, once for each of the K = {k} terms; add it back"),
                (raw - k * z_x * z_w, "the sign of K z_x z_w: it is added back, (a - b)(c - d) = ac - ad - bc + bd"),
                (qx @ qw.T, "those are the raw codes multiplied: subtract the zero points (four terms)")]
    return check("zero-point expansion of the accumulator", answer, expected, rtol=0, atol=0,
                 hint="sum q_x q_w - z_w sum_k q_x - z_x sum_k q_w + K z_x z_w, all in integers",
                 mistakes=mistakes, solution=functools.partial(_solution_accumulator, q_x, z_x, q_w, z_w))


def _solution_offset(q_w, z_x, z_w):
    k = q_w.shape[1]
    return k * z_x * z_w - z_x * q_w.to(torch.int32).sum(1)


def check_offset(answer, q_w: torch.Tensor, z_x: int, z_w: int) -> Feedback:
    """Exercise 2: the per-output-channel constant of the expansion (what is precomputed into the bias)."""
    expected = I.zero_point_offset(q_w, z_x, z_w).to(torch.int64)
    k = q_w.shape[1]
    sums = q_w.to(torch.int64).sum(1)
    mistakes = [(-z_x * sums, "the K z_x z_w term is missing: it depends only on constants, so it is precomputed "
                              "too"),
                (k * z_x * z_w + z_x * sums, "the sign of z_x sum q_w: the expansion subtracts it"),
                (torch.full_like(sums, k * z_x * z_w), "z_x sum_k q_w[c, k] depends only on the weights and the "
                                                       "static z_x: it is precomputed as well")]
    return check("the precomputable zero-point terms", answer, expected, rtol=0, atol=0,
                 hint="keep the terms that do not involve q_x: one integer per output channel",
                 mistakes=mistakes, solution=functools.partial(_solution_offset, q_w, z_x, z_w))


def _solution_int32_bias(bias, s_x, s_w):
    answer = torch.round(bias.double() / (s_x * s_w.double())).to(torch.int32)
    return answer


def check_int32_bias(answer, bias: torch.Tensor, s_x: float, s_w: torch.Tensor, s_y: float) -> Feedback:
    """Exercise 3: the int32 bias of a layer (scale ``s_x * s_w`` per channel)."""
    expected = I.quantize_bias(bias, s_x, s_w).to(torch.int64)
    b = bias.double()
    mistakes = [(torch.round(b / s_y), "that is the bias at the output's scale s_y; it is added to the "
                                       "accumulator, whose scale is s_x * s_w"),
                (torch.round(b / s_w.double()), "the accumulator's scale is s_x * s_w, not s_w alone"),
                (torch.trunc(b / (s_x * s_w.double())), "round to nearest: int() / .to(int) truncates toward 0")]
    return check("int32 bias", answer, expected, rtol=0, atol=0,
                 hint="divide the float bias by the accumulator's scale and round",
                 mistakes=mistakes, solution=functools.partial(_solution_int32_bias, bias, s_x, s_w))


def _solution_multiplier(s_x, s_w, s_y):
    return s_x * s_w.double() / s_y


def check_multiplier(answer, s_x: float, s_w: torch.Tensor, s_y: float) -> Feedback:
    """Exercise 4: the real requantization multiplier ``M`` per output channel."""
    layer_m = float(s_x) * s_w.double() / float(s_y)
    mistakes = [(float(s_y) / (float(s_x) * s_w.double()), "upside down: the accumulator is in units of "
                                                            "s_x s_w and the output in units of s_y"),
                (float(s_x) * s_w.double(), "that converts to real values; divide by s_y to get output codes")]
    return check("requantization multiplier M", answer, layer_m, rtol=1e-6, atol=0,
                 hint="y = s_y q_y and y = s_x s_w acc, so q_y = (s_x s_w / s_y) acc",
                 mistakes=mistakes, solution=functools.partial(_solution_multiplier, s_x, s_w, s_y))


def _solution_quantize_multiplier(m):
    mantissa, exponent = torch.frexp(m.double())          # m = mantissa * 2^exponent, 0.5 <= mantissa < 1
    m0 = torch.round(mantissa * 2 ** 31).long()
    shift = 31 - exponent.long()
    carry = m0 == 2 ** 31                                  # rounded up to 1.0: halve it, shift one less
    answer = (torch.where(carry, m0 // 2, m0), torch.where(carry, shift - 1, shift))
    return answer


def check_quantize_multiplier(answer, m: torch.Tensor) -> Feedback:
    """Exercise 5: ``(M0, shift)`` with ``M = M0 2^-shift`` and ``2^30 <= M0 < 2^31``."""
    m0, shift = I.quantize_multiplier(m)
    expected = (m0, shift)
    mantissa, exponent = torch.frexp(m.double())
    mistakes = [((torch.trunc(mantissa * 2 ** 31).long(), 31 - exponent.long()),
                 "round the mantissa to the nearest integer: truncating loses up to one unit of M0"),
                ((torch.round(mantissa * 2 ** 32).long(), 32 - exponent.long()),
                 "M0 must fit a signed int32: 2^30 <= M0 < 2^31 (you used 32 bits)"),
                ((torch.round(mantissa * 2 ** 31).long(), -exponent.long()),
                 "the shift counts the 31 fraction bits of M0 too: shift = 31 - exponent"),
                ((mantissa, -exponent.long()), "M0 is an integer: scale the mantissa by 2^31 and round")]
    return check("M as a fixed-point M0 and a shift", answer, expected, rtol=0, atol=0,
                 hint="write M = mantissa * 2^exponent (torch.frexp), M0 = round(mantissa * 2^31), "
                      "shift = 31 - exponent",
                 mistakes=mistakes, solution=functools.partial(_solution_quantize_multiplier, m))


def _solution_rounding_shift(x, n):
    magnitude = (x.abs() + (1 << (n - 1))) >> n
    return torch.where(x < 0, -magnitude, magnitude)


def check_rounding_shift(answer, x: torch.Tensor, n: int) -> Feedback:
    """Exercise 6: ``x / 2^n`` rounded to nearest, ties away from zero."""
    expected = I.rounding_right_shift(x, n)
    xl = x.to(torch.int64)
    mistakes = [(xl >> n, "a plain >> rounds toward minus infinity (floor): add half of 2^n before shifting"),
                ((xl + (1 << (n - 1))) >> n, "that rounds ties up (toward +infinity); ties of negative values "
                                             "must go away from zero: shift |x|, then put the sign back"),
                (torch.div(xl, 1 << n, rounding_mode="trunc"), "that truncates toward zero; round to nearest")]
    return check(f"rounding right shift by {n}", answer, expected, rtol=0, atol=0,
                 hint="round |x| / 2^n to nearest with an added half, then restore the sign",
                 mistakes=mistakes, solution=functools.partial(_solution_rounding_shift, x, n))


def _solution_requantize_relu(acc, m0, shift, z_y):
    prod = acc.long() * m0
    magnitude = (prod.abs() + (1 << (shift - 1))) >> shift
    scaled = torch.where(prod < 0, -magnitude, magnitude)
    return (scaled + z_y).clamp(z_y, 127).to(torch.int8)


def check_requantize_relu(answer, acc: torch.Tensor, m0: torch.Tensor, shift: torch.Tensor, z_y: int) -> Feedback:
    """Exercise 7: int8 output codes of a layer with a fused ReLU from its int32 accumulator (bias included)."""
    expected = I.requantize(acc, m0, shift, z_y, z_y, QMAX).to(torch.int64)
    scaled = I.multiply_by_quantized_multiplier(acc, m0, shift)
    mistakes = [((scaled + z_y).clamp(0, QMAX), f"ReLU clamps at the code of real 0, which is z_y = {z_y}, "
                                                 f"not at code 0"),
                ((scaled + z_y).clamp(QMIN, QMAX), f"the ReLU is missing: clamp from below at z_y = {z_y}"),
                (scaled.clamp(z_y, QMAX), "add the output zero point before clamping"),
                (scaled.clamp(0, QMAX), "add the output zero point z_y, and clamp at it")]
    return check("requantize with a fused ReLU", answer, expected, rtol=0, atol=0,
                 hint="codes = clamp(z_y + rounding_shift(acc * M0, shift), z_y, 127)",
                 mistakes=mistakes, solution=functools.partial(_solution_requantize_relu, acc, m0, shift, z_y))


def _solution_fold_bn(conv, bn):
    s = bn.weight / torch.sqrt(bn.running_var + bn.eps)               # (out,)
    weight = conv.weight * s.reshape(-1, 1, 1, 1)
    bias = (conv.bias - bn.running_mean) * s + bn.bias
    return (weight.detach(), bias.detach())


def check_fold_bn(answer, conv: nn.Conv2d, bn: nn.BatchNorm2d) -> Feedback:
    """Exercise 8: the folded (weight, bias) of ``conv`` followed by ``bn`` (eval mode)."""
    c, b = copy.deepcopy(conv), copy.deepcopy(bn)
    fold_pair(c, b)
    expected = (c.weight.detach(), c.bias.detach())
    with torch.no_grad():
        s = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        s_no_eps = bn.weight / torch.sqrt(bn.running_var)
        w = conv.weight * s.reshape(-1, 1, 1, 1)
        mistakes = [((w, conv.bias * s + bn.bias), "the running mean is missing from the bias: "
                                                   "b' = (b - mean) * s + beta"),
                    ((w, (conv.bias - bn.running_mean) * s), "beta (bn.bias) is missing from the bias"),
                    ((conv.weight * (bn.weight / bn.running_var).reshape(-1, 1, 1, 1),
                      (conv.bias - bn.running_mean) * bn.weight / bn.running_var + bn.bias),
                     "divide by the standard deviation sqrt(var + eps), not by the variance"),
                    ((conv.weight * s_no_eps.reshape(-1, 1, 1, 1), (conv.bias - bn.running_mean) * s_no_eps + bn.bias),
                     "BatchNorm divides by sqrt(running_var + eps): eps is missing")]
    return check("fold BatchNorm into the convolution", answer, expected, rtol=2e-6, atol=1e-7,
                 hint="s = gamma / sqrt(var + eps) per output channel; W' = W * s, b' = (b - mean) * s + beta",
                 mistakes=mistakes, solution=functools.partial(_solution_fold_bn, conv, bn))


def _solution_integer_linear(q_in, ex):
    acc = (q_in.int() - ex.input_zero_point) @ ex.weight.int().T + ex.bias_int32
    prod = acc.long() * ex.multiplier
    magnitude = (prod.abs() + (1 << (ex.shift - 1))) >> ex.shift
    scaled = torch.where(prod < 0, -magnitude, magnitude)
    return (scaled + ex.output_zero_point).clamp(ex.output_zero_point, 127).to(torch.int8)


@dataclass(frozen=True)
class LinearExercise:
    """What exercise 9 gives the learner: the codes of an int8 Linear + ReLU and its qparams (the bias
    without the zero-point offset, so the learner subtracts ``z_x`` themselves)."""

    weight: torch.Tensor             # (C, K) int8
    bias_int32: torch.Tensor         # (C,) int32 at scale s_x s_w
    multiplier: torch.Tensor         # (C,) int64
    shift: torch.Tensor              # (C,) int64
    input_zero_point: int
    output_zero_point: int


def linear_exercise(net: IntegerCNN, name: str = "fc1") -> LinearExercise:
    """The exercise's view of layer ``name``."""
    layer = net.layers[name]
    bias = layer.bias - I.zero_point_offset(layer.weight, layer.input_zero_point)
    return LinearExercise(layer.weight, bias.to(torch.int32), layer.multiplier, layer.shift, layer.input_zero_point,
                          layer.output_zero_point)


def check_integer_linear(answer, q_x: torch.Tensor, net: IntegerCNN, name: str = "fc1") -> Feedback:
    """Exercise 9: the int8 output codes of Linear + ReLU layer ``name`` for input codes ``q_x``."""
    layer = net.layers[name]
    expected = I.integer_linear(q_x, layer).to(torch.int64)
    ex = linear_exercise(net, name)
    raw = q_x.to(torch.int32) @ ex.weight.to(torch.int32).T + ex.bias_int32
    mistakes = [(I.requantize(raw, ex.multiplier, ex.shift, ex.output_zero_point, ex.output_zero_point, QMAX),
                 f"subtract the input zero point z_x = {ex.input_zero_point} from the codes (or add its "
                 f"precomputed offset to the bias)"),
                (I.requantize(raw - ex.bias_int32 + I.zero_point_offset(ex.weight, ex.input_zero_point),
                              ex.multiplier, ex.shift, ex.output_zero_point, ex.output_zero_point, QMAX),
                 "the bias is missing from the accumulator")]
    return check(f"integer-only {name} (Linear + ReLU)", answer, expected, rtol=0, atol=0,
                 hint="acc = (q_x - z_x) @ q_w.T + bias (int32); then M0, the rounding shift, + z_y, clamp at z_y",
                 mistakes=mistakes, solution=functools.partial(_solution_integer_linear, q_x, ex))
