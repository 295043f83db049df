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
- `QuantizedKVCache(model, fmt)`: the real thing for ``per="token"`` - a transformers ``Cache`` whose layers
  (`QuantizedKVLayer`, on transformers' ``BaseQuantizedLayer``) store each new token's keys and values as codes
  (packed two per byte at 4 bits, four at 2; 3-bit codes in 4-bit slots) with its fp32 scales, and hand the
  attention their dequantized history: ``model.generate(ids, past_key_values=QuantizedKVCache(model, fmt))``.
  It computes what `quantized_kv_cache` computes (each token is quantized once, with its own scale), and
  ``cache.nbytes()`` is what it holds (`cache_bytes` of the tokens so far). Per-head and per-channel scales would
  change as tokens arrive (re-quantizing the history, as KIVI's residual window does): refused.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from workbench.quantization import packing
from workbench.quantization.primitives import EPS, FLOAT8_DTYPES

__all__ = ["KVCacheFormat", "SCALE_AXES", "quantize", "dequantize", "fake_quantize", "bytes_per_position",
           "cache_bytes", "quantized_kv_cache", "QuantizedKVCache"]   # (and QuantizedKVLayer, made on first use)

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
    def slot_bits(self) -> int:
        """The bits a stored code takes: 2, 4 (3-bit codes too) or 8."""
        return 2 if self.bits == 2 else 4 if self.bits <= 4 else 8

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
    """Bytes the cache grows by per token of context, batch 1, all layers, keys and values: codes (``fmt.slot_bits /
    8`` bytes with ``fmt``: 3-bit codes in 4-bit slots; else ``float_bytes``) plus, per token, its fp32 scales
    (``per="token"`` only; the other scales do not grow with the context, see `cache_bytes`)."""
    layers, kv_heads, head_dim = _shape(config)
    values = 2 * layers * kv_heads * head_dim
    if fmt is None:
        return float(values * float_bytes)
    scales = 2 * layers * kv_heads * 4 if fmt.per == "token" else 0
    return float(values * fmt.slot_bits / 8 + scales)


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


@functools.cache
def _layer_class():
    """`QuantizedKVLayer`, made on first use on transformers' ``BaseQuantizedLayer`` (so this module imports without
    transformers)."""
    from transformers.cache_utils import BaseQuantizedLayer

    class QuantizedKVLayer(BaseQuantizedLayer):
        """One attention layer's cache: every token's keys and values stored as codes of ``fmt`` with one fp32
        scale per (batch, head, token) - appended as they come, never re-quantized - and read back dequantized
        (turned back when ``fmt.rotate``)."""

        def __init__(self, fmt: KVCacheFormat):
            super().__init__()
            self.fmt = fmt

        def _quantize(self, tensor: torch.Tensor):
            fmt = self.fmt
            if fmt.rotate:
                tensor = _turn(tensor.shape[-1]).rotate(tensor)
            q, scale = quantize(tensor, fmt)
            if fmt.dtype == torch.int8 and fmt.slot_bits < 8:   # unsigned codes, packed along head_dim
                q = packing.pack((q.to(torch.int16) + (1 << (fmt.bits - 1))).to(torch.uint8), fmt.slot_bits)
            return q, scale

        def _dequantize(self, q_tensor) -> torch.Tensor:
            q, scale = q_tensor
            fmt = self.fmt
            if fmt.dtype == torch.int8 and fmt.slot_bits < 8:
                q = packing.unpack(q, fmt.slot_bits, self.head_dim).to(torch.int16) - (1 << (fmt.bits - 1))
            x = dequantize(q, scale, self.dtype)
            return _turn(x.shape[-1]).rotate(x, transpose=True) if fmt.rotate else x

        def lazy_initialization(self, key_states, value_states) -> None:
            super().lazy_initialization(key_states, value_states)
            self.head_dim = key_states.shape[-1]

        def update(self, key_states, value_states, *args, **kwargs):
            self.cumulative_length += key_states.shape[-2]
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self._quantized_keys = self._quantize(key_states)
                self._quantized_values = self._quantize(value_states)
            else:
                new_k, new_v = self._quantize(key_states), self._quantize(value_states)
                self._quantized_keys = tuple(torch.cat([a, b], dim=-2)
                                             for a, b in zip(self._quantized_keys, new_k))
                self._quantized_values = tuple(torch.cat([a, b], dim=-2)
                                               for a, b in zip(self._quantized_values, new_v))
            return self._dequantize(self._quantized_keys), self._dequantize(self._quantized_values)

        def _each(self, fn) -> None:   # every stored tensor (codes and scales) of keys and values
            if self.is_initialized:
                self._quantized_keys = tuple(fn(t) for t in self._quantized_keys)
                self._quantized_values = tuple(fn(t) for t in self._quantized_values)

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            self._each(lambda t: t.index_select(0, beam_idx.to(t.device)))

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            self._each(lambda t: t[indices, ...])

        def batch_repeat_interleave(self, repeats: int) -> None:
            self._each(lambda t: t.repeat_interleave(repeats, dim=0))

        def crop(self, tokens_to_remove: int) -> None:
            """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count)."""
            if tokens_to_remove > 0:
                raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
            n = -tokens_to_remove
            if n == 0 or not self.is_initialized:
                return
            self._each(lambda t: t[..., : t.shape[-2] - n, :])   # (codes and per-token scales: dim -2)
            self.cumulative_length -= n

        def nbytes(self) -> int:
            """Bytes held: codes and scales of keys and values."""
            if not self.is_initialized:
                return 0
            return sum(t.numel() * t.element_size() for t in (*self._quantized_keys, *self._quantized_values))

    return QuantizedKVLayer


def QuantizedKVCache(model: nn.Module, fmt: KVCacheFormat):
    """A transformers ``Cache`` for ``model`` (a decoder with only full-attention layers) whose every layer is a
    `QuantizedKVLayer` of ``fmt`` (``per="token"``); ``cache.nbytes()`` sums what its layers hold. Pass it as
    ``past_key_values`` to ``model.generate`` or to a forward."""
    from transformers.cache_utils import Cache

    if not isinstance(fmt, KVCacheFormat):
        raise TypeError(f"fmt must be a KVCacheFormat, got {type(fmt).__name__}")
    if fmt.per != "token":
        raise ValueError(f"QuantizedKVCache stores {fmt.label}: only per-token scales can be appended as tokens arrive "
                         f"(per-head and per-channel ones would re-quantize the history); use per='token', or "
                         f"quantized_kv_cache to measure the others")
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        raise TypeError(f"{type(model).__name__} is not a transformers decoder (no config.num_hidden_layers)")
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"QuantizedKVCache holds full-attention layers; {type(model).__name__} has {sorted(kinds)}")
    layer = _layer_class()
    cache = Cache(layers=[layer(fmt) for _ in range(config.num_hidden_layers)])
    cache.nbytes = lambda: sum(lay.nbytes() for lay in cache.layers)   # type: ignore[attr-defined]
    return cache


def __getattr__(name: str):
    if name == "QuantizedKVLayer":
        return _layer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
