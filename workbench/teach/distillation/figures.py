"""Lesson 30's computations and figures: soft targets, the student, T^2 and the KD experiment."""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from workbench.plots.style import TEMPLATE

__all__ = ["soft_targets", "entropy", "pick_example", "student", "soft_gradient_norms", "logit_spread",
           "t_squared_table", "t_squared_figure", "compare_kd", "temperature_figure", "kd_figure"]


_T_COLOURS = ["#08306b", "#2171b5", "#6baed6", "#c6dbef", "#fdae6b", "#e6550d"]
_METHOD_COLOURS = {"hard labels": "#7f7f7f", "KD": "#2ca02c"}


def soft_targets(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) along the last dimension."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    return torch.softmax(logits.detach().float() / temperature, dim=-1)


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Entropy in bits of distributions along the last dimension (log2(10) = 3.32 bits: uniform over 10)."""
    return -(p * torch.log2(p.clamp_min(1e-30))).sum(-1)


def pick_example(teacher: nn.Module, task, rank: int = 0) -> int:
    """Index of a test example the teacher classifies correctly but with a strong runner-up class (the
    ``rank``-th strongest), so its soft targets have something to show."""
    split = task.split
    x, y = torch.from_numpy(split.x_test), torch.from_numpy(split.y_test)
    with torch.no_grad():
        p = torch.softmax(teacher.eval()(x), dim=-1)                           # (N, classes)
    top2 = p.topk(2, dim=-1)
    runner_up = torch.where(top2.indices[:, 0] == y, top2.values[:, 1], torch.full_like(y, -1, dtype=p.dtype))
    return int(runner_up.argsort(descending=True)[rank])


def student(hidden: Sequence[int] = (64, 32), seed: int = 0) -> nn.Module:
    """A fresh digits MLP (64 -> hidden -> 10) with seeded initial weights: the lesson's student."""
    from workbench.models.architectures import DigitsMLP

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return DigitsMLP(hidden=tuple(hidden))


def soft_gradient_norms(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                        temperatures: Sequence[float] = (1, 2, 4, 8)):
    """Norm of the gradient of the KL term (batch mean) with respect to the student's logits, at each T, without
    and with the T^2 factor (a DataFrame). T^2 restores the T = 1 scale only approximately: it is the
    high-temperature limit (see `t_squared_table`)."""
    import pandas as pd

    rows = []
    for T in temperatures:
        with torch.enable_grad():
            z = student_logits.detach().float().clone().requires_grad_(True)          # (B, classes)
            kl = F.kl_div(F.log_softmax(z / T, dim=-1), F.log_softmax(teacher_logits.detach().float() / T, dim=-1),
                          reduction="batchmean", log_target=True)
            (grad,) = torch.autograd.grad(kl, z)
        norm = float(grad.norm())
        rows.append({"T": T, "gradient norm (KL alone)": norm, "gradient norm (T² × KL)": norm * T * T})
    return pd.DataFrame(rows).set_index("T")


def logit_spread(logits: torch.Tensor) -> float:
    """Median over the batch of max_i |z_i - mean(z)|: Hinton's T² argument expands exp(z_i / T) to first order,
    which holds when T is large against this spread."""
    z = logits.detach().float()                                                        # (B, classes)
    return float((z - z.mean(-1, keepdim=True)).abs().amax(-1).median())


def t_squared_table(gradients):
    """From `soft_gradient_norms`: how much the KL gradient really shrinks from T = 1 to each T, beside the T²
    that the KD loss multiplies back, and the ratio of the two (1 only in the high-temperature limit)."""
    import pandas as pd

    norm = gradients["gradient norm (KL alone)"]
    shrink = float(norm.iloc[0]) / norm
    T = pd.Series(gradients.index, index=gradients.index, dtype=float)
    step = norm.shift(1) / norm                                                   # shrink from the previous T
    return pd.DataFrame({"measured shrink from T=1": shrink, "T²": T ** 2, "T² / measured": T ** 2 / shrink,
                         "measured shrink from the previous T": step, "(T / previous T)²": (T / T.shift(1)) ** 2})


def t_squared_figure(table, spread: float | None = None, title: str | None = None):
    """Measured shrink of the KL gradient against T² on log-log axes; ``spread`` (`logit_spread`) marked, since
    T² is the limit for T well above it."""
    import plotly.graph_objects as go

    T = list(table.index)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=T, y=table["T²"], mode="lines+markers", name="T² (the KD loss's factor)",
                             line=dict(color="#9aa0a6", dash="dash")))
    fig.add_trace(go.Scatter(x=T, y=table["measured shrink from T=1"], mode="lines+markers",
                             name="measured: |grad at T=1| / |grad at T|", line=dict(color="#1a73e8")))
    if spread is not None:
        fig.add_vline(x=spread, line=dict(color="#d93025", dash="dot"),
                      annotation_text=f"logit spread {spread:.1f}", annotation_position="top left")
    fig.update_layout(title=title or "T² is the high-temperature limit: the real shrink is smaller at small T",
                      xaxis=dict(title="temperature T", type="log"),
                      yaxis=dict(title="gradient shrink factor (log)", type="log"),
                      template=TEMPLATE, height=420)
    return fig


def compare_kd(teacher: nn.Module, task, *, seeds: Sequence[int] = (0, 1, 2), hidden: Sequence[int] = (64, 32),
               epochs: int = 60, lr: float = 3e-3, alpha: float = 0.9, temperature: float = 4.0,
               progress: bool = False):
    """Train the same seeded students with hard labels only (``alpha=0``) and with KD (``alpha``,
    ``temperature``), same budget, through `wb.distill.fit`. Returns ``(table, histories, students)``: test
    accuracy per (method, seed); each run's validation history; the trained students by (method, seed)."""
    import pandas as pd

    from workbench.distillation import fit

    rows, histories, trained = [], {}, {}
    for seed in seeds:
        for method, a in (("hard labels", 0.0), ("KD", alpha)):
            s = student(hidden, seed)
            history = fit(s, teacher, task, epochs=epochs, lr=lr, alpha=a, temperature=temperature, patience=None,
                          seed=seed, progress=progress)
            rows.append({"method": method, "seed": seed, "accuracy": task.evaluate(s)["accuracy"],
                         "best_epoch": history.attrs.get("best_epoch")})
            histories[(method, seed)] = history
            trained[(method, seed)] = s
    return pd.DataFrame(rows), histories, trained


# --- figures -------------------------------------------------------------------------------------------

def temperature_figure(logits: torch.Tensor, temperatures: Sequence[float] = (1, 2, 4, 8),
                       image: torch.Tensor | None = None, label: int | None = None):
    """The teacher's soft targets for one example at each temperature (bars per class), their entropy against T,
    and (given ``image``, 64 pixels) the 8x8 digit itself."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    z = logits.detach().float().reshape(-1)                                   # (classes,)
    classes = list(range(len(z)))
    cols = 3 if image is not None else 2
    widths = [0.2, 0.55, 0.25] if image is not None else [0.68, 0.32]
    titles = ([f"the example (label {label})" if label is not None else "the example"] if image is not None
              else []) + ["soft targets softmax(z / T)", "entropy of the soft targets"]
    fig = make_subplots(rows=1, cols=cols, column_widths=widths, subplot_titles=titles, horizontal_spacing=0.07)
    col = 1
    if image is not None:
        fig.add_trace(go.Heatmap(z=image.detach().float().reshape(8, 8).tolist(), colorscale="Greys",
                                 showscale=False, hovertemplate="pixel (%{y}, %{x}): %{z:.2f}<extra></extra>"),
                      row=1, col=1)
        fig.update_yaxes(autorange="reversed", scaleanchor="x", showticklabels=False, row=1, col=1)
        fig.update_xaxes(showticklabels=False, row=1, col=1)
        col = 2
    for i, T in enumerate(temperatures):
        p = soft_targets(z, T)
        fig.add_trace(go.Bar(x=classes, y=p.tolist(), name=f"T = {T:g}",
                             marker_color=_T_COLOURS[i % len(_T_COLOURS)],
                             hovertemplate=f"T = {T:g}, " + "class %{x}: p = %{y:.3f}<extra></extra>"),
                      row=1, col=col)
    fig.update_xaxes(title="class", dtick=1, row=1, col=col)
    lowest = min(float(soft_targets(z, T).min()) for T in temperatures)
    fig.update_yaxes(title="probability (log scale)", type="log", range=[math.floor(math.log10(lowest)), 0.05],
                     exponentformat="power", row=1, col=col)       # 10⁻⁴, not 100µ, for a probability
    ts = torch.logspace(math.log10(0.5), math.log10(20), 60)
    fig.add_trace(go.Scatter(x=ts.tolist(), y=[float(entropy(soft_targets(z, float(t)))) for t in ts],
                             mode="lines", line=dict(color="#444"), showlegend=False,
                             hovertemplate="T = %{x:.2f}: %{y:.2f} bits<extra></extra>"), row=1, col=col + 1)
    fig.add_trace(go.Scatter(x=list(temperatures), y=[float(entropy(soft_targets(z, T))) for T in temperatures],
                             mode="markers", marker=dict(size=10, color=_T_COLOURS[:len(temperatures)]),
                             showlegend=False, hovertemplate="T = %{x}: %{y:.2f} bits<extra></extra>"),
                  row=1, col=col + 1)
    fig.add_hline(y=math.log2(len(z)), line=dict(color="grey", dash="dot"), annotation_text="uniform",
                  annotation_position="top left", row=1, col=col + 1)
    fig.update_xaxes(title="temperature T (log scale)", type="log", tickvals=[0.5, 1, 2, 4, 8, 16],
                     row=1, col=col + 1)
    fig.update_yaxes(title="entropy (bits)", row=1, col=col + 1)
    fig.update_layout(title="Temperature flattens the teacher's distribution and shows its runner-up classes",
                      barmode="group", template=TEMPLATE, height=420, legend_title="temperature")
    return fig


def kd_figure(table, histories: dict | None = None, teacher_accuracy: float | None = None):
    """Test accuracy of each student (one dot per seed, a bar for the mean) by method; with ``histories``,
    the validation accuracy per epoch (mean over seeds) on a second panel."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    cols = 2 if histories else 1
    titles = (["validation accuracy during training (mean over seeds)"] if histories else []) + \
        ["test accuracy of each student"]
    fig = make_subplots(rows=1, cols=cols, subplot_titles=titles, column_widths=[0.6, 0.4] if histories else None)
    if histories:
        for method in dict.fromkeys(m for m, _ in histories):
            runs = [h for (m, _), h in histories.items() if m == method]
            curve = sum(h.set_index("epoch")["val_accuracy"] for h in runs) / len(runs)
            fig.add_trace(go.Scatter(x=curve.index.tolist(), y=curve.tolist(), mode="lines", name=method,
                                     line=dict(color=_METHOD_COLOURS.get(method), width=3), legendgroup=method,
                                     hovertemplate=method + ", epoch %{x}: %{y:.3f}<extra></extra>"), row=1, col=1)
        fig.update_xaxes(title="epoch", row=1, col=1)
        fig.update_yaxes(title="validation accuracy", range=[0.8, 1.0], row=1, col=1)
    for method in dict.fromkeys(table["method"]):
        part = table[table["method"] == method]
        mean = float(part["accuracy"].mean())
        category = f"{method}<br>mean {mean:.4f}"
        fig.add_trace(go.Bar(x=[category], y=[mean], marker_color=_METHOD_COLOURS.get(method), opacity=0.45,
                             showlegend=False, hovertemplate=method + " mean: %{y:.4f}<extra></extra>"),
                      row=1, col=cols)
        fig.add_trace(go.Scatter(x=[category] * len(part), y=part["accuracy"].tolist(), mode="markers",
                                 marker=dict(size=10, color=_METHOD_COLOURS.get(method), line=dict(width=1)),
                                 showlegend=False, text=[f"seed {s}" for s in part["seed"]],
                                 hovertemplate="%{text}: %{y:.4f}<extra></extra>"), row=1, col=cols)
    if teacher_accuracy is not None:
        fig.add_hline(y=teacher_accuracy, line=dict(color="black", dash="dot"), annotation_text="teacher",
                      annotation_position="bottom right", row=1, col=cols)
    low = float(table["accuracy"].min())
    fig.update_yaxes(title="test accuracy (higher is better)", range=[min(0.9, low - 0.01), 1.005], row=1, col=cols)
    fig.update_layout(title="Same student, same budget: hard labels vs knowledge distillation",
                      template=TEMPLATE, height=420)
    return fig
