"""Lesson 12's computations and figures: layer inputs, GPTQ / AWQ / SmoothQuant step-throughs, measured plans."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workbench.plots.style import TEMPLATE
from workbench.quantization import formats as fm
from workbench.quantization.gptq import GPTQStep, gptq_quantize, hessian
from workbench.quantization.smoothquant import activation_absmax, smoothing_factors

__all__ = ["layer_inputs", "relative_output_error", "GPTQTrace", "gptq_trace", "gptq_error_figure",
           "gptq_update_figure", "awq_grid", "awq_scales_figure", "awq_loss_figure", "smoothing_view",
           "smoothing_figure", "layer_errors", "layer_errors_figure", "ptq_plans", "measure_plans", "results_figure",
           "method_table"]


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
