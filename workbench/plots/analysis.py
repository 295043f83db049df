"""Figures of the analysis tables: Pareto fronts, sensitivity heatmaps, roofline overlays, size breakdowns.

Every function returns a ``go.Figure`` (``go.FigureWidget(fig)`` for live updates); axes carry units and
say which direction is better.
"""
from __future__ import annotations

from workbench.plots.style import TEMPLATE

__all__ = ["frontier", "sensitivity_heatmap", "roofline", "size_breakdown"]

_AXES = {"size_bytes": ("size (MiB, lower is better)", 2**20), "latency_ms": ("latency (ms, lower is better)", 1),
         "peak_memory_bytes": ("peak memory (MiB, lower is better)", 2**20),
         "speedup": ("speedup over the reference (x, paired rounds, 95 % interval; higher is better)", 1)}


def _axis(df, column: str) -> tuple[str, float]:
    if column in _AXES:
        return _AXES[column]
    from workbench.analysis.sweep import higher_is_better

    try:
        better = "higher" if higher_is_better(df, column) else "lower"
        return f"{column} ({better} is better)", 1
    except ValueError:
        return column, 1


def frontier(df, x: str = "size_bytes", y: str | None = None, color: str = "techniques", title: str | None = None):
    """Every row of a sweep table as a point (coloured by ``color``), the Pareto front of ``y`` against ``x``
    as a line through its points, hover showing the row's label. ``x="speedup"``: each row's paired speedup over
    the reference with its interval (higher is better) - the speed axis of rows measured in separate rounds."""
    import plotly.graph_objects as go

    from workbench.analysis.sweep import pareto

    if not len(df):
        raise ValueError("frontier needs a non-empty table (e.g. from wb.sweep)")
    y = y or df.attrs.get("primary") or "primary_value"
    x_title, x_scale = _axis(df, x)
    y_title, _ = _axis(df, y)
    labels = df["label"] if "label" in df.columns else df.index.astype(str)
    groups = df[color] if color in df.columns else ["all"] * len(df)
    higher_x = x == "speedup"   # a ratio over the reference: higher is better, with its interval
    fig = go.Figure()
    for group in dict.fromkeys(groups):
        sel = [g == group for g in groups]
        part = df[sel]
        error = (dict(type="data", symmetric=False, array=list(part["speedup_high"] - part["speedup"]),
                      arrayminus=list(part["speedup"] - part["speedup_low"]), color="gray")
                 if higher_x and {"speedup_low", "speedup_high"} <= set(df.columns) else None)
        fig.add_trace(go.Scatter(
            x=part[x] / x_scale, y=part[y], mode="markers", name=str(group), text=labels[sel], error_x=error,
            marker=dict(size=10), hovertemplate="%{text}<br>%{x:.4g}<br>" + y + "=%{y:.4g}<extra></extra>"))
    on = pareto(df, x, y, x_lower_is_better=not higher_x)
    front = df[on].sort_values(x)
    fig.add_trace(go.Scatter(x=front[x] / x_scale, y=front[y], mode="lines", name="Pareto front",
                             line=dict(color="black", dash="dot"), hoverinfo="skip"))
    fig.update_layout(title=title or f"{y} vs {x_title.split(' (')[0]} ({int(on.sum())} of {len(df)} on the front)",
                      xaxis_title=x_title, yaxis_title=y_title, template=TEMPLATE, height=460)
    return fig


def sensitivity_heatmap(table, value: str = "loss", title: str | None = None):
    """Layers x candidates, coloured by ``value`` ("loss": quality lost by changing only that layer;
    "size_after" or "latency_after_ms" also work). Unsupported or failed cells are blank."""
    import plotly.graph_objects as go

    if not len(table):
        raise ValueError("sensitivity_heatmap needs a non-empty table from wb.sensitivity")
    ok = table[table["status"] == "ok"]
    grid = ok.pivot(index="layer", columns="candidate", values=value)
    grid = grid.reindex(index=list(dict.fromkeys(table["layer"])), columns=list(dict.fromkeys(table["candidate"])))
    metric = table.attrs.get("metric", "metric")
    names = {"loss": f"{metric} loss (lower is better)", "size_after": "bytes after (lower is better)",
             "latency_after_ms": "layer latency, ms (lower is better)"}
    # good is light: a loss of zero is white, a loss red, a gain (negative loss) green; sizes and latencies
    # are light when small
    colours = (dict(colorscale=[[0.0, "#1a9850"], [0.5, "#ffffff"], [1.0, "#d73027"]], zmid=0.0)
               if value == "loss" else dict(colorscale="Blues"))
    fig = go.Figure(go.Heatmap(
        z=grid.to_numpy(), x=list(grid.columns), y=list(grid.index), **colours,
        colorbar=dict(title=names.get(value, value)),
        hovertemplate="%{y}<br>%{x}<br>" + value + "=%{z:.4g}<extra></extra>"))
    # cells that did not run (unsupported, failed) are grey with a cross and their status in the hover - never
    # white, which reads as "no loss"
    bad = table[table["status"] != "ok"]
    if len(bad):
        status = bad.pivot_table(index="layer", columns="candidate", values="status", aggfunc="first")
        status = status.reindex(index=grid.index, columns=grid.columns)
        mask = status.notna().to_numpy()
        fig.add_trace(go.Heatmap(
            z=[[1.0 if m else None for m in row] for row in mask], x=list(grid.columns), y=list(grid.index),
            colorscale=[[0.0, "#bdbdbd"], [1.0, "#bdbdbd"]], showscale=False, name="did not run",
            text=status.astype(object).fillna("").to_numpy(), texttemplate="✕", textfont=dict(color="#555"),
            hovertemplate="%{y}<br>%{x}<br>did not run: %{text}<extra></extra>"))
    fig.update_layout(title=title or f"per-layer sensitivity: {names.get(value, value)}", template=TEMPLATE,
                      height=max(360, 16 * len(grid.index) + 160), yaxis=dict(autorange="reversed"),
                      xaxis_title="candidate", yaxis_title="layer")
    return fig


def roofline(df, baseline: str | None = None, title: str | None = None):
    """Measured speedup of each sweep row over the baseline row beside its byte-ratio ceiling.

    The ceiling is ``baseline bytes / row bytes``: the speedup a purely memory-bound forward pass would
    get from moving fewer bytes. A compute-bound pass (large batches on a CPU) sits far below it; a
    measured speedup above it means the row saved compute, not bytes (e.g. structured pruning)."""
    import plotly.graph_objects as go

    if not len(df) or "label" not in df.columns:
        raise ValueError("roofline needs a sweep table (with a 'label' column)")
    base_label = baseline or str(df["label"].iloc[0])
    if base_label not in set(df["label"]):
        raise ValueError(f"roofline: no row labelled {base_label!r}")
    base = df[df["label"] == base_label].iloc[0]
    rows = df[df["label"] != base_label]
    ceiling = base["size_bytes"] / rows["size_bytes"]
    # long labels (a plan in words) would stand rotated under the bars and squeeze the chart into a strip:
    # the bars are then "plan 1", "plan 2", ... in the table's order and the plan is in the hover
    full = [str(v) for v in rows["label"]]
    names = [f"plan {i + 1}" for i in range(len(full))] if max(map(len, full), default=0) > 20 else full
    hover = [f.replace("; ", "<br>") for f in full]
    if "speedup" in rows.columns and rows["speedup"].notna().all():
        # side-by-side speedups (wb.speedup) with their intervals; "~" marks a ratio inside the noise
        measured = rows["speedup"].astype(float)
        error = dict(type="data", symmetric=False, array=list(rows["speedup_high"].astype(float) - measured),
                     arrayminus=list(measured - rows["speedup_low"].astype(float)))
        text = [f"{v:.2f}x" if verdict and not str(verdict).startswith("no measurable") else f"~{v:.2f}x"
                for v, verdict in zip(measured, rows.get("speedup_verdict", [None] * len(rows)))]
        name = "measured speedup (95% interval)"
    else:
        measured = base["latency_ms"] / rows["latency_ms"]
        error, text = None, [f"{v:.2f}x" for v in measured]
        name = "latency ratio (measured separately)"
    fig = go.Figure([
        go.Bar(name=name, x=names, y=measured, text=text, textposition="auto", error_y=error, customdata=hover,
               hovertemplate="%{customdata}<br>%{y:.3g}x<extra>measured</extra>"),
        go.Bar(name="byte-ratio ceiling", x=names, y=ceiling, text=[f"{v:.2f}x" for v in ceiling],
               textposition="auto", marker_color="lightgray", customdata=hover,
               hovertemplate="%{customdata}<br>%{y:.3g}x<extra>byte-ratio ceiling</extra>"),
    ])
    fig.add_hline(y=1.0, line_dash="dot", annotation_text=base_label)
    if error is not None:   # one wide interval must not flatten every bar: the axis stops at twice the tallest
        tallest = max([*measured, *ceiling, 1.0])
        if max(m + e for m, e in zip(measured, error["array"])) > 2 * tallest:
            fig.update_yaxes(range=[0, 2 * tallest])
    threads = sorted(set(df["threads"])) if "threads" in df.columns else []
    device = str(base["device"]) if "device" in df.columns else ""
    fig.update_layout(barmode="group", template=TEMPLATE, height=420,
                      title=title or (f"speedup vs {base_label} and the byte-ratio ceiling "
                                      f"({device}, threads {threads})"),
                      yaxis_title="speedup over the baseline (x, higher is better)",
                      xaxis=dict(tickangle=0, automargin=True), yaxis=dict(automargin=True),
                      margin=dict(l=70, r=20, t=60, b=90),   # the legend under the bars, clear of the title
                      legend=dict(orientation="h", y=-0.12, x=0.5, xanchor="center", yanchor="top"))
    return fig


def size_breakdown(model, top: int | None = 40, title: str | None = None):
    """Bytes per layer, stacked by storage dtype (the ``top`` largest layers)."""
    import plotly.graph_objects as go
    from torch import nn

    if not isinstance(model, nn.Module):
        raise TypeError(f"size_breakdown needs a torch.nn.Module, got {type(model).__name__}")
    rows = []
    for name, module in model.named_modules():
        by_dtype: dict[str, int] = {}
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            key = str(t.dtype).removeprefix("torch.")
            by_dtype[key] = by_dtype.get(key, 0) + t.numel() * t.element_size()
        if by_dtype:
            rows.append((name or "<root>", by_dtype))
    rows.sort(key=lambda r: -sum(r[1].values()))
    rows = rows[:top] if top else rows
    dtypes = sorted({d for _, b in rows for d in b})
    names = [r[0] for r in rows]
    fig = go.Figure([go.Bar(name=d, y=names, x=[b.get(d, 0) / 2**20 for _, b in rows], orientation="h")
                     for d in dtypes])
    total = sum(sum(b.values()) for _, b in rows)
    fig.update_layout(barmode="stack", template=TEMPLATE, height=max(320, 18 * len(names) + 140),
                      title=title or f"bytes per layer by dtype ({total / 2**20:.2f} MiB shown)",
                      xaxis_title="MiB (lower is better)", yaxis=dict(autorange="reversed"))
    return fig



