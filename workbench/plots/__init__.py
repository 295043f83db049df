"""Plotly figures of measured results. Each function returns a ``go.Figure`` (wrap it in
``go.FigureWidget`` for live updates); axes carry units and say when lower is better."""
from __future__ import annotations

from typing import Sequence

__all__ = ["tradeoff", "comparison_bars", "frontier", "sensitivity_heatmap", "roofline", "size_breakdown"]


def _labels(metrics, labels):
    return list(labels) if labels is not None else [f"{i}: {m.model}" for i, m in enumerate(metrics)]


def tradeoff(metrics: Sequence, labels: Sequence[str] | None = None, x: str = "size_bytes",
             metric: str | None = None, title: str | None = None):
    """Quality (the primary metric unless ``metric``) against ``x`` (``size_bytes`` or ``latency_ms``)."""
    import plotly.graph_objects as go

    if not metrics:
        raise ValueError("tradeoff needs at least one Metrics")
    name = metric or metrics[0].primary
    better = "higher" if metrics[0].higher_is_better[name] else "lower"
    xs = [getattr(m, x) / (2**20 if x == "size_bytes" else 1) for m in metrics]
    x_title = {"size_bytes": "size (MiB, lower is better)", "latency_ms": "latency (ms, lower is better)",
               "peak_memory_bytes": "peak memory (B, lower is better)"}.get(x, x)
    fig = go.Figure(go.Scatter(
        x=xs, y=[m.quality[name] for m in metrics], mode="markers+text", text=_labels(metrics, labels),
        textposition="top center", marker=dict(size=12),
        hovertemplate="%{text}<br>%{x:.4g}<br>" + name + "=%{y:.4g}<extra></extra>"))
    fig.update_layout(title=title or f"{name} vs {x_title.split(' (')[0]}", xaxis_title=x_title,
                      yaxis_title=f"{name} ({better} is better)", template="plotly_white", height=420)
    return fig


def comparison_bars(metrics: Sequence, labels: Sequence[str] | None = None):
    """Side-by-side bars of quality, latency, size and peak memory, each relative to the first model."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    if not metrics:
        raise ValueError("comparison_bars needs at least one Metrics")
    names = _labels(metrics, labels)
    base = metrics[0]
    panels = [
        (f"{base.primary} ({'higher' if base.higher_is_better[base.primary] else 'lower'} is better)",
         [m.primary_value for m in metrics], "{:.4g}"),
        ("latency, ms (lower is better)", [m.latency_ms for m in metrics], "{:.3g}"),
        ("size, MiB (lower is better)", [m.size_bytes / 2**20 for m in metrics], "{:.3f}"),
        ("peak memory, MiB (lower is better)", [m.peak_memory_bytes / 2**20 for m in metrics], "{:.3f}"),
    ]
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[p[0] for p in panels])
    for col, (_, values, fmt) in enumerate(panels, start=1):
        fig.add_trace(go.Bar(x=names, y=values, text=[fmt.format(v) for v in values], textposition="auto",
                             showlegend=False), row=1, col=col)
    fig.update_layout(template="plotly_white", height=380, margin=dict(t=60))
    return fig


from workbench.plots.analysis import frontier, roofline, sensitivity_heatmap, size_breakdown  # noqa: E402
