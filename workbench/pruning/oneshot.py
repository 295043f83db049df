"""One-shot LLM pruning from calibration data: Wanda and SparseGPT (unstructured or N:M), as pure functions.

Both score a Linear's weights with its calibration inputs X ``(tokens, K)``:

- Wanda (Sun et al., 2023): score ``|W_ij| * ||X_:,j||_2``; within each output row (unstructured) or each
  group of ``m`` consecutive inputs (N:M) the lowest scores are pruned; the kept weights are not changed.
- SparseGPT (Frantar & Alistarh, 2023): the GPTQ recipe with pruning in place of rounding. Columns are
  processed left to right in blocks; at the start of a block (unstructured) or of every ``m`` columns (N:M)
  the mask is chosen from ``w^2 / [H^-1]_jj^2`` (the OBS saliency, on the weights already updated by
  earlier columns' feedback), then each pruned weight's error is fed back into the columns not yet
  processed, ``W[:, j+1:] -= (w_j / [H^-1]_jj) [H^-1]_{j, j+1:}`` (upper Cholesky factor of H^-1, as in GPTQ).

Unstructured masks keep an exact count, ``numel - round(sparsity * numel)`` (spread evenly over rows for
Wanda, over blocks for SparseGPT), so the structure of a saved model follows from its plan alone.
`NormAccumulator` (Wanda) and `workbench.quantization.gptq.HessianAccumulator` (SparseGPT) build the statistics
one calibration batch at a time, so the sequential pipeline never keeps a layer's inputs.

A mixture of experts' fused experts (`workbench.quantization.experts`: ``gate_up_proj`` (E, 2I, H), ``down_proj``
(E, H, I), or their transpose) are pruned matrix by matrix by `prune_experts`: each expert's ``(rows, K)`` matrix is
the nn.Linear weight it stands for, scored on exactly the tokens the router sent to that expert (`expert_inputs`
runs the class's own forward on the experts module's recorded calls), projection after projection in chain order
(``down_proj`` sees what the already-pruned ``gate_up_proj`` computes).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from workbench.plans.registry import Accumulator
from workbench.pruning.masks import prune_lowest
from workbench.quantization.experts import ExpertMatrix, expert_inputs
from workbench.quantization.gptq import hessian, inverse_hessian_factor

__all__ = ["NormAccumulator", "input_norms", "wanda_mask", "sparsegpt_prune", "prune_experts"]


class NormAccumulator(Accumulator):
    """sum over tokens of x_j^2 per input channel, one batch at a time (``add`` is what a pre-hook calls)."""

    def __init__(self, in_features: int, name: str = "layer"):
        self.K, self.name = in_features, name
        self.sq = torch.zeros(in_features, dtype=torch.float64)   # (K,)
        self.n = 0

    def add(self, batch: tuple[torch.Tensor, ...]) -> None:
        x = batch[0]
        if x.shape[-1] != self.K:
            raise ValueError(f"calibration input of {self.name!r} has last dimension {x.shape[-1]}, expected {self.K}")
        self.sq += x.reshape(-1, self.K).to("cpu", torch.float64).pow(2).sum(0)
        self.n += 1

    def value(self) -> torch.Tensor:
        if self.n == 0:
            raise ValueError(f"Wanda needs calibration inputs for {self.name!r}, and none were recorded")
        return self.sq.sqrt()


def input_norms(inputs: Sequence[tuple[torch.Tensor, ...]] | NormAccumulator | None, K: int,
                name: str = "layer") -> torch.Tensor:
    """||X_:,j||_2 per input channel ``(K,)`` (float64), from recorded inputs or an accumulator."""
    if isinstance(inputs, NormAccumulator):
        return inputs.value()
    acc = NormAccumulator(K, name)
    for batch in inputs or ():
        acc.add(batch)
    return acc.value()


def _check_nm(K: int, nm: tuple[int, int] | None, name: str) -> None:
    if nm is not None and K % nm[1]:
        raise ValueError(f"{nm[0]}:{nm[1]} pruning of {name!r} needs its input size {K} to be a multiple of {nm[1]}")


def _nm_keep(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the ``n`` highest of every ``m`` consecutive scores along the last dimension."""
    groups = scores.reshape(-1, m)                                                  # (groups, m)
    top = torch.topk(groups, n, dim=1).indices
    return torch.zeros_like(groups, dtype=torch.bool).scatter_(1, top, True).reshape(scores.shape)


def wanda_mask(weight: torch.Tensor, inputs, sparsity: float = 0.5, nm: tuple[int, int] | None = None,
               name: str = "layer") -> torch.Tensor:
    """Wanda keep-mask ``(N, K)`` (True = keep) of a Linear weight from its calibration inputs."""
    N, K = weight.shape
    _check_nm(K, nm, name)
    scores = weight.detach().to("cpu", torch.float64).abs() * input_norms(inputs, K, name)   # (N, K)
    if nm is not None:
        return _nm_keep(scores, *nm).to(weight.device)
    total = round(sparsity * N * K)
    per_row = [total // N + (1 if r < total % N else 0) for r in range(N)]          # exact count, even spread
    keep = torch.stack([prune_lowest(scores[r], per_row[r]) for r in range(N)])
    return keep.to(weight.device)


def sparsegpt_prune(weight: torch.Tensor, inputs, sparsity: float = 0.5, nm: tuple[int, int] | None = None,
                    damp: float = 0.01, block_size: int = 128,
                    name: str = "layer") -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT: returns (the updated weight with pruned entries zero, in ``weight``'s dtype and device; the
    keep-mask). ``inputs``: recorded calibration inputs or a `HessianAccumulator`."""
    N, K = weight.shape
    _check_nm(K, nm, name)
    W = weight.detach().to("cpu", torch.float32).clone()                               # (N, K)
    H = hessian(inputs, K, name).to(torch.float32)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    Hinv = inverse_hessian_factor(H, damp, name)   # (H is consumed)
    del H
    if nm is not None:
        block_size = max(1, block_size // nm[1]) * nm[1]   # N:M groups never straddle blocks
    keep = torch.ones(N, K, dtype=torch.bool)
    total = round(sparsity * N * K)
    pruned = 0
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1 = W[:, i1:i2].clone()                                                       # (N, B)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        d = torch.diag(Hinv1)                                                          # (B,)
        if nm is None:   # this block's share of the exact total, chosen by OBS saliency
            count = round(total * i2 / K) - pruned
            keep1 = prune_lowest(W1.pow(2) / d.pow(2), count)
            pruned += count
        else:
            keep1 = torch.ones_like(W1, dtype=torch.bool)
        for i in range(i2 - i1):
            if nm is not None and i % nm[1] == 0:   # choose this group's n survivors from the updated weights
                sal = W1[:, i:i + nm[1]].pow(2) / d[i:i + nm[1]].pow(2)
                keep1[:, i:i + nm[1]] = _nm_keep(sal, *nm)
            w = W1[:, i]
            q = torch.where(keep1[:, i], w, torch.zeros_like(w))
            err = (w - q) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            W1[:, i] = q
            Err1[:, i] = err
        W[:, i1:i2] = W1
        keep[:, i1:i2] = keep1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    W[~keep] = 0.0
    return W.to(device=weight.device, dtype=weight.dtype), keep.to(weight.device)


# (label, an expert's matrix (rows, K), its inputs [(x (tokens, K),), ...] or None) -> (the matrix pruned, method)
ExpertPruner = Callable[[str, torch.Tensor, "list[tuple[torch.Tensor]] | None"], tuple[torch.Tensor, str]]


def prune_experts(name: str, module: nn.Module, layout: Sequence[ExpertMatrix], prune: ExpertPruner,
                  calls=None) -> tuple[dict[str, torch.Tensor], list[tuple[str, int, int, str]]]:
    """The fused projections of the experts module ``module`` (``layout``: `experts_layout`'s) with every expert's
    matrix pruned by ``prune``, which sees it as the nn.Linear weight ``(rows, K)`` it stands for (contiguous; the
    transpose of a transposed layout's slice). With ``calls`` (the module's recorded positional arguments, e.g.
    ``(hidden_states, top_k_index, top_k_weights)``) each matrix also gets the inputs it is multiplied with when
    the class's own forward runs on them - the tokens routed to that expert - projection after projection, each
    on the outputs of the ones already pruned; without, ``None``. Returns (projection name -> the pruned tensor in
    the parameter's layout and dtype, the rows (projection, expert, tokens, method) of what each matrix got)."""
    current = {m.name: module.get_parameter(m.name).detach() for m in layout}
    rows: list[tuple[str, int, int, str]] = []
    for m in layout:
        inputs = expert_inputs(module, calls, m.name, current) if calls is not None else None
        pruned = []
        for e in range(m.experts):
            w = current[m.name][e]
            w = (w.t() if m.transposed else w).contiguous()                       # (rows, K): the Linear weight
            xs = None if inputs is None else [(x,) for x in inputs[e]]
            new, how = prune(f"{name}.{m.name}[{e}]", w, xs)
            rows.append((m.name, e, sum(x.shape[0] for (x,) in xs or ()), how))
            pruned.append(new.t() if m.transposed else new)
        current[m.name] = torch.stack(pruned)            # (E, rows, K) or (E, K, rows): what the next one sees
    return current, rows
