"""Lab 41's computations and figures: fp8 formats, a training step's tensors, amax traces, the recipe runs."""
from __future__ import annotations

import copy
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from workbench.plots.style import TEMPLATE
from workbench.precision.fp8 import Fp8Recipe, Fp8State, fp8_layers, fp8_restore, fp8_training
from workbench.training import epoch_batches, optimizer_step

__all__ = ["FP8", "format_table", "step_tensors", "zero_fraction", "amax_trace", "saturating_steps", "train_recipes",
           "amax_figure", "recipe_figure"]


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
    opt = torch.optim.AdamW(model.parameters(), lr=lr)          # a constant learning rate: no schedule
    g = torch.Generator().manual_seed(seed)
    try:
        for _ in range(epochs):
            for idx, _, _ in epoch_batches(len(xs), batch_size, g):
                optimizer_step(F.cross_entropy(model(xs[idx]), ys[idx]), opt)
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
