"""Lesson 20's computations and figures: a layer's masks, N:M grouping, channel norms, sparsity curves."""
from __future__ import annotations

import torch
from torch import nn

from workbench.plots.style import TEMPLATE
from workbench.pruning import masks as M
from workbench.pruning.structured import channel_importance

__all__ = ["row_mask", "lesson_masks", "mask_sparsity", "mask_heatmaps", "channel_norms", "sparsity_curves",
           "nm_grouping"]


_COLOURS = {"magnitude": "#1f77b4", "magnitude + fine-tune": "#2ca02c", "random": "#d62728"}


def _norms(weight: torch.Tensor, criterion: str = "l1") -> torch.Tensor:
    """Per output channel (row) norm of ``weight`` (out, ...), as `wb.prune.channel_importance` ranks them."""
    w = weight.detach().float().reshape(weight.shape[0], -1)                   # (out, in * k)
    if criterion == "l1":
        return w.abs().sum(1)
    if criterion == "l2":
        return w.pow(2).sum(1).sqrt()
    raise ValueError(f"criterion must be 'l1' or 'l2', got {criterion!r}")


def _removed(weight: torch.Tensor, amount: float, criterion: str = "l1") -> list[int]:
    """Indices of the ``round(amount * out)`` rows with the smallest norm (those structured pruning removes)."""
    norms = _norms(weight, criterion)
    keep = len(norms) - round(amount * len(norms))
    kept = set(torch.topk(norms, keep).indices.tolist())                     # the same rule as wb.prune.channels
    return [i for i in range(len(norms)) if i not in kept]


def row_mask(weight: torch.Tensor, amount: float, criterion: str = "l1") -> torch.Tensor:
    """Boolean keep-mask of ``weight``'s shape that drops the ``amount`` of rows with the smallest L1 norm."""
    M.check_sparsity(amount, "amount")
    keep = torch.ones(weight.shape[0], dtype=torch.bool)
    keep[_removed(weight, amount, criterion)] = False
    return keep.reshape(-1, *[1] * (weight.ndim - 1)).expand_as(weight).clone()


def lesson_masks(weight: torch.Tensor, sparsity: float = 0.5) -> dict[str, torch.Tensor]:
    """The three keep-masks of the lesson for one 2-D weight: unstructured magnitude and structured rows at
    ``sparsity``, and 2:4 (always 50 %)."""
    if weight.ndim != 2:
        raise ValueError(f"lesson_masks takes a 2-D (out, in) weight, got shape {tuple(weight.shape)}")
    return {"unstructured magnitude": M.magnitude_mask(weight, sparsity),
            "structured rows (L1)": row_mask(weight, sparsity),
            "2:4 semi-structured": M.nm_mask(weight, 2, 4)}


def mask_sparsity(mask: torch.Tensor) -> float:
    """Fraction of the entries a keep-mask drops."""
    return 1.0 - float(mask.float().mean())


def _flattened_nm_mask(weight: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """The mistaken N:M mask of a convolution: groups of ``m`` over the flattened (in, kh, kw) of each output."""
    w2d = weight.detach().reshape(weight.shape[0], -1)                          # (out, in * kh * kw)
    return M.nm_mask(w2d, n, m).reshape(weight.shape)


def nm_grouping(weight: torch.Tensor, n: int = 2, m: int = 4):
    """Measured on a convolution weight (out, in, kh, kw): the share of the groups sparse tensor cores read -
    ``m`` consecutive input channels at one (output, kernel position) - that hold exactly ``n`` kept weights,
    for the package's N:M mask and for the mistaken mask grouped over the flattened (in, kh, kw). A DataFrame."""
    import pandas as pd

    if weight.ndim < 3:
        raise ValueError(f"nm_grouping takes a convolution weight (out, in, *kernel), got {tuple(weight.shape)}")
    rows = []
    for label, mask in (("along input channels (wb.prune.NM)", M.nm_mask(weight, n, m)),
                        ("over flattened (in, kh, kw)", _flattened_nm_mask(weight, n, m))):
        groups = M.nm_groups(mask, m)                                               # (groups, m)
        rows.append({"grouping": label, "kept": int(mask.sum()),
                     f"input-channel groups with exactly {n} of {m} kept": float((groups.sum(1) == n).float().mean())})
    return pd.DataFrame(rows).set_index("grouping")


# --- figures -------------------------------------------------------------------------------------------

def mask_heatmaps(weight: torch.Tensor, masks: dict[str, torch.Tensor], rows: int = 16, cols: int = 32,
                  layer: str = "layer"):
    """One heatmap per mask of the top-left ``rows`` x ``cols`` corner of ``weight``: ``|w|`` where the mask keeps
    it, blank where it prunes. The titles give each mask's sparsity over the whole layer."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    w = weight.detach().float().abs()[:rows, :cols]                              # (rows, cols)
    titles = [f"{name}<br>{mask_sparsity(m):.0%} pruned" for name, m in masks.items()]
    fig = make_subplots(rows=1, cols=len(masks), subplot_titles=titles, horizontal_spacing=0.04)
    top = float(w.max())
    for i, m in enumerate(masks.values(), start=1):
        z = torch.where(m[:rows, :cols], w, torch.full_like(w, float("nan")))
        fig.add_trace(go.Heatmap(z=z.tolist(), zmin=0, zmax=top, colorscale=[[0, "#c6dbef"], [1, "#08306b"]],
                                 showscale=i == len(masks),
                                 xgap=1, ygap=1, colorbar=dict(title="|w|"), hoverongaps=False,
                                 hovertemplate="row %{y}, input %{x}: |w| = %{z:.3f}<extra></extra>"), row=1, col=i)
        fig.update_xaxes(title="input (column)", dtick=4, showgrid=False, row=1, col=i)   # ticks: the groups of 4
        fig.update_yaxes(autorange="reversed", showticklabels=i == 1, showgrid=False, row=1, col=i)
    fig.update_yaxes(title="output row", row=1, col=1)
    fig.update_layout(title=f"Three ways to prune {layer} (corner {rows}x{cols}; blank = pruned)",
                      template=TEMPLATE, height=400, plot_bgcolor="white",
                      margin=dict(t=120))                          # two-line subplot titles below the title
    return fig


def channel_norms(model: nn.Module, layer: str, amount: float, criterion: str = "l1"):
    """Bars of the ``criterion`` norm of each output channel of ``model.<layer>``; the channels structured pruning
    of ``amount`` removes are red."""
    import plotly.graph_objects as go

    norms = channel_importance(model, layer, criterion)
    gone = set(_removed(model.get_submodule(layer).weight, amount, criterion))
    colours = ["#d62728" if i in gone else "#1f77b4" for i in range(len(norms))]
    fig = go.Figure(go.Bar(x=list(range(len(norms))), y=norms.tolist(), marker_color=colours,
                           hovertemplate="channel %{x}: %{y:.3f}<extra></extra>"))
    fig.update_layout(title=f"{layer}: {criterion.upper()} norm of each output channel "
                            f"(red: the {len(gone)} removed at {amount:.0%})",
                      xaxis_title="output channel", yaxis_title=f"{criterion.upper()} norm of its weights",
                      template=TEMPLATE, height=360)
    return fig


def sparsity_curves(sweep, random=None, dense_accuracy: float | None = None, metric: str = "accuracy"):
    """Accuracy against sparsity from `wb.prune.sweep` tables: magnitude pruning with and without the fine-tune
    (``sweep``), and random pruning (``random``, optional) - the baseline a criterion must beat."""
    import plotly.graph_objects as go

    fig = go.Figure()
    curves = []
    for tuned, name in ((False, "magnitude"), (True, "magnitude + fine-tune")):
        part = sweep[sweep["finetuned"] == tuned]
        if len(part):
            curves.append((name, part))
    if random is not None:
        curves.append(("random", random[random["finetuned"] == False]))  # noqa: E712 (pandas mask)
    for name, part in curves:
        fig.add_trace(go.Scatter(x=(part["sparsity"] * 100).tolist(), y=part[metric].tolist(), name=name,
                                 mode="lines+markers", line=dict(color=_COLOURS[name], width=3),
                                 hovertemplate=name + ": %{x:.0f} % pruned, " + metric + " %{y:.3f}<extra></extra>"))
    if dense_accuracy is not None:
        fig.add_hline(y=dense_accuracy, line=dict(color="grey", dash="dot"), annotation_text="dense model",
                      annotation_position="bottom right")
    fig.update_layout(title=f"{metric} vs sparsity: pruning alone, and after a short fine-tune",
                      xaxis_title="sparsity (% of weights pruned)", yaxis_title=f"{metric} (higher is better)",
                      yaxis_range=[0, 1.02], template=TEMPLATE, height=420)
    return fig
