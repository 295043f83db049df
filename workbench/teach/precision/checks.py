"""Lesson 40's exercises: worked solutions (``_solution_*``), their checks (``check_*``) and what only they use."""
from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from workbench.teach import Feedback, check
from workbench.teach.precision.figures import _dtype, smallest_subnormal, underflow_fraction

__all__ = ["HALFWAY", "bf16_bits_variants", "gradient_peaks", "grad_scaler_trace", "check_bf16_round",
           "check_underflow_fractions", "check_grad_scaler"]


# --- exercise checks -----------------------------------------------------------------------------------
# Each exercise has a worked solution (``_solution_*``, as a learner writes it in the cell), shown behind the
# feedback's "Show solution" toggle and run by the regression suite (``wb.teach.use_solutions``).

HALFWAY = (1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), -(0.75 + 3 * 2 ** -10), 2 - 2 ** -20, 3.0e-39)
"""fp32 values for the bf16 exercise: exactly halfway between two bf16 numbers (ties: to the even one), one that
rounds up into the next power of two, and an fp32 subnormal."""


def _solution_bf16_round(x):
    bits = x.view(torch.int32)                      # the fp32 bit pattern: sign, 8 exponent bits, 23 mantissa bits
    lsb = (bits >> 16) & 1                          # the lowest mantissa bit bf16 keeps
    rounded = (bits + 0x7FFF + lsb) & -65536        # just under half a step, one more at a tie above an odd value
    return rounded.view(torch.float32)              # the low 16 bits are now 0: exactly a bf16 value


def _solution_underflow_fractions(activations, scales):
    nonzero = activations[activations != 0]
    tiny = 2.0 ** -24                                # fp16's smallest subnormal; half of it rounds to 0 (to even)
    return [float((nonzero.abs() * s <= tiny / 2).float().mean()) for s in scales]


def _solution_grad_scaler(peaks, init_scale, growth_interval):
    scale, good, scales, skipped = init_scale, 0, [], []
    for peak in peaks:
        scales.append(scale)
        overflow = bool(torch.tensor(peak * scale).half().isinf())     # the scaled gradient stored in fp16
        skipped.append(overflow)
        if overflow:
            scale, good = scale / 2, 0                # skip the step, halve, start counting again
        else:
            good += 1
            if good == growth_interval:
                scale, good = scale * 2, 0
    return scales, skipped


def bf16_bits_variants(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """fp32 -> bf16 conversions with the usual slips, by their hint: truncation, ties rounded away from zero."""
    bits = x.detach().float().contiguous().view(torch.int32)
    return {"that truncates (drops the low 16 bits): round to nearest - add just under half of bf16's step before "
            "cutting": (bits & -65536).view(torch.float32),
            "round half to *even*: a value exactly halfway between two bf16 numbers goes to the one whose last kept "
            "bit is 0, not always away from zero": ((bits + 0x8000) & -65536).view(torch.float32)}


def check_bf16_round(answer, x: torch.Tensor) -> Feedback:
    """Exercise: ``x`` (fp32) rounded to bf16 with integer operations on its bits, round to nearest with ties to
    even, as fp32 values (expected: ``x.to(torch.bfloat16)``, bit for bit)."""
    solution = functools.partial(_solution_bf16_round, x)
    expected = x.detach().float().to(torch.bfloat16).float()
    mistakes = [(value, why) for why, value in bf16_bits_variants(x).items()]
    hint = ("bf16 is the top 16 bits of fp32 (sign, the same 8 exponent bits, 7 mantissa bits): round the 16 bits "
            "that are dropped, to nearest and ties to even, with integer operations on x.view(torch.int32)")
    if isinstance(answer, torch.Tensor) and not answer.is_floating_point():
        hint = "those are integers (the bits?): view them as torch.float32 again"
    elif isinstance(answer, torch.Tensor) and answer.dtype == torch.bfloat16:
        hint = "return the bf16 values as float32 (the check compares bit patterns of fp32 values)"
    return check("fp32 to bf16, round to nearest even", answer, expected, hint=hint, rtol=0, atol=0,
                 mistakes=mistakes, solution=solution)


def check_underflow_fractions(answer, values: torch.Tensor, scales: Sequence[float],
                              dtype: str | torch.dtype = torch.float16) -> Feedback:
    """Exercise: for each loss scale, the fraction of the non-zero ``values`` that become exactly 0 when
    ``values * scale`` is stored in ``dtype`` (expected: `underflow_fraction`)."""
    solution = functools.partial(_solution_underflow_fractions, values, list(scales))
    d = _dtype(dtype)
    v = values.detach().double().flatten()
    expected = [underflow_fraction(values, d, s) for s in scales]
    nz = v[v != 0].abs()
    tiny, normal = smallest_subnormal(d), float(torch.finfo(d).smallest_normal)

    def below(limit, strict=True):
        return [float(((nz * s < limit) if strict else (nz * s <= limit)).double().mean()) for s in scales]

    mistakes = [
        (below(normal), f"that counts the subnormals as lost too: below the smallest normal ({normal:.3g}) values "
                        f"keep fewer bits but survive; only those below half the smallest subnormal ({tiny:.3g}) "
                        f"round to 0"),
        (below(tiny), f"values between half the smallest subnormal and the smallest subnormal {tiny:.3g} round *up* "
                      f"to it: only those at or below {tiny / 2:.3g} become 0"),
        ([float(((v.abs() * s <= tiny / 2) & (v != 0)).double().mean()) for s in scales],
         "that divides by every value, zeros included: count among the non-zero gradients (an exact 0 is not lost)"),
        ([float((nz / s <= tiny / 2).double().mean()) for s in scales], "the loss scale multiplies the gradients"),
        ([float((nz <= tiny / 2).double().mean())] * len(scales), "the fraction must change with the scale: "
                                                                  "multiply the gradients by S before storing"),
    ]
    hint = (f"per scale S: which of the non-zero |g| times S are too small for {str(d).removeprefix('torch.')} to "
            f"hold (they round to 0) - the format table at the top has its limits")
    return check(f"fractions lost to underflow in {str(d).removeprefix('torch.')}", answer, expected, hint=hint,
                 rtol=1e-6, atol=1e-9, mistakes=mistakes, solution=solution)


def gradient_peaks(model: nn.Module, task, *, steps: int = 40, lr: float = 1e-3, batch_size: int = 64,
                   seed: int = 0) -> list[float]:
    """The largest |gradient| of each of ``steps`` fp32 training steps of a copy of ``model`` (AdamW, the batches
    of `scale_trace`): what the same steps in fp16 would multiply by the loss scale and store."""
    import copy

    m = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    split = task.split
    g = torch.Generator().manual_seed(seed)
    x, y = torch.from_numpy(split.x_train), torch.from_numpy(split.y_train)
    peaks = []
    for _ in range(steps):
        idx = torch.randint(len(x), (batch_size,), generator=g)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(m(x[idx]), y[idx]).backward()
        peaks.append(max(float(p.grad.abs().max()) for p in m.parameters() if p.grad is not None))
        opt.step()
    return peaks


def grad_scaler_trace(peaks: Sequence[float], init_scale: float, growth_interval: int) -> tuple[list, list]:
    """``(scales, skipped)``: the loss scale `torch.amp.GradScaler` uses at each step and whether it skips the step,
    when step i's largest gradient is ``peaks[i]`` (the scaled gradient is stored in fp16: inf when it overflows).
    Runs a real GradScaler (growth 2, backoff 0.5) on a one-value parameter."""
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=growth_interval)
    scales, skipped = [], []
    for peak in peaks:
        scale = float(scaler.get_scale())
        scaler.scale(torch.zeros(()))                     # the scaler's state starts with its first scaled loss
        p.grad = (torch.tensor([float(peak)]) * scale).half().float()
        scaler.step(opt)
        scaler.update()
        scales.append(scale)
        skipped.append(float(scaler.get_scale()) < scale)
    return scales, skipped


def _scaler_variant(peaks, init_scale: float, growth_interval: int, *, reset_on_skip: bool = True,
                    reset_on_growth: bool = True, limit: float | None = None, after_update: bool = False,
                    interval: int | None = None) -> tuple[list, list]:
    """Dynamic loss scaling with one of the usual slips (keywords)."""
    scale, good, scales, skipped = init_scale, 0, [], []
    for peak in peaks:
        overflow = bool(torch.isinf(torch.tensor(peak * scale).half())) if limit is None else peak * scale > limit
        used = scale
        if overflow:
            scale /= 2
            good = 0 if reset_on_skip else good
        else:
            good += 1
            if good >= (interval or growth_interval):
                scale *= 2
                good = 0 if reset_on_growth else good
        scales.append(scale if after_update else used)
        skipped.append(overflow)
    return scales, skipped


def _trace_of(answer) -> tuple | None:
    """``(scales, skipped)`` as plain float lists, or None when ``answer`` is not such a pair."""
    try:
        scales, skipped = answer
        return [float(v) for v in scales], [float(v) for v in skipped]
    except (TypeError, ValueError):
        return None


def check_grad_scaler(answer, peaks: Sequence[float], init_scale: float, growth_interval: int) -> Feedback:
    """Exercise: dynamic loss scaling by hand - the pair ``(scales, skipped)``, the scale used at each step and
    whether the step is skipped, given each step's largest gradient (expected: `grad_scaler_trace`, a real
    `torch.amp.GradScaler`)."""
    solution = functools.partial(_solution_grad_scaler, list(peaks), init_scale, growth_interval)
    expected = grad_scaler_trace(peaks, init_scale, growth_interval)
    args = (list(peaks), init_scale, growth_interval)
    fmax = float(torch.finfo(torch.float16).max)
    strict = _scaler_variant(*args, limit=fmax)      # "peak x S > 65504" differs only on [65504, 65520), which
    if _trace_of(answer) == _trace_of(strict):        # fp16 rounds down to 65504: accepted too
        expected = strict
    mistakes = [
        (_scaler_variant(*args, reset_on_skip=False), "after a skipped step the count of good steps starts again "
                                                      "from 0: the scale doubles only after growth_interval good "
                                                      "steps *in a row*"),
        (_scaler_variant(*args, reset_on_growth=False), "after the scale doubles, the count starts again: the next "
                                                        "doubling needs growth_interval more good steps"),
        (_scaler_variant(*args, interval=growth_interval + 1), f"off by one: the scale doubles on the "
                                                               f"{growth_interval}th good step in a row, not after it"),
        (_scaler_variant(*args, after_update=True), "each entry is the scale the step *used*; you recorded the "
                                                    "scale after the step's update"),
        (_scaler_variant(*args, limit=float("inf")), f"no step overflowed in your trace: the scaled gradient peak x "
                                                     f"S is stored in fp16, which ends at {fmax:g}"),
        (_scaler_variant(*args, limit=1.0), "the overflow test compares the *scaled* gradient, peak x S, with "
                                            "fp16's largest value"),
    ]
    hint = ("walk through the steps with the scale and a count of good steps in a row: a step whose scaled gradient "
            "does not fit fp16 is skipped and changes the scale one way, a run of growth_interval good steps the "
            "other; return (scales, skipped)")
    if isinstance(answer, (list, tuple)) and len(answer) == len(expected[0]):
        hint = "return the pair (scales, skipped): two lists, one entry per step"
    return check("dynamic loss scaling by hand", answer, expected, hint=hint, rtol=0, atol=0, mistakes=mistakes,
                 solution=solution)
