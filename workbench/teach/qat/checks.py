"""Lesson 13's exercises: worked solutions (``_solution_*``), their checks (``check_*``) and what only they use."""
from __future__ import annotations

import functools
import math

import torch

from workbench.quantization.primitives import qrange
from workbench.quantization.qat import fake_quantize_ste
from workbench.teach import Feedback, as_number, check
from workbench.teach.qat.figures import code_usage

__all__ = ["ste_reference", "lsq_step_gradient", "check_ste_fake_quantize", "check_lsq_step_gradient",
           "check_code_usage"]


# --- exercise checks -----------------------------------------------------------------------------------------
# Each exercise has a worked solution (``_solution_*``, as a learner writes it in the cell), shown behind the
# feedback's "Show solution" toggle and run by the regression suite (``wb.teach.use_solutions``).


def _solution_ste_fake_quantize(x, scale, zero_point, exercise_bits):
    qmin, qmax = -2 ** (exercise_bits - 1), 2 ** (exercise_bits - 1) - 1     # the signed codes of that many bits
    u = x / scale
    rounded = u + (u.round() - u).detach()         # round() in the forward pass, the identity in the backward pass
    codes = (rounded + zero_point).clamp(qmin, qmax)         # the clamp keeps its true gradient: 0 where it clamps
    return (codes - zero_point) * scale


def _solution_lsq_step_gradient(x, scale, zero_point, exercise_bits, upstream):
    qmin, qmax = -2 ** (exercise_bits - 1), 2 ** (exercise_bits - 1) - 1
    u = x.detach() / scale
    code = u.round() + zero_point
    # d x_hat / d scale: inside the grid round(u) - u (round() passes straight through, u = x / scale moves);
    # a clamped value sits at its end of the grid, (qmin - z) * scale or (qmax - z) * scale
    inside = (u.round() - u).where((code >= qmin) & (code <= qmax), code.clamp(qmin, qmax) - zero_point)
    gradient_scale = (x.numel() * qmax) ** -0.5              # LSQ: the step learns at the pace of the weights
    return float((upstream * inside).sum() * gradient_scale)


def _solution_code_usage(w2, bits):
    qmin, qmax = -2 ** (bits - 1), 2 ** (bits - 1) - 1
    rows = w2.reshape(w2.shape[0], -1)                                     # one row per output channel
    s = rows.abs().amax(dim=1, keepdim=True) / ((qmax - qmin) / 2)         # the symmetric rule, per channel
    codes = (rows / s).round().clamp(qmin, qmax)
    return [int((codes == c).sum()) for c in range(qmin, qmax + 1)]


def ste_reference(x: torch.Tensor, scale: float, zero_point: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake quantization of ``x`` on the signed ``bits``-bit grid with ``scale`` and ``zero_point`` through the
    package's `fake_quantize_ste`, and the gradient of the sum of its output with respect to ``x``: the pair a
    QAT layer's forward and backward pass compute."""
    qmin, qmax = qrange(bits, True)
    leaf = x.detach().float().clone().requires_grad_(True)
    with torch.enable_grad():
        out = fake_quantize_ste(leaf.reshape(1, -1), torch.tensor([[float(scale)]]),
                                torch.tensor([[float(zero_point)]]), qmin, qmax).reshape(x.shape)
        out.sum().backward()
    return out.detach(), leaf.grad


def _value_and_gradient(answer, x: torch.Tensor):
    """What the STE exercise checks of an answer: its values and d sum(answer) / dx as autograd finds it (None
    when the answer has no autograd path to ``x``)."""
    if not isinstance(answer, torch.Tensor):
        return answer
    values = answer.detach().float()
    if not answer.requires_grad or answer.shape != x.shape:
        return values, None
    try:
        (grad,) = torch.autograd.grad(answer.sum(), x, retain_graph=True, allow_unused=True)
    except RuntimeError:                      # the graph was already used by a backward pass of the learner's
        return values, None
    return values, None if grad is None else grad.detach().float()


def _ste_hint(got: torch.Tensor, got_grad: torch.Tensor | None, x: torch.Tensor, scale: float, zero_point: int,
              bits: int, values: torch.Tensor, grad: torch.Tensor) -> str | None:
    """The hint for a wrong STE fake-quantizer: which slip its values, or else its gradient, show (None: none)."""
    qmin, qmax = qrange(bits, True)
    u, z = x.detach().float() / scale, float(zero_point)
    forward = {
        "the zero point is missing: the code of x is round(x / scale) + zero_point, and it is subtracted again "
        "when the code is scaled back": u.round().clamp(qmin, qmax) * scale,
        "subtract the zero point from the clamped code before multiplying by the scale":
            (u.round() + z).clamp(qmin, qmax) * scale,
        f"values outside the grid must be clamped: the codes live in [{qmin}, {qmax}]": u.round() * scale,
        f"the signed {bits}-bit codes are [{qmin}, {qmax}], not the unsigned [0, {2 ** bits - 1}]":
            ((u.round() + z).clamp(0, 2 ** bits - 1) - z) * scale,
        f"the codes run from {qmin} to {qmax}: the signed range has one more negative code than positive ones":
            ((u.round() + z).clamp(-qmax, qmax) - z) * scale,
        f"the top code of {bits} signed bits is {qmax} = 2^{bits - 1} - 1":
            ((u.round() + z).clamp(qmin, qmax + 1) - z) * scale,
        "round to the nearest integer (torch.round), not down (floor)": ((u.floor() + z).clamp(qmin, qmax) - z) * scale,
    }
    if not torch.allclose(got, values, atol=1e-6):
        return next((why for why, wrong in forward.items() if torch.allclose(got, wrong, atol=1e-6)), None)
    if got_grad is None:
        return ("your answer has no gradient with respect to x: compute it from x itself (not x.detach(), not under "
                "torch.no_grad()), so that autograd can reach x")
    backward = {
        "the gradient is 0 everywhere: torch.round()'s derivative is 0, which is why QAT needs the STE - write the "
        "rounded value as u + (u.round() - u).detach(), round() forward and the identity backward":
            torch.zeros_like(grad),
        "every value got a gradient: the STE replaces round() only; where the code was clamped the output does not "
        "move with x, so the clamp must keep its zero gradient (detach only the rounding)": torch.ones_like(grad),
        "close: the clamp acts on the *rounded* code, so round first and clamp the rounded value; x / scale a little "
        "past the grid's end still rounds onto it": ((u + z >= qmin) & (u + z <= qmax)).float(),
    }
    return next((why for why, wrong in backward.items() if torch.allclose(got_grad, wrong)), None)


def check_ste_fake_quantize(answer, x: torch.Tensor, scale: float, zero_point: int, bits: int) -> Feedback:
    """Exercise: fake quantization of ``x`` (a leaf tensor that requires grad) with a zero point, written so that
    autograd gives the straight-through estimator's gradient. Both are checked: the values against the package's
    `fake_quantize_ste` and the gradient of their sum with respect to ``x`` against the one autograd finds
    through it (1 where the rounded code lies inside the grid, 0 where it was clamped)."""
    if not (isinstance(x, torch.Tensor) and x.requires_grad):
        raise ValueError("the exercise's x must be a tensor that requires grad (torch.tensor(..., requires_grad=True))")
    solution = functools.partial(_solution_ste_fake_quantize, x, scale, zero_point, bits)
    qmin, qmax = qrange(bits, True)
    values, grad = ste_reference(x, scale, zero_point, bits)
    name = "fake quantization with the STE"
    hint = (f"two things are checked: the values (the grid of signed {bits}-bit codes [{qmin}, {qmax}] with its zero "
            f"point) and the gradient autograd finds through them (the STE: round() passes it unchanged, the clamp "
            f"does not)")
    found = _value_and_gradient(answer, x)
    if isinstance(found, tuple):
        hint = _ste_hint(*found, x, scale, zero_point, bits, values, grad) or hint
    elif answer is not ... and answer is not None:
        hint = "the answer is a tensor like x: its fake-quantized values, computed from x so that autograd reaches x"
    return check(name, answer, (values, grad), hint=hint, rtol=0, atol=1e-6, solution=solution,
                 measure=functools.partial(_value_and_gradient, x=x))


def lsq_step_gradient(x: torch.Tensor, scale: float, zero_point: int, bits: int, upstream: torch.Tensor) -> float:
    """dL/d(scale) for L = sum(upstream * fake_quantize(x)) as the package's LSQ layers compute it: autograd
    through `fake_quantize_ste` with the step's gradient multiplied by 1 / sqrt(N * qmax) (N values share it)."""
    from workbench.quantization.qat import grad_scale

    qmin, qmax = qrange(bits, True)
    step = torch.tensor([[float(scale)]], requires_grad=True)
    with torch.enable_grad():
        scaled = grad_scale(step, 1.0 / math.sqrt(x.numel() * qmax))
        out = fake_quantize_ste(x.detach().float().reshape(1, -1), scaled, torch.tensor([[float(zero_point)]]),
                                qmin, qmax)
        (out.reshape(x.shape) * upstream.detach().float()).sum().backward()
    return float(step.grad)


def check_lsq_step_gradient(answer, x: torch.Tensor, scale: float, zero_point: int, bits: int,
                            upstream: torch.Tensor) -> Feedback:
    """Exercise: LSQ's gradient of L = sum(upstream * fake_quantize(x)) with respect to the step size, by hand:
    the STE's derivative of each fake-quantized value with respect to the scale, weighted by the upstream
    gradient, summed, times LSQ's gradient scale (expected: `lsq_step_gradient`, autograd through the package)."""
    solution = functools.partial(_solution_lsq_step_gradient, x, scale, zero_point, bits, upstream)
    qmin, qmax = qrange(bits, True)
    expected = lsq_step_gradient(x, scale, zero_point, bits, upstream)
    u, z, up = x.detach().double() / scale, float(zero_point), upstream.detach().double()
    code = u.round() + z
    inside = (code >= qmin) & (code <= qmax)
    ends = code.clamp(qmin, qmax) - z
    g = 1 / math.sqrt(x.numel() * qmax)

    def grad(d):
        return float((up * d).sum() * g)

    mistakes = [
        (expected / g, f"that is the gradient before LSQ's scaling: multiply it by 1 / sqrt(N * qmax) = {g:.4g} "
                       f"(N = {x.numel()} values share this step)"),
        (grad((u.round()).where(inside, ends)), "round(x / s) moves with s too: under the STE it is x / s in the "
                                                "backward pass, so inside the grid the derivative is round(x/s) - x/s, "
                                                "not the code alone"),
        (grad(torch.zeros_like(u).where(inside, ends)), "inside the grid the derivative is not 0: the STE passes "
                                                         "round() through, but the rounding error round(x/s) - x/s "
                                                         "still depends on s"),
        (grad(u.round() - u), "the clamped values count differently: their output is (qmin - z) s or (qmax - z) s, "
                              "whose derivative with respect to s is qmin - z or qmax - z"),
        (grad((u.round() - u).where(inside, code.clamp(qmin, qmax))), "at the clamped ends the derivative is the "
                                                                      "end's code minus the zero point"),
        (-expected, "the sign is flipped: round(x/s) - x/s, not x/s - round(x/s)"),
        (float((u.round() - u).where(inside, ends).sum() * g), "weight each value's derivative by its upstream "
                                                               "gradient (the chain rule) before summing"),
    ]
    hint = ("per value: the derivative of its fake-quantized value with respect to the scale under the STE - one "
            "expression inside the grid, another where the code was clamped; weight by `upstream`, sum, and apply "
            "LSQ's gradient scale")
    return check("LSQ's step-size gradient", answer, expected, hint=hint, rtol=1e-4, atol=1e-8, mistakes=mistakes,
                 solution=solution)


def check_code_usage(answer, weight: torch.Tensor, bits: int) -> Feedback:
    """Exercise: how many of a conv weight's values land on each code ``qmin .. qmax`` (in that order) of the
    symmetric signed ``bits``-bit grid with one scale per output channel (expected: `code_usage`). A value on a
    rounding tie (the channel's largest magnitude at exactly (qmax - qmin) / 2 steps) may round either way,
    dividing by the scale or multiplying by its reciprocal: both counts pass."""
    w = weight.detach().float()
    solution = functools.partial(_solution_code_usage, w, bits)
    qmin, qmax = qrange(bits, True)
    usage = code_usage(w, bits, symmetric=True)
    expected = [usage[c] for c in range(qmin, qmax + 1)]
    rows = w.reshape(w.shape[0], -1)

    def counts(codes):
        return [int((codes == c).sum()) for c in range(qmin, qmax + 1)]

    half = (qmax - qmin) / 2
    s = rows.abs().amax(dim=1, keepdim=True) / half
    divided = counts((rows / s).round().clamp(qmin, qmax))
    got = solution() if answer is ... or answer is None else answer
    got = got.tolist() if isinstance(got, torch.Tensor) else got
    if isinstance(got, (list, tuple)) and [as_number(v) for v in got] == divided:
        expected = divided                                  # the ties rounded the other way: accepted
    per_tensor = rows.abs().max() / half
    per_input = w.abs().amax(dim=(0, *range(2, w.ndim)), keepdim=True) / half
    mistakes = [
        (counts((rows / per_tensor).round().clamp(qmin, qmax)), "one scale for the whole tensor: the grid has one "
                                                                 "scale per output channel (a row of the weight "
                                                                 "reshaped to (out, -1))"),
        (counts((rows / (rows.abs().amax(dim=1, keepdim=True) / qmax)).round().clamp(qmin, qmax)),
         f"scale = max|w| / {qmax} maps the largest weight to code {qmax}: the symmetric rule divides by "
         f"(qmax - qmin) / 2 = {half:g}"),
        (counts((w / per_input).round().clamp(qmin, qmax)), "that is one scale per *input* channel: the output "
                                                            "channel is the weight's first dimension"),
        (counts((rows / s).round()), f"the counts add up to fewer than the {w.numel()} weights: some rounded codes "
                                     f"fall outside [{qmin}, {qmax}] and must be clamped"),
    ]
    hint = (f"one grid per output channel, its scale from that channel's own weights by the symmetric rule of lesson "
            f"11; then count the weights on each code from {qmin} to {qmax}, in that order")
    return check(f"conv weights per code, symmetric int{bits}", answer, expected, hint=hint, rtol=0, atol=0,
                 mistakes=mistakes, solution=solution)
