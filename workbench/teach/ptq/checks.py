"""Lesson 12's exercises: worked solutions (``_solution_*``), their checks (``check_*``) and what only they use."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from workbench.quantization import formats  # the name the lesson's notebook (and a worked solution) uses
from workbench.quantization import formats as fm
from workbench.quantization.gptq import hessian, inverse_hessian_factor
from workbench.quantization.smoothquant import activation_absmax, smoothing_factors
from workbench.teach import Feedback, as_number, check
from workbench.teach.ptq.figures import awq_grid

__all__ = ["GPTQBlock", "gptq_block", "gptq_block_reference", "check_gptq_block", "check_awq_alpha", "check_smoothing",
           "check_best_method"]


# --- exercise 1: GPTQ on a block -------------------------------------------------------------------------------

@dataclass
class GPTQBlock:
    """A small corner of a real layer for the GPTQ exercise: weights ``W`` ``(rows, cols)`` (float64), the
    undamped Hessian ``H`` = 2 Xᵀ X / n of those ``cols`` input channels ``(cols, cols)``, the per-row scale of the
    symmetric grid (``scale`` ``(rows,)``, fixed before the first column, as the package fixes a group's scale when
    the group starts), the grid's signed codes ``qmin .. qmax`` and GPTQ's relative damping ``damp``."""

    W: torch.Tensor
    H: torch.Tensor
    scale: torch.Tensor
    qmin: int
    qmax: int
    damp: float


def gptq_block(weight: torch.Tensor, X: torch.Tensor, rows: int = 8, cols: int = 8, bits: int = 4,
               damp: float = 0.01) -> GPTQBlock:
    """The first ``rows`` x ``cols`` block of a real layer, with the Hessian of its columns on the calibration
    inputs ``X`` ``(tokens, K)`` and the grid (`formats.IntFormat(bits, None)`: one fp16 scale per row) that
    `gptq.gptq_quantize` would use for it."""
    W = weight.detach().double().cpu()[:rows, :cols].clone()
    H = hessian([(X[:, :cols],)], cols, dtype=torch.float64)
    fmt = fm.IntFormat(bits, None, True)
    scale, _ = fm.int_qparams(W.float(), fmt)
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return GPTQBlock(W, H, scale.double().flatten(), qmin, qmax, damp)


def _gptq_loop(block: GPTQBlock, U: torch.Tensor, sign: float = 1.0, divide: bool = True, clamp: bool = True,
               keep_quantized: bool = True, feedback: bool = True) -> torch.Tensor:
    """GPTQ's column loop on ``block`` with the factor ``U``; the keywords make the usual slips."""
    W = block.W.clone()
    for j in range(W.shape[1]):
        q = (W[:, j] / block.scale).round()
        q = (q.clamp(block.qmin, block.qmax) if clamp else q) * block.scale
        error = (W[:, j] - q) / (U[j, j] if divide else 1.0)
        if keep_quantized:
            W[:, j] = q
        if feedback:
            W[:, j + 1:] -= sign * torch.outer(error, U[j, j + 1:])
    return W


def _damped(H: torch.Tensor, damp: float) -> torch.Tensor:
    return H + damp * H.diagonal().mean() * torch.eye(H.shape[0], dtype=H.dtype)


def gptq_block_reference(block: GPTQBlock) -> torch.Tensor:
    """GPTQ on the block in float64: each column rounded to its row's grid, its error divided by ``U[j, j]`` and
    fed forward along row ``j`` of ``U``, the upper Cholesky factor of the damped ``H⁻¹`` (what
    `gptq.gptq_quantize` computes in float32; a test compares them)."""
    return _gptq_loop(block, inverse_hessian_factor(block.H.clone(), block.damp))


def _solution_gptq_block(toy):
    H = toy.H + toy.damp * toy.H.diagonal().mean() * torch.eye(len(toy.H), dtype=toy.H.dtype)    # damped
    U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)           # the upper Cholesky factor of H^-1
    Wq = toy.W.clone()
    for j in range(Wq.shape[1]):
        q = (Wq[:, j] / toy.scale).round().clamp(toy.qmin, toy.qmax) * toy.scale     # column j on its grid
        error = (Wq[:, j] - q) / U[j, j]
        Wq[:, j] = q
        Wq[:, j + 1:] -= torch.outer(error, U[j, j + 1:])                # fed forward to the columns still to come
    return Wq


def check_gptq_block(answer, block: GPTQBlock) -> Feedback:
    """Exercise: the block quantized by GPTQ, column by column on its grid, each column's rounding error fed
    forward with the upper Cholesky factor of the damped inverse Hessian (expected: `gptq_block_reference`)."""
    solution = functools.partial(_solution_gptq_block, block)
    expected = gptq_block_reference(block)
    U = inverse_hessian_factor(block.H.clone(), block.damp)
    n = block.W.shape[1]
    mistakes = [
        (_gptq_loop(block, U, feedback=False), "those are round-to-nearest values: each column's rounding error must "
                                               "be fed forward (along row j of the *upper* factor: a lower one holds "
                                               "zeros right of its diagonal), and each column quantized as the "
                                               "feedback of the earlier ones has left it, not as it was at the start"),
        (_gptq_loop(block, U, sign=-1.0), "the feedback has the wrong sign: the columns still to come move against "
                                          "the error, to cancel it in the layer's output"),
        (_gptq_loop(block, U, divide=False), "the error is scaled by 1 / U[j, j] before it is fed forward"),
        (_gptq_loop(block, torch.linalg.cholesky(_damped(block.H, block.damp), upper=True)),
         "that factor is the Cholesky factor of H itself: GPTQ uses the factor of the (damped) *inverse* Hessian"),
        (_gptq_loop(block, torch.linalg.cholesky(torch.linalg.inv(block.H), upper=True)),
         f"the Hessian is damped before it is inverted: add damp × mean(diag H) = {block.damp:g} × "
         f"{float(block.H.diagonal().mean()):.3g} to its diagonal"),
        (_gptq_loop(block, U, clamp=False), f"clamp the codes to the grid [{block.qmin}, {block.qmax}]: the feedback "
                                            f"can push a weight past the largest code"),
        (_gptq_loop(block, U, keep_quantized=False), "the block you return must hold the quantized values: set "
                                                     "column j to its grid values once its error is taken"),
    ]
    hint = (f"section 2 has the pieces: the factor U from the damped Hessian, then columns 0 … {n - 1} in order, "
            f"each rounded to its row's grid as it stands, its error passed on to the columns after it")
    if isinstance(answer, torch.Tensor) and answer.shape == (block.W.shape[0], n - 1):
        hint = f"return the whole block, {tuple(block.W.shape)}, every column quantized"
    return check("GPTQ on a block", answer, expected, hint=hint, rtol=1e-6, atol=1e-7, mistakes=mistakes,
                 solution=solution)


# --- exercise 2: AWQ's alpha search ------------------------------------------------------------------------

def _solution_awq_alpha(W, X, fmt):
    x_mean = X.abs().mean(dim=0)                                  # (K,) mean |x_j| over the tokens
    reference = X @ W.T                                           # (tokens, N)
    errors = []
    for alpha in [i / 20 for i in range(21)]:
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        Wq = formats.decode(formats.encode(W * s, fmt), fmt, W.shape[1]) / s
        errors.append(float((X @ Wq.T - reference).pow(2).mean()))
    return errors.index(min(errors)) / 20


def _alpha_search(W: torch.Tensor, X: torch.Tensor, fmt: fm.IntFormat, activation: torch.Tensor,
                  divide_back: bool = True, on_weights: bool = False) -> float:
    """The alpha a search with one of the usual slips picks: scales from another activation statistic, the
    scales not divided out again, or the error measured on the weights instead of the layer's output."""
    errors = []
    for i in range(21):
        s = activation.pow(i / 20).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        Wq = fm.decode(fm.encode(W * s, fmt), fmt, W.shape[1])
        Wq = Wq / s if divide_back else Wq
        errors.append(float((Wq - W).pow(2).mean()) if on_weights else float((X @ (Wq - W).T).pow(2).mean()))
    return errors.index(min(errors)) / 20


def check_awq_alpha(answer, W: torch.Tensor, X: torch.Tensor, bits: int, group_size: int | None) -> Feedback:
    """Exercise: AWQ's alpha on 0, 0.05, ..., 1 - the one whose scales s = mean|x|^alpha (normalised) give
    the smallest output error of RTN on ``W diag(s)``, divided by s again (expected: `awq_grid`, which computes
    what `awq.awq_search` computes)."""
    W, X = W.detach().float(), X.detach().float()
    solution = functools.partial(_solution_awq_alpha, W, X, fm.IntFormat(bits, group_size))
    grid, x_mean, _ = awq_grid(W, X, bits=bits, group_size=group_size)
    expected = float(grid.loc[grid["relative_error"].idxmin(), "alpha"])
    hint = ("for each alpha: s = mean|x|^alpha (clamped at 1e-4), divided by sqrt(max(s) · min(s)); quantize W · s "
            "(columns scaled), divide by s again, and measure the mean squared error of X Ŵᵀ against X Wᵀ")
    mistakes = []
    value = as_number(answer) if answer is not ... and answer is not None else None
    if value is not None and abs(value - expected) > 1e-6:       # the slips are searched only for a wrong answer
        fmt = fm.IntFormat(bits, group_size)
        worst = float(grid.loc[grid["relative_error"].idxmax(), "alpha"])
        mistakes = [
            (_alpha_search(W, X, fmt, x_mean, on_weights=True),
             "that alpha minimises the error of the *weights*; AWQ minimises the error of the layer's output "
             "X Ŵᵀ, which is what lets large activations count"),
            (_alpha_search(W, X, fmt, X.abs().amax(dim=0)),
             "those scales come from max|x_j|; AWQ uses the mean |x_j| over the tokens"),
            (_alpha_search(W, X, fmt, x_mean, divide_back=False),
             "divide the quantized W · s by s again: the layer computes (x / s) · (W s)ᵀ = x Wᵀ"),
            (worst, "that alpha has the *largest* error; take the smallest"),
        ]
        if value in (0.0, 1.0) and value != expected:
            mistakes.append((value, f"alpha = {value:g} is an end of the grid; the search found a smaller error "
                                    f"inside it"))
    return check("AWQ alpha search", answer, expected, hint=hint, rtol=0, atol=1e-6, mistakes=mistakes,
                 solution=solution)


def _solution_smoothing(X, W, smooth_alpha):
    s = X.abs().amax(dim=0) ** smooth_alpha / W.abs().amax(dim=0) ** (1 - smooth_alpha)   # (K,) one per input channel
    return X / s, W * s                                                        # activations down, weights up


# --- exercise 3: SmoothQuant's migration -------------------------------------------------------------------

def check_smoothing(answer, X: torch.Tensor, weight: torch.Tensor, alpha: float) -> Feedback:
    """Exercise: the smoothed pair ``(X / s, W * s)`` with SmoothQuant's factors
    s_j = max|X_:,j|^alpha / max|W_:,j|^(1 - alpha) (`smoothquant.smoothing_factors`): the same product X Wᵀ,
    with the activation outliers moved into the weights."""
    X, W = X.detach().float(), weight.detach().float()
    solution = functools.partial(_solution_smoothing, X, W, alpha)
    K = W.shape[1]
    s = smoothing_factors(activation_absmax([(X,)], K), W, alpha)                 # (K,)
    expected = (X / s, W * s)
    act, w = X.abs().amax(dim=0).clamp(min=1e-5), W.abs().amax(dim=0).clamp(min=1e-5)
    swapped = act.pow(1 - alpha) / w.pow(alpha)
    mistakes = [((X * s, W / s), "the migration runs the other way: divide the activations by s (their outliers "
                                 "shrink) and multiply the weights by it"),
                ((X / swapped, W * swapped), "alpha and 1 − alpha are swapped: the activations' maximum gets the "
                                             "exponent alpha"),
                ((X / s, W), "the weights must be multiplied by s too, or X Wᵀ changes")]
    hint = ("s has one value per input channel j: the maxima run over the tokens (X.abs().amax(dim=0)) and over the "
            "output rows (W.abs().amax(dim=0)); return the pair (X / s, W * s)")
    if isinstance(answer, torch.Tensor):
        hint = "return the pair (smoothed activations, smoothed weights), e.g. `answer = X / s, W * s`"
    return check("SmoothQuant migration", answer, expected, hint=hint, rtol=1e-4, atol=1e-6, mistakes=mistakes,
                 solution=solution)


# --- exercise 4: reading the measurements ------------------------------------------------------------------

def _solution_best_method(minilm_table, bits):
    return minilm_table[bits].idxmax()                          # fidelity: higher is better


def check_best_method(answer, table, bits: int, higher_is_better: bool = True) -> Feedback:
    """Exercise: which weight-only method (``"rtn"``, ``"gptq"`` or ``"awq"``) measured best at ``bits``."""
    solution = functools.partial(_solution_best_method, table, bits) if higher_is_better else None
    column = table[bits]
    expected = str(column.idxmax() if higher_is_better else column.idxmin())
    direction = "highest" if higher_is_better else "lowest"
    hint = f"find the {direction} value in the int{bits} column of the table (column {bits})"
    if isinstance(answer, str) and answer.lower() in column.index and answer.lower() != expected:
        hint = (f"{answer.lower()} measured {column[answer.lower()]:.4f} at {bits} bits; another method did better "
                f"({'higher' if higher_is_better else 'lower'} is better)")
    return check(f"best method at {bits} bits", answer.lower() if isinstance(answer, str) else answer, expected,
                 hint=hint, solution=solution)
