"""Attention-head pruning (`wb.prune.attention_heads`, `head_importance`): remove whole heads of every attention
block - the query / key / value output channels and the output projection's input channels of those heads - and
update the block's own head bookkeeping, so the model is smaller and its forward runs unchanged.

Blocks are recognised by layout (`LAYOUTS`, one class per family, each checked by shape):

- `_BertLayout`: BERT / MiniLM (``self.query/key/value`` + ``output.dense``; ``num_attention_heads``,
  ``all_head_size``);
- `_GPT2Layout`: GPT-2 (one fused ``c_attn`` - query, key, value side by side - and ``c_proj``; transformers'
  Conv1D or, once canonicalised, nn.Linear; ``num_heads``, ``split_size``);
- `_QKVOLayout`: Llama / Mistral / Qwen and ViT (``q_proj/k_proj/v_proj/o_proj``, ``head_dim``). With grouped-query
  attention (fewer key/value heads than query heads) a removable unit is a key/value head together with the
  query heads that share it, so ``num_key_value_groups`` stays right;
- `_T5Layout`: T5 (``q/k/v/o``, ``n_heads``, ``inner_dim``). The first block of a T5 stack computes a relative
  position bias for all heads that every later block of the stack reuses, so every block of a stack keeps the same
  heads (chosen by their summed importance) and the bias table (``relative_attention_bias``) keeps their columns.

``nn.MultiheadAttention`` is refused: its projections must be ``embed_dim`` wide (PyTorch's
``multi_head_attention_forward`` and the fused TransformerEncoderLayer path assume it), so heads cannot be removed
without replacing the module. The result records a plan of `KeptHeads` entries, so `wb.save` / `wb.load` rebuild
the pruned blocks.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workbench.plans.layers import applied_plans, record_plan
from workbench.plans.plan import Plan
from workbench.plans.registry import Config, Handler, register_config
from workbench.pruning.structured import _is_layer, _take, is_conv1d_hf, out_in, run

__all__ = ["KeptHeads", "attention_heads", "head_importance", "LAYOUTS"]


def _rows(units: torch.Tensor, width: int) -> torch.Tensor:
    """Channel indices of ``units`` blocks of ``width`` consecutive channels."""
    return (units[:, None] * width + torch.arange(width)[None, :]).reshape(-1)


def _out_view(layer: nn.Module) -> torch.Tensor:
    """The weight with output channels first (a view: writing to it writes the layer)."""
    return layer.weight.T if is_conv1d_hf(layer) else layer.weight


class _Layout:
    """One attention family. ``units``: removable units (heads, or key/value groups); ``per_unit``: query heads
    per unit; ``values``: (layer, output channels) holding one unit's values (zero them and the unit is off)."""

    def match(self, m: nn.Module) -> bool:
        raise NotImplementedError

    def head_dim(self, m: nn.Module) -> int:
        raise NotImplementedError

    def heads(self, m: nn.Module) -> int:
        raise NotImplementedError

    def per_unit(self, m: nn.Module) -> int:
        return 1

    def values(self, m: nn.Module, unit: int) -> tuple[nn.Module, torch.Tensor]:
        raise NotImplementedError

    def keep(self, m: nn.Module, units: torch.Tensor) -> None:
        """Cut ``m`` (in place) down to ``units``."""
        raise NotImplementedError

    def tie_key(self, name: str, m: nn.Module) -> str:
        """Blocks with the same key keep the same heads."""
        return name


class _BertLayout(_Layout):
    def match(self, m):
        sa = getattr(m, "self", None)
        return all(isinstance(getattr(sa, k, None), nn.Linear) for k in ("query", "key", "value")) and \
            isinstance(getattr(getattr(m, "output", None), "dense", None), nn.Linear) and \
            hasattr(sa, "attention_head_size")

    def head_dim(self, m):
        return m.self.attention_head_size

    def heads(self, m):
        return m.self.query.out_features // self.head_dim(m)

    def values(self, m, unit):
        return m.self.value, _rows(torch.tensor([unit]), self.head_dim(m))

    def keep(self, m, units):
        sa, rows = m.self, _rows(units, self.head_dim(m))
        sa.query, sa.key, sa.value = (_take(getattr(sa, k), out_idx=rows) for k in ("query", "key", "value"))
        m.output.dense = _take(m.output.dense, in_idx=rows)
        sa.num_attention_heads, sa.all_head_size = len(units), len(rows)


class _GPT2Layout(_Layout):
    def match(self, m):
        return all(hasattr(m, k) for k in ("c_attn", "c_proj", "num_heads", "head_dim", "split_size")) and \
            _is_layer(m.c_attn) and _is_layer(m.c_proj)

    def head_dim(self, m):
        return m.head_dim

    def heads(self, m):
        return m.split_size // m.head_dim

    def _check(self, m):
        if getattr(m, "is_cross_attention", False):
            raise ValueError("cross-attention (q_attn + c_attn holding key and value) is not supported")

    def values(self, m, unit):
        self._check(m)
        return m.c_attn, 2 * m.split_size + _rows(torch.tensor([unit]), m.head_dim)

    def keep(self, m, units):
        self._check(m)
        rows = _rows(units, m.head_dim)
        m.c_attn = _take(m.c_attn, out_idx=torch.cat([rows, m.split_size + rows, 2 * m.split_size + rows]))
        m.c_proj = _take(m.c_proj, in_idx=rows)
        m.num_heads, m.split_size = len(units), len(rows)


class _QKVOLayout(_Layout):
    def match(self, m):
        return all(_is_layer(getattr(m, k, None) or nn.Identity()) for k in ("q_proj", "k_proj", "v_proj", "o_proj")) \
            and isinstance(getattr(m, "head_dim", None), int)

    def head_dim(self, m):
        return m.head_dim

    def heads(self, m):
        return out_in(m.q_proj)[0] // m.head_dim

    def per_unit(self, m):
        return self.heads(m) // (out_in(m.k_proj)[0] // m.head_dim)

    def values(self, m, unit):
        return m.v_proj, _rows(torch.tensor([unit]), m.head_dim)

    def keep(self, m, units):
        g, d = self.per_unit(m), m.head_dim
        q_heads = _rows(units, g)                      # the query heads of the kept key/value units
        q_rows, kv_rows = _rows(q_heads, d), _rows(units, d)
        m.q_proj = _take(m.q_proj, out_idx=q_rows)
        m.k_proj, m.v_proj = _take(m.k_proj, out_idx=kv_rows), _take(m.v_proj, out_idx=kv_rows)
        m.o_proj = _take(m.o_proj, in_idx=q_rows)
        for attr, value in (("num_heads", len(q_heads)), ("num_attention_heads", len(q_heads)),
                            ("num_key_value_heads", len(units))):
            if isinstance(getattr(m, attr, None), int):
                setattr(m, attr, value)


class _T5Layout(_Layout):
    def match(self, m):
        return all(isinstance(getattr(m, k, None), nn.Linear) for k in ("q", "k", "v", "o")) and \
            hasattr(m, "n_heads") and hasattr(m, "key_value_proj_dim")

    def head_dim(self, m):
        return m.key_value_proj_dim

    def heads(self, m):
        return m.n_heads

    def values(self, m, unit):
        return m.v, _rows(torch.tensor([unit]), m.key_value_proj_dim)

    def keep(self, m, units):
        rows = _rows(units, m.key_value_proj_dim)
        m.q, m.k, m.v = (_take(getattr(m, k), out_idx=rows) for k in ("q", "k", "v"))
        m.o = _take(m.o, in_idx=rows)
        m.n_heads, m.inner_dim = len(units), len(rows)
        bias = getattr(m, "relative_attention_bias", None)
        if bias is not None:                                       # (buckets, heads): keep the heads' columns
            new = nn.Embedding(bias.num_embeddings, len(units), device=bias.weight.device, dtype=bias.weight.dtype)
            with torch.no_grad():
                new.weight.copy_(bias.weight[:, units])
            m.relative_attention_bias = new

    def tie_key(self, name, m):
        # blocks of one stack share the first block's position bias: ``encoder.block.3.layer.0.SelfAttention``
        stack, _, rest = name.partition(".block.")
        return f"{stack}.block.*.{rest.split('.', 1)[-1].split('.', 1)[-1]}" if rest else name


LAYOUTS: tuple[_Layout, ...] = (_BertLayout(), _GPT2Layout(), _T5Layout(), _QKVOLayout())


def _layout_of(m: nn.Module) -> _Layout | None:
    return next((lay for lay in LAYOUTS if lay.match(m)), None)


def _blocks(model: nn.Module) -> dict[str, _Layout]:
    mha = [n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    if mha:
        raise ValueError(f"{mha[0]!r} is an nn.MultiheadAttention, whose query/key/value projections must stay "
                         f"embed_dim wide (PyTorch's attention function and the fused TransformerEncoderLayer path "
                         f"assume it): its heads cannot be removed in place. Prune its feed-forward channels "
                         f"instead (wb.prune.channels with consumers=wb.prune.transformer_ffn_consumers(model))")
    out = {}
    for name, m in model.named_modules():
        if any(name.startswith(o + ".") for o in out):
            continue
        lay = _layout_of(m)
        if lay is not None:
            out[name] = lay
    if not out:
        raise ValueError(f"found no attention block in {type(model).__name__} (known layouts: BERT self.query/key/"
                         f"value + output.dense; GPT-2 c_attn + c_proj; Llama/ViT q_proj/k_proj/v_proj/o_proj; "
                         f"T5 q/k/v/o)")
    return out


def head_importance(model: nn.Module, calibration, reference=None) -> dict[str, torch.Tensor]:
    """Per attention block, the importance of each removable unit (a head; with grouped-query attention a
    key/value group): how far the model output moves (1 - cosine similarity, averaged over the calibration
    batches) when that unit alone is switched off (its values set to zero). Batches are tensors, tuples or
    dicts of keyword inputs (Hugging Face); a ModelOutput is read through its logits / last_hidden_state."""
    blocks = _blocks(model)
    batches = list(calibration)
    if not batches:
        raise ValueError("head_importance needs calibration batches")
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            ref = reference if reference is not None else [run(model, b) for b in batches]
            scores = {}
            for name, lay in blocks.items():
                block = model.get_submodule(name)
                units = lay.heads(block) // lay.per_unit(block)
                s = torch.zeros(units)
                for u in range(units):
                    layer, rows = lay.values(block, u)
                    w = _out_view(layer)
                    saved_w = w[rows].clone()
                    saved_b = layer.bias[rows].clone() if layer.bias is not None else None
                    w[rows] = 0   # a head with zero values outputs zero
                    if saved_b is not None:
                        layer.bias[rows] = 0
                    try:
                        s[u] = sum(float(1 - F.cosine_similarity(run(model, b).flatten(1).float(),
                                                                 r.flatten(1).float()).mean())
                                   for b, r in zip(batches, ref, strict=True)) / len(batches)
                    finally:
                        w[rows] = saved_w
                        if saved_b is not None:
                            layer.bias[rows] = saved_b
                scores[name] = s
    finally:
        model.train(was_training)
    return scores


def attention_heads(model: nn.Module, heads: int, calibration, importance: dict[str, torch.Tensor] | None = None):
    """A copy of ``model`` with the ``heads`` least important query heads of every attention block removed (see
    the module docstring). With grouped-query attention ``heads`` must be a multiple of the query heads per
    key/value head (whole groups go); T5 blocks of one stack lose the same heads."""
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 0:
        raise ValueError(f"heads must be a non-negative int, got {heads!r}")
    target = copy.deepcopy(model)
    blocks = _blocks(target)
    importance = importance if importance is not None else head_importance(target, calibration)
    tied: dict[str, list[str]] = {}
    for name, lay in blocks.items():
        tied.setdefault(lay.tie_key(name, target.get_submodule(name)), []).append(name)
    kept: dict[str, torch.Tensor] = {}
    for names in tied.values():
        lay, block = blocks[names[0]], target.get_submodule(names[0])
        total, per = lay.heads(block), lay.per_unit(block)
        if heads % per:
            raise ValueError(f"{names[0]!r} has grouped-query attention ({per} query heads per key/value head): "
                             f"remove a multiple of {per} heads, not {heads}")
        if heads >= total:
            raise ValueError(f"removing {heads} heads would remove every head of {names[0]!r} ({total} heads)")
        score = sum(importance[n] for n in names)
        units = torch.sort(torch.topk(score, (total - heads) // per).indices).values
        for n in names:
            kept[n] = units
    with torch.no_grad():
        for name, units in kept.items():
            blocks[name].keep(target.get_submodule(name), units)
    entries = {name: KeptHeads(heads=len(units) * blocks[name].per_unit(model.get_submodule(name)))
               for name, units in kept.items()}
    record_plan(target, (*applied_plans(model), Plan(entries)))
    return target


class _KeptHeadsHandler(Handler):
    """Rebuilds the blocks `attention_heads` cut, so `wb.load` can restore them (the file holds the values)."""

    def why_not(self, module: nn.Module, config) -> str | None:
        return None if _layout_of(module) is not None else "KeptHeads rebuilds attention blocks of known layouts"

    def supports(self, module: nn.Module, config) -> bool:
        return self.why_not(module, config) is None

    def needs_calibration(self, config) -> bool:
        return False

    def apply(self, name, module, config, inputs):
        raise ValueError(f"{name!r}: KeptHeads records what wb.prune.attention_heads removed; it cannot choose "
                         f"heads itself - call wb.prune.attention_heads instead")

    def skeleton(self, name, module, config):
        lay = _layout_of(module)
        per = lay.per_unit(module)
        if config.heads % per or not 0 < config.heads <= lay.heads(module):
            raise ValueError(f"{name!r} has {lay.heads(module)} heads ({per} per key/value head): cannot keep "
                             f"{config.heads}")
        new = copy.deepcopy(module)
        with torch.no_grad():
            lay.keep(new, torch.arange(config.heads // per))
        return new


@register_config(_KeptHeadsHandler(), kind="prune.KeptHeads")
@dataclass(frozen=True)
class KeptHeads(Config):
    """Recorded per attention block by `attention_heads`: how many query heads remain."""

    heads: int = 1
