"""Plotly figures of measured results. Each function returns a ``go.Figure`` (wrap it in
``go.FigureWidget`` for live updates); axes carry units and say when lower is better."""
from __future__ import annotations

import math
from typing import Sequence

from workbench.plots.style import TEMPLATE

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
                      yaxis_title=f"{name} ({better} is better)", template=TEMPLATE, height=420)
    return fig


def _plain(value: float) -> str:
    """A bar label people read at a glance: about 4 significant digits in plain notation (1,380, 0.9727,
    12.35), never 1.38e+03; scientific only outside [0.001, 1e6)."""
    if value == 0:
        return "0"
    if not 1e-3 <= abs(value) < 1e6:
        return f"{value:.3g}"
    return f"{value:,.{max(0, 3 - math.floor(math.log10(abs(value))))}f}"


def comparison_bars(metrics: Sequence, labels: Sequence[str] | None = None):
    """Side-by-side bars of quality, latency, size and peak memory (a 2 x 2 grid, so titles and model labels
    never overlap); the quality bars carry the metric's sampling error (95 %) where the task states one."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    if not metrics:
        raise ValueError("comparison_bars needs at least one Metrics")
    names = _labels(metrics, labels)
    base = metrics[0]
    errors = [m.primary_error for m in metrics]
    panels = [
        (f"{base.primary} ({'higher' if base.higher_is_better[base.primary] else 'lower'} is better)",
         [m.primary_value for m in metrics], errors if all(e is not None for e in errors) else None),
        ("latency, ms (lower is better)", [m.latency_ms for m in metrics], None),
        ("size, MiB (lower is better)", [m.size_bytes / 2**20 for m in metrics], None),
        ("peak memory, MiB (lower is better)", [m.peak_memory_bytes / 2**20 for m in metrics], None),
    ]
    fig = make_subplots(rows=2, cols=2, subplot_titles=[p[0] for p in panels], vertical_spacing=0.16,
                        horizontal_spacing=0.08)
    for i, (_, values, err) in enumerate(panels):
        fig.add_trace(go.Bar(x=names, y=values, text=[_plain(v) for v in values], textposition="auto",
                             error_y=dict(type="data", array=err, visible=True, color="gray") if err else None,
                             marker_color=["#9e9e9e", *["#1f77b4"] * (len(values) - 1)], showlegend=False,
                             hovertemplate="%{x}: %{y:.4g}<extra></extra>"), row=i // 2 + 1, col=i % 2 + 1)
    fig.update_xaxes(tickangle=0, automargin=True)
    fig.update_yaxes(tickformat="~g", rangemode="tozero")
    fig.update_layout(template=TEMPLATE, height=620, margin=dict(t=60, l=50, r=20, b=40))
    return fig


from workbench.plots.analysis import frontier, roofline, sensitivity_heatmap, size_breakdown  # noqa: E402
