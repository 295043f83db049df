"""Lab 60's computations and figures: decode bytes and speed, activation outliers, NF4, KV-cache errors."""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from workbench.plots.style import TEMPLATE
from workbench.quantization import formats as fm
from workbench.quantization import kvcache
from workbench.quantization.primitives import PerChannel, PerTensor, PerToken, fake_quantize, nf4_codebook

__all__ = ["linear_shapes", "weight_bytes", "bytes_per_token", "decode_bytes_table", "nf4_figure", "kv_error_figure",
           "measure_decode", "decode_figure", "matvec_sweep", "matvec_figure", "outlier_figure", "activation_errors",
           "attention_inputs", "kv_errors", "kv_share_table", "kv_share_figure", "perplexity_with_kv", "quick_task"]


_COLOURS = {"fp32": "#5f6368", "bf16": "#1a73e8", "int8": "#f29900", "int4 g64": "#188038", "nf4 g64": "#9334e6"}


# --- bytes per decoded token --------------------------------------------------------------------------------

def quick_task(windows: int = 4):
    """The tiny-llama task, its quick perplexity over the first ``windows`` 128-token held-out windows."""
    from workbench.tasks import load

    task = load("tiny-llama")
    task.quick_windows = windows
    return task


def linear_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{name: (out, in)}`` of every nn.Linear - the weights a decode step reads in full (the output head too:
    tiny-llama's embedding is tied to it, and the embedding itself reads one row per token)."""
    return {name: tuple(m.weight.shape) for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def weight_bytes(shapes: dict[str, tuple[int, int]], fmt: fm.WeightFormat | None = None,
                 float_bytes: int = 4) -> int:
    """Bytes of all weights of ``shapes`` stored in ``fmt`` (its codes and scales, as the package stores them:
    `formats.empty`), or as floats of ``float_bytes`` each (``fmt=None``)."""
    if fmt is None:
        return sum(n * k for n, k in shapes.values()) * float_bytes
    return sum(t.numel() * t.element_size() for shape in shapes.values() for t in fm.empty(shape, fmt).values())


FORMATS = {"fp32": (None, 4), "bf16": (None, 2), "int8": (fm.IntFormat(8, None), 0),
           "int4 g64": (fm.IntFormat(4, 64), 0), "nf4 g64": (fm.NF4Format(64), 0)}


def decode_bytes_table(model: nn.Module, contexts=(128, 1024, 8192), kv_float_bytes: int = 2):
    """One row per weight format (`FORMATS`): weight bytes per decoded token and, per context, the total with an
    fp16 KV cache of that many tokens (batch 1)."""
    import pandas as pd

    shapes = linear_shapes(model)
    rows = []
    for label, (fmt, fb) in FORMATS.items():
        wb_ = weight_bytes(shapes, fmt, fb)
        row = {"format": label, "weight MB": wb_ / 1e6}
        for T in contexts:
            row[f"total MB @ {T}"] = (wb_ + kvcache.cache_bytes(model.config, T, None, kv_float_bytes)) / 1e6
        rows.append(row)
    return pd.DataFrame(rows)


def bytes_per_token(model: nn.Module, context: int) -> dict[str, float]:
    """Bytes one decode step reads for each `FORMATS` variant of ``model``: its Linear weights and a KV cache of
    ``context`` tokens in the activations' dtype (bf16 for the bf16 model, fp32 for the others: weight-only
    formats keep fp32 activations)."""
    shapes = linear_shapes(model)
    return {label: weight_bytes(shapes, fmt, fb) + kvcache.cache_bytes(model.config, context, None,
                                                                        2 if label == "bf16" else 4)
            for label, (fmt, fb) in FORMATS.items()}


def matvec_sweep(sizes=(256, 512, 1024, 2048, 4096), dtype=torch.float32, runs: int = 20):
    """``y = W x`` for square ``W`` of each size, batch 1: median time and effective GB/s (weight bytes / time).
    Small weights sit in cache and pay a fixed cost per call; large ones stream from memory."""
    import pandas as pd

    rows = []
    for n in sizes:
        W = torch.randn(n, n).to(dtype)
        x = torch.randn(1, n).to(dtype)
        for _ in range(3):
            torch.nn.functional.linear(x, W)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, W)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        nbytes = W.numel() * W.element_size()
        rows.append({"size": n, "weight MB": nbytes / 1e6, "us": t * 1e6, "GB/s": nbytes / t / 1e9})
    return pd.DataFrame(rows)


def matvec_figure(sweep, bandwidth_GBs: float, title: str | None = None):
    import plotly.graph_objects as go

    fig = go.Figure(go.Scatter(x=sweep["weight MB"], y=sweep["GB/s"], mode="lines+markers",
                               name="measured matrix-vector product", line=dict(color=_COLOURS["fp32"])))
    fig.add_hline(y=bandwidth_GBs, line=dict(dash="dash", color="#d93025"),
                  annotation_text=f"copy bandwidth {bandwidth_GBs:.1f} GB/s")
    fig.update_layout(title=title or "Batch-1 y = Wx: effective bandwidth vs weight size",
                      xaxis_title="weight MB (log)", yaxis_title="weight bytes / time (GB/s)", xaxis_type="log",
                      template=TEMPLATE, height=380)
    return fig


def measure_decode(models: dict[str, nn.Module], task, bytes_per_token: dict[str, float], bandwidth: float,
                   new_tokens: int = 16, repeats: int = 2, threads: int | None = None):
    """Decode tokens/s of each model (`tokens_per_second`, greedy, batch 1, KV cache) beside the roofline bound
    ``bandwidth / bytes_per_token[label]``; bandwidth in bytes/s. The eager static-cache loop (``compile=False``):
    the lesson compares formats under one per-token overhead, and a compiled fp32 step of this 42 MB model, read
    from a large last-level cache, can pass the bound measured from memory (1.005x on a Xeon with 480 MiB of L3)."""
    import pandas as pd

    from workbench.measurement.decode import tokens_per_second

    rows = []
    for label, model in models.items():
        speed = tokens_per_second(model, task, new_tokens=new_tokens, repeats=repeats, threads=threads,
                                  compile=False)
        bound = bandwidth / bytes_per_token[label]
        rows.append({"format": label, "MB per token": bytes_per_token[label] / 1e6,
                     "decode tokens/s": speed.decode_tokens_per_s, "roofline bound tokens/s": bound,
                     "fraction of bound": speed.decode_tokens_per_s / bound, "threads": speed.threads})
    return pd.DataFrame(rows)


def decode_figure(table, title: str | None = None):
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.add_trace(go.Bar(x=table["format"], y=table["roofline bound tokens/s"], name="bound: bandwidth / bytes",
                         marker_color="#dadce0"))
    fig.add_trace(go.Bar(x=table["format"], y=table["decode tokens/s"], name="measured decode",
                         marker_color=[_COLOURS.get(f, "#5f6368") for f in table["format"]]))
    fig.update_layout(title=title or "tiny-llama batch-1 decode: measured vs the memory roofline",
                      yaxis_title="tokens/s (log)", yaxis_type="log", barmode="group", template=TEMPLATE,
                      height=400)
    return fig


def nf4_figure(W: torch.Tensor, group_size: int = 64, title: str | None = None):
    """Histogram of one layer's weights divided by their group's max |w|, with the 16 NF4 levels and the 16
    levels of symmetric int4 (-8..7 over 7.5) on the same axis."""
    import plotly.graph_objects as go

    groups = W.detach().float().reshape(-1, group_size)
    normed = (groups / groups.abs().amax(1, keepdim=True)).flatten()
    fig = go.Figure(go.Histogram(x=normed.tolist(), nbinsx=120, marker_color="#dadce0", name="w / max|w| of group"))
    for values, colour, name in ((nf4_codebook().tolist(), "#9334e6", "NF4 levels"),
                                 ([i / 7.5 for i in range(-8, 8)], "#188038", "int4 levels")):
        fig.add_trace(go.Scatter(x=values, y=[0] * len(values), mode="markers", name=name,
                                 marker=dict(color=colour, size=10, symbol="line-ns-open", line=dict(width=2))))
    fig.update_layout(title=title or "Where the 16 levels sit: NF4 follows the bell, int4 is uniform",
                      xaxis_title="weight / max |w| of its group", yaxis_title="weights", template=TEMPLATE,
                      height=380)
    return fig


# --- activation outliers ---------------------------------------------------------------------------------

def outlier_figure(inputs: dict[str, torch.Tensor], title: str | None = None):
    """max |x_j| over tokens, per input channel j, for each recorded layer input ``(tokens, K)``."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    names = list(inputs)
    fig = make_subplots(rows=len(names), cols=1, subplot_titles=names, vertical_spacing=0.12)
    for i, name in enumerate(names, start=1):
        peak = inputs[name].abs().amax(dim=0)
        fig.add_trace(go.Bar(x=list(range(len(peak))), y=peak.tolist(), marker_color="#5f6368", showlegend=False),
                      row=i, col=1)
        fig.update_yaxes(title_text="max |x_j|", row=i, col=1)
    fig.update_xaxes(title_text="input channel j", row=len(names), col=1)
    fig.update_layout(title=title or "Activation outliers: a few channels are far larger than the rest",
                      template=TEMPLATE, height=300 * len(names), bargap=0)
    return fig


def _rel(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.double(), approx.double()
    return float((ref - approx).pow(2).sum() / ref.pow(2).sum())


def activation_errors(X: torch.Tensor, W: torch.Tensor, ratio: float = 4.0):
    """Relative error of int8 activations ``X`` ``(tokens, K)`` and of the layer output ``X W^T``: per tensor,
    per token, per input channel, and LLM.int8 (channels whose max |x| exceeds ``ratio`` times the median
    channel's kept in float, the rest per token; the paper's fixed threshold 6 suits OPT's activation scale, not
    every model's). Per-channel scales run along the sum of X W^T, so an int8 GEMM cannot apply them."""
    import pandas as pd

    X, W = X.float(), W.detach().float()
    ref = X @ W.T
    peak = X.abs().amax(dim=0)                                                     # (K,)
    outliers = peak > ratio * peak.median()
    split = torch.where(outliers, X, fake_quantize(X, 8, PerToken()))
    variants = {"per tensor": fake_quantize(X, 8, PerTensor()), "per token": fake_quantize(X, 8, PerToken()),
                "per channel": fake_quantize(X, 8, PerChannel(1)),
                f"LLM.int8 ({int(outliers.sum())} channels > {ratio:g}x median in float)": split}
    rows = [{"scales": k, "activation error": _rel(X, v), "output error": _rel(ref, v @ W.T),
             "int8 GEMM can use it": not k.startswith("per channel")} for k, v in variants.items()]
    return pd.DataFrame(rows)


# --- KV cache ------------------------------------------------------------------------------------------------

def attention_inputs(model: nn.Module, ids: torch.Tensor, layer: int = 0):
    """(query (B, H, T, D), key (B, kv_heads, T, D), value, scaling) that attention layer ``layer`` of a
    transformers model sees on ``ids`` - after the rotary embedding, as its cache holds them."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    previous = model.config._attn_implementation
    inner = ALL_ATTENTION_FUNCTIONS[previous]
    seen: list = []

    def record(module, query, key, value, attention_mask, **kwargs):
        if getattr(module, "layer_idx", None) == layer:
            seen.append((query.detach().clone(), key.detach().clone(), value.detach().clone(),
                         kwargs.get("scaling", module.scaling)))
        return inner(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register("workbench_teach_record", record)
    model.set_attn_implementation("workbench_teach_record")
    try:
        with torch.inference_mode():
            model(ids)
    finally:
        model.set_attn_implementation(previous)
    if not seen:
        raise ValueError(f"attention layer {layer} was not called: the model has "
                         f"{model.config.num_hidden_layers} layers")
    return seen[0]


def _attend(q, k, v, scaling):
    groups = q.shape[1] // k.shape[1]                                                 # grouped-query attention
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                            scale=scaling)


KV_FORMATS = [kvcache.KVCacheFormat(d, p) for d in (torch.int8, torch.float8_e4m3fn) for p in ("token", "head",
                                                                                                "channel")]


def kv_errors(q, k, v, scaling, formats=KV_FORMATS):
    """Relative attention-output error when keys, values or both are stored in each format."""
    import pandas as pd

    ref = _attend(q, k, v, scaling)
    rows = []
    for f in formats:
        kq, vq = kvcache.fake_quantize(k, f), kvcache.fake_quantize(v, f)
        rows.append({"format": f.label, "keys only": _rel(ref, _attend(q, kq, v, scaling)),
                     "values only": _rel(ref, _attend(q, k, vq, scaling)),
                     "keys + values": _rel(ref, _attend(q, kq, vq, scaling))})
    return pd.DataFrame(rows)


def kv_error_figure(table, title: str | None = None):
    import plotly.graph_objects as go

    fig = go.Figure()
    for col, colour in (("keys only", "#1a73e8"), ("values only", "#f29900"), ("keys + values", "#5f6368")):
        fig.add_trace(go.Bar(x=table["format"], y=table[col], name=col, marker_color=colour))
    fig.update_layout(title=title or "Attention-output error of a quantized KV cache (one layer, real tokens)",
                      yaxis_title="relative error (log, lower is better)", yaxis_type="log", barmode="group",
                      template=TEMPLATE, height=400)
    return fig


def perplexity_with_kv(model: nn.Module, task, formats=KV_FORMATS) -> dict[str, float]:
    """Quick perplexity of ``model`` with its keys and values fake-quantized in each format (plus "fp32")."""
    out = {"fp32": task.evaluate(model, quick=True)["perplexity"]}
    for f in formats:
        with kvcache.quantized_kv_cache(model, f):
            out[f.label] = task.evaluate(model, quick=True)["perplexity"]
    return out


def kv_share_table(model: nn.Module, weight_bytes_per_token: float, contexts, kv_formats: dict):
    """KV-cache share of the bytes of one decode step at each context, for each KV format (None: fp16)."""
    import pandas as pd

    rows = []
    for T in contexts:
        row = {"context": T}
        for label, f in kv_formats.items():
            kv = kvcache.cache_bytes(model.config, T, f)
            row[label] = kv / (kv + weight_bytes_per_token)
        rows.append(row)
    return pd.DataFrame(rows)


def kv_share_figure(table, title: str | None = None):
    import plotly.graph_objects as go

    fig = go.Figure()
    for col in table.columns[1:]:
        fig.add_trace(go.Scatter(x=table["context"], y=table[col], mode="lines+markers", name=col))
    fig.update_layout(title=title or "Share of decode bytes spent reading the KV cache (int4 g64 weights)",
                      xaxis_title="context tokens (log)", xaxis_type="log", yaxis_title="KV bytes / all bytes",
                      yaxis_range=[0, 1], template=TEMPLATE, height=380)
    return fig
