"""Lesson 20, pruning: which weights a mask removes, what it costs in accuracy, and what it buys in speed.

Three ways to choose the weights ``W`` (out x in) to drop, all at the same 50 % sparsity (= fraction of zeros):

- **unstructured magnitude**: drop the smallest ``|w|`` anywhere - the zeros land scattered over the matrix,
  which dense kernels still multiply, so nothing gets faster;
- **structured**: drop whole output rows (neurons / channels) with the smallest L1 norm ``sum_j |w_ij|`` - the
  layer (and the input of the next one) really becomes smaller, so dense kernels run faster;
- **N:M semi-structured** (2:4): in every group of M = 4 consecutive inputs keep the N = 2 largest - a pattern
  sparse tensor cores on recent GPUs run at up to 2x. For a convolution (out, in, kh, kw) the groups run along
  the input channels at each kernel position (the GEMM's reduction dimension, as NVIDIA's ASP prunes), never
  over the flattened (in, kh, kw), which would mix kernel positions in a group.

Here: the masks of a real layer (`lesson_masks`, `row_mask`), the figures (`mask_heatmaps`, `channel_norms`,
`sparsity_curves`) and the exercise checks (``check_*``), which compute their expected values themselves.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from workbench.plots.style import TEMPLATE
from workbench.pruning import masks as M
from workbench.pruning.structured import channel_importance, channels
from workbench.teach import Feedback, check

__all__ = ["row_mask", "lesson_masks", "mask_sparsity", "mask_heatmaps", "channel_norms", "sparsity_curves",
           "nm_grouping", "check_global_mask", "check_nm_mask", "check_structured_pair"]

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


# --- exercise checks -----------------------------------------------------------------------------------
# Each exercise has a worked solution (``_solution_*``, as a learner writes it in the cell), shown behind the
# feedback's "Show solution" toggle and run by the regression suite (``wb.teach.use_solutions``).


def _solution_global_mask(weights, global_sparsity, target):
    scores = torch.cat([w.abs().flatten() for w in weights.values()])      # every selected weight, ranked together
    threshold = scores.sort().values[round(global_sparsity * scores.numel()) - 1]
    return weights[target].abs() > threshold


def _solution_nm_mask(w2, n, m):
    groups = w2.detach().abs().permute(0, 2, 3, 1).reshape(-1, m)         # (out * kh * kw * in / m, m)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(n, dim=1).indices, True)
    return keep.reshape(w2.shape[0], w2.shape[2], w2.shape[3], w2.shape[1]).permute(0, 3, 1, 2)


def check_global_mask(answer, weights: dict[str, torch.Tensor], sparsity: float, layer: str) -> Feedback:
    """Exercise: ``layer``'s keep-mask (True = kept) under one magnitude threshold shared by all ``weights``
    that prunes ``sparsity`` of them together (what `wb.prune.global_plan` does)."""
    solution = functools.partial(_solution_global_mask, weights, sparsity, layer)
    per_layer = M.global_sparsities({k: w.detach() for k, w in weights.items()}, sparsity)
    w = weights[layer].detach()
    expected = M.magnitude_mask(w, per_layer[layer])
    name = f"{layer}'s mask under a global threshold"
    hint = (f"rank |w| of every layer together, find the value below which {sparsity:.0%} of them lie, and keep "
            f"{layer}'s weights above it")
    mistakes = [(M.magnitude_mask(w, sparsity), f"that prunes {layer} on its own at {sparsity:.0%}: the threshold "
                                                f"must come from all the layers' weights together"),
                (~expected, "True means kept: you marked the pruned weights")]
    return check(name, answer, expected, hint=hint, rtol=0, atol=0, mistakes=mistakes, solution=solution)


def check_nm_mask(answer, weight: torch.Tensor, n: int = 2, m: int = 4) -> Feedback:
    """Exercise: the N:M keep-mask of a convolution weight, groups of ``m`` input channels at each kernel
    position (the package's `wb.prune.NM` mask)."""
    solution = functools.partial(_solution_nm_mask, weight, n, m)
    expected = M.nm_mask(weight, n, m)
    name = f"{n}:{m} mask along the input channels"
    hint = (f"move the input channels (dim 1) last, group them by {m}, keep the {n} largest |w| of each group, "
            f"and move them back")
    mistakes = [(_flattened_nm_mask(weight, n, m), f"those groups of {m} run over the flattened (in, kh, kw): a "
                                                  f"group mixes kernel positions; group input channels at each "
                                                  f"kernel position"),
                (~expected, "True means kept: you marked the pruned weights")]
    return check(name, answer, expected, hint=hint, rtol=0, atol=0, mistakes=mistakes, solution=solution)


def _solution_structured_pair(w1, w2, removed_fraction):
    norms = w1.abs().sum(dim=(1, 2, 3))                         # the L1 norm of each of conv1's output channels
    keep = w1.shape[0] - round(removed_fraction * w1.shape[0])
    kept = norms.topk(keep).indices.sort().values               # the largest norms, back in channel order
    return w1[kept], w2[:, kept]                                # conv2 loses the same channels, as inputs


def check_structured_pair(answer, model: nn.Module, layer: str, next_layer: str, amount: float) -> Feedback:
    """Exercise: the weights of ``layer`` and of the layer reading its output after structured L1 pruning removes
    ``amount`` of ``layer``'s output channels: ``layer`` keeps the rows of the kept channels, ``next_layer`` the
    same channels along its input dimension, both in the original order (expected: what `wb.prune.channels`
    leaves in the two layers)."""
    w1 = model.get_submodule(layer).weight.detach()
    w2 = model.get_submodule(next_layer).weight.detach()
    pruned = channels(model, {layer: amount}, criterion="l1")
    expected = (pruned.get_submodule(layer).weight.detach(), pruned.get_submodule(next_layer).weight.detach())
    solution = functools.partial(_solution_structured_pair, w1, w2, amount)
    gone = _removed(w1, amount, "l1")
    kept = [i for i in range(w1.shape[0]) if i not in gone]
    by_norm = torch.topk(_norms(w1), len(kept)).indices                          # kept, largest norm first
    smallest = sorted(torch.topk(_norms(w1), len(kept), largest=False).indices.tolist())
    l2_kept = [i for i in range(w1.shape[0]) if i not in set(_removed(w1, amount, "l2"))]
    own = sorted(torch.topk(w2.abs().sum(dim=(0, *range(2, w2.ndim))), len(kept)).indices.tolist())
    zeroed1, zeroed2 = w1.clone(), w2.clone()
    zeroed1[gone] = 0
    zeroed2[:, gone] = 0
    mistakes = [
        ((w1[kept], w2), f"{next_layer} still expects {w1.shape[0]} input channels: it reads {layer}'s output, so it "
                         f"loses the same {len(gone)} channels along its *input* dimension (dim 1)"),
        ((w1[kept], w2[kept]), f"dim 0 of {next_layer}'s weight is its own output channels; the channels {layer} "
                               f"lost are {next_layer}'s inputs, dim 1"),
        ((zeroed1, zeroed2), "the pruned channels are zeroed but still there: structured pruning removes them, so "
                             f"{layer} has {len(kept)} output channels and {next_layer} {len(kept)} inputs"),
        ((zeroed1, w2), "the pruned channels are zeroed but still there: structured pruning removes them from "
                        f"{layer}, and from {next_layer}'s inputs"),
        ((w1[smallest], w2[:, smallest]), "those are the channels with the *smallest* L1 norms: pruning keeps the "
                                          "largest and removes the rest"),
        ((w1[by_norm], w2[:, by_norm]), "the right channels, in the order of their norms; keep them in their "
                                        f"original order (and {next_layer}'s inputs in the same order)"),
        ((w1[l2_kept], w2[:, l2_kept]), "those channels are ranked by the L2 norm; the exercise ranks by L1"),
        ((w1[own], w2[:, own]), f"those channels were ranked by {next_layer}'s weights; the criterion is the norm "
                                f"of {layer}'s own output channels, and {next_layer} drops the same ones"),
    ]
    hint = (f"rank {layer}'s {w1.shape[0]} output channels by their L1 norm and keep the largest; {layer} keeps "
            f"those channels and {next_layer} the inputs that read them, in channel order")
    if isinstance(answer, torch.Tensor):
        hint = f"return the pair ({layer}'s weight, {next_layer}'s weight): `answer = w1_pruned, w2_pruned`"
    return check(f"{layer} and {next_layer} after {amount:.0%} structured L1 pruning", answer, expected, hint=hint,
                 rtol=0, atol=0, mistakes=mistakes, solution=solution)
