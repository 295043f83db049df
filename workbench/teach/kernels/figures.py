"""Lesson 50's computations and figures: the byte-ratio ceiling, the roofline, the measured speedups."""
from __future__ import annotations

from workbench.plots.style import TEMPLATE

__all__ = ["byte_ratio_ceiling", "roofline_chart", "speedup_chart"]


def byte_ratio_ceiling(bits: int, group_size: int | None, in_features: int, scale_bits: int = 16,
                       baseline_bits: int = 16) -> float:
    """Speedup ceiling of a memory-bound weight-only GEMM over ``baseline_bits`` weights: the byte ratio."""
    group = in_features if group_size is None else group_size
    return baseline_bits / (bits + scale_bits / group)


def roofline_chart(table, bandwidth_GBs: float, peak_GFLOPs: float, title: str | None = None):
    """Achieved GFLOP/s of each measured (shape, M, path) against its arithmetic intensity, under the roofs
    ``bandwidth * I`` (memory) and ``peak`` (compute); log-log."""
    import numpy as np
    import plotly.graph_objects as go

    lo, hi = max(table["intensity"].min() / 2, 1e-2), table["intensity"].max() * 2
    xs = np.geomspace(lo, hi, 200)
    fig = go.Figure(go.Scatter(x=xs, y=np.minimum(peak_GFLOPs, bandwidth_GBs * xs), mode="lines",
                               name=f"roofline ({bandwidth_GBs:.0f} GB/s, {peak_GFLOPs:.0f} GFLOP/s)",
                               line=dict(color="black", dash="dash")))
    for path, rows in table.groupby("path", sort=False):
        fig.add_trace(go.Scatter(x=rows["intensity"], y=rows["GFLOP/s"], mode="markers", name=path,
                                 marker=dict(size=10),
                                 text=[f"{s} M={m}: {t:.3g} ms" for s, m, t in zip(rows["shape"], rows["M"],
                                                                                    rows["ms"], strict=True)],
                                 hovertemplate="%{text}<br>I=%{x:.3g} FLOP/B, %{y:.3g} GFLOP/s"))
    fig.update_layout(template=TEMPLATE, height=460, title=title or "Measured Linear layers on the roofline",
                      xaxis=dict(type="log", title="arithmetic intensity (FLOPs per byte moved)"),
                      yaxis=dict(type="log", title="achieved GFLOP/s"))
    return fig


def speedup_chart(table, baseline: str = "fp32", title: str | None = None):
    """Measured speedup over ``baseline`` beside the byte-ratio ceiling, one group of bars per (shape, M)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = table[table["path"] != baseline]
    paths = list(dict.fromkeys(rows["path"]))
    fig = make_subplots(rows=1, cols=len(paths), subplot_titles=paths, shared_yaxes=True)
    for i, path in enumerate(paths, start=1):
        r = rows[rows["path"] == path]
        labels = [f"{s}<br>M={m}" for s, m in zip(r["shape"], r["M"], strict=True)]
        fig.add_trace(go.Bar(x=labels, y=r["speedup"], name="measured", marker_color="#1f77b4",
                             showlegend=i == 1, text=[f"{v:.2f}x" for v in r["speedup"]]), row=1, col=i)
        fig.add_trace(go.Bar(x=labels, y=r["ceiling"], name="byte-ratio ceiling", marker_color="lightgray",
                             showlegend=i == 1), row=1, col=i)
    fig.add_hline(y=1.0, line_dash="dot")
    fig.update_layout(barmode="group", template=TEMPLATE, height=460,
                      title=title or f"Speedup over {baseline} and the byte-ratio ceiling",
                      yaxis_title="speedup (x)")
    return fig
