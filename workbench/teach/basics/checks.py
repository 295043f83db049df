"""Lesson 11's exercises: worked solutions (``_solution_*``), their checks (``check_*``) and what only they use."""
from __future__ import annotations

import functools
import math

import torch

from workbench.quantization import primitives as P
from workbench.teach import Feedback, as_number, check
from workbench.teach.formats.checks import differs_only_at_ties

__all__ = ["check_group_quantizer", "check_asymmetric_quantizer", "check_best_clipping", "check_codes_used"]


# --- exercise checks -----------------------------------------------------------------------------------
# Each exercise has a worked solution (``_solution_*``, written as a learner would write it in the cell), shown
# behind the feedback's "Show solution" toggle and run by the regression suite (``wb.teach.use_solutions``).


def _solution_asymmetric_quantizer(v, lo, hi, bits):
    qmin, qmax = 0, 2 ** bits - 1                        # unsigned codes
    s = (hi - lo) / (qmax - qmin)                        # the range spread over the steps between the codes
    z = qmin - round(lo / s)                             # an integer code: real 0 lands exactly on the grid
    codes = torch.clamp(torch.round(v / s) + z, qmin, qmax)
    return codes, (codes - z) * s


def _solution_codes_used(a, act_bits):
    codes, scale, zero_point = P.quantize_affine(a, act_bits, P.PerTensor(), symmetric=True)
    return codes.unique().numel()


def _solution_group_quantizer(w, bits, group_size):
    qmin, qmax = -2 ** (bits - 1), 2 ** (bits - 1) - 1
    groups = w.reshape(-1, group_size)                                  # (out * in / group_size, group_size)
    s = groups.abs().amax(dim=1, keepdim=True) / ((qmax - qmin) / 2)    # one scale per group: max|w| / 7.5 at 4 bits
    return ((groups / s).round().clamp(qmin, qmax) * s).reshape(w.shape)


def _solution_best_clipping(curve):
    return curve["threshold"][curve["mse"].idxmin()]


def check_group_quantizer(answer, w: torch.Tensor, bits: int = 4, group_size: int = 64) -> Feedback:
    """Exercise: ``w`` (out, in) fake-quantized with symmetric signed ``bits``-bit codes and one scale per
    ``group_size`` consecutive inputs of a row (`primitives.fake_quantize` with `PerGroup`). A value on a
    rounding boundary (w / s = k + 0.5, e.g. a group's largest |w| at exactly 7.5 steps) may round either way
    (dividing by s or multiplying by 1 / s): those may differ by one step."""
    solution = functools.partial(_solution_group_quantizer, w.detach().float(), bits, group_size)
    w = w.detach().float()
    expected = P.fake_quantize(w, bits, P.PerGroup(group_size), symmetric=True)
    name = f"int{bits} group quantizer, g{group_size}"
    hint = (f"reshape w to (-1, {group_size}); per group s = max|w| / ((qmax - qmin) / 2) with qmin, qmax = "
            f"{-2 ** (bits - 1)}, {2 ** (bits - 1) - 1}; w_hat = clamp(round(w / s), qmin, qmax) * s, reshaped back")
    got = answer if isinstance(answer, torch.Tensor) else solution() if answer is ... or answer is None else None
    if isinstance(got, torch.Tensor) and differs_only_at_ties(got, expected, w, bits, group_size):
        expected = got.detach().float()                                   # rounding-boundary ties only: accepted
    elif isinstance(answer, torch.Tensor) and answer.shape == expected.shape:
        got = answer.detach().float()
        qmin, qmax = -2 ** (bits - 1), 2 ** (bits - 1) - 1
        g = w.reshape(-1, group_size)
        known = [(P.fake_quantize(w, bits, P.PerChannel(0), symmetric=True),
                  f"one scale per row: the exercise asks for one per {group_size} weights"),
                 (((g / (g.abs().amax(1, keepdim=True) / qmax)).round().clamp(qmin, qmax)
                   * (g.abs().amax(1, keepdim=True) / qmax)).reshape(w.shape),
                  f"scale = max|w| / {qmax}: the symmetric rule divides by (qmax - qmin) / 2 = {(qmax - qmin) / 2:g}"),
                 (((g / (g.abs().amax(1, keepdim=True) / ((qmax - qmin) / 2))).round()
                   * (g.abs().amax(1, keepdim=True) / ((qmax - qmin) / 2))).reshape(w.shape),
                  f"no clamp: max|w| / s = {(qmax - qmin) / 2:g} rounds to {qmax + 1}, outside the grid")]
        for value, why in known:
            if torch.allclose(got, value, rtol=1e-4, atol=1e-6):
                return check(name, answer, expected, hint=why, rtol=1e-4, atol=1e-6, solution=solution)
    return check(name, answer, expected, hint=hint, rtol=1e-4, atol=1e-6, solution=solution)


def _affine(v: torch.Tensor, s: float, z: float, qmin: int, qmax: int, clamp: bool = True):
    """(codes, dequantized values) of ``v`` on the grid ``s``, ``z``, codes ``qmin .. qmax`` (by division)."""
    codes = torch.round(v / s) + z
    codes = codes.clamp(qmin, qmax) if clamp else codes
    return codes, (codes - z) * s


def check_asymmetric_quantizer(answer, v: torch.Tensor, lo: float, hi: float, bits: int = 4) -> Feedback:
    """Exercise: an asymmetric quantizer for unsigned ``bits``-bit codes calibrated on the range [``lo``, ``hi``]:
    the pair ``(codes, x_hat)`` of ``v`` (values outside the range are clipped), as the package's
    `primitives.choose_qparams` (asymmetric, unsigned), `quantize` and `dequantize` compute them."""
    solution = functools.partial(_solution_asymmetric_quantizer, v, lo, hi, bits)
    qmin, qmax = P.qrange(bits, signed=False)
    vg = v.detach().float().reshape(1, -1)
    scale, zero = P.choose_qparams(vg, bits, symmetric=False, signed=False, min_val=torch.tensor(float(lo)),
                                   max_val=torch.tensor(float(hi)))
    codes = P.quantize(vg, scale, zero, qmin, qmax, torch.int32)
    expected = (codes.reshape(v.shape), P.dequantize(codes, scale, zero).reshape(v.shape))
    s, z = float(scale), int(zero)
    x = v.detach().double()
    lo_v, hi_v = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    sqmin, sqmax = P.qrange(bits, signed=True)
    off_by_one = (hi - lo) / (qmax - qmin + 1)
    own = (hi_v - lo_v) / (qmax - qmin)
    codes_only = _affine(x, s, z, qmin, qmax)[0]
    mistakes = [
        (_affine(x, off_by_one, qmin - round(lo / off_by_one), qmin, qmax),
         f"{qmax - qmin + 1} codes have {qmax - qmin} steps between them: the scale spreads hi - lo over "
         f"qmax - qmin = {qmax - qmin}, so that lo and hi land on the first and the last code"),
        (_affine(x, s, round(lo / s), qmin, qmax), f"the zero point's sign: lo must land on code {qmin}, so "
                                                  f"z = {qmin} - round(lo / s) = {z}, a code inside the grid"),
        (_affine(x, s, qmin - lo / s, qmin, qmax), "the zero point must be an integer (a code): round it, so that "
                                                   "real 0 is exactly representable"),
        (_affine(x, s, z, qmin, qmax, clamp=False), f"values outside [lo, hi] must be clipped: clamp the codes to "
                                                    f"[{qmin}, {qmax}]"),
        (_affine(x, s, z - qmin + sqmin, sqmin, sqmax), f"those are signed codes [{sqmin}, {sqmax}]; this quantizer "
                                                        f"stores unsigned ones, [{qmin}, {qmax}]"),
        ((codes_only, codes_only * s), "dequantize with the zero point: subtract z from the code before scaling"),
        ((codes_only, codes_only), "the second item is the dequantized value, back on the real axis, not the code"),
        (_affine(x, own, qmin - round(lo_v / own), qmin, qmax),
         "that grid comes from v's own minimum and maximum; the quantizer uses the range calibrated in advance, "
         "[lo, hi] (v holds held-out values, some beyond it)"),
    ]
    hint = (f"from lo and hi: the scale and an integer zero point for codes [{qmin}, {qmax}]; then each value's "
            f"code, clipped to the grid, and its value back on the real axis")
    if isinstance(answer, torch.Tensor):
        hint = "return the pair (codes, x_hat): `answer = codes, x_hat`"
    return check(f"asymmetric uint{bits} quantizer", answer, expected, hint=hint, rtol=1e-5, atol=1e-6,
                 mistakes=mistakes, solution=solution)


def check_best_clipping(answer, curve) -> Feedback:
    """Exercise: the threshold of ``curve`` (from `clipping_curve`) with the smallest MSE; any threshold within
    one grid step of it passes."""
    solution = functools.partial(_solution_best_clipping, curve)
    best = int(curve["mse"].values.argmin())
    t = curve["threshold"].values
    expected = float(t[best])
    step = float(max(t[min(best + 1, len(t) - 1)] - t[best], t[best] - t[max(best - 1, 0)]))
    value = as_number(answer)
    name = "best clipping threshold"
    hint = "read the threshold at the bottom of the curve: the row of `curve` with the smallest mse"
    if value is not None and math.isclose(value, float(t[-1]), rel_tol=1e-6):
        hint = "that is max|x|, i.e. min-max with no clipping; the curve is lower to the left of it"
    elif value is not None and math.isclose(value, float(curve["mse"].values[best]), rel_tol=1e-6):
        hint = "that is the smallest MSE itself; the exercise asks for the threshold where it occurs"
    return check(name, answer, expected, hint=hint, rtol=0.0, atol=step, solution=solution)


def check_codes_used(answer, x: torch.Tensor, bits: int = 8) -> Feedback:
    """Exercise: how many distinct codes symmetric per-tensor quantization of ``x`` uses."""
    solution = functools.partial(_solution_codes_used, x, bits)
    q, _, _ = P.quantize_affine(x.detach().float(), bits, P.PerTensor(), symmetric=True)
    qa, _, _ = P.quantize_affine(x.detach().float(), bits, P.PerTensor(), symmetric=False)
    expected, asym = int(q.unique().numel()), int(qa.unique().numel())
    hint = (f"quantize x with primitives.quantize_affine(x, {bits}, PerTensor(), symmetric=True) and count the "
            f"distinct codes (tensor.unique().numel())")
    value = as_number(answer)
    if value == asym and asym != expected:
        hint = "that is the count for asymmetric quantization; the exercise asks for symmetric"
    elif value == 1 << bits:
        hint = f"{1 << bits} is every code the format has; count the ones the quantized tensor actually uses"
    return check(f"int{bits} codes used by symmetric quantization", answer, expected, hint=hint, rtol=0, atol=0,
                 solution=solution)
