"""Attention-head pruning (`wb.prune.attention_heads`, `head_importance`): remove whole heads of every attention
block - the query / key / value output channels and the output projection's input channels of those heads - and
update the block's own head bookkeeping, so the model is smaller and its forward runs unchanged.

Blocks are recognised by layout (`LAYOUTS`, one class per family, each checked by shape):

- `_BertLayout`: BERT / MiniLM and older Swin (``self.query/key/value`` + ``output.dense``; ``num_attention_heads``,
  ``all_head_size``);
- `_DebertaLayout`: DeBERTa-v2 (``self.query_proj/key_proj/value_proj`` + ``output.dense``). With relative attention
  and unshared keys, ``pos_key_proj`` / ``pos_query_proj`` project the shared relative embeddings into heads: they
  lose the same heads' rows;
- `_GPT2Layout`: GPT-2 (one fused ``c_attn`` - query, key, value side by side - and ``c_proj``; transformers'
  Conv1D or, once canonicalised, nn.Linear; ``num_heads``, ``split_size``);
- `_QKVOLayout`: Llama / Mistral / Qwen, ViT and Swin (``q_proj/k_proj/v_proj/o_proj``, ``head_dim``);
  `_QKVOutLayout`: OPT / BART / CLIP (the same with ``out_proj``, ``num_heads``). With grouped-query attention (fewer
  key/value heads than query heads) a removable unit is a key/value head together with the query heads that share
  it, so ``num_key_value_groups`` stays right;
- `_Phi3Layout`: Phi-3 (one fused ``qkv_proj``: all query heads, then the key heads, then the value heads; its
  forward reads ``config.num_attention_heads``, so a pruned block gets its own copy of the config);
- `_NeoXLayout`: GPT-NeoX / Pythia (fused ``query_key_value`` laid out per head as (query, key, value), ``dense``);
- `_FalconLayout`: Falcon (fused ``query_key_value`` + ``dense``, FalconLinear). Multi-query (one key/value head
  shared by every query head): only query heads go; the new decoder architecture: key/value groups go; classic
  multi-head: per-head (query, key, value) as GPT-NeoX. ALiBi blocks are refused (the model builds one bias per
  head of its config, outside the block);
- `_T5Layout`: T5 (``q/k/v/o``, ``n_heads``, ``inner_dim``). The first block of a T5 stack computes a relative
  position bias for all heads that every later block of the stack reuses, so every block of a stack keeps the same
  heads (chosen by their summed importance) and the bias table (``relative_attention_bias``) keeps their columns.

A per-head position-bias table inside a block (Swin's and BEiT's ``relative_position_bias_table``: rows =
positions, columns = heads) keeps the kept heads' columns. ``nn.MultiheadAttention`` is refused: its projections
must be ``embed_dim`` wide (PyTorch's ``multi_head_attention_forward`` and the fused TransformerEncoderLayer path
assume it), so heads cannot be removed without replacing the module. After cutting, the pruned model runs one
calibration batch: a block whose forward reads a head count no layout updates is refused, naming it, instead of
handing back a model that crashes. The result records a plan of `KeptHeads` entries, so `wb.save` / `wb.load`
rebuild the pruned blocks.
"""
from __future__ import annotations

import copy
import re
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


def _in_view(layer: nn.Module) -> torch.Tensor:
    """The weight with input features first (a view)."""
    return layer.weight if is_conv1d_hf(layer) else layer.weight.T


def _cut(layer: nn.Module, out_idx: torch.Tensor | None = None, in_idx: torch.Tensor | None = None) -> nn.Module:
    """`_take`, keeping an nn.Linear subclass built like nn.Linear (Falcon's FalconLinear) of its own class."""
    new = _take(layer, out_idx=out_idx, in_idx=in_idx)
    cls = type(layer)
    if isinstance(layer, nn.Linear) and cls is not nn.Linear and cls.__init__ is nn.Linear.__init__:
        same = cls(new.in_features, new.out_features, bias=new.bias is not None, device=new.weight.device,
                   dtype=new.weight.dtype)
        same.load_state_dict(new.state_dict())
        new = same.train(layer.training)
    return new


def _keep_bias_tables(m: nn.Module, heads: torch.Tensor, total: int) -> None:
    """Cut every per-head position-bias table under ``m`` (Swin / BEiT ``relative_position_bias_table``:
    (positions, heads)) down to the kept query ``heads``."""
    for name, p in list(m.named_parameters()):
        owner_name, _, attr = name.rpartition(".")
        if attr == "relative_position_bias_table" and p.dim() == 2 and p.shape[1] == total:
            owner = m.get_submodule(owner_name) if owner_name else m
            setattr(owner, attr, nn.Parameter(p.detach()[:, heads].clone(), requires_grad=p.requires_grad))


def _linear_like(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or is_conv1d_hf(m)


class _Layout:
    """One attention family. ``units``: removable units (heads, or key/value groups); ``per_unit``: query heads
    per unit; ``values``: (layer, output channels) holding one unit's values (zero them and the unit is off);
    ``off``: the tensors `head_importance` zeroes to switch a unit off; ``why_not``: a matched block's refusal."""

    def match(self, m: nn.Module) -> bool:
        raise NotImplementedError

    def why_not(self, m: nn.Module) -> str | None:
        """Why a block of this layout cannot lose heads (None: it can)."""
        return None

    def head_dim(self, m: nn.Module) -> int:
        raise NotImplementedError

    def heads(self, m: nn.Module) -> int:
        raise NotImplementedError

    def per_unit(self, m: nn.Module) -> int:
        return 1

    def values(self, m: nn.Module, unit: int) -> tuple[nn.Module, torch.Tensor]:
        raise NotImplementedError

    def off(self, m: nn.Module, unit: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tensor, index) pairs: zeroing ``tensor[index]`` switches ``unit`` off (its values, weight and bias)."""
        layer, rows = self.values(m, unit)
        return [(_out_view(layer), rows)] + ([(layer.bias, rows)] if layer.bias is not None else [])

    def keep(self, m: nn.Module, units: torch.Tensor) -> None:
        """Cut ``m`` (in place) down to ``units``."""
        raise NotImplementedError

    def tie_key(self, name: str, m: nn.Module) -> str:
        """Blocks with the same key keep the same heads."""
        return name


class _BertLayout(_Layout):
    qkv = ("query", "key", "value")
    extra: tuple[str, ...] = ()   # more per-head projections of ``self`` (lose the same rows when present)

    def match(self, m):
        sa = getattr(m, "self", None)
        return all(isinstance(getattr(sa, k, None), nn.Linear) for k in self.qkv) and \
            isinstance(getattr(getattr(m, "output", None), "dense", None), nn.Linear) and \
            hasattr(sa, "attention_head_size")

    def head_dim(self, m):
        return m.self.attention_head_size

    def heads(self, m):
        return getattr(m.self, self.qkv[0]).out_features // self.head_dim(m)

    def values(self, m, unit):
        return getattr(m.self, self.qkv[2]), _rows(torch.tensor([unit]), self.head_dim(m))

    def keep(self, m, units):
        sa, rows, total = m.self, _rows(units, self.head_dim(m)), self.heads(m)
        for k in (*self.qkv, *self.extra):
            if isinstance(getattr(sa, k, None), nn.Linear):
                setattr(sa, k, _cut(getattr(sa, k), out_idx=rows))
        m.output.dense = _cut(m.output.dense, in_idx=rows)
        sa.num_attention_heads, sa.all_head_size = len(units), len(rows)
        _keep_bias_tables(m, units, total)


class _DebertaLayout(_BertLayout):
    qkv = ("query_proj", "key_proj", "value_proj")
    extra = ("pos_key_proj", "pos_query_proj")   # relative embeddings projected into heads (share_att_key=False)


def _has_layer(m: nn.Module, attr: str) -> bool:
    layer = getattr(m, attr, None)
    return layer is not None and _is_layer(layer)


def _set_ints(m: nn.Module, **values: int) -> None:
    """Set the head counts ``m`` keeps as int attributes (those it has)."""
    for attr, value in values.items():
        if isinstance(getattr(m, attr, None), int):
            setattr(m, attr, value)


class _GPT2Layout(_Layout):
    def match(self, m):
        return all(hasattr(m, k) for k in ("c_attn", "c_proj", "num_heads", "head_dim", "split_size")) and \
            _is_layer(m.c_attn) and _is_layer(m.c_proj)

    def head_dim(self, m):
        return m.head_dim

    def heads(self, m):
        return m.split_size // m.head_dim

    def why_not(self, m):
        if getattr(m, "is_cross_attention", False):
            return "cross-attention (q_attn + c_attn holding key and value) is not supported"
        return None

    def values(self, m, unit):
        return m.c_attn, 2 * m.split_size + _rows(torch.tensor([unit]), m.head_dim)

    def keep(self, m, units):
        rows = _rows(units, m.head_dim)
        m.c_attn = _cut(m.c_attn, out_idx=torch.cat([rows, m.split_size + rows, 2 * m.split_size + rows]))
        m.c_proj = _cut(m.c_proj, in_idx=rows)
        m.num_heads, m.split_size = len(units), len(rows)


class _QKVOLayout(_Layout):
    out = "o_proj"

    def match(self, m):
        return all(_has_layer(m, k) for k in ("q_proj", "k_proj", "v_proj", self.out)) \
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
        g, d, total = self.per_unit(m), m.head_dim, self.heads(m)
        q_heads = _rows(units, g)                      # the query heads of the kept key/value units
        q_rows, kv_rows = _rows(q_heads, d), _rows(units, d)
        m.q_proj = _cut(m.q_proj, out_idx=q_rows)
        m.k_proj, m.v_proj = _cut(m.k_proj, out_idx=kv_rows), _cut(m.v_proj, out_idx=kv_rows)
        setattr(m, self.out, _cut(getattr(m, self.out), in_idx=q_rows))
        _set_ints(m, num_heads=len(q_heads), num_attention_heads=len(q_heads), num_key_value_heads=len(units))
        _keep_bias_tables(m, q_heads, total)


class _QKVOutLayout(_QKVOLayout):
    out = "out_proj"

    def match(self, m):   # (not nn.MultiheadAttention split into these projections: its width is fixed)
        from workbench.models.canonical import SplitMultiheadAttention

        return not isinstance(m, (nn.MultiheadAttention, SplitMultiheadAttention)) and super().match(m)


class _Phi3Layout(_Layout):
    """Fused ``qkv_proj`` rows: H query heads, then KV key heads, then KV value heads (``head_dim`` each)."""

    def match(self, m):
        return _has_layer(m, "qkv_proj") and _has_layer(m, "o_proj") and \
            isinstance(getattr(m, "head_dim", None), int) and isinstance(getattr(m, "num_key_value_heads", None), int) \
            and out_in(m.qkv_proj)[0] == out_in(m.o_proj)[1] + 2 * m.num_key_value_heads * m.head_dim

    def head_dim(self, m):
        return m.head_dim

    def heads(self, m):
        return out_in(m.o_proj)[1] // m.head_dim

    def per_unit(self, m):
        return self.heads(m) // m.num_key_value_heads

    def values(self, m, unit):
        d = m.head_dim
        return m.qkv_proj, (self.heads(m) + m.num_key_value_heads) * d + _rows(torch.tensor([unit]), d)

    def keep(self, m, units):
        g, d, h, kv = self.per_unit(m), m.head_dim, self.heads(m), m.num_key_value_heads
        q_heads = _rows(units, g)
        q_rows, kv_rows = _rows(q_heads, d), _rows(units, d)
        m.qkv_proj = _cut(m.qkv_proj, out_idx=torch.cat([q_rows, h * d + kv_rows, (h + kv) * d + kv_rows]))
        m.o_proj = _cut(m.o_proj, in_idx=q_rows)
        _set_ints(m, num_heads=len(q_heads), num_attention_heads=len(q_heads), num_key_value_heads=len(units))
        config = getattr(m, "config", None)
        if isinstance(getattr(config, "num_attention_heads", None), int):
            # Phi-3's forward splits qkv at config.num_attention_heads * head_dim; the config is shared by every
            # block (and the model), so this block gets its own copy
            m.config = copy.copy(config)
            _set_ints(m.config, num_attention_heads=len(q_heads), num_key_value_heads=len(units))


class _NeoXLayout(_Layout):
    """Fused ``query_key_value`` rows per head: (query, key, value), ``head_size`` each."""

    def match(self, m):
        return _has_layer(m, "query_key_value") and _has_layer(m, "dense") and \
            isinstance(getattr(m, "head_size", None), int) and \
            out_in(m.query_key_value)[0] == 3 * out_in(m.dense)[1]

    def head_dim(self, m):
        return m.head_size

    def heads(self, m):
        return out_in(m.dense)[1] // m.head_size

    def values(self, m, unit):
        d = m.head_size
        return m.query_key_value, unit * 3 * d + 2 * d + torch.arange(d)

    def keep(self, m, units):
        m.query_key_value = _cut(m.query_key_value, out_idx=_rows(units, 3 * m.head_size))
        m.dense = _cut(m.dense, in_idx=_rows(units, m.head_size))
        _set_ints(m, num_heads=len(units), num_attention_heads=len(units))


class _FalconLayout(_Layout):
    """Falcon's fused ``query_key_value`` (FalconLinear), three ways: the new decoder architecture (per key/value
    group: its query heads, then one key and one value head), multi-query (every query head, then one shared key
    and one value head) and classic multi-head (per head: query, key, value)."""

    def match(self, m):
        return all(isinstance(getattr(m, k, None), nn.Linear) for k in ("query_key_value", "dense")) and \
            all(hasattr(m, k) for k in ("new_decoder_architecture", "multi_query", "num_heads", "num_kv_heads",
                                        "head_dim"))

    def why_not(self, m):
        if getattr(getattr(m, "config", None), "alibi", False):
            return ("uses ALiBi: the model builds one position bias per head of its config outside the block, "
                    "so the block cannot lose heads alone")
        return None

    def head_dim(self, m):
        return m.head_dim

    def heads(self, m):
        return m.num_heads

    def per_unit(self, m):
        return m.num_heads // m.num_kv_heads if m.new_decoder_architecture else 1

    def _width(self, m):
        """Fused rows per unit (None: multi-query, whose units are query heads alone)."""
        if m.new_decoder_architecture:
            return (self.per_unit(m) + 2) * m.head_dim
        return None if m.multi_query else 3 * m.head_dim

    def values(self, m, unit):
        width = self._width(m)
        if width is None:
            raise ValueError("multi-query attention: every query head shares one value head")
        return m.query_key_value, unit * width + width - m.head_dim + torch.arange(m.head_dim)

    def off(self, m, unit):
        if self._width(m) is None:   # the value head is shared: switch the query head off at the output instead
            return [(_in_view(m.dense), _rows(torch.tensor([unit]), m.head_dim))]
        return super().off(m, unit)

    def keep(self, m, units):
        d, width, g = m.head_dim, self._width(m), self.per_unit(m)
        q_heads = _rows(units, g)
        if width is None:
            rows = torch.cat([_rows(units, d), m.num_heads * d + torch.arange(2 * d)])
        else:
            rows = _rows(units, width)
        m.query_key_value = _cut(m.query_key_value, out_idx=rows)
        m.dense = _cut(m.dense, in_idx=_rows(q_heads, d))
        kv = len(units) if m.new_decoder_architecture or not m.multi_query else m.num_kv_heads
        m.num_heads, m.num_kv_heads = len(q_heads), kv


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
        m.q, m.k, m.v = (_cut(getattr(m, k), out_idx=rows) for k in ("q", "k", "v"))
        m.o = _cut(m.o, in_idx=rows)
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


LAYOUTS: tuple[_Layout, ...] = (_BertLayout(), _DebertaLayout(), _GPT2Layout(), _T5Layout(), _QKVOLayout(),
                                _QKVOutLayout(), _Phi3Layout(), _NeoXLayout(), _FalconLayout())
_KNOWN = ("BERT self.query/key/value + output.dense; DeBERTa self.query_proj/key_proj/value_proj + output.dense; "
          "GPT-2 c_attn + c_proj; Llama/ViT/Swin q_proj/k_proj/v_proj/o_proj; OPT q_proj/k_proj/v_proj/out_proj; "
          "Phi-3 qkv_proj + o_proj; GPT-NeoX and Falcon query_key_value + dense; T5 q/k/v/o")
_ATTENTION_NAME = re.compile(r"attn|attention", re.IGNORECASE)


def _layout_of(m: nn.Module) -> _Layout | None:
    return next((lay for lay in LAYOUTS if lay.match(m)), None)


def _no_block_message(model: nn.Module) -> str:
    """Why no block was found, naming the modules that look like attention (named so, holding projections)."""
    seen: dict[str, list[str]] = {}
    for name, m in model.named_modules():
        if not _ATTENTION_NAME.search(name.rpartition(".")[2]) or any(name.startswith(s + ".") for s in seen):
            continue
        projections = [n for n, c in m.named_modules() if n and _linear_like(c)]
        if projections:
            seen[name] = projections
    if not seen:
        return (f"found no attention block in {type(model).__name__}: no module named like attention holds "
                f"linear projections (known layouts: {_KNOWN})")
    shown = ", ".join(f"{n!r} ({type(model.get_submodule(n)).__name__}, projections {', '.join(p[:6])})"
                      for n, p in list(seen.items())[:3])
    more = f" and {len(seen) - 3} more" if len(seen) > 3 else ""
    return (f"found no attention block of a known layout in {type(model).__name__}: {shown}{more} match none of "
            f"the known layouts (their projections or head-count attributes differ): {_KNOWN}")


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
            why = lay.why_not(m)
            if why is not None:
                raise ValueError(f"cannot remove heads of {name!r} ({type(m).__name__}): {why}")
            out[name] = lay
    if not out:
        raise ValueError(_no_block_message(model))
    return out


def head_importance(model: nn.Module, calibration, reference=None) -> dict[str, torch.Tensor]:
    """Per attention block, the importance of each removable unit (a head; with grouped-query attention a
    key/value group): how far the model output moves (1 - cosine similarity, averaged over the calibration
    batches) when that unit alone is switched off (its values - or, where query heads share a value head, its
    output columns - set to zero). Batches are tensors, tuples or dicts of keyword inputs (Hugging Face); a
    ModelOutput is read through its logits / last_hidden_state."""
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
                    pairs = lay.off(block, u)
                    saved = [t[i].clone() for t, i in pairs]
                    for t, i in pairs:
                        t[i] = 0   # a head with zero values (or zero output columns) contributes nothing
                    try:
                        s[u] = sum(float(1 - F.cosine_similarity(run(model, b).flatten(1).float(),
                                                                 r.flatten(1).float()).mean())
                                   for b, r in zip(batches, ref, strict=True)) / len(batches)
                    finally:
                        for (t, i), v in zip(pairs, saved, strict=True):
                            t[i] = v
                scores[name] = s
    finally:
        model.train(was_training)
    return scores


def _check_runs(model: nn.Module, names: list[str], lay: _Layout, batches: list) -> None:
    """Run one calibration batch through ``model`` just after ``names`` lost heads: a block whose forward reads a
    head count its layout does not update is refused here, named, rather than crashing after apply."""
    if not batches:
        return
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            run(model, batches[0])
    except Exception as e:
        raise ValueError(f"cannot remove heads of {names[0]!r} ({type(model.get_submodule(names[0])).__name__}): "
                         f"once cut as {type(lay).__name__[1:]}, the model's forward fails ({type(e).__name__}: "
                         f"{e}) - something outside the layout reads its head count") from e
    finally:
        model.train(was_training)


def attention_heads(model: nn.Module, heads: int, calibration, importance: dict[str, torch.Tensor] | None = None):
    """A copy of ``model`` with the ``heads`` least important query heads of every attention block removed (see
    the module docstring). With grouped-query attention ``heads`` must be a multiple of the query heads per
    key/value head (whole groups go); T5 blocks of one stack lose the same heads. The copy runs the first
    calibration batch after each block is cut (a block it breaks is refused, named)."""
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 0:
        raise ValueError(f"heads must be a non-negative int, got {heads!r}")
    batches = list(calibration) if calibration is not None else []
    target = copy.deepcopy(model)
    blocks = _blocks(target)
    importance = importance if importance is not None else head_importance(target, batches)
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
        for names in tied.values():
            for name in names:
                blocks[name].keep(target.get_submodule(name), kept[name])
            _check_runs(target, names, blocks[names[0]], batches)
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
