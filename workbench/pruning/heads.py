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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workbench.plans.layers import applied_plans, record_plan
from workbench.plans.plan import Plan
from workbench.plans.registry import Config, Handler, register_config
from workbench.pruning.head_layouts import _ATTENTION_NAME, _KNOWN, LAYOUTS, _Layout, _layout_of, _linear_like
from workbench.pruning.structured import run

__all__ = ["KeptHeads", "attention_heads", "head_importance", "LAYOUTS"]


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
