"""Lesson 30, knowledge distillation: a small student learns from a large teacher's softened outputs.

The teacher's logits ``z`` become soft targets at temperature ``T``::

    p_i(T) = exp(z_i / T) / sum_j exp(z_j / T)

T = 1 is the ordinary softmax; a higher T flattens it and reveals how the teacher ranks the *wrong* classes
("this 3 looks a bit like an 8") - information a one-hot label does not carry. The student minimises
(`wb.distill.kd_loss`, Hinton et al. 2015)::

    L = (1 - alpha) * CE(student, labels) + alpha * T^2 * KL(p_teacher(T) || p_student(T))

The gradient of the KL term with respect to the student's logits is ``(p_student(T) - p_teacher(T)) / T``, and
for large T the difference of the two soft distributions itself shrinks like 1/T, so the term's gradients shrink
like 1/T^2: the factor T^2 puts them back on the scale of the hard-label term, whatever T is.

Here: soft targets and their entropy, the lesson's student and example choice, the KD-vs-hard-labels
experiment (`compare_kd`, which trains with `wb.distill.fit`), its figures, and the exercise checks.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from workbench.plots.style import TEMPLATE
from workbench.teach import Feedback, as_number, check

__all__ = ["soft_targets", "entropy", "pick_example", "student", "soft_gradient_norms", "logit_spread",
           "t_squared_table", "t_squared_figure", "check_restoring_factor", "check_entropies", "compare_kd",
           "temperature_figure", "kd_figure", "check_kd_loss"]

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


# --- exercise checks -----------------------------------------------------------------------------------

def _tensor(answer) -> torch.Tensor | None:
    try:
        return torch.as_tensor(answer.detach() if isinstance(answer, torch.Tensor) else answer).double()
    except (TypeError, ValueError, RuntimeError):
        return None


# Each exercise has a worked solution (``_solution_*``, as a learner writes it in the cell), shown behind the
# feedback's "Show solution" toggle and run by the regression suite (``wb.teach.use_solutions``).

def _solution_entropies(logits, temperatures):
    entropies = []
    for t in temperatures:
        p = torch.softmax(logits / t, dim=-1)                  # the soft targets at T = t
        entropies.append(float(-(p * p.log2()).sum()))         # bits: log base 2
    return entropies


def _solution_kd_loss(student_logits, teacher_logits, labels, alpha, temperature):
    log_p_student = torch.log_softmax(student_logits / temperature, dim=-1)    # both softened by the same T
    log_p_teacher = torch.log_softmax(teacher_logits / temperature, dim=-1)
    kl = (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(dim=-1).mean()   # KL(teacher || student)
    hard = torch.nn.functional.cross_entropy(student_logits, labels)
    return float((1 - alpha) * hard + alpha * temperature ** 2 * kl)   # T^2 keeps the soft gradients in scale


def _solution_restoring_factor(gradients, temperature):
    norms = gradients["gradient norm (KL alone)"]               # indexed by T, T = 1 first
    return norms.iloc[0] / norms.loc[temperature]


def _kd_variant(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, alpha: float, T: float, *,
                factor: float | None = None, reverse: bool = False, reduction: str = "batchmean",
                soften_student: bool = True, soften_teacher: bool = True, probabilities: bool = False,
                swap_weights: bool = False) -> float:
    """The KD loss, or one of its usual slips (keywords), in float64."""
    s, t = student.detach().double(), teacher.detach().double()
    log_s = torch.log_softmax(s / (T if soften_student else 1.0), dim=-1)
    log_t = torch.log_softmax(t / (T if soften_teacher else 1.0), dim=-1)
    if probabilities:                      # F.kl_div(p_student, p_teacher): probabilities where it wants logs
        pointwise = log_t.exp() * (log_t - log_s.exp())
    elif reverse:
        pointwise = log_s.exp() * (log_s - log_t)
    else:
        pointwise = log_t.exp() * (log_t - log_s)
    kl = {"batchmean": pointwise.sum() / s.shape[0], "mean": pointwise.mean(), "sum": pointwise.sum()}[reduction]
    soft = float(kl) * (T * T if factor is None else factor)
    hard = float(F.cross_entropy(s, labels))
    w_soft, w_hard = (1 - alpha, alpha) if swap_weights else (alpha, 1 - alpha)
    return w_hard * hard + w_soft * soft


def check_kd_loss(answer, student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                  alpha: float, temperature: float) -> Feedback:
    """Exercise: the knowledge-distillation loss of a batch, as `wb.distill.kd_loss` computes it: (1 - alpha) times
    the cross-entropy with the labels plus alpha T^2 times KL(teacher(T) || student(T)), each averaged over the
    batch."""
    from workbench.distillation.losses import kd_loss

    solution = functools.partial(_solution_kd_loss, student_logits, teacher_logits, labels, alpha, temperature)
    with torch.no_grad():
        expected = float(kd_loss(student_logits.detach().float(), teacher_logits.detach().float(), labels, alpha,
                                 temperature))
    T = float(temperature)
    args = (student_logits, teacher_logits, labels, alpha, T)
    mistakes = [
        (_kd_variant(*args, factor=1.0), f"the soft term is multiplied by T² = {T * T:g}: softened distributions "
                                         f"give gradients about 1/T² as large (section 2), and the factor puts "
                                         f"them back next to the hard-label term"),
        (_kd_variant(*args, factor=T), f"the factor is T² = {T * T:g}, not T: the gradient loses one 1/T from the "
                                       f"softened logits and another from the softened difference"),
        (_kd_variant(*args, reverse=True), "the KL divergence runs from the teacher to the student, "
                                           "KL(p_teacher || p_student) = sum p_teacher (log p_teacher - log "
                                           "p_student): the teacher's probabilities weigh the terms"),
        (_kd_variant(*args, reduction="mean"), f"that KL is averaged over every class too (reduction='mean'); sum "
                                               f"over the {student_logits.shape[-1]} classes and average over the "
                                               f"batch (reduction='batchmean')"),
        (_kd_variant(*args, reduction="sum"), "the KL term is summed over the batch; average it over the examples, "
                                              "as the cross-entropy is"),
        (_kd_variant(*args, soften_student=False), "the student's logits are divided by T too: both distributions "
                                                   "are compared at the same temperature"),
        (_kd_variant(*args, soften_teacher=False), "the teacher's logits are divided by T too: the soft targets are "
                                                   "the teacher's softmax at T"),
        (_kd_variant(*args, probabilities=True), "F.kl_div(input, target) expects log-probabilities as its input: "
                                                 "pass log_softmax(student / T), not the probabilities"),
        (_kd_variant(*args, swap_weights=True), f"alpha = {alpha:g} weighs the soft term and 1 - alpha the "
                                                f"hard-label cross-entropy, not the other way round"),
    ]
    hint = ("two averages over the batch: the cross-entropy with the labels at T = 1, and the soft term of the "
            "introduction, a KL divergence between the teacher's and the student's softmax at T, with section 2's "
            "factor; weigh them 1 - alpha and alpha")
    return check(f"KD loss at T = {T:g}, alpha = {alpha:g}", answer, expected, hint=hint, rtol=1e-4, atol=1e-7,
                 mistakes=mistakes, solution=solution)


def check_restoring_factor(answer, gradients, temperature: float) -> Feedback:
    """Exercise: from the measured `soft_gradient_norms` table, the factor that brings the KL gradient at
    ``temperature`` back to its T = 1 norm (T² is only the high-temperature limit of it)."""
    solution = functools.partial(_solution_restoring_factor, gradients, temperature)
    norm = gradients["gradient norm (KL alone)"]
    expected = float(norm.iloc[0]) / float(norm.loc[temperature])
    name = f"the factor restoring the T = 1 gradient at T = {temperature:g}"
    hint = "divide the gradient norm at T = 1 by the norm at this T (column 'gradient norm (KL alone)')"
    fb = check(name, answer, expected, hint=hint, rtol=1e-4, solution=solution)
    value = as_number(answer)
    if fb.status == "failed" and value is not None:
        known = [(float(temperature) ** 2, f"T² = {temperature ** 2:g} is Hinton's high-temperature limit; at this T "
                                           f"the logits are not small against T, so measure it from the table"),
                 (1 / expected, "that is the shrink the other way round: norm at T over norm at T = 1"),
                 (float(temperature), "T undoes only one of the two 1/T factors, and only in the limit")]
        for known_value, why in known:
            if math.isclose(value, known_value, rel_tol=1e-4):
                return check(name, answer, expected, hint=why, rtol=1e-4, solution=solution)
    return fb


def check_entropies(answer, logits: torch.Tensor, temperatures: Sequence[float]) -> Feedback:
    """Exercise: the entropy in bits of softmax(logits / T) for each T in ``temperatures`` (a list or tensor)."""
    solution = functools.partial(_solution_entropies, logits, temperatures)
    z = logits.detach().double()
    expected = [float(entropy(torch.softmax(z / T, dim=-1))) for T in temperatures]
    name = "entropies of the soft targets"
    hint = "for each T: the soft targets at T, then their entropy in bits (logarithms in base 2)"
    fb = check(name, answer, expected, hint=hint, rtol=1e-4, atol=1e-6, solution=solution)
    got = _tensor(answer)
    if fb.status == "failed" and got is not None and got.shape == (len(expected),):
        exp = torch.tensor(expected, dtype=torch.double)
        plain = float(entropy(torch.softmax(z, dim=-1)))
        known = [(exp * math.log(2), "those are nats (natural log): use log2 for bits"),
                 (torch.full_like(exp, plain), "every value is the T = 1 entropy: divide the logits by each T"),
                 (-exp, "entropy is minus the sum of p log p: mind the sign")]
        for value, why in known:
            if torch.allclose(got, value, rtol=1e-4, atol=1e-6):
                return check(name, answer, expected, hint=why, rtol=1e-4, atol=1e-6, solution=solution)
    return fb


