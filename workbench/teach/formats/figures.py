"""Lesson 10's computations and figures: the formats, their grids and bit fields, round trips, errors."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from workbench.plots.style import TEMPLATE
from workbench.quantization import primitives as P

__all__ = ["Format", "FORMATS", "format_of", "format_table", "grid", "bit_layout", "cast", "quantize_dequantize",
           "error_table", "flushed_fraction", "layer_inputs", "spacing_figure", "grid_figure", "magnitude_error_figure",
           "error_bars_figure"]


@dataclass(frozen=True)
class Format:
    """One number format. Integers: ``exponent_bits == 0``, ``mantissa_bits`` = magnitude bits, no dtype."""
    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int
    dtype: torch.dtype | None = None

    @property
    def is_int(self) -> bool:
        return self.dtype is None

    @property
    def bias(self) -> int:
        return (1 << (self.exponent_bits - 1)) - 1 if not self.is_int else 0


FORMATS: dict[str, Format] = {f.name: f for f in [
    Format("int4", 4, 0, 3),
    Format("int8", 8, 0, 7),
    Format("e4m3", 8, 4, 3, torch.float8_e4m3fn),
    Format("e5m2", 8, 5, 2, torch.float8_e5m2),
    Format("fp16", 16, 5, 10, torch.float16),
    Format("bf16", 16, 8, 7, torch.bfloat16),
    Format("fp32", 32, 8, 23, torch.float32),
]}

_ALIASES = {"float8_e4m3fn": "e4m3", "float8_e4m3": "e4m3", "fp8_e4m3": "e4m3", "float8_e5m2": "e5m2",
            "fp8_e5m2": "e5m2", "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32",
            "float": "fp32"}


def format_of(name: str | torch.dtype | Format) -> Format:
    """The `Format` called ``name`` (short names, torch dtype names such as ``"bfloat16"``, or a torch dtype)."""
    if isinstance(name, Format):
        return name
    if isinstance(name, torch.dtype):
        for f in FORMATS.values():
            if f.dtype == name:
                return f
        raise ValueError(f"no lesson format for dtype {name}; formats: {', '.join(FORMATS)}")
    key = str(name).strip().lower().removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key not in FORMATS:
        raise ValueError(f"unknown format {name!r}; formats: {', '.join(FORMATS)}")
    return FORMATS[key]


def _qmax(f: Format) -> int:
    return P.qrange(f.bits, signed=True)[1]


def grid(name: str | torch.dtype) -> torch.Tensor:
    """Every finite non-negative value of the format, sorted (float64). Integers: the codes 0..qmax, i.e. the
    grid for scale 1. Float formats are enumerated from all their bit patterns (up to 16 bits)."""
    f = format_of(name)
    if f.is_int:
        return torch.arange(_qmax(f) + 1, dtype=torch.float64)
    if f.bits > 16:
        raise ValueError(f"{f.name} has 2^{f.bits - 1} non-negative values; grid() enumerates formats of at most "
                         f"16 bits")
    patterns = torch.arange(1 << (f.bits - 1), dtype=torch.int32)            # sign bit 0: non-negative
    raw = patterns.to(torch.uint8 if f.bits == 8 else torch.int16)
    values = raw.view(f.dtype).double()
    return torch.unique(values[torch.isfinite(values)])                     # sorted


def _smallest_subnormal(f: Format) -> float:
    return math.ldexp(1.0, 1 - f.bias - f.mantissa_bits)


def format_table(names: Sequence[str] = ("int4", "int8", "e4m3", "e5m2", "fp16", "bf16", "fp32")):
    """One row per format: bit fields, largest finite value, smallest normal / non-zero value, the relative
    step near 1 (floats: 2^-m; integers: at their largest value, 1 / qmax) and the dynamic range in decades
    (log10 of largest / smallest non-zero). Integers are given for scale 1 (values are codes times the scale)."""
    import pandas as pd

    rows = []
    for name in names:
        f = format_of(name)
        if f.is_int:
            qmax = _qmax(f)
            largest, normal, tiny, step = float(qmax), float("nan"), 1.0, 1.0 / qmax
        else:
            info = torch.finfo(f.dtype)
            largest, normal, tiny, step = float(info.max), float(info.smallest_normal), _smallest_subnormal(f), \
                float(info.eps)
        rows.append({"format": f.name, "bits": f.bits, "exponent bits": f.exponent_bits,
                     "mantissa bits": f.mantissa_bits, "largest": largest, "smallest normal": normal,
                     "smallest non-zero": tiny, "relative step": step,
                     "range (decades)": math.log10(largest / tiny)})
    return pd.DataFrame(rows).set_index("format")


def bit_layout(value: float, name: str | torch.dtype) -> dict:
    """How ``value`` is stored in float format ``name`` (after rounding): its sign / exponent / mantissa bits
    and the formula that gives the stored value back."""
    f = format_of(name)
    if f.is_int:
        raise ValueError(f"{f.name} is an integer format: it stores a code, with no exponent or mantissa")
    stored = torch.tensor([value], dtype=torch.float32).to(f.dtype)
    view = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[f.bits]
    word = int(stored.view(view).to(torch.int64).item()) & ((1 << f.bits) - 1)
    e, m = f.exponent_bits, f.mantissa_bits
    sign, exp, man = word >> (e + m), (word >> m) & ((1 << e) - 1), word & ((1 << m) - 1)
    bits = format(word, f"0{f.bits}b")
    if exp == 0:
        formula = f"{'-' if sign else '+'}2^(1-{f.bias}) × ({man}/{1 << m})   (subnormal)"
    else:
        formula = f"{'-' if sign else '+'}2^({exp}-{f.bias}) × (1 + {man}/{1 << m})"
    return {"format": f.name, "value": value, "stored": float(stored.float().item()),
            "bits": f"{bits[0]} {bits[1:1 + e]} {bits[1 + e:]}", "sign": sign, "exponent": exp, "mantissa": man,
            "formula": formula}


def cast(x: torch.Tensor, name: str | torch.dtype) -> torch.Tensor:
    """``x`` stored in float format ``name`` with no scale, read back as fp32 (overflow: inf, or 448 for e4m3,
    which PyTorch saturates; underflow: 0)."""
    f = format_of(name)
    if f.is_int:
        raise ValueError(f"{f.name} is an integer format: it needs a scale; use quantize_dequantize(x, {f.name!r})")
    return x.detach().float().to(f.dtype).float()


def quantize_dequantize(x: torch.Tensor, name: str | torch.dtype) -> torch.Tensor:
    """``x`` through format ``name`` as it is used in practice: integers and fp8 with one per-tensor scale
    (max|x| maps to the largest value; `primitives.fake_quantize` / `float8_quantize`), fp16 / bf16 / fp32
    by a plain cast."""
    f = format_of(name)
    x = x.detach().float()
    if f.is_int:
        return P.fake_quantize(x, f.bits, P.PerTensor(), symmetric=True)
    if f.bits == 8:
        q, scale = P.float8_quantize(x, P.PerTensor(), f.dtype)
        return P.float8_dequantize(q, scale, P.PerTensor())
    return cast(x, f)


def flushed_fraction(x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of the non-zero values of ``x`` that are 0 in ``y`` (lost to underflow)."""
    nonzero = x != 0
    return float(((y == 0) & nonzero).sum()) / max(int(nonzero.sum()), 1)


def error_table(tensors: dict[str, torch.Tensor],
                names: Sequence[str] = ("int4", "int8", "e4m3", "e5m2", "fp16", "bf16"), scaled: bool = True):
    """Round-trip error of every tensor in every format: SQNR (dB, higher is better), relative RMS error,
    the fraction of non-zero values flushed to 0 and the fraction that overflowed (inf / NaN / saturated).
    ``scaled``: `quantize_dequantize` (a per-tensor scale for int and fp8); otherwise `cast` (floats only)."""
    import pandas as pd

    rows = []
    for tname, x in tensors.items():
        x = x.detach().float()
        for name in names:
            f = format_of(name)
            y = quantize_dequantize(x, f) if scaled else cast(x, f)
            finite = torch.isfinite(y)
            top = float(torch.finfo(f.dtype).max) if not f.is_int else float("inf")
            over = (~finite) | ((y.abs() == top) & (x.abs() > top))
            yf = torch.where(finite, y, torch.zeros_like(y))
            rel = float((x - yf).norm() / x.norm().clamp(min=1e-30))
            rows.append({"tensor": tname, "format": f.name, "sqnr_db": P.sqnr(x, yf) if finite.all() else float("nan"),
                         "rel_rms_error": rel, "flushed": flushed_fraction(x, y),
                         "overflowed": float(over.float().mean())})
    return pd.DataFrame(rows)


class _Stop(Exception):
    """Raised by the recording hook so that the forward pass ends at the recorded layer."""


def layer_inputs(model: nn.Module, layer: str, batches: Sequence[tuple[torch.Tensor, ...]],
                 mask_index: int | None = None) -> list[torch.Tensor]:
    """The first input of ``model.<layer>`` for every batch, one ``(tokens, features)`` tensor per sample.

    The forward pass stops at the layer (nothing after it runs). ``mask_index``: where each batch holds an
    attention mask ``(B, T)`` (MiniLM: 1); masked (padding) positions are dropped.
    """
    module = model.get_submodule(layer)
    seen: list[torch.Tensor] = []

    def hook(mod, args):
        seen.append(args[0].detach().float())
        raise _Stop

    handle = module.register_forward_pre_hook(hook)
    out: list[torch.Tensor] = []
    try:
        with torch.inference_mode():
            for batch in batches:
                seen.clear()
                try:
                    model(*batch)
                except _Stop:
                    pass
                if not seen:
                    raise RuntimeError(f"layer {layer!r} did not run for a batch of shape "
                                       f"{tuple(batch[0].shape)}")
                x = seen[0]                                                   # (B, T, features) or (B, features)
                for i in range(x.shape[0]):
                    xi = x[i].reshape(-1, x.shape[-1])                        # (T, features)
                    if mask_index is not None:
                        xi = xi[batch[mask_index][i].reshape(-1).bool()]
                    out.append(xi.clone())
    finally:
        handle.remove()
    return out


# --- figures -------------------------------------------------------------------------------------------

_COLOURS = {"int4": "#9467bd", "int8": "#1f77b4", "e4m3": "#ff7f0e", "e5m2": "#d62728", "fp16": "#2ca02c",
            "bf16": "#17becf", "fp32": "#7f7f7f"}


_TENSOR_COLOURS = ["#555555", "#bcbd22", "#e377c2", "#8c564b"]


def _thin(x: torch.Tensor, y: torch.Tensor, most: int = 2000) -> tuple[list, list]:
    step = max(1, math.ceil(len(x) / most))
    return x[::step].tolist(), y[::step].tolist()


def spacing_figure(names: Sequence[str] = ("int8", "e4m3", "e5m2", "fp16", "bf16"),
                   x_range: tuple[float, float] = (1e-9, 1e6)):
    """Precision against magnitude: the relative step (gap to the next value / value) of every positive value.
    Floats: a saw-tooth band around 2^-m that holds over their whole range; integers (scale 1): 1 / value."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name in names:
        f = format_of(name)
        g = grid(f)
        g = g[g > 0]
        rel = (g[1:] - g[:-1]) / g[:-1]                                       # (values - 1,)
        xs, ys = _thin(g[:-1], rel)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers" if len(g) < 300 else "lines", name=f.name,
                                 line=dict(color=_COLOURS.get(f.name), width=2), marker=dict(size=4),
                                 hovertemplate=f.name + ": value %{x:.4g}<br>relative step %{y:.3g}<extra></extra>"))
    fig.update_xaxes(type="log", range=[math.log10(x_range[0]), math.log10(x_range[1])], exponentformat="power",
                     title="value (log scale; integers with scale 1)")
    fig.update_yaxes(type="log", dtick=1, exponentformat="power",          # decades: no crowded minor labels
                     title="relative step = gap to the next value / value")
    fig.update_layout(title="Precision vs magnitude: floats keep a constant relative step, integers do not",
                      template=TEMPLATE, height=450)
    return fig


def _log_histogram(v: torch.Tensor, lo: float, hi: float, bins: int = 80) -> tuple[list, list]:
    """Fraction of ``|v|`` per log-spaced bin in [lo, hi]: (bin centres, fractions)."""
    a = v.detach().abs().double().flatten()
    a = a[a > 0]
    edges = torch.logspace(math.log10(lo), math.log10(hi), bins + 1, dtype=torch.float64)
    counts = torch.histogram(a.clamp(lo, hi), edges).hist
    centres = (edges[1:] * edges[:-1]).sqrt()
    return centres.tolist(), (counts / max(len(a), 1)).tolist()


def grid_figure(names: Sequence[str] = ("int4", "int8", "e4m3", "e5m2"), x: torch.Tensor | None = None,
                x_label: str = "tensor", lo: float = 1e-5):
    """Where each format puts its values once a scale maps its largest value to 1 (log axis), and, given
    ``x``, the distribution of ``|x| / max|x|`` on the same axis."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = 2 if x is not None else 1
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        row_heights=[0.4, 0.6] if rows == 2 else None,
                        subplot_titles=([f"|{x_label}| / max|{x_label}|"] if rows == 2 else [])
                        + ["representable values / largest value"])
    if x is not None:
        xs, ys = _log_histogram(x / x.abs().max(), lo, 1.0)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=dict(shape="hvh", color="#444"), fill="tozeroy",
                                 name=f"|{x_label}|", hovertemplate="%{x:.3g}: %{y:.2%}<extra></extra>"),
                      row=1, col=1)
        fig.update_yaxes(title="fraction", row=1, col=1)
    for name in names:
        f = format_of(name)
        g = grid(f)
        g = g[g > 0] / g.max()
        g = g[g >= lo]
        fig.add_trace(go.Scatter(x=g.tolist(), y=[f.name] * len(g), mode="markers", name=f.name,
                                 marker=dict(symbol="line-ns-open", size=14, color=_COLOURS.get(f.name)),
                                 hovertemplate=f.name + ": %{x:.4g}<extra></extra>"), row=rows, col=1)
    fig.update_xaxes(type="log", range=[math.log10(lo), 0.05], exponentformat="power")
    fig.update_xaxes(title="magnitude relative to the largest value (log scale)", row=rows, col=1)
    fig.update_yaxes(title="format", row=rows, col=1)
    fig.update_layout(title="Integer grids are uniform, float grids are logarithmic", template=TEMPLATE,
                      height=520 if rows == 2 else 360, showlegend=False)
    return fig


def magnitude_error_figure(names: Sequence[str] = ("e4m3", "e5m2", "fp16", "bf16"),
                           tensors: dict[str, torch.Tensor] | None = None, lo: float = 1e-12, hi: float = 1e8,
                           points: int = 6000):
    """Worst relative error of a plain cast (no scale) against magnitude: flat at about 2^-(m+1) inside the
    range, 100 % where values underflow to 0 or overflow (inf, or saturate). Below, ``|tensor|`` histograms show
    where real values sit."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = 2 if tensors else 1
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        row_heights=[0.6, 0.4] if rows == 2 else None,
                        subplot_titles=["worst relative error of a cast"] + (["where real values sit"] if tensors
                                                                              else []))
    v = torch.logspace(math.log10(lo), math.log10(hi), points, dtype=torch.float64)
    window = 30
    for name in names:
        f = format_of(name)
        y = v.float().to(f.dtype).double()
        err = ((y - v).abs() / v).nan_to_num(nan=1.0, posinf=1.0).clamp(max=1.0)       # (points,)
        worst = err[: len(err) // window * window].reshape(-1, window).amax(dim=1).clamp(min=1e-6)
        centre = v[: len(v) // window * window].reshape(-1, window)[:, window // 2]
        fig.add_trace(go.Scatter(x=centre.tolist(), y=worst.tolist(), mode="lines", name=f.name,
                                 line=dict(color=_COLOURS.get(f.name), width=2),
                                 hovertemplate=f.name + ": |x| ≈ %{x:.3g}<br>worst error %{y:.2%}<extra></extra>"),
                      row=1, col=1)
    for (tname, t), colour in zip((tensors or {}).items(), itertools.cycle(_TENSOR_COLOURS)):
        xs, ys = _log_histogram(t, lo, hi, bins=120)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=f"|{tname}|", line=dict(shape="hvh", color=colour),
                                 fill="tozeroy", hovertemplate=tname + " %{x:.3g}: %{y:.2%}<extra></extra>"),
                      row=2, col=1)
    fig.update_xaxes(type="log", exponentformat="power")
    fig.update_xaxes(title="|x| (log scale)", row=rows, col=1)
    fig.update_yaxes(type="log", dtick=1, exponentformat="power", title="relative error (1 = value lost)", row=1, col=1)
    if tensors:
        fig.update_yaxes(title="fraction of values", row=2, col=1)
    fig.update_layout(title="Range vs precision: where each format loses values", template=TEMPLATE,
                      height=620 if rows == 2 else 420)
    return fig


def error_bars_figure(table):
    """Grouped bars of SQNR (dB) per format, one group per tensor (from `error_table`)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for fname in dict.fromkeys(table["format"]):
        part = table[table["format"] == fname]
        fig.add_trace(go.Bar(x=part["tensor"].tolist(), y=part["sqnr_db"].tolist(), name=fname,
                             marker_color=_COLOURS.get(fname), text=[f"{v:.1f}" for v in part["sqnr_db"]],
                             textposition="outside",
                             hovertemplate=fname + " on %{x}: %{y:.1f} dB<extra></extra>"))
    fig.update_layout(barmode="group", title="Round-trip error on real tensors (each 6 dB ≈ one more bit)",
                      xaxis_title="tensor", yaxis_title="SQNR (dB, higher is better)", template=TEMPLATE,
                      height=430, legend_title="format")
    return fig
