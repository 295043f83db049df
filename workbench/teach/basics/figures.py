"""Lesson 11's tables and figures: granularity, symmetry, clipping, observers and calibration, measured."""
from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from workbench.plots.style import TEMPLATE
from workbench.quantization import formats as QF
from workbench.quantization import observers as QO
from workbench.quantization import primitives as P
from workbench.teach.formats.figures import layer_inputs

__all__ = ["layer_inputs", "mse", "bytes_per_weight", "granularity_table", "granularity_figure", "symmetry_table",
           "symmetry_figure", "clip_mse", "clipping_curve", "fit_observer", "observer_table", "clipping_figure",
           "calibration_table", "calibration_figure", "OBSERVER_LABELS", "OBSERVER_KEYS"]


def mse(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Mean squared error between ``x`` and its reconstruction."""
    return float((x.detach().double() - x_hat.detach().double()).pow(2).mean())


def _label(granularity: P.Granularity) -> str:
    if isinstance(granularity, P.PerTensor):
        return "per-tensor"
    if isinstance(granularity, P.PerChannel):
        return "per-channel"
    if isinstance(granularity, P.PerGroup):
        return f"g{granularity.group_size}"
    return type(granularity).__name__


def bytes_per_weight(w: torch.Tensor, bits: int, granularity: P.Granularity, symmetric: bool = True) -> float:
    """Bytes per weight as the workbench stores a 2-D weight: packed codes + fp16 scales (+ uint8 zero points
    when asymmetric), measured from the tensors `formats.encode` returns. Per-tensor (not a storage format of
    the workbench) counts the codes plus one fp16 scale (and one zero point)."""
    if isinstance(granularity, P.PerTensor):
        packed = w.numel() * QF.IntFormat(bits, None, symmetric).slot_bits / 8
        return (packed + 2 + (0 if symmetric else 1)) / w.numel()
    if isinstance(granularity, P.PerChannel) and granularity.axis % w.ndim != 0:
        raise ValueError("stored weights have one scale per output channel (axis 0)")
    group = None if isinstance(granularity, P.PerChannel) else granularity.group_size
    stored = QF.encode(w.detach().float(), QF.IntFormat(bits, group, symmetric))
    return sum(t.numel() * t.element_size() for t in stored.values()) / w.numel()


def granularity_table(w: torch.Tensor, bits: Sequence[int] = (8, 4),
                      group_sizes: Sequence[int] = (16, 32, 64, 128), symmetric: bool = True):
    """Error of round-to-nearest ``w`` (``(out, in)``) per granularity and bit-width, with the bytes per weight
    including scales. Columns: bits, granularity, values_per_scale, mse, sqnr_db, bytes_per_weight."""
    import pandas as pd

    grans = [P.PerTensor(), P.PerChannel(0)] + [P.PerGroup(g) for g in group_sizes if w.shape[-1] % g == 0]
    rows = []
    for b in bits:
        for g in grans:
            w_hat = P.fake_quantize(w.detach().float(), b, g, symmetric=symmetric)
            per_scale = {P.PerTensor: w.numel(), P.PerChannel: w.shape[-1]}.get(type(g)) or g.group_size
            rows.append({"bits": b, "granularity": _label(g), "values_per_scale": per_scale, "mse": mse(w, w_hat),
                         "sqnr_db": P.sqnr(w, w_hat), "bytes_per_weight": bytes_per_weight(w, b, g, symmetric)})
    return pd.DataFrame(rows)


_BIT_COLOURS = {2: "#8c564b", 3: "#e377c2", 4: "#d62728", 8: "#1f77b4"}


def granularity_figure(table, title: str = "Smaller groups: lower error, more bytes for scales"):
    """Left: SQNR against the number of weights sharing a scale (log axis). Right: SQNR against bytes per
    weight including scales (the trade-off)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=["error vs values sharing one scale",
                                                        "error vs storage (codes + scales)"])
    for b in dict.fromkeys(table["bits"]):
        part = table[table["bits"] == b].sort_values("values_per_scale")
        colour = _BIT_COLOURS.get(int(b))
        for col, x in ((1, "values_per_scale"), (2, "bytes_per_weight")):
            fig.add_trace(go.Scatter(x=part[x].tolist(), y=part["sqnr_db"].tolist(),
                                     mode="lines+markers+text" if col == 1 else "lines+markers",
                                     text=part["granularity"].tolist(),
                                     textposition=["top center"] * (len(part) - 1) + ["top left"],    # per-tensor: in
                                     name=f"int{b}", legendgroup=f"int{b}", showlegend=col == 1,
                                     line=dict(color=colour), marker=dict(size=9),
                                     hovertemplate=f"int{b} " + "%{text}: %{x:.4g} → %{y:.1f} dB<extra></extra>"),
                          row=1, col=col)
    fig.update_xaxes(type="log", dtick=1, title="weights per scale (log scale)", row=1, col=1)   # decades only
    fig.update_xaxes(title="bytes per weight, scales included (lower is better)", row=1, col=2)
    fig.update_yaxes(title="SQNR (dB, higher is better)")
    fig.update_layout(title=title, template=TEMPLATE, height=450)
    return fig


def symmetry_table(tensors: dict[str, torch.Tensor], bits: Sequence[int] = (8, 4),
                   granularity: P.Granularity = P.PerTensor()):
    """MSE / SQNR of symmetric and asymmetric round-to-nearest per tensor and bit-width, and how many of the
    ``2^b`` codes each actually uses."""
    import pandas as pd

    rows = []
    for name, x in tensors.items():
        x = x.detach().float()
        for b in bits:
            for sym in (True, False):
                q, scale, zp = P.quantize_affine(x, b, granularity, symmetric=sym)
                x_hat = P.dequantize_affine(q, scale, zp, granularity)
                rows.append({"tensor": name, "bits": b, "scheme": "symmetric" if sym else "asymmetric",
                             "mse": mse(x, x_hat), "sqnr_db": P.sqnr(x, x_hat),
                             "codes_used": int(q.unique().numel()), "codes": 1 << b})
    return pd.DataFrame(rows)


def symmetry_figure(table):
    """Bars of SQNR, symmetric vs asymmetric, for each tensor and bit-width (from `symmetry_table`)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for scheme, colour in (("symmetric", "#1f77b4"), ("asymmetric", "#ff7f0e")):
        part = table[table["scheme"] == scheme]
        labels = [f"{t}, int{b}" for t, b in zip(part["tensor"], part["bits"], strict=True)]
        fig.add_trace(go.Bar(x=labels, y=part["sqnr_db"].tolist(), name=scheme, marker_color=colour,
                             text=[f"{v:.1f} dB<br>{u}/{c} codes" for v, u, c in
                                   zip(part["sqnr_db"], part["codes_used"], part["codes"], strict=True)],
                             textposition="outside", hovertemplate="%{x}: %{y:.1f} dB<extra>" + scheme + "</extra>"))
    fig.update_layout(barmode="group", title="Symmetric vs asymmetric: one-sided tensors waste half a symmetric grid",
                      xaxis_title="tensor and bit-width", yaxis_title="SQNR (dB, higher is better)",
                      template=TEMPLATE, height=450, legend_title="scheme")
    return fig


# --- clipping and observers ---------------------------------------------------------------------------

def clip_mse(x: torch.Tensor, threshold: float, bits: int = 8) -> float:
    """MSE of symmetric per-tensor quantization of ``x`` with the range clipped to [-threshold, threshold]."""
    xg = x.detach().float().reshape(1, -1)
    t = torch.tensor([float(threshold)])
    scale, zp = P.choose_qparams(xg, bits, symmetric=True, min_val=-t, max_val=t)
    qmin, qmax = P.qrange(bits, True)
    return mse(xg, P.dequantize(P.quantize(xg, scale, zp, qmin, qmax, torch.int32), scale, zp))


def clipping_curve(x: torch.Tensor, bits: int = 8, points: int = 120, low: float = 0.02):
    """MSE of ``x`` against the clipping threshold, from ``low * max|x|`` to ``max|x|`` (no clipping), on a
    log-spaced grid. Columns: threshold, mse, clipped (fraction of values beyond the threshold)."""
    import pandas as pd

    amax = float(x.abs().max())
    thresholds = torch.logspace(math.log10(low * amax), math.log10(amax), points, dtype=torch.float64).tolist()
    a = x.detach().abs().flatten()
    return pd.DataFrame({"threshold": thresholds, "mse": [clip_mse(x, t, bits) for t in thresholds],
                         "clipped": [float((a > t).float().mean()) for t in thresholds]})


_OBSERVERS = {
    "min-max": QO.MinMax,
    "percentile 99.9": functools.partial(QO.Percentile, q=99.9),
    "percentile 99.99": functools.partial(QO.Percentile, q=99.99),
    "MSE": functools.partial(QO.MSE, max_samples=8192),   # a seeded sample of each tensor keeps the search fast
    "histogram (KL)": QO.Histogram,
}
OBSERVER_LABELS = tuple(_OBSERVERS)
# for recorded metric names
OBSERVER_KEYS = dict(zip(OBSERVER_LABELS, ("minmax", "p99_9", "p99_99", "mse", "kl"), strict=True))


def fit_observer(label: str, samples: Sequence[torch.Tensor], bits: int = 8) -> QO.Observer:
    """A fresh observer (one of `OBSERVER_LABELS`) that has observed each calibration sample in turn."""
    if label not in _OBSERVERS:
        raise ValueError(f"unknown observer {label!r}; choose from {OBSERVER_LABELS}")
    obs = _OBSERVERS[label]()
    for s in samples:
        obs.observe(s)
    return obs


def _threshold(obs: QO.Observer, bits: int) -> float:
    scale, _ = obs.qparams(bits, symmetric=True)
    qmin, qmax = P.qrange(bits, True)
    return float(scale.flatten()[0]) * (qmax - qmin) / 2


def observer_table(calibration: Sequence[torch.Tensor], evaluation: torch.Tensor, bits: int = 8,
                   labels: Sequence[str] = OBSERVER_LABELS):
    """Each observer fitted on the calibration samples: the clipping threshold it picks and the MSE on the
    held-out ``evaluation`` values. Columns: observer, key (a short name), threshold, mse."""
    import pandas as pd

    rows = []
    for label in labels:
        t = _threshold(fit_observer(label, calibration, bits), bits)
        rows.append({"observer": label, "key": OBSERVER_KEYS[label], "threshold": t,
                     "mse": clip_mse(evaluation, t, bits)})
    return pd.DataFrame(rows)


_OBS_COLOURS = dict(zip(OBSERVER_LABELS, ("#d62728", "#2ca02c", "#98df8a", "#ff7f0e", "#9467bd"), strict=True))


def clipping_figure(curve, observers=None, bits: int = 8):
    """The MSE-vs-threshold curve (log-log) with the clipped fraction, and each observer's pick."""
    import plotly.graph_objects as go

    fig = go.Figure(go.Scatter(x=curve["threshold"].tolist(), y=curve["mse"].tolist(), mode="lines",
                               name="MSE on held-out activations", line=dict(color="#444", width=3),
                               customdata=curve["clipped"].tolist(),
                               hovertemplate="threshold %{x:.3g}<br>MSE %{y:.3g}<br>clipped %{customdata:.3%}"
                                             "<extra></extra>"))
    for _, row in (observers.iterrows() if observers is not None else []):
        fig.add_trace(go.Scatter(x=[row["threshold"]], y=[row["mse"]], mode="markers", name=row["observer"],
                                 marker=dict(size=13, color=_OBS_COLOURS.get(row["observer"]),
                                             line=dict(color="white", width=1)),
                                 hovertemplate=row["observer"] + ": threshold %{x:.3g}, MSE %{y:.3g}<extra></extra>"))
    fig.update_xaxes(type="log", title="clipping threshold t: values beyond ±t are clipped (log scale)")
    fig.update_yaxes(type="log", title="MSE (lower is better, log scale)")
    fig.update_layout(title=f"int{bits} clipping: rounding error falls as t shrinks, until clipping error takes over",
                      template=TEMPLATE, height=460)
    return fig


def calibration_table(pool: Sequence[torch.Tensor], evaluation: torch.Tensor, sizes: Sequence[int],
                      labels: Sequence[str] = ("min-max", "percentile 99.99", "MSE"), repeats: int = 3,
                      bits: int = 8, seed: int = 0):
    """For each calibration-set size ``n`` and each of ``repeats`` seeded random draws of ``n`` samples from
    ``pool``: each observer's threshold and its MSE on ``evaluation``. Columns: observer, key, samples, draw,
    threshold, mse."""
    import pandas as pd

    rows = []
    gen = torch.Generator().manual_seed(seed)
    for n in sizes:
        if not 1 <= n <= len(pool):
            raise ValueError(f"calibration size {n} is outside 1..{len(pool)} (the pool's size)")
        for r in range(repeats):
            pick = torch.randperm(len(pool), generator=gen)[:n].tolist()
            for label in labels:
                t = _threshold(fit_observer(label, [pool[i] for i in pick], bits), bits)
                rows.append({"observer": label, "key": OBSERVER_KEYS[label], "samples": n, "draw": r, "threshold": t,
                             "mse": clip_mse(evaluation, t, bits)})
    return pd.DataFrame(rows)


def calibration_figure(table):
    """Held-out MSE (mean over draws, with the min-max band) and the chosen threshold against the number of
    calibration samples, per observer."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=["held-out MSE (band: best and worst draw)",
                                                        "threshold chosen"])
    for label in dict.fromkeys(table["observer"]):
        g = table[table["observer"] == label].groupby("samples")
        n = list(g.groups)
        colour = _OBS_COLOURS.get(label)
        for col, key in ((1, "mse"), (2, "threshold")):
            lo, hi, mean = g[key].min().tolist(), g[key].max().tolist(), g[key].mean().tolist()
            fig.add_trace(go.Scatter(x=n + n[::-1], y=hi + lo[::-1], fill="toself", fillcolor=colour, opacity=0.2,
                                     line=dict(width=0), hoverinfo="skip", showlegend=False, legendgroup=label),
                          row=1, col=col)
            fig.add_trace(go.Scatter(x=n, y=mean, mode="lines+markers", name=label, legendgroup=label,
                                     showlegend=col == 1, line=dict(color=colour, width=2),
                                     hovertemplate=label + ": %{x} samples → %{y:.3g}<extra></extra>"),
                          row=1, col=col)
    fig.update_xaxes(type="log", title="calibration samples (sentences, log scale)")
    fig.update_yaxes(type="log", title="MSE (lower is better)", row=1, col=1)
    fig.update_yaxes(type="log", title="clipping threshold", row=1, col=2)
    fig.update_layout(title="How much calibration data a range needs", template=TEMPLATE, height=450)
    return fig
