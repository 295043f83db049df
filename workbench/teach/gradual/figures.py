"""Lab 21 (pruning beyond one shot): the gradual schedule, Wanda and SparseGPT on tiny-llama, and 2:4 hardware.

The notebook ``notebooks/21_pruning_beyond.ipynb`` compares Zhu & Gupta's gradual pruning with one-shot pruning
at the same final sparsity and fine-tuning budget, then calibrated one-shot LLM pruning (`workbench.pruning.oneshot`)
against magnitude at 50 % and 2:4, and measures what 2:4 storage costs and buys on this CPU. Here:

- `schedule_figure`: the cubic schedule (`workbench.pruning.polynomial_sparsity`) against a linear one;
- `gradual_vs_oneshot` / `gradual_figure`: `workbench.pruning.gradual_prune` against prune-once-then-fine-tune;
- `llm_pruning`, `layer_errors`: the package's plans on tiny-llama (perplexity) and on one layer (output error);
- `obs_example`: a corner of a real layer for SparseGPT's update; `time_24`: dense vs 2:4 storage, timed side by
  side on this CPU;
- the exercise checks with their worked solutions (``_solution_*``).
"""
from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from workbench.plots.style import TEMPLATE
from workbench.pruning import masks
from workbench.pruning.modules import SemiStructuredLinear
from workbench.pruning.oneshot import input_norms, sparsegpt_prune, wanda_mask
from workbench.pruning.schedules import polynomial_sparsity
from workbench.quantization.gptq import hessian, inverse_hessian_factor
from workbench.teach import Feedback, check

__all__ = ["schedule_figure", "gradual_vs_oneshot", "gradual_figure", "llm_pruning", "llm_figure", "layer_errors",
           "OBSExample", "obs_example", "time_24", "bytes_24",
           "check_schedule", "check_magnitude_mask", "check_wanda_scores", "check_wanda_mask", "check_nm_mask",
           "check_obs_update", "check_obs_saliency", "check_24_bytes", "check_24_ceiling", "check_best_pruner"]

_COLOURS = {"magnitude": "#d93025", "wanda": "#188038", "sparsegpt": "#1a73e8"}


# --- the gradual schedule ---------------------------------------------------------------------------------

def schedule_figure(final: float, steps: int, title: str | None = None):
    """Sparsity after each pruning step: cubic (Zhu & Gupta), linear, and one shot."""
    import plotly.graph_objects as go

    t = list(range(0, steps + 1))
    cubic = [0.0] + [polynomial_sparsity(s, final, steps) for s in t[1:]]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=t, y=cubic, mode="lines+markers", name="cubic (Zhu & Gupta)",
                             line=dict(color="#1a73e8", shape="hv")))
    fig.add_trace(go.Scatter(x=t, y=[final * s / steps for s in t], mode="lines+markers", name="linear",
                             line=dict(color="#9aa0a6", dash="dot", shape="hv")))
    fig.add_trace(go.Scatter(x=t, y=[0.0] + [final] * steps, mode="lines", name="one shot",
                             line=dict(color="#d93025", dash="dash", shape="hv")))
    fig.update_layout(title=title or f"Pruning schedules to {final:.0%}", xaxis_title="pruning step",
                      yaxis_title="sparsity", template=TEMPLATE, height=360)
    return fig


def gradual_vs_oneshot(model: nn.Module, task, patterns, finals, steps: int = 5, epochs_per_step: int = 2,
                       lr: float = 1e-3):
    """For each final sparsity: one shot (prune to it, then fine-tune ``steps * epochs_per_step`` epochs) and
    gradual (`gradual_prune`: ``steps`` cubic steps, ``epochs_per_step`` epochs after each) - the same fine-tuning
    budget. Returns (summary DataFrame, {final: gradual history DataFrame})."""
    import pandas as pd

    from workbench.plans import apply
    from workbench.pruning import Magnitude, gradual_prune
    from workbench.training import fit_classifier

    metric = task.primary.name
    pats = [patterns] if isinstance(patterns, str) else list(patterns)
    rows, histories = [], {}
    for final in finals:
        once = apply(model, {p: Magnitude(final) for p in pats}, progress=False)
        pruned = task.evaluate(once)[metric]
        fit_classifier(once, task, epochs=steps * epochs_per_step, lr=lr, progress=False)
        gradual, history = gradual_prune(model, task, pats, final, steps=steps, epochs_per_step=epochs_per_step,
                                         lr=lr, progress=False)
        histories[final] = history
        rows.append({"final sparsity": final, "one shot, before fine-tune": pruned,
                     "one shot + fine-tune": task.evaluate(once)[metric],
                     "gradual": task.evaluate(gradual)[metric], "fine-tune epochs (each)": steps * epochs_per_step})
    return pd.DataFrame(rows), histories


def gradual_figure(histories: dict, dense: float, metric: str = "accuracy", title: str | None = None):
    """Accuracy along each gradual run: after every prune (drop) and after its fine-tune (recovery)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for final, h in histories.items():
        xs, ys = [0.0], [dense]
        for _, r in h.iterrows():
            xs += [r["sparsity"], r["sparsity"]]
            ys += [r[f"{metric}_after_prune"], r[f"{metric}_after_finetune"]]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=f"gradual to {final:.0%}"))
    fig.update_layout(title=title or "Gradual pruning: each step drops accuracy, each fine-tune recovers it",
                      xaxis_title="sparsity", yaxis_title=metric, template=TEMPLATE, height=380)
    return fig


# --- LLM one-shot pruning ----------------------------------------------------------------------------------

def _configs(sparsity: float) -> dict:
    from workbench.pruning import NM, Magnitude, SparseGPT, Wanda

    return {("magnitude", f"{sparsity:.0%}"): Magnitude(sparsity), ("wanda", f"{sparsity:.0%}"): Wanda(sparsity),
            ("sparsegpt", f"{sparsity:.0%}"): SparseGPT(sparsity), ("magnitude", "2:4"): NM(2, 4),
            ("wanda", "2:4"): Wanda(nm=(2, 4)), ("sparsegpt", "2:4"): SparseGPT(nm=(2, 4))}


def llm_pruning(model: nn.Module, task, pattern: str, calibration, sparsity: float = 0.5):
    """Perplexity of ``model`` with the layers matching ``pattern`` pruned by magnitude, Wanda and SparseGPT, at
    ``sparsity`` (unstructured) and 2:4. A table method x pattern; ``attrs['dense']`` the unpruned perplexity,
    ``attrs['seconds']`` the time each plan took to apply."""
    import pandas as pd

    from workbench.plans import apply

    dense = task.evaluate(model, quick=True)["perplexity"]
    rows, seconds = [], {}
    for (method, kind), config in _configs(sparsity).items():
        t0 = time.perf_counter()
        pruned = apply(model, {pattern: config}, calibration=calibration, progress=False)
        seconds[f"{method} {kind}"] = time.perf_counter() - t0
        rows.append({"method": method, "pattern": kind, "perplexity": task.evaluate(pruned, quick=True)["perplexity"]})
    table = pd.DataFrame(rows).pivot(index="method", columns="pattern", values="perplexity")
    table = table.loc[["magnitude", "wanda", "sparsegpt"], [f"{sparsity:.0%}", "2:4"]]
    table.attrs.update(dense=dense, seconds=seconds)
    return table


def llm_figure(table, title: str | None = None):
    import plotly.graph_objects as go

    fig = go.Figure()
    for method in table.index:
        fig.add_trace(go.Bar(x=list(table.columns), y=table.loc[method].tolist(), name=method,
                             marker_color=_COLOURS[method]))
    fig.add_hline(y=table.attrs["dense"], line=dict(dash="dash", color="#5f6368"),
                  annotation_text=f"dense {table.attrs['dense']:.1f}")
    lo = min(table.attrs["dense"], float(table.min().min()))
    fig.update_layout(title=title or "tiny-llama perplexity after one-shot pruning (lower is better)",
                      yaxis_title="perplexity", yaxis_range=[lo * 0.97, float(table.max().max()) * 1.02],
                      barmode="group", template=TEMPLATE, height=400)
    return fig


def layer_errors(weight: torch.Tensor, X: torch.Tensor, X_held: torch.Tensor, sparsity: float = 0.5):
    """Relative output error ``||X (W - W_hat)^T||^2 / ||X W^T||^2`` of one layer, on the calibration tokens ``X``
    and on held-out tokens, for magnitude / Wanda / SparseGPT at ``sparsity`` and 2:4 (the package's functions)."""
    import pandas as pd

    W = weight.detach().float()

    def err(Xe, W_hat):
        Xe, Wd, Wh = Xe.double(), W.double(), W_hat.double()
        return float((Xe @ (Wd - Wh).T).pow(2).sum() / (Xe @ Wd.T).pow(2).sum())

    variants = {}
    for kind, nm in ((f"{sparsity:.0%}", None), ("2:4", (2, 4))):
        mag = masks.nm_mask(W, 2, 4) if nm else masks.magnitude_mask(W, sparsity)
        variants[("magnitude", kind)] = W * mag
        variants[("wanda", kind)] = W * wanda_mask(W, [(X,)], sparsity, nm=nm)
        variants[("sparsegpt", kind)] = sparsegpt_prune(W, [(X,)], sparsity, nm=nm)[0]
    rows = [{"method": m, "pattern": k, "calibration tokens": err(X, v), "held-out tokens": err(X_held, v)}
            for (m, k), v in variants.items()]
    return pd.DataFrame(rows)


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


# --- 2:4 on this CPU ----------------------------------------------------------------------------------------

def bytes_24(out_features: int, in_features: int, dtype=torch.float16) -> int:
    """Bytes of a 2:4 weight as `SemiStructuredLinear` stores it: the kept values and their 2-bit positions."""
    layer = SemiStructuredLinear(in_features, out_features, bias=False, dtype=dtype)
    return sum(b.numel() * b.element_size() for b in layer.buffers())


def time_24(out_features: int = 4096, in_features: int = 4096, batches=(1, 64), rounds: int = 7,
            threads: int | None = None):
    """Median ms of ``x @ W^T`` (fp32) with a dense W, the same W with a 2:4 mask (zeros stored densely) and
    `SemiStructuredLinear` (its CPU path), interleaved round by round; the spread is the interquartile range."""
    import pandas as pd

    from workbench.measurement.latency import num_threads

    torch.manual_seed(0)
    dense = nn.Linear(in_features, out_features, bias=False)
    mask = masks.nm_mask(dense.weight.detach(), 2, 4)
    zeros = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        zeros.weight.copy_(dense.weight * mask)
    semi = SemiStructuredLinear.from_dense(zeros.weight.detach(), mask, None)
    layers = {"dense": dense, "2:4 mask, dense storage": zeros, "2:4 storage (SemiStructuredLinear)": semi}
    rows = []
    with num_threads(threads), torch.inference_mode():
        for M in batches:
            x = torch.randn(M, in_features)
            times: dict[str, list[float]] = {k: [] for k in layers}
            for r in range(rounds + 1):                                          # round 0: warm-up
                for name, layer in layers.items():
                    t0 = time.perf_counter()
                    layer(x)
                    if r:
                        times[name].append((time.perf_counter() - t0) * 1e3)
            base = statistics.median(times["dense"])
            for name, ts in times.items():
                q = statistics.quantiles(ts, n=4)
                rows.append({"batch": M, "layer": name, "median ms": statistics.median(ts), "IQR ms": q[2] - q[0],
                             "speedup vs dense": base / statistics.median(ts)})
    return pd.DataFrame(rows)


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
