"""Lab 41, fp8 training recipes: what e4m3 and e5m2 hold, why every tensor needs a scale, current vs delayed
scaling, and what fp8 numerics do to a real training run (`wb.precision.fp8_training`, emulated on this CPU).

Here: the format table, real tensors of a training step (inputs, weights, output gradients of each Linear), the
per-step amax trace of a training run, the recipe comparison (accuracy, saturated values), the lab's figures and
the exercise checks (``check_*``), which compute their expected values through the package and know a worked
solution each (``_solution_*``, shown behind "Show solution", run by the regression suite).
"""
from __future__ import annotations

import copy
import functools
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from workbench.plots.style import TEMPLATE
from workbench.precision.fp8 import Fp8Recipe, Fp8State, fp8_layers, fp8_restore, fp8_training
from workbench.teach import Feedback, check

__all__ = ["FP8", "format_table", "step_tensors", "zero_fraction", "amax_trace", "saturating_steps",
           "train_recipes", "amax_figure", "recipe_figure", "check_round_trip", "check_current_scale",
           "check_zero_fraction", "check_delayed_scale", "check_saturating_steps", "check_relative_error",
           "check_headroom", "check_better_gradient_format", "check_saved_bytes"]

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _fp8(d: str | torch.dtype) -> torch.dtype:
    if isinstance(d, torch.dtype) and d in FP8.values():
        return d
    if d not in FP8:
        raise ValueError(f"unknown fp8 format {d!r}; use 'e4m3' or 'e5m2'")
    return FP8[d]


def format_table():
    """Bits, range and precision of e4m3 and e5m2 beside bf16 (a DataFrame indexed by name), from torch.finfo."""
    import pandas as pd

    rows = []
    for name, dtype in {**FP8, "bf16": torch.bfloat16}.items():
        info = torch.finfo(dtype)
        mantissa = round(-math.log2(info.eps))
        rows.append({"format": name, "exponent bits": info.bits - 1 - mantissa, "mantissa bits": mantissa,
                     "largest": float(info.max), "smallest normal": float(info.smallest_normal),
                     "smallest subnormal": float(info.smallest_normal) * float(info.eps),
                     "relative step": float(info.eps)})
    return pd.DataFrame(rows).set_index("format")


def step_tensors(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """One fp32 training step's tensors of every ``nn.Linear``: its input, weight and output gradient (the
    tensors an fp8 recipe casts), keyed by layer name. ``model`` is not changed."""
    model = copy.deepcopy(model).train()
    x, y = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.long)
    seen: dict[str, dict[str, torch.Tensor]] = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            def fwd(mod, args, out, name=name):
                seen[name] = {"input": args[0].detach().clone(), "weight": mod.weight.detach().clone()}
                out.register_hook(lambda g, name=name: seen[name].__setitem__("grad", g.detach().clone()))
            handles.append(m.register_forward_hook(fwd))
    try:
        F.cross_entropy(model(x), y).backward()
    finally:
        for h in handles:
            h.remove()
    return seen


def zero_fraction(t: torch.Tensor, dtype: str | torch.dtype, scale: float = 1.0) -> float:
    """Fraction of the non-zero values of ``t`` that become 0 when ``t * scale`` is cast to ``dtype``."""
    nz = t[t != 0].float()
    return float(((nz * scale).to(_fp8(dtype)) == 0).float().mean()) if nz.numel() else 0.0


def _fresh(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every layer re-initialised (the architecture, untrained)."""
    fresh = copy.deepcopy(model)
    for m in fresh.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    return fresh


def amax_trace(model: nn.Module, task, layer: str, epochs: int = 1, batch_size: int = 64, lr: float = 3e-3,
               seed: int = 0, fresh: bool = True) -> list[float]:
    """The amax (max |x|) of ``layer``'s input at every step of training ``model`` in fp32 (a copy; ``fresh``:
    re-initialised first, so the activations grow as a model learns)."""
    torch.manual_seed(seed)
    model = (_fresh(model) if fresh else copy.deepcopy(model)).train()
    trace: list[float] = []
    handle = model.get_submodule(layer).register_forward_hook(
        lambda m, args, out: trace.append(float(args[0].detach().abs().max())))
    split = task.split
    xs, ys = torch.as_tensor(split.x_train, dtype=torch.float32), torch.as_tensor(split.y_train, dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    try:
        for _ in range(epochs):
            order = torch.randperm(len(xs), generator=g)
            for i in range(0, len(order), batch_size):
                idx = order[i:i + batch_size]
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(xs[idx]), ys[idx]).backward()
                opt.step()
    finally:
        handle.remove()
    return trace


def saturating_steps(amaxes: Sequence[float], history: int) -> int:
    """The package's count: steps whose amax exceeds the largest of the previous ``history`` amaxes (where delayed
    scaling clamps), through `Fp8State` on tensors holding each step's amax."""
    state = Fp8State(torch.float8_e4m3fn, Fp8Recipe(scaling="delayed", history=history))
    steps = 0
    for a in amaxes:
        before = state.saturated
        state.cast(torch.tensor([a, -a * 0.5]))
        steps += state.saturated > before
    return steps


def train_recipes(model: nn.Module, task, recipes: dict[str, Fp8Recipe | None], epochs: int = 2, lr: float = 3e-3,
                  seed: int = 0):
    """Train a fresh initialisation of ``model``'s architecture once per recipe (None: fp32) from one seed; a
    DataFrame of the quick-subset accuracy and the values each recipe saturated / flushed."""
    import pandas as pd

    from workbench.measurement.metrics import measure
    from workbench.training import fit_classifier

    rows = []
    for name, recipe in recipes.items():
        torch.manual_seed(seed)
        fresh = _fresh(model)
        trained = fresh if recipe is None else fp8_training(fresh, recipe, inplace=True)
        fit_classifier(trained, task, epochs=epochs, lr=lr, seed=seed, progress=False)
        states = [s for layer in fp8_layers(trained).values() for s in layer.states().values()]
        saturated = sum(s.saturated for s in states)
        seen = sum(s.seen for s in states)
        acc = measure(fp8_restore(trained), task, quick=True, progress=False).primary_value
        rows.append({"recipe": name, "accuracy": acc, "saturated values": saturated,
                     "saturated fraction": saturated / seen if seen else 0.0})
    return pd.DataFrame(rows).set_index("recipe")


def amax_figure(trace: Sequence[float], history: int, title: str = ""):
    """The amax of every step beside delayed scaling's reference max(previous ``history`` amaxes); steps above it
    (where the tensor saturates) marked."""
    import plotly.graph_objects as go

    ref = [max(trace[max(0, i - history):i]) if i else trace[0] for i in range(len(trace))]
    over = [i for i, (a, r) in enumerate(zip(trace, ref)) if a > r]
    fig = go.Figure([go.Scatter(y=list(trace), mode="lines", name="this step's amax"),
                     go.Scatter(y=ref, mode="lines", name=f"max of the previous {history} (delayed scaling)",
                                line=dict(dash="dot")),
                     go.Scatter(x=over, y=[trace[i] for i in over], mode="markers", name="saturates (amax above)",
                                marker=dict(color="red", size=7))])
    fig.update_layout(template=TEMPLATE, height=380, title=title or "amax of a layer's input, step by step",
                      xaxis_title="training step", yaxis_title="max |x|", legend=dict(orientation="h", y=-0.25))
    return fig


def recipe_figure(table):
    import plotly.graph_objects as go

    fig = go.Figure(go.Bar(x=list(table.index), y=list(table["accuracy"]), text=[f"{v:.4f}" for v in
                                                                                 table["accuracy"]],
                           textposition="auto", marker_color="#1f77b4"))
    lo = float(table["accuracy"].min())
    fig.update_layout(template=TEMPLATE, height=360, title="accuracy after the same training, per recipe",
                      yaxis_title="accuracy (quick subset, higher is better)", yaxis_range=[max(0.0, lo - 0.05), 1.0])
    return fig


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
