"""KV-cache quantization: the keys and values an LLM keeps for every past token, stored in int8 or fp8 e4m3.

Batch-1 decoding reads every weight once per token *and* the whole KV cache (keys and values of every layer for
every position so far); the cache grows with the context, so at long contexts it, not the weights, sets the bytes
per token. A `KVCacheFormat` says how a key or value tensor ``(B, kv_heads, T, head_dim)`` is stored:

- ``per="token"``: one scale per (batch, head, position), over the head_dim values of one token;
- ``per="head"``: one scale per (batch, head), over all positions and dims (the cheapest, the coarsest);
- ``per="channel"``: one scale per (batch, head, dim), over all positions: for keys, whose outliers sit in
  fixed channels (KIVI, Liu et al. 2024).

int8 is symmetric with the package's grid (`primitives.choose_qparams`: scale = max|x| / 127.5, codes clamped to
[-128, 127]); ``bits`` below 8 keeps the int8 container with the same grid of fewer levels (``bits=4``: scale
max|x| / 7.5, codes in [-8, 7]; a real cache would pack them, and `bytes_per_position` counts ``bits / 8`` bytes a
value); fp8 e4m3 maps max|x| to 448 (`primitives.float8_quantize`). Scales are fp32 (4 bytes each).
``rotate=True`` (QuaRot's online rotation of keys and values): queries and keys are multiplied by one orthogonal
matrix per head (the normalized Hadamard matrix of head_dim where one is constructed,
`workbench.quantization.rotation.OnlineHadamard`) before keys are quantized, which leaves every score q . k as it
was, and values are rotated before they are quantized and the attention output rotated back: the same attention,
with the keys' outlier channels spread over the head.

- `quantize` / `dequantize` / `fake_quantize`: one tensor;
- `bytes_per_position` / `cache_bytes`: what the cache of a Hugging Face config costs;
- `quantized_kv_cache(model, fmt)`: a context manager under which a Hugging Face model (one using transformers'
  ``AttentionInterface``, e.g. Llama) attends to fake-quantized keys and values - the whole cache as it would be
  read back, so perplexity and generation measure the format's error. "head" and "channel" scales are recomputed
  over the positions attended so far (a real cache would calibrate them or grow them; the error is the same for
  a prefill).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from workbench.quantization.primitives import EPS, FLOAT8_DTYPES

__all__ = ["KVCacheFormat", "SCALE_AXES", "quantize", "dequantize", "fake_quantize", "bytes_per_position",
           "cache_bytes", "quantized_kv_cache"]

# per -> the axes of (B, kv_heads, T, head_dim) that share one scale
SCALE_AXES = {"token": (3,), "head": (2, 3), "channel": (2,)}
KV_DTYPES = (torch.int8, *FLOAT8_DTYPES)


@dataclass(frozen=True)
class KVCacheFormat:
    """How keys and values are stored: ``dtype`` int8, float8_e4m3fn or float8_e5m2; ``per`` (see `SCALE_AXES`)."""

    dtype: torch.dtype = torch.int8
    per: str = "token"
    bits: int = 8          # int8 only: codes of fewer bits on the same grid (4: [-8, 7])
    rotate: bool = False   # keys and values rotated per head before they are quantized (see the module docstring)

    def __post_init__(self):
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KVCacheFormat.dtype must be one of {KV_DTYPES}, got {self.dtype!r}")
        if self.per not in SCALE_AXES:
            raise ValueError(f"KVCacheFormat.per must be one of {sorted(SCALE_AXES)}, got {self.per!r}")
        if not isinstance(self.bits, int) or not 2 <= self.bits <= 8 or (self.dtype != torch.int8 and self.bits != 8):
            raise ValueError(f"KVCacheFormat.bits must be an int from 2 to 8 (below 8 with dtype int8 only), got "
                             f"{self.bits!r} with {self.dtype}")

    @property
    def label(self) -> str:
        kind = f"int{self.bits}" if self.dtype == torch.int8 else str(self.dtype).replace("torch.float8_", "fp8 ")
        return f"{kind} per {self.per}" + (", rotated" if self.rotate else "")


def _check(x: torch.Tensor) -> None:
    if x.ndim != 4 or not x.is_floating_point():
        raise ValueError(f"a key or value tensor must be floating point (B, kv_heads, T, head_dim), got {x.dtype} "
                         f"{tuple(x.shape)}")


def quantize(x: torch.Tensor, fmt: KVCacheFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``(B, H, T, D)`` -> (codes of ``fmt.dtype`` shaped like ``x``, fp32 scales broadcastable to ``x``)."""
    _check(x)
    xf = x.float()
    amax = xf.abs().amax(dim=SCALE_AXES[fmt.per], keepdim=True)                 # e.g. (B, H, T, 1) per token
    if fmt.dtype == torch.int8:
        half = float(1 << (fmt.bits - 1))
        scale = torch.clamp(amax / (half - 0.5), min=EPS)
        return torch.clamp(torch.round(xf / scale), -half, half - 1).to(torch.int8), scale
    fmax = torch.finfo(fmt.dtype).max
    scale = torch.clamp(amax / fmax, min=EPS)
    return torch.clamp(xf / scale, -fmax, fmax).to(fmt.dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def fake_quantize(x: torch.Tensor, fmt: KVCacheFormat) -> torch.Tensor:
    """quantize -> dequantize, in ``x``'s dtype."""
    q, scale = quantize(x, fmt)
    return dequantize(q, scale, x.dtype)


@functools.lru_cache(maxsize=8)
def _turn(head_dim: int):
    from workbench.quantization.rotation import OnlineHadamard

    return OnlineHadamard(head_dim)


def _shape(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a Hugging Face decoder config."""
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(layers), int(kv_heads), int(head_dim)


def bytes_per_position(config, fmt: KVCacheFormat | None = None, float_bytes: int = 2) -> float:
    """Bytes the cache grows by per token of context, batch 1, all layers, keys and values: codes (``fmt.bits / 8``
    bytes with ``fmt``, else ``float_bytes``) plus, per token, its fp32 scales (``per="token"`` only; the other
    scales do not grow with the context, see `cache_bytes`)."""
    layers, kv_heads, head_dim = _shape(config)
    values = 2 * layers * kv_heads * head_dim
    if fmt is None:
        return float(values * float_bytes)
    scales = 2 * layers * kv_heads * 4 if fmt.per == "token" else 0
    return float(values * fmt.bits / 8 + scales)


def cache_bytes(config, context: int, fmt: KVCacheFormat | None = None, float_bytes: int = 2) -> float:
    """Bytes of the whole KV cache at ``context`` tokens, batch 1 (what one decode step reads)."""
    if not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be a non-negative int, got {context!r}")
    layers, kv_heads, head_dim = _shape(config)
    fixed = 0
    if fmt is not None and fmt.per != "token":
        per_layer = kv_heads * (head_dim if fmt.per == "channel" else 1)
        fixed = 2 * layers * per_layer * 4
    return bytes_per_position(config, fmt, float_bytes) * context + fixed


@contextlib.contextmanager
def quantized_kv_cache(model: nn.Module, fmt: KVCacheFormat) -> Iterator[nn.Module]:
    """Within the block, ``model`` attends to keys and values fake-quantized in ``fmt``; its attention
    implementation is restored on exit (also on error). Needs a transformers model whose attention goes through
    ``AttentionInterface`` (``config._attn_implementation``, ``set_attn_implementation``) and one of its
    registered functions (e.g. "sdpa", the default)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    if previous is None or not callable(getattr(model, "set_attn_implementation", None)):
        raise TypeError(f"{type(model).__name__} is not a transformers model with a pluggable attention "
                        f"implementation (config._attn_implementation); quantized_kv_cache cannot reach its cache")
    if not isinstance(fmt, KVCacheFormat):
        raise TypeError(f"fmt must be a KVCacheFormat, got {type(fmt).__name__}")
    inner = ALL_ATTENTION_FUNCTIONS.get(previous)
    if inner is None:
        raise ValueError(f"quantized_kv_cache wraps a registered attention function, and {type(model).__name__}'s "
                         f"{previous!r} is not one; call model.set_attn_implementation('sdpa') first")

    def attend(module, query, key, value, attention_mask, **kwargs):
        if not fmt.rotate:
            return inner(module, query, fake_quantize(key, fmt), fake_quantize(value, fmt), attention_mask, **kwargs)
        turn = _turn(key.shape[-1])
        query, key, value = turn.rotate(query), turn.rotate(key), turn.rotate(value)
        out, *rest = inner(module, query, fake_quantize(key, fmt), fake_quantize(value, fmt), attention_mask, **kwargs)
        return (turn.rotate(out, transpose=True), *rest)   # (B, T, heads, head_dim): the values' rotation undone

    name = (f"workbench_kv_{str(fmt.dtype).replace('torch.', '')}{fmt.bits}_{fmt.per}{'_rot' * fmt.rotate}_"
            f"{previous}")
    ALL_ATTENTION_FUNCTIONS.register(name, attend)
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
