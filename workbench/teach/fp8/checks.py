"""Lab 41's exercises: worked solutions (``_solution_*``), their checks (``check_*``) and what only they use."""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from workbench.precision.fp8 import Fp8Recipe, Fp8State
from workbench.teach import Feedback, check
from workbench.teach.fp8.figures import FP8, _fp8, saturating_steps, zero_fraction

__all__ = ["check_round_trip", "check_current_scale", "check_zero_fraction", "check_delayed_scale",
           "check_saturating_steps", "check_relative_error", "check_headroom", "check_better_gradient_format",
           "check_saved_bytes"]


# --- exercises --------------------------------------------------------------------------------------------
# Each has a worked solution (``_solution_*``, as a learner writes it in the cell).


def _solution_round_trip(x, dtype, scale):
    fmax = torch.finfo(dtype).max
    return (x * scale).clamp(-fmax, fmax).to(dtype).float() / scale


def check_round_trip(answer, x: torch.Tensor, dtype: str | torch.dtype, scale: float) -> Feedback:
    """Exercise: ``x`` scaled, saturated to the format's range, cast to fp8 and back, unscaled."""
    d = _fp8(dtype)
    fmax = torch.finfo(d).max
    expected = (x.float() * scale).clamp(-fmax, fmax).to(d).float() / scale
    unclamped = (x.float() * scale).to(d).float() / scale
    mistakes = [(x.float().to(d).float(), "the scale is missing: multiply by it before the cast, divide after"),
                ((x.float() * scale).clamp(-fmax, fmax).to(d).float(), "divide by the scale after the cast")]
    if not torch.equal(unclamped, expected):
        mistakes.append((unclamped, "clamp to +-torch.finfo(dtype).max before the cast: how a value beyond the "
                                    "range is cast depends on the PyTorch version"))
    return check(f"fp8 round trip ({str(d).removeprefix('torch.float8_')})", answer, expected, rtol=0, atol=0,
                 mistakes=mistakes, hint="(x * scale).clamp(...).to(dtype), then back to float and / scale",
                 solution=functools.partial(_solution_round_trip, x, d, scale))


def _solution_current_scale(grad, dtype):
    return torch.finfo(dtype).max / grad.abs().max().item()


def check_current_scale(answer, t: torch.Tensor, dtype: str | torch.dtype) -> Feedback:
    """Exercise: the current-scaling multiplier of ``t`` for ``dtype``."""
    d = _fp8(dtype)
    expected = Fp8State(d, Fp8Recipe(scaling="current")).scale(t)
    amax = float(t.abs().max())
    return check(f"current scale for {str(d).removeprefix('torch.float8_')}", answer, expected, rtol=1e-6,
                 mistakes=[(amax / torch.finfo(d).max, "that is the inverse: the scale maps amax onto the largest "
                                                       "fp8 value, s * amax = max"),
                           (torch.finfo(d).max / float(t.max()), "amax is the largest |value|, not the largest value")],
                 hint="s = max_fp8 / amax(t)", solution=functools.partial(_solution_current_scale, t, d))


def _solution_zero_fraction(grad, dtype):
    nonzero = grad[grad != 0]
    return (nonzero.to(dtype) == 0).float().mean().item()


def check_zero_fraction(answer, t: torch.Tensor, dtype: str | torch.dtype) -> Feedback:
    """Exercise: the fraction of ``t``'s non-zero values that flush to 0 when cast to ``dtype`` without a scale."""
    d = _fp8(dtype)
    expected = zero_fraction(t, d)
    wrong_all = float((t.to(d) == 0).float().mean())
    return check(f"values flushed to 0 in {str(d).removeprefix('torch.float8_')}", answer, expected, rtol=1e-6,
                 mistakes=[(wrong_all, "count only the values that were not zero to begin with")],
                 hint="cast the non-zero values, count the zeros, divide by how many there were",
                 solution=functools.partial(_solution_zero_fraction, t, d))


def _solution_delayed_scale(amax_history, fmax, margin):
    return fmax / max(amax_history) / 2 ** margin


def check_delayed_scale(answer, history: Sequence[float], fmax: float, margin: int = 0) -> Feedback:
    """Exercise: the delayed-scaling multiplier from an amax history, with a margin."""
    state = Fp8State(torch.float8_e4m3fn, Fp8Recipe(scaling="delayed", history=len(history), margin=margin))
    state.history, state.fmax = list(history), fmax
    expected = state.scale(torch.zeros(1))
    return check("delayed scale", answer, expected, rtol=1e-9,
                 mistakes=[(fmax / history[-1] / 2 ** margin, "use the largest amax of the whole history, not the "
                                                             "last one"),
                           (fmax / max(history), "back the scale off by the margin: divide by 2**margin"),
                           (fmax / max(history) * 2 ** margin, "a margin makes the scale smaller (headroom)")],
                 hint="max_fp8 / max(history) / 2**margin",
                 solution=functools.partial(_solution_delayed_scale, list(history), fmax, margin))


def _solution_saturating_steps(trace, history):
    count = 0
    for i in range(1, len(trace)):
        if trace[i] > max(trace[max(0, i - history):i]):
            count += 1
    return count


def check_saturating_steps(answer, amaxes: Sequence[float], history: int) -> Feedback:
    """Exercise: the steps at which delayed scaling with ``history`` clamps (amax above the previous ones)."""
    expected = saturating_steps(amaxes, history)
    whole = sum(amaxes[i] > max(amaxes[:i]) for i in range(1, len(amaxes)))
    return check(f"steps that saturate (history {history})", answer, expected, rtol=0, atol=0,
                 mistakes=[(whole, f"the history holds only the previous {history} steps, not all of them")]
                 if whole != expected else [],
                 hint="step i saturates when amaxes[i] > max(amaxes[i - history:i]); the first step is scaled by "
                      "its own amax", solution=functools.partial(_solution_saturating_steps, list(amaxes), history))


def _solution_relative_error(grad, dtype):
    s = torch.finfo(dtype).max / grad.abs().max()
    back = (grad * s).to(dtype).float() / s
    return ((back - grad).norm() / grad.norm()).item()


def check_relative_error(answer, t: torch.Tensor, dtype: str | torch.dtype) -> Feedback:
    """Exercise: ||fp8(t) - t|| / ||t|| under current scaling."""
    d = _fp8(dtype)
    back = Fp8State(d, Fp8Recipe(scaling="current")).cast(t, record=False)
    expected = float((back - t).norm() / t.norm())
    unscaled = float((t.to(d).float() - t).norm() / t.norm())
    return check(f"relative error in {str(d).removeprefix('torch.float8_')}", answer, expected, rtol=1e-4,
                 mistakes=[(unscaled, "scale first (current scaling), then cast")],
                 hint="norm of the difference over the norm of t, after a scaled round trip",
                 solution=functools.partial(_solution_relative_error, t, d))


def _solution_headroom(margin):
    return 2.0 ** margin


def check_headroom(answer, margin: int) -> Feedback:
    """Exercise: how many times its recorded amax a tensor can grow before a delayed scale with ``margin`` clamps."""
    state = Fp8State(torch.float8_e4m3fn, Fp8Recipe(scaling="delayed", margin=margin))
    state.history = [1.0]
    expected = state.fmax / state.scale(torch.zeros(1))        # the largest |x| that still fits: amax * headroom
    return check(f"headroom of margin {margin}", answer, expected, rtol=1e-9,
                 mistakes=[(float(margin), "the margin is an exponent: the scale shrinks by 2**margin"),
                           (2.0 ** -margin, "the inverse: the scale shrinks by 2**margin, so the headroom grows")],
                 hint="s * amax_new <= max_fp8 with s = max_fp8 / amax / 2**margin",
                 solution=functools.partial(_solution_headroom, margin))


def check_better_gradient_format(answer, grad: torch.Tensor) -> Feedback:
    """Exercise: "e4m3" or "e5m2" - which keeps this output gradient with the smaller relative error under
    current scaling (measured, not recalled)."""
    errors = {}
    for name, d in FP8.items():
        back = Fp8State(d, Fp8Recipe(scaling="current")).cast(grad, record=False)
        errors[name] = float((back - grad).norm() / grad.norm())
    expected = min(errors, key=errors.get)
    return check("the format for this gradient", answer, expected,
                 hint="measured relative errors: " + ", ".join(f"{k} {v:.3g}" for k, v in errors.items()),
                 solution=functools.partial(_solution_better_gradient_format, grad))


def _solution_better_gradient_format(grad):
    errors = {}
    for name, dtype in {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}.items():
        s = torch.finfo(dtype).max / grad.abs().max()
        errors[name] = ((grad * s).to(dtype).float() / s - grad).norm() / grad.norm()
    return min(errors, key=errors.get)


def _solution_saved_bytes(rows, features):
    return sum(rows * f for f in features) * (2 - 1)


def check_saved_bytes(answer, batch: int, features: Sequence[int]) -> Feedback:
    """Exercise: bytes saved by keeping each Linear's input for the backward in fp8 instead of bf16, for a batch of
    ``batch`` rows and Linear layers with ``features`` input features."""
    values = sum(batch * int(f) for f in features)
    expected = values * (torch.bfloat16.itemsize - torch.float8_e4m3fn.itemsize)
    return check("activation bytes saved", answer, expected, rtol=0, atol=0.5,
                 mistakes=[(values * 3, "compared with bf16 (2 bytes), not fp32"),
                           (values * 2, "that is the bf16 total; the saving is one byte per value")],
                 hint="one byte per saved value (2 in bf16, 1 in fp8)",
                 solution=functools.partial(_solution_saved_bytes, batch, list(features)))
