"""Lesson 13 (quantization-aware training): the straight-through estimator, training curves, LSQ's scales.

The notebook ``notebooks/13_qat.ipynb`` cannot define functions; what it needs beyond the package's public API
lives here, computed with the package's own pieces (`workbench.quantization.qat.fake_quantize_ste`,
`wb.qat.prepare` / `convert`, `wb.training`):

- `ste_curve` / `ste_figure`: fake quantization of a range of values and the gradient the STE gives it;
- `train_with_curve`: exactly `wb.training.fit_classifier` (same optimizer, schedule, batches and seed; a test
  checks the weights are identical), also recording the loss of every step and the test accuracy every few
  steps, for the plot only (nothing is chosen by it: the number of epochs is fixed in advance);
- `ptq_baselines`, `code_usage`: the strong PTQ baselines (asymmetric grid, GPTQ) and why a symmetric 2-bit
  grid is nearly ternary;
- `ptq_vs_qat`: PTQ (round-to-nearest) against QAT with and without learned scales, per bit width;
- `lsq_scales`, `zero_gradient_fraction`: what learning the scales changed in a layer;
- checks for the exercises, computing the expected values themselves.
"""
from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from workbench.plots.style import TEMPLATE
from workbench.quantization.primitives import choose_qparams, qrange
from workbench.quantization.qat import fake_quantize_ste
from workbench.teach import Feedback, as_number, check

__all__ = ["fake_quantize", "ste_gradient", "ste_curve", "ste_figure", "Curve", "train_with_curve",
           "curves_figure", "qat_plan", "ptq_baselines", "code_usage", "ptq_vs_qat", "bits_figure", "lsq_scales",
           "lsq_scales_figure",
           "zero_gradient_fraction", "ste_reference", "lsq_step_gradient", "check_ste_fake_quantize",
           "check_lsq_step_gradient", "check_code_usage"]

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
    from workbench.quantization.qat import _grad_scale

    qmin, qmax = qrange(bits, True)
    step = torch.tensor([[float(scale)]], requires_grad=True)
    with torch.enable_grad():
        scaled = _grad_scale(step, 1.0 / math.sqrt(x.numel() * qmax))
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
