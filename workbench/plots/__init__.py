"""Plotly figures of measured results. Each function returns a ``go.Figure`` (wrap it in
``go.FigureWidget`` for live updates); axes carry units and say when lower is better."""
from __future__ import annotations

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
    """A bar label: `workbench.measurement.table.plain_number` (4 significant digits, plain notation)."""
    from workbench.measurement.table import plain_number

    return plain_number(value)


def comparison_bars(metrics: Sequence, labels: Sequence[str] | None = None):
    """Side-by-side bars of quality, speed, size and peak memory (a 2 x 2 grid, so titles and model labels
    never overlap); the quality bars carry the metric's sampling error (95 %) where the task states one.

    Speed comes from one regime: when every model after the first was timed side by side with it
    (``wb.measure(..., baseline=first)``), the panel shows each one's paired speedup over the first with its 95 %
    interval (the first at 1) - the numbers its verdict reads; latencies of separate measurements would disagree
    with that verdict on a busy machine. Otherwise it shows each model's own latency, titled as measured apart.
    An interval that reaches past twice the bars' height is cut at the axis edge (its hover gives it whole)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    if not metrics:
        raise ValueError("comparison_bars needs at least one Metrics")
    names = _labels(metrics, labels)
    base = metrics[0]
    errors = [m.primary_error for m in metrics]
    paired = len(metrics) > 1 and all(m.speedup is not None for m in metrics[1:])
    if paired:
        speed = ([1.0, *(m.speedup.ratio for m in metrics[1:])],
                 dict(type="data", symmetric=False, array=[0.0, *(m.speedup.high - m.speedup.ratio
                                                                   for m in metrics[1:])],
                      arrayminus=[0.0, *(m.speedup.ratio - m.speedup.low for m in metrics[1:])],
                      visible=True, color="gray"))
        speed_title = f"speedup over {names[0]}, x (paired rounds, 95 % interval)"
        speed_text = ["1x", *(f"{m.speedup.ratio:.2f}x" if m.speedup.changed else f"~{m.speedup.ratio:.2f}x "
                              "(no measurable change)" for m in metrics[1:])]
        speed_hover = ["the reference", *(m.speedup.verdict for m in metrics[1:])]
    else:
        speed = ([m.latency_ms for m in metrics], None)
        speed_title = "latency, ms (lower is better)" + (", each measured apart" if len(metrics) > 1 else "")
        speed_text = [_plain(v) for v in speed[0]]
        speed_hover = [f"{v:.4g} ms" for v in speed[0]]
    quality_err = dict(type="data", array=errors, visible=True, color="gray") if all(
        e is not None for e in errors) else None
    panels = [
        (f"{base.primary} ({'higher' if base.higher_is_better[base.primary] else 'lower'} is better)",
         [m.primary_value for m in metrics], quality_err, None, None),
        (speed_title, speed[0], speed[1], speed_text, speed_hover),
        ("size, MiB (lower is better)", [m.size_bytes / 2**20 for m in metrics], None, None, None),
        ("peak memory, MiB (lower is better)", [m.peak_memory_bytes / 2**20 for m in metrics], None, None, None),
    ]
    fig = make_subplots(rows=2, cols=2, subplot_titles=[p[0] for p in panels], vertical_spacing=0.16,
                        horizontal_spacing=0.08)
    for i, (_, values, err, text, hover) in enumerate(panels):
        row, col = i // 2 + 1, i % 2 + 1
        fig.add_trace(go.Bar(x=names, y=values, text=text or [_plain(v) for v in values], textposition="auto",
                             error_y=err, customdata=hover or [f"{v:.4g}" for v in values],
                             marker_color=["#9e9e9e", *["#1f77b4"] * (len(values) - 1)], showlegend=False,
                             hovertemplate="%{x}: %{customdata}<extra></extra>"), row=row, col=col)
        if err is not None:   # keep the bars readable whatever one interval does
            top = max(v + e for v, e in zip(values, err["array"]))
            limit = 2.0 * max(values)
            if top > limit:
                fig.update_yaxes(range=[0, limit], row=row, col=col)
    if paired:
        fig.add_hline(y=1.0, line_dash="dot", line_color="gray", row=1, col=2)
    fig.update_xaxes(tickangle=0, automargin=True)
    fig.update_yaxes(tickformat="~g", rangemode="tozero")
    fig.update_layout(template=TEMPLATE, height=620, margin=dict(t=60, l=50, r=20, b=40))
    return fig


from workbench.plots.analysis import frontier, roofline, sensitivity_heatmap, size_breakdown  # noqa: E402
