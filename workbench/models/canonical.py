"""Canonical layers: modules whose computation is a Linear in disguise, rewritten as real ``nn.Linear`` children,
so that every technique (quantization, pruning, low rank) sees plain layers.

- Hugging Face ``transformers.pytorch_utils.Conv1D`` (GPT-2 family; weight stored ``(in, out)``, ``y = x W + b``)
  becomes an ``nn.Linear`` holding the transposed weight (same numbers up to fp32 rounding of the GEMM).
- ``nn.MultiheadAttention`` (one packed in-projection) becomes `SplitMultiheadAttention`, the same attention with
  four separate ``nn.Linear`` children ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj``.

Usage, on a model the caller already copied::

    changed = canonicalize(model)            # {"h.0.attn.c_attn": "Conv1D(nx=64, nf=192) -> Linear(64, 192)", ...}

`canonicalize` is deterministic: run on the same base model it builds the same structure with the same names
(``<mha>.q_proj`` ...), so a saved compressed model is reloaded by canonicalising a fresh copy of the base model
first. Conversion is keyed by the exact class (a subclass may compute something else; it is left alone and
`needs_canonical` says False). Parameters shared between converted modules stay shared (one transposed copy per
original Parameter); parameters of other modules (``lm_head`` / ``wte``) are not touched.

PyTorch's fused Transformer fast paths read the packed ``in_proj_weight``; `SplitMultiheadAttention` declares
``_qkv_same_embed_dim = False`` and ``in_proj_weight = None`` (exactly what ``nn.MultiheadAttention`` itself says
when its projections are separate), so ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` take
their ordinary path, which calls ``self_attn(...)``. ``nn.TransformerEncoder`` decides at construction to pack
padded batches into nested tensors for that fast path; `canonicalize` switches that off
(``use_nested_tensor = False``, reported in its result) for an encoder whose attention it replaces. Outputs at
padded positions then hold computed values instead of the fast path's zeros; all other positions are equal.
"""
from __future__ import annotations

import math
import sys
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SplitMultiheadAttention", "conv1d_to_linear", "canonicalize", "needs_canonical", "canonical_types"]


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face Conv1D -> nn.Linear

def conv1d_to_linear(conv, shared: dict[int, nn.Parameter] | None = None) -> nn.Linear:
    """An ``nn.Linear(nx, nf)`` computing what the Hugging Face ``Conv1D`` ``conv`` computes (weight transposed,
    same bias Parameter). ``shared`` maps ``id(original weight)`` to its transposed Parameter, so Conv1D layers
    that share a weight still share one after conversion."""
    w = conv.weight                                                   # (nx, nf)
    new = nn.Linear(conv.nx, conv.nf, bias=conv.bias is not None, device="meta")
    shared = {} if shared is None else shared
    if id(w) not in shared:
        shared[id(w)] = nn.Parameter(w.detach().t().contiguous(), requires_grad=w.requires_grad)  # (nf, nx)
    new.weight = shared[id(w)]
    new.bias = conv.bias                                              # the same Parameter: ties are kept
    return new.train(conv.training)


# ----------------------------------------------------------------------------------------------------------------
# nn.MultiheadAttention -> separate projections

def _additive(mask: torch.Tensor | None, name: str, dtype: torch.dtype) -> torch.Tensor | None:
    """A mask as the float to add to the attention scores: bool True (not allowed) -> -inf, float kept."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise TypeError(f"SplitMultiheadAttention: {name} must be a bool or floating-point tensor, got {mask.dtype}")
    return mask.to(dtype)


class SplitMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with its in-projection split into ``q_proj``, ``k_proj``, ``v_proj`` (nn.Linear
    children, each replaceable by a compressed layer) plus ``out_proj``. Same constructor arguments, same
    ``forward`` signature and the same ``(output, weights)`` results as ``nn.MultiheadAttention``'s reference
    path, including ``batch_first``, unbatched inputs, ``kdim`` / ``vdim``, ``bias``, ``add_bias_kv``,
    ``add_zero_attn``, bool and float ``key_padding_mask`` / ``attn_mask`` (2-D and 3-D), ``need_weights`` /
    ``average_attn_weights``, ``is_causal`` and attention dropout in training. Nested-tensor inputs are refused.

    ``in_proj_weight`` is None and ``_qkv_same_embed_dim`` False (there is no packed projection, as in
    ``nn.MultiheadAttention`` with separate weights), which makes PyTorch's fused paths decline this module;
    ``in_proj_bias`` is the concatenation of the three projection biases (None without bias)."""

    in_proj_weight = None
    _qkv_same_embed_dim = False

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device=None, dtype=None):
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"SplitMultiheadAttention: embed_dim ({embed_dim}) must be a positive multiple of "
                             f"num_heads ({num_heads})")
        kw = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.dropout, self.batch_first = embed_dim, num_heads, dropout, batch_first
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.head_dim = embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias, **kw)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.zeros(1, 1, embed_dim, **kw))
            self.bias_v = nn.Parameter(torch.zeros(1, 1, embed_dim, **kw))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn

    @property
    def in_proj_bias(self) -> torch.Tensor | None:
        """The three projection biases concatenated, as ``nn.MultiheadAttention.in_proj_bias`` (read-only)."""
        biases = [getattr(p, "bias", None) for p in (self.q_proj, self.k_proj, self.v_proj)]
        return None if any(b is None for b in biases) else torch.cat(biases)

    @classmethod
    def from_mha(cls, mha: nn.MultiheadAttention) -> "SplitMultiheadAttention":
        """The same attention as ``mha`` with its weights copied (the packed in-projection split in three; the
        out-projection's Parameters reused)."""
        ref = mha.out_proj.weight
        new = cls(mha.embed_dim, mha.num_heads, mha.dropout, mha.in_proj_bias is not None, mha.bias_k is not None,
                  mha.add_zero_attn, mha.kdim, mha.vdim, mha.batch_first, device="meta")
        E = mha.embed_dim
        if mha._qkv_same_embed_dim:
            weights = mha.in_proj_weight.detach().split(E)                # 3 x (E, E)
        else:
            weights = (mha.q_proj_weight.detach(), mha.k_proj_weight.detach(), mha.v_proj_weight.detach())
        biases = (None,) * 3 if mha.in_proj_bias is None else mha.in_proj_bias.detach().split(E)
        grad = ref.requires_grad
        for proj, w, b in zip((new.q_proj, new.k_proj, new.v_proj), weights, biases):
            proj.weight = nn.Parameter(w.clone(), requires_grad=grad)
            proj.bias = None if b is None else nn.Parameter(b.clone(), requires_grad=grad)
        new.out_proj.weight, new.out_proj.bias = mha.out_proj.weight, mha.out_proj.bias
        if mha.bias_k is not None:
            new.bias_k, new.bias_v = mha.bias_k, mha.bias_v
        return new.train(mha.training)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if query.is_nested or key.is_nested or value.is_nested:
            raise ValueError("SplitMultiheadAttention: nested-tensor inputs are not supported (they come from "
                             "nn.TransformerEncoder's fast path: set its use_nested_tensor = False)")
        batched = query.dim() == 3
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"SplitMultiheadAttention: query, key and value must all be 3-D (batched) or 2-D, got "
                             f"{query.dim()}-D, {key.dim()}-D and {value.dim()}-D")
        if is_causal and attn_mask is None:
            raise RuntimeError("SplitMultiheadAttention: is_causal is a hint that attn_mask is causal and needs "
                               "attn_mask (e.g. nn.Transformer.generate_square_subsequent_mask)")
        # to (N, L, E) whatever the layout
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        N, L, _ = query.shape
        S, H, D = key.shape[1], self.num_heads, self.head_dim
        kpm = _additive(key_padding_mask, "key_padding_mask", query.dtype)       # (N, S)
        # as nn.MultiheadAttention: the hint replaces the mask only when nothing else needs it
        causal_hint = is_causal and kpm is None and not need_weights
        am = None if causal_hint else _additive(attn_mask, "attn_mask", query.dtype)
        if am is not None and am.shape not in ((L, S), (N * H, L, S)):
            raise RuntimeError(f"SplitMultiheadAttention: attn_mask has shape {tuple(am.shape)}, expected {(L, S)} "
                               f"or {(N * H, L, S)}")
        if kpm is not None and kpm.shape != (N, S):
            raise RuntimeError(f"SplitMultiheadAttention: key_padding_mask has shape {tuple(kpm.shape)}, "
                               f"expected {(N, S)}")

        q = self.q_proj(query)                                           # (N, L, E)
        k = self.k_proj(key)                                             # (N, S, E)
        v = self.v_proj(value)                                           # (N, S, E)
        if self.bias_k is not None:                                      # one learned key / value more
            k = torch.cat([k, self.bias_k.expand(N, 1, -1)], dim=1)
            v = torch.cat([v, self.bias_v.expand(N, 1, -1)], dim=1)
            am, kpm = (None if m is None else F.pad(m, (0, 1)) for m in (am, kpm))
        q = q.view(N, L, H, D).transpose(1, 2)                           # (N, H, L, D)
        k = k.view(N, -1, H, D).transpose(1, 2)                          # (N, H, S', D)
        v = v.view(N, -1, H, D).transpose(1, 2)                          # (N, H, S', D)
        if self.add_zero_attn:                                           # one all-zero key / value more
            k = torch.cat([k, k.new_zeros(N, H, 1, D)], dim=2)
            v = torch.cat([v, v.new_zeros(N, H, 1, D)], dim=2)
            am, kpm = (None if m is None else F.pad(m, (0, 1)) for m in (am, kpm))
        Sp = k.shape[2]
        mask = None                                                      # broadcastable to (N, H, L, S')
        if am is not None:
            mask = am if am.dim() == 2 else am.view(N, H, L, Sp)
        if kpm is not None:
            kpm = kpm.view(N, 1, 1, Sp)
            mask = kpm if mask is None else mask + kpm
        p = self.dropout if self.training else 0.0

        if need_weights:
            scores = (q * math.sqrt(1.0 / D)) @ k.transpose(-2, -1)      # (N, H, L, S')
            if mask is not None:
                scores = scores + mask
            weights = scores.softmax(dim=-1)
            if p > 0.0:
                weights = F.dropout(weights, p=p)
            out = weights @ v                                            # (N, H, L, D)
            weights = weights.mean(dim=1) if average_attn_weights else weights
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal_hint)
            weights = None
        out = self.out_proj(out.transpose(1, 2).reshape(N, L, self.embed_dim))   # (N, L, E)
        if not batched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, kdim={self.kdim}, vdim={self.vdim}, "
                f"batch_first={self.batch_first}, dropout={self.dropout}, add_bias_kv={self.bias_k is not None}, "
                f"add_zero_attn={self.add_zero_attn}")


# ----------------------------------------------------------------------------------------------------------------
# the model-level pass

def canonical_types() -> dict[type, Callable[[nn.Module, dict], nn.Module]]:
    """The conversions, keyed by exact class: ``converter(module, shared) -> replacement``. Hugging Face's Conv1D
    is included when ``transformers`` is already imported (a model holding one has imported it)."""
    table: dict[type, Callable[[nn.Module, dict], nn.Module]] = {
        nn.MultiheadAttention: lambda m, shared: SplitMultiheadAttention.from_mha(m)}
    if "transformers" in sys.modules:
        from transformers.pytorch_utils import Conv1D

        table[Conv1D] = conv1d_to_linear
    return table


def needs_canonical(module: nn.Module) -> bool:
    """Whether `canonicalize` would replace this module (its exact class has a conversion)."""
    return type(module) in canonical_types()


def _describe(old: nn.Module, new: nn.Module) -> str:
    if isinstance(new, nn.Linear):
        return f"Conv1D(nx={old.nx}, nf={old.nf}) -> Linear({new.in_features}, {new.out_features})"
    return "MultiheadAttention -> SplitMultiheadAttention (q_proj, k_proj, v_proj, out_proj)"


def canonicalize(model: nn.Module, names: list[str] | None = None) -> dict[str, str]:
    """Replace, in place, the modules named in ``names`` (default: every module `needs_canonical` accepts) by
    their canonical equivalents; returns ``{name: what changed}`` in module order. A name that does not exist or
    has no conversion raises, naming it. A module reachable under several names is converted once and the
    replacement set under every name. An ``nn.TransformerEncoder`` whose attention was replaced gets
    ``use_nested_tensor = False`` (its nested fast path needs the packed projection), reported under its name.
    Deterministic: the same base model gives the same structure and names."""
    table = canonical_types()
    found = [(n, m) for n, m in model.named_modules(remove_duplicate=False) if type(m) in table]
    if names is not None:
        wanted = set(names)
        modules = dict(model.named_modules(remove_duplicate=False))
        for n in names:
            if n not in modules:
                raise ValueError(f"canonicalize: the model has no module named {n!r}")
            if type(modules[n]) not in table:
                raise ValueError(f"canonicalize: {n!r} is a {type(modules[n]).__name__}, which has no canonical "
                                 f"form (convertible: {sorted(t.__name__ for t in table)})")
        found = [(n, m) for n, m in found if n in wanted]
    if any(n == "" for n, _ in found):
        raise ValueError(f"canonicalize: the model itself is a {type(model).__name__}; wrap it in a parent module "
                         "to replace it in place")
    changed: dict[str, str] = {}
    replacements: dict[int, nn.Module] = {}
    shared: dict[int, nn.Parameter] = {}
    for name, old in found:
        if id(old) not in replacements:
            replacements[id(old)] = table[type(old)](old, shared)
        new = replacements[id(old)]
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
        changed[name] = _describe(old, new)
    for name, m in model.named_modules():
        if (isinstance(m, nn.TransformerEncoder) and getattr(m, "use_nested_tensor", False)
                and any(isinstance(layer.self_attn, SplitMultiheadAttention) for layer in m.layers)):
            m.use_nested_tensor = False
            changed[name] = "TransformerEncoder: use_nested_tensor = False (its nested fast path needs a packed " \
                            "in_proj_weight)"
    return changed
