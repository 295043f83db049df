"""Lab 21's computations and figures: the gradual schedule, LLM one-shot pruning, 2:4 bytes and timing."""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from workbench.plots.style import TEMPLATE
from workbench.pruning import masks
from workbench.pruning.modules import SemiStructuredLinear
from workbench.pruning.oneshot import sparsegpt_prune, wanda_mask
from workbench.pruning.schedules import polynomial_sparsity

__all__ = ["schedule_figure", "gradual_vs_oneshot", "gradual_figure", "llm_pruning", "llm_figure", "layer_errors",
           "time_24", "bytes_24"]


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
