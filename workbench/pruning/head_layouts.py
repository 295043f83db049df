"""The attention layouts `workbench.pruning.heads` knows (one class per family, each checked by shape): which
projections hold a block's heads, how many there are, what `head_importance` switches off for one, and how
`attention_heads` keeps a subset (the projections' rows and columns, the block's own head bookkeeping, bias tables
with a column per head). See `workbench.pruning.heads` for the layouts' list and what each family needs."""
from __future__ import annotations

import copy
import re

import torch
from torch import nn

from workbench.pruning.structured import _is_layer, _take, is_conv1d_hf, out_in

__all__ = ["LAYOUTS"]


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
