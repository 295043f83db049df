"""Lesson 12 (post-training quantization algorithms): step-throughs, figures and exercise checks.

The notebook ``notebooks/12_ptq_algorithms.ipynb`` compares RTN, GPTQ, AWQ and SmoothQuant on real models.
It cannot define functions, so what it needs beyond the package's public API lives here:

- `layer_inputs`: the inputs a layer sees on calibration data, as one ``(tokens, K)`` matrix;
- `gptq_trace`: `workbench.quantization.gptq.gptq_quantize` itself, watched column by column through its
  ``observer`` hook, recording the layer-output error after every few columns and the weights as the error
  feedback moves them;
- `awq_grid`: the loss of AWQ's scale search at every alpha of its grid (as `awq.awq_search` computes it);
- `smoothing_view`: per-channel ranges of activations and weights before and after SmoothQuant;
- figures (plotly ``go.Figure``) for each, and checks for the exercises, which compute the expected value
  themselves so the notebook never shows the answer.

Every layer-output error here is relative: ``||X (W - W_hat)^T||^2 / ||X W^T||^2`` over calibration tokens X.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from workbench.plots.style import TEMPLATE
from workbench.quantization import formats  # the name the lesson's notebook (and a worked solution) uses
from workbench.quantization import formats as fm
from workbench.quantization.gptq import GPTQStep, gptq_quantize, hessian, inverse_hessian_factor
from workbench.quantization.smoothquant import activation_absmax, smoothing_factors
from workbench.teach import Feedback, as_number, check

__all__ = ["layer_inputs", "relative_output_error", "GPTQTrace", "gptq_trace", "gptq_error_figure",
           "gptq_update_figure", "awq_grid", "awq_scales_figure", "awq_loss_figure", "smoothing_view",
           "smoothing_figure", "layer_errors", "layer_errors_figure", "ptq_plans", "measure_plans", "GPTQBlock",
           "gptq_block", "gptq_block_reference", "results_figure", "method_table",
           "check_gptq_block", "check_awq_alpha", "check_smoothing", "check_best_method"]

_METHOD_COLOURS = {"fp32": "#5f6368", "rtn": "#d93025", "gptq": "#1a73e8", "awq": "#188038",
                   "w8a8": "#f29900", "w8a8+sq": "#9334e6"}


# --- data ------------------------------------------------------------------------------------------------

def layer_inputs(model: nn.Module, name: str, calibration, max_tokens: int = 4096) -> torch.Tensor:
    """The inputs of layer ``name`` over the calibration batches, as a float32 ``(tokens, K)`` matrix (the
    first ``max_tokens`` tokens; AWQ subsamples above 4096, so stay at or below that to match it exactly)."""
    layer = model.get_submodule(name)
    seen: list[torch.Tensor] = []
    handle = layer.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for batch in calibration:
                model(*batch)
    finally:
        handle.remove()
        model.train(was_training)
    if not seen:
        raise ValueError(f"layer {name!r} saw no inputs: is it used by the model's forward?")
    K = seen[0].shape[-1]
    return torch.cat([x.reshape(-1, K).float().cpu() for x in seen])[:max_tokens]    # (tokens, K)


def relative_output_error(X: torch.Tensor, W: torch.Tensor, W_hat: torch.Tensor) -> float:
    """``||X (W - W_hat)^T||^2 / ||X W^T||^2``: how much of the layer's output the change destroys."""
    X, W, W_hat = X.detach().double(), W.detach().double(), W_hat.detach().double()
    return float((X @ (W - W_hat).T).pow(2).sum() / (X @ W.T).pow(2).sum())


# --- GPTQ step-through -----------------------------------------------------------------------------------

@dataclass
class GPTQTrace:
    """What `gptq_trace` recorded. ``columns[i]`` columns were quantized at snapshot i."""

    columns: list[int]            # snapshots of the relative output error
    gptq_error: list[float]       # GPTQ: quantized columns + error-fed remaining columns
    rtn_error: list[float]        # RTN: quantized columns + untouched remaining columns
    frame_columns: list[int]      # snapshots of the weights (heatmap frames)
    updates: list[torch.Tensor]   # (rows, K) float32: current weights - original weights, per frame
    weight: torch.Tensor          # (N, K) float32: the final GPTQ weight (dequantized)
    rtn_weight: torch.Tensor      # (N, K) float32: round-to-nearest
    block_size: int
    group_size: int | None
    bits: int

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame({"columns quantized": self.columns, "rtn": self.rtn_error, "gptq": self.gptq_error})


def gptq_trace(weight: torch.Tensor, X: torch.Tensor, bits: int = 4, group_size: int | None = 64,
               damp: float = 0.01, block_size: int = 128, every: int = 16, frame_every: int | None = None,
               rows: int = 32) -> GPTQTrace:
    """Run `gptq_quantize` (``act_order=False``) on ``weight`` ``(N, K)`` with calibration inputs ``X``
    ``(tokens, K)``, recording the relative layer-output error every
    ``every`` columns (for RTN too) and, every ``frame_every`` columns (default: one group), the first
    ``rows`` rows of ``current - original`` weights.

    The recorded "current" weights of GPTQ are the quantized columns so far plus the remaining columns as
    the error feedback has moved them, including the feedback that the package applies lazily per block."""
    fmt = fm.IntFormat(bits, group_size, True)
    W_orig = weight.detach().to("cpu", torch.float64)                             # (N, K)
    N, K = W_orig.shape
    g = K if group_size is None else group_size
    if K % g:
        raise ValueError(f"group_size {g} does not divide the input dimension {K}")
    frame_every = g if frame_every is None else frame_every
    H_err = hessian([(X,)], K, dtype=torch.float64)   # undamped: the true objective
    rtn = fm.decode(fm.encode(weight.detach().float().cpu(), fmt), fmt, K).double()  # (N, K)
    E = W_orig - rtn
    G = E.T @ E                                                                    # (K, K): RTN error Gram
    denom = float((W_orig @ H_err * W_orig).sum())

    columns, gptq_err, rtn_err = [0], [0.0], [0.0]
    frame_cols, updates = [0], [torch.zeros(min(rows, N), K)]
    Q = torch.empty_like(W_orig)                                                   # dequantized columns

    def observe(step: GPTQStep) -> None:
        Q[:, step.column] = step.q
        done = step.column + 1
        if done % every and done % frame_every and done != K:
            return
        i = step.column - step.i1
        rest = step.W[:, step.i2:] - step.Err1[:, :i + 1] @ step.Hinv[step.i1:step.i1 + i + 1, step.i2:]
        current = torch.cat([Q[:, :done], step.W1[:, i + 1:], rest], dim=1)       # the lazy feedback applied
        if done % every == 0 or done == K:
            D = W_orig - current
            columns.append(done)
            gptq_err.append(float((D @ H_err * D).sum()) / denom)
            rtn_err.append(float((G[:done, :done] * H_err[:done, :done]).sum()) / denom)
        if done % frame_every == 0 or done == K:
            frame_cols.append(done)
            updates.append((current - W_orig)[:rows].float())

    gptq_quantize(weight, [(X,)], fmt, damp=damp, block_size=block_size, observer=observe)
    block = block_size if group_size is None else max(1, block_size // g) * g
    return GPTQTrace(columns, gptq_err, rtn_err, frame_cols, updates, Q.float(), rtn.float(), block,
                     group_size, bits)


def gptq_error_figure(trace: GPTQTrace, title: str | None = None):
    """Relative layer-output error as columns get quantized: RTN vs GPTQ (block boundaries dotted)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for key, label in (("rtn", "RTN: remaining columns untouched"), ("gptq", "GPTQ: error fed forward")):
        fig.add_trace(go.Scatter(x=trace.columns, y=getattr(trace, f"{key}_error"), mode="lines+markers",
                                 name=label, line=dict(color=_METHOD_COLOURS[key]), marker=dict(size=5)))
    K = trace.columns[-1]
    for b in range(trace.block_size, K, trace.block_size):
        fig.add_vline(x=b, line=dict(color="#9aa0a6", dash="dot", width=1))
    fig.update_layout(
        title=title or f"Layer-output error while quantizing column by column (int{trace.bits}, "
                       f"{'per channel' if trace.group_size is None else f'g{trace.group_size}'})",
        xaxis_title="columns (input channels) quantized so far",
        yaxis_title="relative output error ‖X(W−Ŵ)ᵀ‖² / ‖XWᵀ‖² (lower is better)",
        template=TEMPLATE, height=420, legend=dict(x=0.01, y=0.99))
    return fig


def gptq_update_figure(trace: GPTQTrace, title: str | None = None):
    """Heatmap (with a slider over the steps) of how far each weight has moved from its original value:
    left of the dashed line the columns are quantized (rounding + feedback), right of it they are not yet
    quantized and show only the error feedback they received."""
    import plotly.graph_objects as go

    final = trace.updates[-1].abs().flatten()
    zmax = float(final.quantile(0.99)) or 1e-8
    rows, K = trace.updates[-1].shape

    def boundary(c):
        return [dict(type="line", x0=c - 0.5, x1=c - 0.5, y0=-0.5, y1=rows - 0.5,
                     line=dict(color="black", dash="dash", width=2))]

    # one slider step per snapshot; each step swaps the heatmap's values and the boundary line (no animation
    # frames: the figure opens on the final state and never auto-plays)
    fig = go.Figure(go.Heatmap(z=trace.updates[-1].numpy().round(5), colorscale="RdBu", zmid=0, zmin=-zmax,
                               zmax=zmax, colorbar=dict(title="Δw"),
                               hovertemplate="row %{y}, column %{x}: Δw=%{z:.3g}<extra></extra>"))
    steps = [dict(method="update", label=str(c), args=[{"z": [u.numpy().round(5)]}, {"shapes": boundary(c)}])
             for c, u in zip(trace.frame_columns, trace.updates, strict=True)]
    fig.update_layout(
        title=title or f"GPTQ weight updates, first {rows} output rows (drag the slider: columns quantized)",
        xaxis_title="input column (left of the dashed line: quantized)", yaxis_title="output row",
        template=TEMPLATE, height=460, shapes=boundary(trace.frame_columns[-1]),
        sliders=[dict(active=len(steps) - 1, steps=steps, currentvalue=dict(prefix="columns quantized: "),
                      pad=dict(t=50))])
    fig.update_yaxes(autorange="reversed")
    return fig


# --- AWQ ---------------------------------------------------------------------------------------------------

def awq_grid(weight: torch.Tensor, X: torch.Tensor, bits: int = 4, group_size: int | None = 64, grid: int = 20):
    """AWQ's search, every point of it: for alpha = 0, 1/grid, ..., 1 the scales
    ``s = mean|x|^alpha`` (normalised to a geometric-mean-like 1) and the output error of RTN on ``W diag(s)``,
    computed as `awq.awq_search` computes it (same formulas; ``X`` with at most 4096 tokens, as AWQ keeps).

    Returns ``(table, x_mean, s)``: a DataFrame with columns alpha / error / relative_error, the
    per-input-channel mean |x| ``(K,)`` and the scales at the best alpha ``(K,)``."""
    import pandas as pd

    if X.shape[0] > 4096:
        raise ValueError(f"awq_grid: X has {X.shape[0]} tokens; AWQ subsamples above 4096, pass at most 4096")
    fmt = fm.IntFormat(bits, group_size, True)
    W = weight.detach().float().cpu()                                              # (N, K)
    K = W.shape[1]
    X = X.float()
    x_mean = X.abs().mean(dim=0)                                                   # (K,)
    ref = X @ W.T                                                                  # (tokens, N)
    ref_power = float(ref.pow(2).mean())
    rows, best = [], (float("inf"), None)
    for i in range(grid + 1):
        alpha = i / grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        Wq = fm.decode(fm.encode(W * s, fmt), fmt, K) / s
        err = float((X @ Wq.T - ref).pow(2).mean())
        rows.append({"alpha": alpha, "error": err, "relative_error": err / ref_power})
        if err < best[0]:
            best = (err, s)
    return pd.DataFrame(rows), x_mean, best[1]


def awq_scales_figure(x_mean: torch.Tensor, s: torch.Tensor, alpha: float, title: str | None = None):
    """Two panels over the input channels: mean |x_j| (the activation magnitude AWQ looks at) and the
    chosen scales s_j = mean|x_j|^alpha (normalised)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    ch = list(range(len(x_mean)))
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("mean |x_j| over calibration tokens", f"AWQ scale s_j (alpha = {alpha:.2f})"))
    fig.add_trace(go.Bar(x=ch, y=x_mean.tolist(), marker_color="#5f6368", name="mean |x_j|"), row=1, col=1)
    fig.add_trace(go.Bar(x=ch, y=s.tolist(), marker_color=_METHOD_COLOURS["awq"], name="s_j"), row=2, col=1)
    fig.update_yaxes(title_text="mean |x_j|", row=1, col=1)
    fig.update_yaxes(title_text="s_j (multiplies column j of W)", row=2, col=1)
    fig.update_xaxes(title_text="input channel j", row=2, col=1)
    fig.update_layout(title=title or "AWQ: channels that see large activations get larger scales",
                      template=TEMPLATE, height=520, showlegend=False, bargap=0)
    return fig


def awq_loss_figure(table, title: str | None = None):
    """Output error of AWQ's candidate scales over the alpha grid; alpha = 0 is plain RTN."""
    import plotly.graph_objects as go

    best = table.loc[table["relative_error"].idxmin()]
    fig = go.Figure(go.Scatter(x=table["alpha"], y=table["relative_error"], mode="lines+markers",
                               name="output error", line=dict(color=_METHOD_COLOURS["awq"])))
    fig.add_trace(go.Scatter(x=[0.0], y=[table["relative_error"].iloc[0]], mode="markers+text", text=["RTN"],
                             textposition="top right", marker=dict(size=12, color=_METHOD_COLOURS["rtn"]),
                             name="alpha = 0 (RTN)"))
    fig.add_trace(go.Scatter(x=[best["alpha"]], y=[best["relative_error"]], mode="markers+text",
                             text=[f"best α={best['alpha']:.2f}"], textposition="bottom center",
                             marker=dict(size=14, symbol="star", color="black"), name="chosen"))
    fig.update_layout(title=title or "AWQ grid search over alpha",
                      xaxis_title="alpha (s = mean|x|^alpha)",
                      yaxis_title="relative output error (lower is better)", template=TEMPLATE, height=400)
    return fig


# --- SmoothQuant -------------------------------------------------------------------------------------------

def smoothing_view(X: torch.Tensor, weight: torch.Tensor, alpha: float = 0.5):
    """Per input channel: max |x_j| and max |W_:,j| before and after SmoothQuant's migration with ``alpha``
    (factors from `smoothquant.smoothing_factors`), as a DataFrame (one row per channel)."""
    import pandas as pd

    K = weight.shape[1]
    act = activation_absmax([(X,)], K)                                             # (K,)
    s = smoothing_factors(act, weight, alpha)                                      # (K,)
    w_max = weight.detach().float().abs().amax(dim=0).cpu()                        # (K,)
    return pd.DataFrame({"channel": range(K), "act_before": act.numpy(), "act_after": (act / s).numpy(),
                         "weight_before": w_max.numpy(), "weight_after": (w_max * s).numpy(),
                         "s": s.numpy()})


def smoothing_figure(view, alpha: float = 0.5, title: str | None = None):
    """Max |activation| and max |weight| per input channel, before and after smoothing (log scale):
    the activation outliers shrink, the weights take a bit of their range."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("activations: max |x_j|", "weights: max |W_:,j|"),
                        horizontal_spacing=0.1)
    for col, kind in ((1, "act"), (2, "weight")):
        for when, colour in (("before", "#9aa0a6"), ("after", _METHOD_COLOURS["w8a8+sq"])):
            fig.add_trace(go.Scatter(x=view["channel"], y=view[f"{kind}_{when}"], mode="markers",
                                     marker=dict(size=4, color=colour), name=f"{when} smoothing",
                                     legendgroup=when, showlegend=col == 1), row=1, col=col)
        fig.update_yaxes(type="log", dtick=1, title_text="max |value| (log)", row=1, col=col)
        fig.update_xaxes(title_text="input channel j", row=1, col=col)
    r = {c: float(view[c].max() / view[c].median()) for c in ("act_before", "act_after", "weight_before",
                                                              "weight_after")}
    fig.update_layout(title=title or (f"SmoothQuant α={alpha}: max/median over channels, activations "
                                      f"{r['act_before']:.0f}× → {r['act_after']:.0f}×, weights "
                                      f"{r['weight_before']:.1f}× → {r['weight_after']:.1f}×"),
                      template=TEMPLATE, height=420)
    return fig


# --- one layer, every method: calibration vs held-out error ------------------------------------------------

def layer_errors(linear: nn.Linear, X: torch.Tensor, X_held: torch.Tensor, bits: int = 3,
                 group_size: int | None = 64, smooth_alpha: float = 0.5):
    """Relative output error of one Linear under each method, on its calibration inputs ``X`` and on held-out
    inputs ``X_held`` (both ``(tokens, K)``), using the package's own algorithms: weight-only RTN / GPTQ / AWQ
    (int``bits``) and W8A8 (dynamic, per-token activations) with and without SmoothQuant. A DataFrame with
    columns method / calibration / held_out; ``attrs["awq_alpha"]`` / ``attrs["awq_scales"]``: what
    `awq.awq_search` chose."""
    import pandas as pd

    from workbench.quantization.awq import awq_search
    from workbench.quantization.gptq import gptq_quantize
    from workbench.quantization.modules import W8A8Linear

    W = linear.weight.detach().float()
    K = W.shape[1]
    fmt = fm.IntFormat(bits, group_size, True)
    tensors, s, alpha = awq_search(W, [(X,)], fmt)
    weights = {f"W{bits} rtn": fm.decode(fm.encode(W, fmt), fmt, K),
               f"W{bits} gptq": fm.decode(gptq_quantize(W, [(X,)], fmt), fmt, K),
               f"W{bits} awq": fm.decode(tensors, fmt, K) / s}
    rows = [{"method": m, "calibration": relative_output_error(X, W, w),
             "held_out": relative_output_error(X_held, W, w)} for m, w in weights.items()]
    smooth = smoothing_factors(activation_absmax([(X,)], K), W, smooth_alpha)
    with torch.inference_mode():
        for label, factors in (("W8A8", None), (f"W8A8 + SmoothQuant {smooth_alpha}", smooth)):
            q = W8A8Linear.from_float(linear, label, smooth=factors)
            errs = {}
            for split, inp in (("calibration", X), ("held_out", X_held)):
                signal = inp.double() @ W.double().T                              # (tokens, N): x W^T
                noise = q(inp).double() - linear(inp).double()                    # the bias cancels
                errs[split] = float(noise.pow(2).sum() / signal.pow(2).sum())
            rows.append({"method": label, **errs})
    out = pd.DataFrame(rows)
    out.attrs.update(awq_alpha=alpha, awq_scales=s)
    return out


def layer_errors_figure(errors, title: str | None = None):
    """Grouped bars: each method's relative output error on calibration vs held-out tokens (log scale)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for split, colour, name in (("calibration", "#9aa0a6", "calibration tokens (what the method saw)"),
                                ("held_out", "#1a73e8", "held-out tokens")):
        fig.add_trace(go.Bar(x=errors["method"], y=errors[split], name=name, marker_color=colour,
                             text=[f"{v:.2g}" for v in errors[split]], textposition="outside"))
    fig.update_layout(title=title or "One layer, every method: error where it was calibrated and where it was not",
                      barmode="group", xaxis_title="method",
                      yaxis=dict(type="log", dtick=1, title="relative output error (log, lower is better)"),
                      template=TEMPLATE, height=450, legend=dict(orientation="h", x=0, y=1.12))
    return fig


def ptq_plans(pattern: str, bits_list=(4, 3), group_size: int | None = 64, smooth_alpha: float = 0.5) -> dict:
    """The plans the lesson compares on ``pattern``: weight-only RTN / GPTQ / AWQ at each of ``bits_list``,
    then W8A8 dynamic without and with SmoothQuant. Labels: ``"W4 rtn"``, ..., ``"W8A8"``,
    ``"W8A8 + SmoothQuant"``."""
    from workbench.plans import Plan
    from workbench.quantization.configs import Dynamic, WeightOnly

    plans = {f"W{b} {m}": Plan({pattern: WeightOnly(b, group_size, method=m)})
             for b in bits_list for m in ("rtn", "gptq", "awq")}
    plans["W8A8"] = Plan({pattern: Dynamic()})
    plans["W8A8 + SmoothQuant"] = Plan({pattern: Dynamic(smooth_alpha=smooth_alpha)})
    return plans


# --- whole-model results -----------------------------------------------------------------------------------

def measure_plans(model: nn.Module, task, plans: dict, calibration, quick: bool = True):
    """Apply each plan (with ``calibration`` batches where a plan needs them) and measure its quality on the
    task's evaluation data (``quick``: the task's fixed subset) and its real bytes. Cheaper than `wb.sweep`
    (no latency or memory runs), which is what a 90-second lesson can afford.

    A DataFrame with one row per plan, the unchanged model first as ``"fp32"``: label, the task's primary
    metric, size_bytes, size_ratio, apply_seconds; ``attrs`` name the primary metric and its direction."""
    import time

    import pandas as pd

    from workbench.measurement import size_bytes
    from workbench.plans import apply

    metric = task.primary.name
    base_bytes = size_bytes(model)
    rows = [{"label": "fp32", metric: task.evaluate(model, quick=quick)[metric], "size_bytes": base_bytes,
             "size_ratio": 1.0, "apply_seconds": 0.0}]
    for label, plan in plans.items():
        t0 = time.perf_counter()
        compressed = apply(model, plan, calibration=calibration, progress=False)
        took = time.perf_counter() - t0
        nbytes = size_bytes(compressed)
        rows.append({"label": label, metric: task.evaluate(compressed, quick=quick)[metric], "size_bytes": nbytes,
                     "size_ratio": nbytes / base_bytes, "apply_seconds": took})
    df = pd.DataFrame(rows)
    df.attrs.update(primary=metric, higher_is_better={metric: task.primary.higher_is_better}, task=task.name)
    return df


def method_table(df, metric: str):
    """A sweep table (labels like ``"W4 gptq"``) pivoted to method × bits for weight-only rows."""
    import pandas as pd

    rows = df[df["label"].str.match(r"^W\d ")]
    bits = rows["label"].str.extract(r"^W(\d) (\w+)$")
    table = pd.DataFrame({"bits": bits[0].astype(int), "method": bits[1], metric: rows[metric].to_numpy()})
    return table.pivot(index="method", columns="bits", values=metric).loc[
        [m for m in ("rtn", "gptq", "awq") if m in set(table["method"])]]


def results_figure(tables: dict, title: str | None = None):
    """Quality lost against fp32 for every plan of each model (log scale, lower is better).

    ``tables``: model name -> a `measure_plans` table (or a `wb.sweep` one: its baseline row is
    ``"reference"``)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    names = list(tables)
    fig = make_subplots(rows=1, cols=len(names), horizontal_spacing=0.12,
                        subplot_titles=[f"{n}: {tables[n].attrs['primary']}" for n in names])
    for col, name in enumerate(names, start=1):
        df = tables[name]
        metric = df.attrs["primary"]
        higher = df.attrs["higher_is_better"][metric]
        baseline = df["label"].isin(("fp32", "reference"))
        base = float(df.loc[baseline, metric].iloc[0])
        rows = df[~baseline]
        lost = [(base - v) if higher else (v - base) for v in rows[metric]]
        colours = [_METHOD_COLOURS.get(_method_of(lbl), "#5f6368") for lbl in rows["label"]]
        fig.add_trace(go.Bar(x=list(rows["label"]), y=[max(v, 1e-6) for v in lost], marker_color=colours,
                             text=[f"{v:.2g}" for v in lost], textposition="outside", showlegend=False,
                             hovertemplate="%{x}: " + metric + " lost %{y:.3g}<extra></extra>"), row=1, col=col)
        fig.update_yaxes(type="log", dtick=1, title_text=f"{metric} {'lost' if higher else 'gained'} vs fp32 "
                                                f"(log, lower is better)", row=1, col=col)
    fig.update_layout(title=title or "What each PTQ method costs (colour: method)", template=TEMPLATE,
                      height=460)
    return fig


def _method_of(label: str) -> str:
    if label.startswith("W8A8"):
        return "w8a8+sq" if "SmoothQuant" in label else "w8a8"
    return label.split()[-1]


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
