"""Lesson 20's exercises: worked solutions (``_solution_*``), their checks (``check_*``) and what only they use."""
from __future__ import annotations

import functools

import torch
from torch import nn

from workbench.pruning import masks as M
from workbench.pruning.structured import channels
from workbench.teach import Feedback, check
from workbench.teach.pruning.figures import _flattened_nm_mask, _norms, _removed

__all__ = ["check_global_mask", "check_nm_mask", "check_structured_pair"]


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
