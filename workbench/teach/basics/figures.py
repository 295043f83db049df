"""Lesson 11, quantization basics: granularity (per-tensor / per-channel / per-group), symmetric vs asymmetric,
observers and clipping, and how much calibration data a range needs - measured on real weights and activations.

Affine quantization with ``b`` bits, scale ``s`` and zero point ``z`` (`workbench.quantization.primitives`)::

    q = clamp(round(x / s) + z, qmin, qmax)        x_hat = (q - z) * s

Every number here comes from the package's primitives (`fake_quantize`, `choose_qparams`, `quantize`,
`dequantize`), its storage formats (`formats.encode`: the bytes really stored) and its observers
(`observers.MinMax`, `Percentile`, `MSE`, `Histogram`). This module adds the lesson's tables and figures and
the exercise checks (``check_*``), which compute their expected values themselves.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from workbench.plots.style import TEMPLATE
from workbench.quantization import formats as QF
from workbench.quantization import observers as QO
from workbench.quantization import primitives as P
from workbench.teach import Feedback, as_number, check
from workbench.teach.formats import differs_only_at_ties, layer_inputs

__all__ = ["layer_inputs", "mse", "bytes_per_weight", "granularity_table", "granularity_figure",
           "symmetry_table", "symmetry_figure", "clip_mse", "clipping_curve", "fit_observer", "observer_table",
           "clipping_figure", "calibration_table", "calibration_figure", "OBSERVER_LABELS", "OBSERVER_KEYS",
           "check_group_quantizer", "check_asymmetric_quantizer", "check_best_clipping",
           "check_codes_used"]


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


# --- exercise checks -----------------------------------------------------------------------------------
# Each exercise has a worked solution (``_solution_*``, written as a learner would write it in the cell), shown
# behind the feedback's "Show solution" toggle and run by the regression suite (``wb.teach.use_solutions``).


def _solution_asymmetric_quantizer(v, lo, hi, bits):
    qmin, qmax = 0, 2 ** bits - 1                        # unsigned codes
    s = (hi - lo) / (qmax - qmin)                        # the range spread over the steps between the codes
    z = qmin - round(lo / s)                             # an integer code: real 0 lands exactly on the grid
    codes = torch.clamp(torch.round(v / s) + z, qmin, qmax)
    return codes, (codes - z) * s


def _solution_codes_used(a, act_bits):
    codes, scale, zero_point = P.quantize_affine(a, act_bits, P.PerTensor(), symmetric=True)
    return codes.unique().numel()


def _solution_group_quantizer(w, bits, group_size):
    qmin, qmax = -2 ** (bits - 1), 2 ** (bits - 1) - 1
    groups = w.reshape(-1, group_size)                                  # (out * in / group_size, group_size)
    s = groups.abs().amax(dim=1, keepdim=True) / ((qmax - qmin) / 2)    # one scale per group: max|w| / 7.5 at 4 bits
    return ((groups / s).round().clamp(qmin, qmax) * s).reshape(w.shape)


def _solution_best_clipping(curve):
    return curve["threshold"][curve["mse"].idxmin()]


def check_group_quantizer(answer, w: torch.Tensor, bits: int = 4, group_size: int = 64) -> Feedback:
    """Exercise: ``w`` (out, in) fake-quantized with symmetric signed ``bits``-bit codes and one scale per
    ``group_size`` consecutive inputs of a row (`primitives.fake_quantize` with `PerGroup`). A value on a
    rounding boundary (w / s = k + 0.5, e.g. a group's largest |w| at exactly 7.5 steps) may round either way
    (dividing by s or multiplying by 1 / s): those may differ by one step."""
    solution = functools.partial(_solution_group_quantizer, w.detach().float(), bits, group_size)
    w = w.detach().float()
    expected = P.fake_quantize(w, bits, P.PerGroup(group_size), symmetric=True)
    name = f"int{bits} group quantizer, g{group_size}"
    hint = (f"reshape w to (-1, {group_size}); per group s = max|w| / ((qmax - qmin) / 2) with qmin, qmax = "
            f"{-2 ** (bits - 1)}, {2 ** (bits - 1) - 1}; w_hat = clamp(round(w / s), qmin, qmax) * s, reshaped back")
    got = answer if isinstance(answer, torch.Tensor) else solution() if answer is ... or answer is None else None
    if isinstance(got, torch.Tensor) and differs_only_at_ties(got, expected, w, bits, group_size):
        expected = got.detach().float()                                   # rounding-boundary ties only: accepted
    elif isinstance(answer, torch.Tensor) and answer.shape == expected.shape:
        got = answer.detach().float()
        qmin, qmax = -2 ** (bits - 1), 2 ** (bits - 1) - 1
        g = w.reshape(-1, group_size)
        known = [(P.fake_quantize(w, bits, P.PerChannel(0), symmetric=True),
                  f"one scale per row: the exercise asks for one per {group_size} weights"),
                 (((g / (g.abs().amax(1, keepdim=True) / qmax)).round().clamp(qmin, qmax)
                   * (g.abs().amax(1, keepdim=True) / qmax)).reshape(w.shape),
                  f"scale = max|w| / {qmax}: the symmetric rule divides by (qmax - qmin) / 2 = {(qmax - qmin) / 2:g}"),
                 (((g / (g.abs().amax(1, keepdim=True) / ((qmax - qmin) / 2))).round()
                   * (g.abs().amax(1, keepdim=True) / ((qmax - qmin) / 2))).reshape(w.shape),
                  f"no clamp: max|w| / s = {(qmax - qmin) / 2:g} rounds to {qmax + 1}, outside the grid")]
        for value, why in known:
            if torch.allclose(got, value, rtol=1e-4, atol=1e-6):
                return check(name, answer, expected, hint=why, rtol=1e-4, atol=1e-6, solution=solution)
    return check(name, answer, expected, hint=hint, rtol=1e-4, atol=1e-6, solution=solution)


def _affine(v: torch.Tensor, s: float, z: float, qmin: int, qmax: int, clamp: bool = True):
    """(codes, dequantized values) of ``v`` on the grid ``s``, ``z``, codes ``qmin .. qmax`` (by division)."""
    codes = torch.round(v / s) + z
    codes = codes.clamp(qmin, qmax) if clamp else codes
    return codes, (codes - z) * s


def check_asymmetric_quantizer(answer, v: torch.Tensor, lo: float, hi: float, bits: int = 4) -> Feedback:
    """Exercise: an asymmetric quantizer for unsigned ``bits``-bit codes calibrated on the range [``lo``, ``hi``]:
    the pair ``(codes, x_hat)`` of ``v`` (values outside the range are clipped), as the package's
    `primitives.choose_qparams` (asymmetric, unsigned), `quantize` and `dequantize` compute them."""
    solution = functools.partial(_solution_asymmetric_quantizer, v, lo, hi, bits)
    qmin, qmax = P.qrange(bits, signed=False)
    vg = v.detach().float().reshape(1, -1)
    scale, zero = P.choose_qparams(vg, bits, symmetric=False, signed=False, min_val=torch.tensor(float(lo)),
                                   max_val=torch.tensor(float(hi)))
    codes = P.quantize(vg, scale, zero, qmin, qmax, torch.int32)
    expected = (codes.reshape(v.shape), P.dequantize(codes, scale, zero).reshape(v.shape))
    s, z = float(scale), int(zero)
    x = v.detach().double()
    lo_v, hi_v = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    sqmin, sqmax = P.qrange(bits, signed=True)
    off_by_one = (hi - lo) / (qmax - qmin + 1)
    own = (hi_v - lo_v) / (qmax - qmin)
    codes_only = _affine(x, s, z, qmin, qmax)[0]
    mistakes = [
        (_affine(x, off_by_one, qmin - round(lo / off_by_one), qmin, qmax),
         f"{qmax - qmin + 1} codes have {qmax - qmin} steps between them: the scale spreads hi - lo over "
         f"qmax - qmin = {qmax - qmin}, so that lo and hi land on the first and the last code"),
        (_affine(x, s, round(lo / s), qmin, qmax), f"the zero point's sign: lo must land on code {qmin}, so "
                                                  f"z = {qmin} - round(lo / s) = {z}, a code inside the grid"),
        (_affine(x, s, qmin - lo / s, qmin, qmax), "the zero point must be an integer (a code): round it, so that "
                                                   "real 0 is exactly representable"),
        (_affine(x, s, z, qmin, qmax, clamp=False), f"values outside [lo, hi] must be clipped: clamp the codes to "
                                                    f"[{qmin}, {qmax}]"),
        (_affine(x, s, z - qmin + sqmin, sqmin, sqmax), f"those are signed codes [{sqmin}, {sqmax}]; this quantizer "
                                                        f"stores unsigned ones, [{qmin}, {qmax}]"),
        ((codes_only, codes_only * s), "dequantize with the zero point: subtract z from the code before scaling"),
        ((codes_only, codes_only), "the second item is the dequantized value, back on the real axis, not the code"),
        (_affine(x, own, qmin - round(lo_v / own), qmin, qmax),
         "that grid comes from v's own minimum and maximum; the quantizer uses the range calibrated in advance, "
         "[lo, hi] (v holds held-out values, some beyond it)"),
    ]
    hint = (f"from lo and hi: the scale and an integer zero point for codes [{qmin}, {qmax}]; then each value's "
            f"code, clipped to the grid, and its value back on the real axis")
    if isinstance(answer, torch.Tensor):
        hint = "return the pair (codes, x_hat): `answer = codes, x_hat`"
    return check(f"asymmetric uint{bits} quantizer", answer, expected, hint=hint, rtol=1e-5, atol=1e-6,
                 mistakes=mistakes, solution=solution)


def check_best_clipping(answer, curve) -> Feedback:
    """Exercise: the threshold of ``curve`` (from `clipping_curve`) with the smallest MSE; any threshold within
    one grid step of it passes."""
    solution = functools.partial(_solution_best_clipping, curve)
    best = int(curve["mse"].values.argmin())
    t = curve["threshold"].values
    expected = float(t[best])
    step = float(max(t[min(best + 1, len(t) - 1)] - t[best], t[best] - t[max(best - 1, 0)]))
    value = as_number(answer)
    name = "best clipping threshold"
    hint = "read the threshold at the bottom of the curve: the row of `curve` with the smallest mse"
    if value is not None and math.isclose(value, float(t[-1]), rel_tol=1e-6):
        hint = "that is max|x|, i.e. min-max with no clipping; the curve is lower to the left of it"
    elif value is not None and math.isclose(value, float(curve["mse"].values[best]), rel_tol=1e-6):
        hint = "that is the smallest MSE itself; the exercise asks for the threshold where it occurs"
    return check(name, answer, expected, hint=hint, rtol=0.0, atol=step, solution=solution)


def check_codes_used(answer, x: torch.Tensor, bits: int = 8) -> Feedback:
    """Exercise: how many distinct codes symmetric per-tensor quantization of ``x`` uses."""
    solution = functools.partial(_solution_codes_used, x, bits)
    q, _, _ = P.quantize_affine(x.detach().float(), bits, P.PerTensor(), symmetric=True)
    qa, _, _ = P.quantize_affine(x.detach().float(), bits, P.PerTensor(), symmetric=False)
    expected, asym = int(q.unique().numel()), int(qa.unique().numel())
    hint = (f"quantize x with primitives.quantize_affine(x, {bits}, PerTensor(), symmetric=True) and count the "
            f"distinct codes (tensor.unique().numel())")
    value = as_number(answer)
    if value == asym and asym != expected:
        hint = "that is the count for asymmetric quantization; the exercise asks for symmetric"
    elif value == 1 << bits:
        hint = f"{1 << bits} is every code the format has; count the ones the quantized tensor actually uses"
    return check(f"int{bits} codes used by symmetric quantization", answer, expected, hint=hint, rtol=0, atol=0,
                 solution=solution)
