"""Lesson 10's exercises: worked solutions (``_solution_*``), their checks (``check_*``) and what only they use."""
from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from workbench.quantization import primitives as P
from workbench.teach import Feedback, check
from workbench.teach.formats.figures import cast, format_of

__all__ = ["differs_only_at_ties", "check_int8_round_trip", "check_e4m3_decode", "check_loses_small_values",
           "check_fp16_exp_limit"]


# --- exercise checks -----------------------------------------------------------------------------------

def _solution_e4m3_decode(codes):
    sign = (codes >> 7) & 1                                     # bit 7
    exponent = (codes >> 3) & 0b1111                            # bits 6-3, bias 7
    mantissa = codes & 0b111                                    # bits 2-0
    normal = 2.0 ** (exponent - 7) * (1 + mantissa / 8)
    subnormal = 2.0 ** (1 - 7) * (mantissa / 8)
    value = torch.where(exponent > 0, normal, subnormal)
    value = torch.where((exponent == 15) & (mantissa == 7), float("nan"), value)   # S.1111.111 is NaN
    return torch.where(sign == 1, -value, value)


def _decode_fields(codes: torch.Tensor, bias: int = 7, subnormals: bool = True, nan_top: bool = True,
                   inf_top: bool = False) -> torch.Tensor:
    """What a decoder with one of the usual slips computes: the wrong bias, no subnormal rule, no NaN pattern,
    or IEEE's reserved top exponent (inf / NaN)."""
    c = codes.long()
    sign, exponent, mantissa = (c >> 7) & 1, (c >> 3) & 15, c & 7
    value = 2.0 ** (exponent - bias) * (1 + mantissa / 8)
    if subnormals:
        value = torch.where(exponent > 0, value, 2.0 ** (1 - bias) * (mantissa / 8))
    if nan_top:
        value = torch.where((exponent == 15) & (mantissa == 7), float("nan"), value)
    if inf_top:
        value = torch.where(exponent == 15, torch.where(mantissa == 0, float("inf"), float("nan")), value)
    return torch.where(sign == 1, -value, value).double()


def check_e4m3_decode(answer, codes: torch.Tensor) -> Feedback:
    """Exercise: the value of every float8 e4m3fn bit pattern in ``codes`` (integers 0..255), decoded by hand
    from its sign, exponent and mantissa fields. Expected: PyTorch's own reading of the same bytes."""
    expected = codes.to(torch.uint8).view(torch.float8_e4m3fn).double()
    mistakes = [
        (_decode_fields(codes, subnormals=False), "exponent field 0 is subnormal: 2^(1 - bias) · M / 8, with no "
                                                  "implicit leading 1"),
        (_decode_fields(codes, bias=8), "the bias of a 4-bit exponent is 2^(4-1) - 1 = 7"),
        (_decode_fields(codes, nan_top=False), "S.1111.111 is NaN in e4m3fn (its only NaN pattern); every other "
                                               "pattern with exponent 1111 is an ordinary number"),
        (_decode_fields(codes, inf_top=True), "that is IEEE-style e4m3, which reserves exponent 1111 for inf / NaN; "
                                              "e4m3fn ('finite') has no inf and uses that exponent for numbers"),
        (_decode_fields(codes).abs(), "the sign bit (bit 7) was dropped: codes 128..255 are negative"),
    ]
    hint = ("split each byte: sign = bit 7, exponent = bits 6-3, mantissa = bits 2-0; normal "
            "(-1)^s · 2^(E - 7) · (1 + M / 8), subnormal (E = 0) (-1)^s · 2^-6 · M / 8, and S.1111.111 is NaN")
    return check("e4m3 decoder", answer, expected, hint=hint, rtol=0, atol=0, mistakes=mistakes,
                 solution=functools.partial(_solution_e4m3_decode, codes))


def differs_only_at_ties(got: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, bits: int,
                         group_size: int) -> bool:
    """True when ``got`` (a symmetric ``bits``-bit fake quantization of ``x``, one scale per ``group_size``
    consecutive values) differs from ``expected`` only where x / scale lies on a rounding boundary (k + 0.5), by
    one step and inside the grid: dividing by the scale or multiplying by its inverse may round those either way
    (a group's largest |x| sits exactly at (2^bits - 1) / 2 steps)."""
    if got.shape != expected.shape:
        return False
    got = got.detach().float()
    g = x.detach().float().reshape(-1, group_size)                                     # (groups, group_size)
    step = g.abs().amax(1, keepdim=True) / ((2 ** bits - 1) / 2)                      # (groups, 1)
    ratio = (g / step).abs()
    tie = (((ratio - ratio.floor()) - 0.5).abs() < 1e-4).reshape(x.shape)            # on a boundary (k.5)
    off = ~torch.isclose(got, expected, rtol=1e-4, atol=1e-7)
    one_step = torch.isclose((got - expected).abs(), step.expand_as(g).reshape(x.shape), rtol=1e-3)
    code = (got.reshape(-1, group_size) / step).round().reshape(x.shape)
    on_grid = (code >= -2 ** (bits - 1)) & (code <= 2 ** (bits - 1) - 1)             # a tie may not leave the grid
    return bool(off.any()) and bool((tie & one_step & on_grid)[off].all())


def _solution_int8_round_trip(w):
    scale = w.abs().max() / ((127 - (-128)) / 2)                # the 255 steps spread over [-max|w|, max|w|]
    codes = (w / scale).round().clamp(-128, 127)
    return codes * scale


def check_int8_round_trip(answer, x: torch.Tensor) -> Feedback:
    """Exercise: ``x`` through symmetric per-tensor int8 and back (x_hat), as `primitives.fake_quantize` with
    `PerTensor` computes it. A value exactly on a rounding boundary (x / scale = k + 0.5, e.g. -max|x| at
    -127.5 steps) may round either way: a one-step difference there passes."""
    x = x.detach().float()
    expected = P.fake_quantize(x, 8, P.PerTensor(), symmetric=True)
    name = "int8 round trip (symmetric, per tensor)"
    solution = functools.partial(_solution_int8_round_trip, x)
    amax = x.abs().max()
    step = amax / 127.5
    got = answer if isinstance(answer, torch.Tensor) else solution() if answer is ... or answer is None else None
    if isinstance(got, torch.Tensor) and differs_only_at_ties(got, expected, x, 8, x.numel()):
        expected = got.detach().float()                                   # rounding-boundary ties only: accepted
    s127, smax = amax / 127, x.max() / 127.5
    mistakes = [
        ((x / s127).round().clamp(-128, 127) * s127, "scale = max|x| / 127 is the restricted range -127..127 some "
                                                     "libraries use; here (like PyTorch) the 255 steps between "
                                                     "qmin = -128 and qmax = 127 span [-max|x|, max|x|]: divide by "
                                                     "127.5"),
        ((x / step).round() * step, "no clamp: max|x| / scale = 127.5 rounds to 128, one code beyond qmax = 127"),
        ((x / step).round().clamp(-128, 127), "those are the integer codes; multiply them by the scale to get x_hat"),
        ((x / smax).round().clamp(-128, 127) * smax, "the scale comes from the largest *magnitude* max|x|, not "
                                                     "max(x): here the most negative value is further from 0"),
    ]
    hint = ("scale = max|x| spread over half of the 255 steps; codes = x / scale rounded to the nearest integer, "
            "clamped to [-128, 127]; x_hat = codes · scale")
    return check(name, answer, expected, hint=hint, rtol=1e-4, atol=1e-7, mistakes=mistakes, solution=solution)


def _canonical(answer) -> object:
    try:
        return format_of(answer).name
    except (ValueError, TypeError):
        return answer


def _solution_loses_small_values(p):
    lost_fp16 = int(((p.half() == 0) & (p != 0)).sum())          # non-zero in fp32, zero after the cast
    lost_bf16 = int(((p.bfloat16() == 0) & (p != 0)).sum())
    return "fp16" if lost_fp16 > lost_bf16 else "bf16"


def check_loses_small_values(answer, p: torch.Tensor, candidates: Sequence[str] = ("fp16", "bf16")) -> Feedback:
    """Exercise: which of ``candidates`` (cast directly, no scale) flushes the most non-zero values of ``p``
    to zero. The feedback says how many each loses."""
    lost = {format_of(c).name: int(((cast(p, c) == 0) & (p != 0)).sum()) for c in candidates}
    expected = max(lost, key=lost.get)
    counts = ", ".join(f"{k} flushes {v} of {p.numel()}" for k, v in lost.items())
    hint = (f"count the values that are non-zero in fp32 but 0 after the cast; {counts}. Underflow depends on the "
            f"exponent bits (the range), not the mantissa bits")
    other = next(iter(set(lost) - {expected}), None)
    mistakes = [(other, f"{other} keeps fp32's 8 exponent bits, so its range reaches as far down as fp32's; "
                        f"{counts}")] if other is not None else []
    return check("format that loses small values", _canonical(answer), expected, hint=hint, mistakes=mistakes,
                 solution=functools.partial(_solution_loses_small_values, p))


def _solution_fp16_exp_limit():
    largest = torch.finfo(torch.float16).max                   # 65504: exp(x) must stay at or below it
    return float(torch.tensor(largest).log())


def check_fp16_exp_limit(answer) -> Feedback:
    """Exercise: the largest x for which exp(x) is finite in fp16, i.e. ln(65504)."""
    expected = math.log(float(torch.finfo(torch.float16).max))
    mistakes = [(math.log10(65504), "that is log10(65504); exp is base e: use math.log"),
                (math.log2(65504), "that is log2(65504); exp is base e: use math.log"),
                (65504.0, "65504 is the largest fp16 value itself; the exercise asks for the x with exp(x) = 65504"),
                (math.log(float(torch.finfo(torch.bfloat16).max)), "that is the bf16 limit, ln(3.39e38)")]
    return check("largest logit with a finite fp16 exp", answer, expected, rtol=1e-3,
                 hint="exp(x) must stay below fp16's largest value, 65504: x = ln(65504)", mistakes=mistakes,
                 solution=_solution_fp16_exp_limit)
