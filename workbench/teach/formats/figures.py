"""Lesson 10, number formats: what int4 / int8 / fp8 (e4m3, e5m2) / fp16 / bf16 can represent, and what that
costs real tensors.

A float format with ``e`` exponent bits and ``m`` mantissa bits stores a sign ``s``, a biased exponent ``E``
and a mantissa ``M``; with ``bias = 2^(e-1) - 1``::

    normal    (E > 0):  (-1)^s * 2^(E - bias) * (1 + M / 2^m)
    subnormal (E = 0):  (-1)^s * 2^(1 - bias) * (M / 2^m)

so its **range** comes from ``e`` and its **precision** (the relative step, about ``2^-m``) from ``m``.
An integer format is a uniform grid that needs a scale: ``x ~ q * scale``.

Here: the format table (`FORMATS`, `format_table`), every representable value (`grid`), the bit fields of a
number (`bit_layout`), round trips through a format (`cast`: no scale; `quantize_dequantize`: a per-tensor
scale, through `workbench.quantization.primitives`), error tables, the lesson's figures, a helper that records a
layer's inputs (`layer_inputs`), and the exercise checks (``check_*``), which compute their expected values.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from workbench.plots.style import TEMPLATE
from workbench.quantization import primitives as P
from workbench.teach import Feedback, check

__all__ = ["Format", "FORMATS", "format_of", "format_table", "grid", "bit_layout", "cast", "quantize_dequantize",
           "error_table", "flushed_fraction", "layer_inputs", "spacing_figure", "grid_figure",
           "magnitude_error_figure", "error_bars_figure", "differs_only_at_ties", "check_int8_round_trip",
           "check_e4m3_decode", "check_loses_small_values", "check_fp16_exp_limit"]


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


# --- exercise checks -----------------------------------------------------------------------------------

def _solution_e4m3_decode(codes):
    sign = (codes >> 7) & 1                                     # bit 7
    exponent = (codes >> 3) & 0b1111                            # bits 6-3, bias 7
    mantissa = codes & 0b111                                    # bits 2-0
    normal = 2.0 ** (exponent - 7) * (1 + mantissa / 8)
    subnormal = 2.0 ** (1 - 7) * (mantissa / 8)
    value = torch.where(exponent > 0, normal, subnormal)
    value = torch.where((exponent == 15) & (mantissa == 7), float("nan"), value)   # S.1111.111 is NaN
    return torch.where(sign == 1, -value, value)


def _decode_fields(codes: torch.Tensor, bias: int = 7, subnormals: bool = True, nan_top: bool = True,
                   inf_top: bool = False) -> torch.Tensor:
    """What a decoder with one of the usual slips computes: the wrong bias, no subnormal rule, no NaN pattern,
    or IEEE's reserved top exponent (inf / NaN)."""
    c = codes.long()
    sign, exponent, mantissa = (c >> 7) & 1, (c >> 3) & 15, c & 7
    value = 2.0 ** (exponent - bias) * (1 + mantissa / 8)
    if subnormals:
        value = torch.where(exponent > 0, value, 2.0 ** (1 - bias) * (mantissa / 8))
    if nan_top:
        value = torch.where((exponent == 15) & (mantissa == 7), float("nan"), value)
    if inf_top:
        value = torch.where(exponent == 15, torch.where(mantissa == 0, float("inf"), float("nan")), value)
    return torch.where(sign == 1, -value, value).double()


def check_e4m3_decode(answer, codes: torch.Tensor) -> Feedback:
    """Exercise: the value of every float8 e4m3fn bit pattern in ``codes`` (integers 0..255), decoded by hand
    from its sign, exponent and mantissa fields. Expected: PyTorch's own reading of the same bytes."""
    expected = codes.to(torch.uint8).view(torch.float8_e4m3fn).double()
    mistakes = [
        (_decode_fields(codes, subnormals=False), "exponent field 0 is subnormal: 2^(1 - bias) · M / 8, with no "
                                                  "implicit leading 1"),
        (_decode_fields(codes, bias=8), "the bias of a 4-bit exponent is 2^(4-1) - 1 = 7"),
        (_decode_fields(codes, nan_top=False), "S.1111.111 is NaN in e4m3fn (its only NaN pattern); every other "
                                               "pattern with exponent 1111 is an ordinary number"),
        (_decode_fields(codes, inf_top=True), "that is IEEE-style e4m3, which reserves exponent 1111 for inf / NaN; "
                                              "e4m3fn ('finite') has no inf and uses that exponent for numbers"),
        (_decode_fields(codes).abs(), "the sign bit (bit 7) was dropped: codes 128..255 are negative"),
    ]
    hint = ("split each byte: sign = bit 7, exponent = bits 6-3, mantissa = bits 2-0; normal "
            "(-1)^s · 2^(E - 7) · (1 + M / 8), subnormal (E = 0) (-1)^s · 2^-6 · M / 8, and S.1111.111 is NaN")
    return check("e4m3 decoder", answer, expected, hint=hint, rtol=0, atol=0, mistakes=mistakes,
                 solution=functools.partial(_solution_e4m3_decode, codes))


def differs_only_at_ties(got: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, bits: int,
                         group_size: int) -> bool:
    """True when ``got`` (a symmetric ``bits``-bit fake quantization of ``x``, one scale per ``group_size``
    consecutive values) differs from ``expected`` only where x / scale lies on a rounding boundary (k + 0.5), by
    one step and inside the grid: dividing by the scale or multiplying by its inverse may round those either way
    (a group's largest |x| sits exactly at (2^bits - 1) / 2 steps)."""
    if got.shape != expected.shape:
        return False
    got = got.detach().float()
    g = x.detach().float().reshape(-1, group_size)                                     # (groups, group_size)
    step = g.abs().amax(1, keepdim=True) / ((2 ** bits - 1) / 2)                      # (groups, 1)
    ratio = (g / step).abs()
    tie = (((ratio - ratio.floor()) - 0.5).abs() < 1e-4).reshape(x.shape)            # on a boundary (k.5)
    off = ~torch.isclose(got, expected, rtol=1e-4, atol=1e-7)
    one_step = torch.isclose((got - expected).abs(), step.expand_as(g).reshape(x.shape), rtol=1e-3)
    code = (got.reshape(-1, group_size) / step).round().reshape(x.shape)
    on_grid = (code >= -2 ** (bits - 1)) & (code <= 2 ** (bits - 1) - 1)             # a tie may not leave the grid
    return bool(off.any()) and bool((tie & one_step & on_grid)[off].all())


def _solution_int8_round_trip(w):
    scale = w.abs().max() / ((127 - (-128)) / 2)                # the 255 steps spread over [-max|w|, max|w|]
    codes = (w / scale).round().clamp(-128, 127)
    return codes * scale


def check_int8_round_trip(answer, x: torch.Tensor) -> Feedback:
    """Exercise: ``x`` through symmetric per-tensor int8 and back (x_hat), as `primitives.fake_quantize` with
    `PerTensor` computes it. A value exactly on a rounding boundary (x / scale = k + 0.5, e.g. -max|x| at
    -127.5 steps) may round either way: a one-step difference there passes."""
    x = x.detach().float()
    expected = P.fake_quantize(x, 8, P.PerTensor(), symmetric=True)
    name = "int8 round trip (symmetric, per tensor)"
    solution = functools.partial(_solution_int8_round_trip, x)
    amax = x.abs().max()
    step = amax / 127.5
    got = answer if isinstance(answer, torch.Tensor) else solution() if answer is ... or answer is None else None
    if isinstance(got, torch.Tensor) and differs_only_at_ties(got, expected, x, 8, x.numel()):
        expected = got.detach().float()                                   # rounding-boundary ties only: accepted
    s127, smax = amax / 127, x.max() / 127.5
    mistakes = [
        ((x / s127).round().clamp(-128, 127) * s127, "scale = max|x| / 127 is the restricted range -127..127 some "
                                                     "libraries use; here (like PyTorch) the 255 steps between "
                                                     "qmin = -128 and qmax = 127 span [-max|x|, max|x|]: divide by "
                                                     "127.5"),
        ((x / step).round() * step, "no clamp: max|x| / scale = 127.5 rounds to 128, one code beyond qmax = 127"),
        ((x / step).round().clamp(-128, 127), "those are the integer codes; multiply them by the scale to get x_hat"),
        ((x / smax).round().clamp(-128, 127) * smax, "the scale comes from the largest *magnitude* max|x|, not "
                                                     "max(x): here the most negative value is further from 0"),
    ]
    hint = ("scale = max|x| spread over half of the 255 steps; codes = x / scale rounded to the nearest integer, "
            "clamped to [-128, 127]; x_hat = codes · scale")
    return check(name, answer, expected, hint=hint, rtol=1e-4, atol=1e-7, mistakes=mistakes, solution=solution)


def _canonical(answer) -> object:
    try:
        return format_of(answer).name
    except (ValueError, TypeError):
        return answer


def _solution_loses_small_values(p):
    lost_fp16 = int(((p.half() == 0) & (p != 0)).sum())          # non-zero in fp32, zero after the cast
    lost_bf16 = int(((p.bfloat16() == 0) & (p != 0)).sum())
    return "fp16" if lost_fp16 > lost_bf16 else "bf16"


def check_loses_small_values(answer, p: torch.Tensor, candidates: Sequence[str] = ("fp16", "bf16")) -> Feedback:
    """Exercise: which of ``candidates`` (cast directly, no scale) flushes the most non-zero values of ``p``
    to zero. The feedback says how many each loses."""
    lost = {format_of(c).name: int(((cast(p, c) == 0) & (p != 0)).sum()) for c in candidates}
    expected = max(lost, key=lost.get)
    counts = ", ".join(f"{k} flushes {v} of {p.numel()}" for k, v in lost.items())
    hint = (f"count the values that are non-zero in fp32 but 0 after the cast; {counts}. Underflow depends on the "
            f"exponent bits (the range), not the mantissa bits")
    other = next(iter(set(lost) - {expected}), None)
    mistakes = [(other, f"{other} keeps fp32's 8 exponent bits, so its range reaches as far down as fp32's; "
                        f"{counts}")] if other is not None else []
    return check("format that loses small values", _canonical(answer), expected, hint=hint, mistakes=mistakes,
                 solution=functools.partial(_solution_loses_small_values, p))


def _solution_fp16_exp_limit():
    largest = torch.finfo(torch.float16).max                   # 65504: exp(x) must stay at or below it
    return float(torch.tensor(largest).log())


def check_fp16_exp_limit(answer) -> Feedback:
    """Exercise: the largest x for which exp(x) is finite in fp16, i.e. ln(65504)."""
    expected = math.log(float(torch.finfo(torch.float16).max))
    mistakes = [(math.log10(65504), "that is log10(65504); exp is base e: use math.log"),
                (math.log2(65504), "that is log2(65504); exp is base e: use math.log"),
                (65504.0, "65504 is the largest fp16 value itself; the exercise asks for the x with exp(x) = 65504"),
                (math.log(float(torch.finfo(torch.bfloat16).max)), "that is the bf16 limit, ln(3.39e38)")]
    return check("largest logit with a finite fp16 exp", answer, expected, rtol=1e-3,
                 hint="exp(x) must stay below fp16's largest value, 65504: x = ln(65504)", mistakes=mistakes,
                 solution=_solution_fp16_exp_limit)
