"""Lab 21's exercises: worked solutions (``_solution_*``), their checks (``check_*``) and what only they use."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from workbench.pruning import masks
from workbench.pruning.oneshot import input_norms, wanda_mask
from workbench.pruning.schedules import polynomial_sparsity
from workbench.quantization.gptq import hessian, inverse_hessian_factor
from workbench.teach import Feedback, check
from workbench.teach.gradual.figures import bytes_24

__all__ = ["OBSExample", "obs_example", "check_schedule", "check_magnitude_mask", "check_wanda_scores",
           "check_wanda_mask", "check_nm_mask", "check_obs_update", "check_obs_saliency", "check_24_bytes",
           "check_24_ceiling", "check_best_pruner"]


# --- SparseGPT's update -----------------------------------------------------------------------------------

@dataclass
class OBSExample:
    """A ``rows x cols`` corner of a real layer: weights ``W``, ``U`` the upper Cholesky factor of the damped
    inverse Hessian of those columns, ``keep0`` the keep-mask of column 0 (its smaller half by |w| pruned)."""

    W: torch.Tensor
    U: torch.Tensor
    keep0: torch.Tensor


def obs_example(weight: torch.Tensor, X: torch.Tensor, rows: int = 8, cols: int = 6,
                damp: float = 0.01) -> OBSExample:
    W = weight.detach().double().cpu()[:rows, :cols].clone()
    U = inverse_hessian_factor(hessian([(X[:, :cols],)], cols, dtype=torch.float64), damp)
    keep0 = masks.magnitude_mask(W[:, 0], 0.5)
    return OBSExample(W, U, keep0)


# --- exercises: worked solutions and checks -----------------------------------------------------------------

def _solution_schedule(finals, steps):
    answer = [finals[-1] * (1 - (1 - t / steps) ** 3) for t in range(1, steps + 1)]
    return answer


def check_schedule(answer, final: float, steps: int) -> Feedback:
    """Exercise: the sparsity after each of ``steps`` pruning steps (from 0) on the cubic schedule."""
    expected = [polynomial_sparsity(t, final, steps) for t in range(1, steps + 1)]
    return check("cubic schedule", answer, expected, rtol=1e-6, atol=1e-9,
                 hint="s_t = s_f + (s_i - s_f) (1 - t/n)^3 with s_i = 0, for t = 1 .. n",
                 mistakes=[([final * t / steps for t in range(1, steps + 1)],
                            "that is a linear schedule; the cubic one prunes fast first, slowly at the end"),
                           ([final * (t / steps) ** 3 for t in range(1, steps + 1)],
                            "that starts slowly and ends fast, the opposite of Zhu & Gupta: use (1 - t/n)^3"),
                           ([final * (1 - (1 - t / steps) ** 3) for t in range(0, steps)],
                            "off by one step: t runs from 1 to n, and step n reaches the final sparsity")],
                 solution=functools.partial(_solution_schedule, [final], steps))   # the notebook's finals[-1]


def _solution_magnitude_mask(w, finals):
    prune = round(finals[0] * w.numel())
    order = w.abs().flatten().argsort(stable=True)
    answer = torch.ones(w.numel(), dtype=torch.bool)
    answer[order[:prune]] = False
    return answer.reshape(w.shape)


def check_magnitude_mask(answer, w: torch.Tensor, sparsity: float) -> Feedback:
    """Exercise: the keep-mask pruning exactly round(sparsity * numel) weights of smallest |w|."""
    expected = masks.magnitude_mask(w, sparsity)
    prune = round(sparsity * w.numel())
    signed = torch.ones(w.numel(), dtype=torch.bool)
    signed[w.flatten().argsort(stable=True)[:prune]] = False
    return check("magnitude mask", answer, expected, rtol=0, atol=0,
                 hint="rank |w| over the whole tensor, prune the round(sparsity * numel) smallest (True = kept)",
                 mistakes=[(signed.reshape(w.shape), "you ranked w, not |w|: large negative weights matter too"),
                           (~expected, "the mask is inverted: True marks a weight that is kept")],
                 solution=functools.partial(_solution_magnitude_mask, w, [sparsity]))   # the notebook's finals[0]


def _solution_wanda_scores(W, X):
    answer = W.abs() * X.norm(dim=0)
    return answer


def check_wanda_scores(answer, W: torch.Tensor, X: torch.Tensor) -> Feedback:
    """Exercise: Wanda's score of every weight ``(N, K)`` from the layer's calibration inputs ``X`` ``(tokens, K)``."""
    K = W.shape[1]
    expected = W.detach().double().abs() * input_norms([(X,)], K)
    Wa = W.detach().double().abs()
    return check("Wanda scores", answer, expected, rtol=1e-4, atol=1e-8,
                 hint="|W_ij| times the L2 norm of input channel j over all calibration tokens (X.norm(dim=0))",
                 mistakes=[(Wa * X.double().abs().mean(0), "that is mean |x_j| (AWQ's statistic); Wanda uses the "
                                                           "L2 norm over tokens"),
                           (Wa * X.double().pow(2).sum(0), "that is the squared norm: take its square root")],
                 solution=functools.partial(_solution_wanda_scores, W.detach(), X))


def _solution_wanda_mask(W, X, sparsity):
    scores = W.abs() * X.norm(dim=0)                                 # (N, K)
    prune = round(sparsity * W.shape[1])
    lowest = scores.argsort(dim=1, stable=True)[:, :prune]           # per output row
    answer = torch.ones_like(W, dtype=torch.bool).scatter_(1, lowest, False)
    return answer


def check_wanda_mask(answer, W: torch.Tensor, X: torch.Tensor, sparsity: float = 0.5) -> Feedback:
    """Exercise: Wanda's unstructured keep-mask: in every output row, prune the lowest-scoring ``sparsity``."""
    expected = wanda_mask(W, [(X,)], sparsity)
    scores = W.detach().double().abs() * input_norms([(X,)], W.shape[1])
    flat = torch.ones(W.numel(), dtype=torch.bool)
    flat[scores.flatten().argsort(stable=True)[:round(sparsity * W.numel())]] = False
    return check("Wanda mask", answer, expected, rtol=0, atol=0,
                 hint="Wanda compares weights within each output row (dim=1), not across the whole matrix",
                 mistakes=[(flat.reshape(W.shape), "that ranks the whole matrix at once; Wanda prunes the same "
                                                   "fraction of every output row"),
                           (masks.magnitude_mask(W, sparsity),
                            "that is plain magnitude: weigh |W| by the input norms")],
                 solution=functools.partial(_solution_wanda_mask, W.detach(), X, sparsity))


def _solution_nm_mask(S):
    groups = S.reshape(-1, 4)                                        # 4 consecutive inputs of a row
    top = groups.topk(2, dim=1).indices
    answer = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, top, True).reshape(S.shape)
    return answer


def check_nm_mask(answer, scores: torch.Tensor) -> Feedback:
    """Exercise: the 2:4 keep-mask of ``scores`` ``(N, K)``: the 2 highest of every 4 consecutive inputs of a row."""
    expected = masks.nm_mask(scores, 2, 4)
    return check("2:4 mask", answer, expected, rtol=0, atol=0,
                 hint="groups of 4 run along the input dimension (each row, columns 4g .. 4g+3); keep the 2 highest",
                 mistakes=[(masks.nm_mask(scores.T.contiguous(), 2, 4).T,
                            "your groups run down the output rows; sparse tensor cores group the inputs of a row"),
                           (~expected, "the mask is inverted: keep the 2 highest scores")],
                 solution=functools.partial(_solution_nm_mask, scores))


def _solution_obs_update(ex):
    w = ex.W[:, 0]
    err = (w - w * ex.keep0) / ex.U[0, 0]
    answer = ex.W[:, 1:] - torch.outer(err, ex.U[0, 1:])
    return answer


def check_obs_update(answer, ex: OBSExample) -> Feedback:
    """Exercise: SparseGPT's update of columns 1.. after column 0 is pruned by ``keep0``."""
    w = ex.W[:, 0]
    removed = w * ~ex.keep0
    expected = ex.W[:, 1:] - torch.outer(removed / ex.U[0, 0], ex.U[0, 1:])
    return check("SparseGPT update", answer, expected, rtol=1e-6, atol=1e-9,
                 hint="the error of column 0 is what pruning removed (w - w * keep0), divided by U[0, 0]; every "
                      "later column j moves by -error * U[0, j]",
                 mistakes=[(ex.W[:, 1:] + torch.outer(removed / ex.U[0, 0], ex.U[0, 1:]),
                            "wrong sign: subtract the feedback"),
                           (ex.W[:, 1:] - torch.outer(removed, ex.U[0, 1:]), "divide the error by U[0, 0]"),
                           (ex.W[:, 1:] - torch.outer(w * ex.keep0 / ex.U[0, 0], ex.U[0, 1:]),
                            "the error is the pruned part of the column (w where keep0 is False), not the kept part"),
                           (ex.W[:, 1:], "that is columns 1.. unchanged: magnitude pruning, no feedback")],
                 solution=functools.partial(_solution_obs_update, ex))


def _solution_obs_saliency(ex):
    answer = ex.W.pow(2) / torch.diag(ex.U).pow(2)
    return answer


def check_obs_saliency(answer, ex: OBSExample) -> Feedback:
    """Exercise: the OBS saliency SparseGPT ranks a block's weights by, ``w^2 / [U]_jj^2`` with U as above."""
    d = torch.diag(ex.U)
    expected = ex.W.pow(2) / d.pow(2)
    return check("OBS saliency", answer, expected, rtol=1e-6, atol=1e-12,
                 hint="the loss of removing w_ij is w_ij^2 / [H_F^-1]_jj, and the inverse Hessian of the columns "
                      "still free (j and after) has diagonal U_jj^2: w^2 / U_jj^2, broadcast over rows",
                 mistakes=[(ex.W.pow(2) / d, "square the diagonal too: [H_F^-1]_jj = U_jj^2"),
                           (ex.W.abs() / d, "the saliency is quadratic in w")],
                 solution=functools.partial(_solution_obs_saliency, ex))


def _solution_24_bytes(out_24, in_24):
    kept = out_24 * in_24 // 2
    answer = kept * 2 + kept * 2 // 8                                # fp16 values + 2-bit positions
    return answer


def check_24_bytes(answer, out_features: int, in_features: int) -> Feedback:
    """Exercise: bytes of a 2:4 fp16 weight: the kept values plus the metadata saying where they sit."""
    expected = bytes_24(out_features, in_features, torch.float16)
    kept = out_features * in_features // 2
    return check("2:4 bytes", answer, expected, rtol=0, atol=0.5,
                 hint="half the values are kept (2 bytes each in fp16); each kept value needs its position in its "
                      "group of 4 (2 bits)",
                 mistakes=[(kept * 2, "that is the values alone: the metadata (2 bits per kept value) is stored too"),
                           (kept * 2 + kept * 2, "a position within a group of 4 needs 2 bits, not 16"),
                           (out_features * in_features * 2, "that is the dense fp16 weight")],
                 solution=functools.partial(_solution_24_bytes, out_features, in_features))


def _solution_24_ceiling(out_24, in_24, sparse_bytes):
    answer = out_24 * in_24 * 2 / sparse_bytes
    return answer


def check_24_ceiling(answer, out_features: int, in_features: int, sparse_bytes: int) -> Feedback:
    """Exercise: the most a memory-bound (batch-1) fp16 GEMV can gain from 2:4 storage: the byte ratio."""
    expected = out_features * in_features * 2 / bytes_24(out_features, in_features, torch.float16)
    return check("2:4 memory-bound ceiling", answer, expected, rtol=1e-6,
                 hint="a memory-bound kernel's time is its bytes / bandwidth: compare the dense fp16 bytes with the "
                      "2:4 bytes",
                 mistakes=[(2.0, "2x is the math ceiling (half the multiply-adds); at batch 1 the bytes decide, and "
                                 "the metadata costs some"),
                           (1 / expected, "inverted: dense bytes / 2:4 bytes")],
                 solution=functools.partial(_solution_24_ceiling, out_features, in_features, sparse_bytes))


def check_best_pruner(answer, table, pattern: str = "2:4") -> Feedback:
    """Exercise: which method (``"magnitude"``, ``"wanda"`` or ``"sparsegpt"``) measured the lowest perplexity."""
    column = table[pattern]
    expected = str(column.idxmin())
    given = answer.lower() if isinstance(answer, str) else answer
    hint = f"find the lowest perplexity in the {pattern!r} column"
    mistakes = [(m, f"{m} measured {column[m]:.2f} at {pattern}; another method did better (lower is better)")
                for m in column.index if m != expected]
    return check(f"best pruner at {pattern}", given, expected, hint=hint, mistakes=mistakes,
                 solution=functools.partial(_solution_best_pruner, table[[pattern]].set_axis(["2:4"], axis=1)))


def _solution_best_pruner(ppl):
    return ppl["2:4"].idxmin()           # the notebook's question (the check passes the column it asks about)
