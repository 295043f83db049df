"""What lab 31 computes and shows: the toy of forward vs reverse KL, and a layer-dropped tiny-llama healed by each
objective, measured on held-out text."""
from __future__ import annotations

import copy
import time

import numpy as np
import pandas as pd
import torch

from workbench.plots.style import TEMPLATE

__all__ = ["GRID", "MUS", "SIGMAS", "toy_teacher", "gaussian", "toy_search", "toy_figure", "OBJECTIVES",
           "held_out_windows", "divergences", "heal", "heal_figure", "continuation"]

GRID = torch.linspace(-4.0, 4.0, 161, dtype=torch.float64)        # the toy's "vocabulary": 161 ordered tokens
MUS = torch.linspace(-3.0, 3.0, 61, dtype=torch.float64)          # the student family's means ...
SIGMAS = torch.linspace(0.2, 3.0, 57, dtype=torch.float64)        # ... and widths

OBJECTIVES = {"data": "data CE (no teacher)", "forward_kl": "forward KL", "reverse_kl": "reverse KL",
              "sequence": "sequence-level"}
_COLOURS = {"teacher": "#7f7f7f", "forward KL": "#1f77b4", "reverse KL": "#d62728", "data CE (no teacher)": "#bcbd22",
            "sequence-level": "#2ca02c", "layers dropped": "#9467bd"}


def gaussian(grid: torch.Tensor, mu: float, sigma: float) -> torch.Tensor:
    """A discretised normal distribution over the grid (sums to 1)."""
    logits = -0.5 * ((grid - mu) / sigma) ** 2
    return torch.softmax(logits, dim=-1)


def toy_teacher(grid: torch.Tensor = GRID, weights=(0.62, 0.38), means=(-1.8, 1.6), sd: float = 0.45) -> torch.Tensor:
    """The teacher's distribution: two modes of unequal mass - more than one Gaussian student can represent."""
    return sum(w * gaussian(grid, m, sd) for w, m in zip(weights, means))


def toy_search(p: torch.Tensor, grid: torch.Tensor = GRID, mus: torch.Tensor = MUS,
               sigmas: torch.Tensor = SIGMAS) -> pd.DataFrame:
    """Both KL divergences between the teacher ``p`` and every Gaussian student q(mu, sigma) of the grid search."""
    mu, sigma = torch.meshgrid(mus, sigmas, indexing="ij")
    q = torch.softmax(-0.5 * ((grid - mu[..., None]) / sigma[..., None]) ** 2, dim=-1)    # (mus, sigmas, grid)
    log_p, log_q = p.clamp_min(1e-300).log(), q.clamp_min(1e-300).log()
    forward = (p * (log_p - log_q)).sum(-1)
    reverse = (q * (log_q - log_p)).sum(-1)
    return pd.DataFrame({"mu": mu.flatten().numpy(), "sigma": sigma.flatten().numpy(),
                         "forward_kl": forward.flatten().numpy(), "reverse_kl": reverse.flatten().numpy()})


def toy_figure(p: torch.Tensor, search: pd.DataFrame, grid: torch.Tensor = GRID):
    """The teacher and the best Gaussian under each divergence."""
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.add_bar(x=grid.numpy(), y=p.numpy(), name="teacher", marker_color=_COLOURS["teacher"], opacity=0.55)
    for column, label in (("forward_kl", "forward KL"), ("reverse_kl", "reverse KL")):
        best = search.loc[search[column].idxmin()]
        q = gaussian(grid, float(best.mu), float(best.sigma))
        fig.add_scatter(x=grid.numpy(), y=q.numpy(), mode="lines", line=dict(color=_COLOURS[label], width=3),
                        name=f"min {label}: mu {best.mu:.1f}, sigma {best.sigma:.2f}")
    fig.update_layout(template=TEMPLATE, title="One Gaussian student fitted to a two-mode teacher", height=380,
                      xaxis_title="token (ordered)", yaxis_title="probability", bargap=0,
                      legend=dict(orientation="h", y=-0.25))
    return fig


def held_out_windows(task, n: int) -> torch.Tensor:
    """``n`` non-overlapping held-out windows of the task's block size, (n, T)."""
    T = task.block_size
    return torch.from_numpy(np.stack([task.test_ids[i * T:(i + 1) * T] for i in range(n)]))


@torch.inference_mode()
def divergences(student, teacher, x: torch.Tensor) -> dict[str, float]:
    """Per-position KL both ways between teacher and student on ``x``, and each one's mean entropy (nats)."""
    from workbench.distillation import lm_kl

    s, t = student(x).logits.float(), teacher(x).logits.float()
    def entropy(z):
        return float(-(z.softmax(-1) * z.log_softmax(-1)).sum(-1).mean())

    return {"KL(teacher||student)": float(lm_kl(s, t, "forward")),
            "KL(student||teacher)": float(lm_kl(s, t, "reverse")),
            "student entropy": entropy(s), "teacher entropy": entropy(t)}


def heal(teacher, task, keep, objectives=tuple(OBJECTIVES), *, steps: int = 30, batch_size: int = 8,
         lr: float = 1e-3, sequences: int = 64, windows: int = 16, seed: int = 0, progress: bool = True):
    """Drop the teacher's blocks not in ``keep``, then heal a copy of that student with each objective on the
    same budget (`wb.distill.fit_lm`: ``steps`` × ``batch_size`` windows; ``"data"`` is ``alpha=0``, no teacher).
    Returns (table, histories): per objective the held-out perplexity of the task's first ``windows`` windows, the
    divergences from the teacher on them (`divergences`) and the seconds it took; ``table.attrs`` holds the
    teacher's and the un-healed student's numbers."""
    from workbench.distillation import drop_layers, fit_lm

    student0 = drop_layers(teacher, "model.layers", list(keep))
    x = held_out_windows(task, windows)
    def ppl(model):
        return task.evaluate(model, quick=True)["perplexity"]     # the task's first 16 held-out windows

    rows, histories = [], {}
    for name in objectives:
        student = copy.deepcopy(student0)
        t0 = time.perf_counter()
        loss, alpha = ("forward_kl", 0.0) if name == "data" else (name, 1.0)
        histories[OBJECTIVES[name]] = fit_lm(student, teacher, task, loss=loss, alpha=alpha, steps=steps,
                                             batch_size=batch_size, lr=lr, sequences=sequences, seed=seed,
                                             progress=progress)
        seconds = time.perf_counter() - t0
        rows.append({"objective": OBJECTIVES[name], "perplexity": ppl(student), **divergences(student, teacher, x),
                     "seconds": seconds})
    table = pd.DataFrame(rows).set_index("objective")
    table.attrs.update(teacher_ppl=ppl(teacher), dropped_ppl=ppl(student0),
                       dropped=divergences(student0, teacher, x), kept=list(keep),
                       blocks=len(teacher.model.layers))
    return table, histories


def heal_figure(table: pd.DataFrame):
    """Held-out perplexity and the two divergences from the teacher, per objective, next to the un-healed student."""
    from plotly.subplots import make_subplots

    names = list(table.index)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("held-out perplexity (lower is better)",
                                                        "divergence from the teacher (nats per token)"))
    fig.add_bar(x=names, y=table["perplexity"], marker_color=[_COLOURS[n] for n in names], showlegend=False,
                row=1, col=1)
    for value, label, dash in ((table.attrs["teacher_ppl"], "teacher", "dot"),
                               (table.attrs["dropped_ppl"], "layers dropped, not healed", "dash")):
        fig.add_hline(y=value, line_dash=dash, line_color="#444", annotation_text=f"{label} {value:.1f}",
                      row=1, col=1)
    for column, colour in (("KL(teacher||student)", "#1f77b4"), ("KL(student||teacher)", "#d62728")):
        fig.add_bar(x=names, y=table[column], name=column.replace("||", " ‖ "), marker_color=colour, row=1, col=2)
    fig.update_layout(template=TEMPLATE, height=420, barmode="group", legend=dict(orientation="h", y=-0.3))
    low = min(table["perplexity"].min(), table.attrs["teacher_ppl"])
    fig.update_yaxes(range=[0.9 * low, 1.05 * max(table["perplexity"].max(), table.attrs["dropped_ppl"])],
                     row=1, col=1)
    return fig


def continuation(tokenizer, sequence: torch.Tensor, prompt_tokens: int) -> tuple[str, str]:
    """A teacher sequence as text: (prompt, what the teacher wrote)."""
    ids = sequence.tolist()
    return tokenizer.decode(ids[:prompt_tokens]), tokenizer.decode(ids[prompt_tokens:])

