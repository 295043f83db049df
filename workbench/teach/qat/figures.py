"""Lesson 13's computations and figures: the STE, training curves, PTQ vs QAT per bit width, LSQ's scales."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from workbench.plots.style import TEMPLATE
from workbench.quantization.primitives import choose_qparams, qrange
from workbench.quantization.qat import fake_quantize_ste

__all__ = ["fake_quantize", "ste_gradient", "ste_curve", "ste_figure", "Curve", "train_with_curve", "curves_figure",
           "qat_plan", "ptq_baselines", "code_usage", "ptq_vs_qat", "bits_figure", "lsq_scales", "lsq_scales_figure",
           "zero_gradient_fraction"]


_COLOURS = {"fp32": "#5f6368", "ptq": "#d93025", "qat": "#1a73e8", "lsq": "#188038"}


# --- fake quantization and the straight-through estimator ---------------------------------------------------

def _fq(x: torch.Tensor, scale: float, bits: int) -> torch.Tensor:
    """Symmetric signed fake quantization of ``x`` (any shape) with one scale, through the package's STE."""
    qmin, qmax = qrange(bits, True)
    s = torch.tensor([[float(scale)]])
    return fake_quantize_ste(x.reshape(1, -1), s, torch.zeros(1, 1), qmin, qmax).reshape(x.shape)


def fake_quantize(x: torch.Tensor, scale: float, bits: int) -> torch.Tensor:
    """``scale * clamp(round(x / scale), qmin, qmax)`` (signed ``bits``-bit grid), as QAT computes it."""
    with torch.no_grad():
        return _fq(x.detach().float(), scale, bits)


def ste_gradient(x: torch.Tensor, scale: float, bits: int) -> torch.Tensor:
    """d sum(fake_quantize(x)) / dx under the straight-through estimator (autograd through the package)."""
    x = x.detach().float().clone().requires_grad_(True)
    _fq(x, scale, bits).sum().backward()
    return x.grad


def ste_curve(bits: int = 2, scale: float = 0.5, lo: float | None = None, hi: float | None = None, n: int = 801):
    """Fake-quantized value and STE gradient over a range of inputs: a DataFrame x / fake / grad. The default
    range runs one and a half grid steps past both ends of the grid."""
    import pandas as pd

    qmin, qmax = qrange(bits, True)
    lo = (qmin - 1.5) * scale if lo is None else lo
    hi = (qmax + 1.5) * scale if hi is None else hi
    x = torch.linspace(lo, hi, n)
    return pd.DataFrame({"x": x.numpy(), "fake": fake_quantize(x, scale, bits).numpy(),
                         "grad": ste_gradient(x, scale, bits).numpy()})


def ste_figure(curve, bits: int, scale: float, title: str | None = None):
    """Left: the forward pass (a staircase on the grid vs the identity). Right: the backward pass (the STE's
    gradient: 1 where the rounded code is inside the grid, 0 where it was clamped; the true derivative of
    round() is 0 almost everywhere). Clamped regions shaded."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    qmin, qmax = qrange(bits, True)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("forward: fake_quantize(x)", "backward: d fake_quantize / dx"))
    x = curve["x"]
    fig.add_trace(go.Scatter(x=x, y=x, mode="lines", line=dict(color="#9aa0a6", dash="dot"), name="identity"),
                  row=1, col=1)
    fig.add_trace(go.Scatter(x=x, y=curve["fake"], mode="lines", line=dict(color=_COLOURS["qat"], width=3),
                             name=f"int{bits} grid, scale {scale:g}"), row=1, col=1)
    fig.add_trace(go.Scatter(x=x, y=curve["grad"], mode="lines", line=dict(color=_COLOURS["lsq"], width=3),
                             name="STE gradient"), row=1, col=2)
    fig.add_trace(go.Scatter(x=x, y=[0.0] * len(x), mode="lines", line=dict(color=_COLOURS["ptq"], dash="dash"),
                             name="true derivative of round()"), row=1, col=2)
    left, right = (qmin - 0.5) * scale, (qmax + 0.5) * scale      # codes outside [qmin, qmax] beyond these
    for col in (1, 2):
        for x0, x1 in ((float(x.min()), left), (right, float(x.max()))):
            fig.add_vrect(x0=x0, x1=x1, fillcolor="#fce8e6", opacity=0.6, line_width=0, layer="below", row=1, col=col)
        fig.update_xaxes(title_text="x", row=1, col=col)
    fig.update_yaxes(title_text="value", row=1, col=1)
    fig.update_yaxes(title_text="gradient", range=[-0.2, 1.2], row=1, col=2)
    fig.update_layout(title=title or f"Fake quantization (int{bits}, scale {scale:g}) and the straight-through "
                                     f"estimator; shaded: clamped, zero gradient",
                      template=TEMPLATE, height=420, legend=dict(orientation="h", y=-0.2))
    return fig


# --- training with a recorded curve --------------------------------------------------------------------------

@dataclass
class Curve:
    """What `train_with_curve` recorded: the loss of every step, the test accuracy every ``eval_every`` steps
    (step 0 = before training); ``steps_per_epoch`` converts steps to epochs."""

    label: str
    steps_per_epoch: int
    loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)


def train_with_curve(model: nn.Module, task, *, epochs: int, lr: float, label: str = "QAT", batch_size: int = 64,
                     weight_decay: float = 1e-4, seed: int = 0, eval_every: int = 5) -> Curve:
    """Train ``model`` in place exactly as ``wb.training.fit_classifier(model, task, epochs=..., lr=...)`` does,
    and record the curve. Evaluation runs in eval mode under inference mode, so it changes nothing in the
    training (not even BatchNorm's running statistics)."""
    from workbench.tasks.base import model_device
    from workbench.training import one_cycle, train_epoch

    split = task.split
    device = model_device(model)
    g = torch.Generator().manual_seed(seed)
    x = torch.from_numpy(split.x_train).to(device)
    y = torch.from_numpy(split.y_train).to(device)
    steps_per_epoch = math.ceil(len(x) / batch_size)
    opt, sched = one_cycle([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay,
                           total_steps=epochs * steps_per_epoch)
    curve = Curve(label, steps_per_epoch)

    def evaluate(step: int) -> None:
        was_training = model.training
        model.eval()
        curve.eval_steps.append(step)
        curve.accuracy.append(task.evaluate(model)["accuracy"])
        model.train(was_training)

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        step = len(curve.loss)
        if step and step % eval_every == 0:
            evaluate(step)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        curve.loss.append(loss.item())
        return loss

    evaluate(0)
    try:
        for _ in range(epochs):
            train_epoch(model, opt, sched, len(x), batch_size, g, batch_loss)
    finally:
        model.eval()
    evaluate(len(curve.loss))
    return curve


def curves_figure(curves: list[Curve], fp32: float, ptq: float, title: str | None = None):
    """Left: training loss per step. Right: test accuracy during training, with fp32 and PTQ for reference."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("training loss (per step)", "test accuracy during training"))
    colours = [_COLOURS["qat"], _COLOURS["lsq"], "#9334e6", "#f29900"]
    for i, curve in enumerate(curves):
        colour = colours[i % len(colours)]
        epochs = [i / curve.steps_per_epoch for i in range(1, len(curve.loss) + 1)]
        fig.add_trace(go.Scatter(x=epochs, y=curve.loss, mode="lines", line=dict(color=colour), name=curve.label,
                                 legendgroup=curve.label), row=1, col=1)
        fig.add_trace(go.Scatter(x=[s / curve.steps_per_epoch for s in curve.eval_steps], y=curve.accuracy,
                                 mode="lines+markers", line=dict(color=colour), name=curve.label,
                                 legendgroup=curve.label, showlegend=False), row=1, col=2)
    for value, name, colour in ((fp32, "fp32", _COLOURS["fp32"]), (ptq, "PTQ (RTN)", _COLOURS["ptq"])):
        fig.add_hline(y=value, line=dict(color=colour, dash="dash"), annotation_text=f"{name} {value:.3f}",
                      annotation_position="bottom right", row=1, col=2)
    fig.update_xaxes(title_text="epoch", row=1, col=1)
    fig.update_xaxes(title_text="epoch", row=1, col=2)
    fig.update_yaxes(title_text="cross-entropy (log, lower is better)", type="log", dtick=1, row=1, col=1)
    fig.update_yaxes(title_text="accuracy (higher is better)", row=1, col=2)
    fig.update_layout(title=title or "QAT starts where PTQ ends and trains the loss back",
                      template=TEMPLATE, height=430)
    return fig


# --- PTQ vs QAT per bit width --------------------------------------------------------------------------------

def qat_plan(patterns, bits: int, group_size: int | None = None, symmetric: bool = True):
    """``WeightOnly(bits, group_size, symmetric)`` (round-to-nearest grid) on every pattern."""
    from workbench.plans import Plan
    from workbench.quantization.configs import WeightOnly

    return Plan({p: WeightOnly(bits, group_size, symmetric=symmetric) for p in patterns})


def ptq_baselines(model: nn.Module, task, patterns, bits: int, calibration=None, kernel: str = "auto"):
    """The PTQ baselines QAT must beat, per output channel at ``bits``: round-to-nearest on a symmetric grid and
    on an asymmetric one (a zero point per channel), and - with ``calibration`` batches - GPTQ (asymmetric) on
    the nn.Linear layers with asymmetric round-to-nearest on the rest (the package's GPTQ serves nn.Linear only).
    ``kernel``: the Linear matmul path of every config (`WeightOnly.kernel`). A DataFrame: accuracy and size
    relative to fp32, one row per baseline."""
    import pandas as pd

    from workbench.measurement import size_bytes
    from workbench.plans import Plan, apply
    from workbench.quantization.configs import WeightOnly

    rtn = {"RTN symmetric": True, "RTN asymmetric": False}
    plans = {label: Plan({p: WeightOnly(bits, None, symmetric=sym, kernel=kernel) for p in patterns})
             for label, sym in rtn.items()}
    if calibration is not None:
        asym = plans["RTN asymmetric"]
        chosen = [(n, m) for n, m in model.named_modules()
                  if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)) and asym.match(n) is not None]
        plans["GPTQ (Linear) + RTN asymmetric (conv)"] = Plan({
            n: WeightOnly(bits, None, symmetric=False, method="gptq" if isinstance(m, nn.Linear) else "rtn",
                          kernel=kernel)
            for n, m in chosen})
    rows = []
    for label, plan in plans.items():
        q = apply(model, plan, calibration=calibration if "GPTQ" in label else None, progress=False)
        rows.append({"baseline": label, "accuracy": task.evaluate(q)["accuracy"],
                     "size_ratio": size_bytes(q) / size_bytes(model)})
    return pd.DataFrame(rows).set_index("baseline")


def code_usage(weight: torch.Tensor, bits: int, symmetric: bool) -> dict[int, int]:
    """How many weights of ``weight`` (per-output-channel min-max grid at ``bits``) land on each integer code:
    a symmetric grid spends its most negative code on values nobody has."""
    from workbench.quantization.primitives import quantize

    w2d = weight.detach().float().reshape(weight.shape[0], -1)                              # (out, K)
    scale, zp = choose_qparams(w2d, bits, symmetric)                                       # (out, 1) each
    qmin, qmax = qrange(bits, True)
    codes = quantize(w2d, scale, zp, qmin, qmax)
    return {c: int((codes == c).sum()) for c in range(qmin, qmax + 1)}


def ptq_vs_qat(model: nn.Module, task, patterns, bits_list, *, epochs: int, lr: float,
               group_size: int | None = None, symmetric: bool = True):
    """For each bit width: accuracy of the fp32 model, of RTN PTQ, of QAT with the STE and of QAT with learned
    scales (LSQ) after ``epochs`` of ``wb.training.fit_classifier``, both converted to real quantized modules;
    plus the converted model's size relative to fp32. A DataFrame, one row per bit width."""
    import pandas as pd

    from workbench.measurement import size_bytes
    from workbench.plans import apply
    from workbench.quantization import qat
    from workbench.training import fit_classifier

    fp32 = task.evaluate(model)["accuracy"]
    rows = []
    for bits in bits_list:
        plan = qat_plan(patterns, bits, group_size, symmetric)
        ptq_model = apply(model, plan, progress=False)
        row = {"bits": bits, "fp32": fp32, "ptq": task.evaluate(ptq_model)["accuracy"]}
        for key, learn in (("qat", False), ("lsq", True)):
            qm = qat.prepare(model, plan, learnable_scales=learn)
            fit_classifier(qm, task, epochs=epochs, lr=lr, progress=False)
            row[key] = task.evaluate(qat.convert(qm))["accuracy"]
        row["size_ratio"] = size_bytes(ptq_model) / size_bytes(model)
        rows.append(row)
    return pd.DataFrame(rows)


def bits_figure(table, title: str | None = None):
    """Accuracy per bit width: PTQ vs QAT (STE) vs QAT + LSQ, fp32 dashed."""
    import plotly.graph_objects as go

    fig = go.Figure()
    labels = [f"int{b}" for b in table["bits"]]
    for key, name in (("ptq", "PTQ (RTN)"), ("qat", "QAT (STE)"), ("lsq", "QAT + LSQ")):
        fig.add_trace(go.Bar(x=labels, y=table[key], name=name, marker_color=_COLOURS[key],
                             text=[f"{v:.3f}" for v in table[key]], textposition="outside"))
    fig.add_hline(y=float(table["fp32"].iloc[0]), line=dict(color=_COLOURS["fp32"], dash="dash"),
                  annotation_text=f"fp32 {float(table['fp32'].iloc[0]):.3f}", annotation_position="top left")
    low = float(table[["ptq", "qat", "lsq"]].min().min())
    fig.update_layout(title=title or "Where QAT pays off: the fewer the bits, the more PTQ loses",
                      barmode="group", xaxis_title="weight bits (per output channel)",
                      yaxis=dict(title="test accuracy (higher is better)", range=[max(0.0, low - 0.1), 1.03]),
                      template=TEMPLATE, height=420)
    return fig


# --- what LSQ learned -----------------------------------------------------------------------------------------

def lsq_scales(layer: nn.Module):
    """Per group (output channel when per-channel) of a QAT layer trained with ``learnable_scales=True``: the
    learned scale and the min-max scale of its current weights (what plain QAT would use). A DataFrame."""
    import pandas as pd

    if getattr(layer, "weight_scale", None) is None:
        raise ValueError("lsq_scales needs a QAT layer prepared with learnable_scales=True")
    w2d = layer.weight.detach().reshape(layer.weight.shape[0], -1)                        # (out, K)
    groups = w2d.reshape(-1, layer.group_size or w2d.shape[1])                             # (G, g)
    minmax, _ = choose_qparams(groups, layer.bits, layer.symmetric)                        # (G, 1)
    learned = layer.weight_scale.detach().abs()                                            # (G, 1)
    return pd.DataFrame({"group": range(len(learned)), "minmax_scale": minmax.flatten().numpy(),
                         "learned_scale": learned.flatten().numpy()})


def lsq_scales_figure(scales, title: str | None = None):
    """Learned scale against the min-max scale per group, with the diagonal: below it, LSQ clips the largest
    weights to get finer steps for the rest."""
    import plotly.graph_objects as go

    values = scales[["minmax_scale", "learned_scale"]].to_numpy()
    lo, hi = float(values.min()) * 0.9, float(values.max()) * 1.05
    fig = go.Figure(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", line=dict(color="#9aa0a6", dash="dot"),
                               name="learned = min-max"))
    fig.add_trace(go.Scatter(x=scales["minmax_scale"], y=scales["learned_scale"], mode="markers",
                             marker=dict(color=_COLOURS["lsq"], size=7), name="one output channel",
                             hovertemplate="channel %{text}: min-max %{x:.3g}, learned %{y:.3g}<extra></extra>",
                             text=scales["group"]))
    below = float((scales["learned_scale"] < scales["minmax_scale"]).mean())
    fig.update_layout(title=title or f"LSQ's learned scales: {below:.0%} of channels chose a smaller step than "
                                     f"min-max",
                      xaxis=dict(title="min-max scale of the trained weights", range=[lo, hi]),
                      yaxis=dict(title="learned scale", range=[lo, hi], scaleanchor="x"),
                      template=TEMPLATE, height=460)
    return fig


def zero_gradient_fraction(layer: nn.Module) -> float:
    """The fraction of a QAT layer's weights whose rounded code falls outside the grid, so the STE gives them
    no gradient (computed by backpropagating through the layer's fake-quantized weight)."""
    probe = copy.deepcopy(layer)
    probe.weight.grad = None
    probe.fake_weight().sum().backward()
    return float((probe.weight.grad == 0).float().mean())
