"""Structured pruning: physically remove output channels / neurons and fix every layer that depends on them,
so the model really is smaller and faster.

``wb.prune.channels(model, {"fc1": 0.5, "conv*": 0.25}, criterion="l1", example_inputs=...)`` returns a new model
in which each selected producer (nn.Linear or nn.Conv2d) keeps ``out - round(amount * out)`` output channels,
ranked by ``criterion``:

- ``"l1"`` / ``"l2"``: the norm of each channel's weights;
- ``"taylor"``: first-order Taylor importance of the channel's activations (Molchanov et al. 2017): per sample
  |sum over positions of a_c * dL/da_c|, summed over ``calibration`` batches; L is the cross-entropy against
  ``labels`` or, without labels, the output projected on a fixed random direction.

The dependents are found by tracing the model with torch.fx and walking forward from the producer through
channel-wise operations (activations, dropout, pooling, BatchNorm - whose statistics are pruned too) and
``flatten`` (a channel then owns H*W consecutive features, from a shape propagation with ``example_inputs``)
to the consumers (nn.Linear / nn.Conv2d with groups=1), whose input channels are removed. Anything else on
the way. A residual add couples every layer whose output is added into the same tensor (a ResNet stage):
they are pruned together, with the same channels, ranked by their summed importance. Anything else - a
concatenation, a reshape, the model's input or output, a grouped convolution - cannot be resolved safely and
raises an error naming the layer; the input model is never modified.

The remaining channel counts are recorded on the result as a plan of `Kept` entries, so `wb.save` / `wb.load`
restore a structurally pruned model (the counts rebuild the shapes; the file holds the values).
"""
from __future__ import annotations

import copy
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from workbench.plans.apply import PLANS_ATTR, applied_plans
from workbench.plans.plan import Plan, _matcher
from workbench.plans.registry import Config, register_config

__all__ = ["Kept", "channels", "channel_importance", "transformer_ffn_consumers", "attention_heads", "head_importance"]

_CHANNELWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.Dropout,
                        nn.Identity, nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool2d)
_CHANNELWISE_FUNCTIONS = {F.relu, torch.relu, F.gelu, F.silu, torch.sigmoid, torch.tanh, F.leaky_relu, F.dropout,
                          F.max_pool1d, F.max_pool2d, F.avg_pool1d, F.avg_pool2d, F.adaptive_avg_pool2d}
_CHANNELWISE_METHODS = {"relu", "contiguous", "sigmoid", "tanh"}
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d)


@dataclass
class _Dependents:
    producers: list[str]              # every layer whose output channels must be cut the same way
    batchnorms: list[str]
    consumers: list[tuple[str, int]]  # (consumer module name, features per channel at its input)


_ADDS = {operator.add, operator.iadd, torch.add}


def _trace(model: nn.Module, example_inputs) -> fx.GraphModule:
    try:
        gm = fx.symbolic_trace(model)
    except Exception as e:
        raise ValueError(f"structured pruning traces the model with torch.fx, and {type(model).__name__} could not "
                         f"be traced: {type(e).__name__}: {e}") from None
    if example_inputs is not None:
        from torch.fx.passes.shape_prop import ShapeProp

        with torch.no_grad():
            ShapeProp(gm).propagate(*example_inputs)
    return gm


def _is_producer(mod: nn.Module) -> bool:
    return type(mod) is nn.Linear or (type(mod) is nn.Conv2d and mod.groups == 1)


def _dependents(gm: fx.GraphModule, producer: str) -> _Dependents:
    """The channel group of ``producer``: walk forward to the consumers and, through residual adds, backward to
    every other producer whose channels are added to the same tensor (they must keep the same channels)."""
    modules = dict(gm.named_modules())
    start = next((n for n in gm.graph.nodes if n.op == "call_module" and n.target == producer), None)
    if start is None:
        raise ValueError(f"layer {producer!r} is not called in the traced forward pass")
    deps = _Dependents([producer], [], [])

    def refuse(node, why="which structured pruning cannot follow"):
        what = node.target if node.op != "call_function" else getattr(node.target, "__name__", node.target)
        raise ValueError(f"cannot resolve the layers that depend on {producer!r}: its channels reach {node.op} "
                         f"{what!r} ({node.name}), {why} (concatenations, reshapes, grouped convolutions and the "
                         f"model's inputs and outputs are not supported)")

    def kind(node) -> str:
        if node.op == "call_module":
            mod = modules[node.target]
            if isinstance(mod, _BATCHNORMS):
                return "bn"
            if isinstance(mod, _CHANNELWISE_MODULES):
                return "pass"
            if _is_producer(mod):
                return "layer"
        elif node.op == "call_function" and node.target in _CHANNELWISE_FUNCTIONS:
            return "pass"
        elif node.op == "call_function" and node.target in _ADDS:
            return "add"
        elif node.op == "call_method" and node.target in _CHANNELWISE_METHODS:
            return "pass"
        elif node.op == "call_method" and node.target in ("add", "add_", "__add__"):
            return "add"
        elif node.op == "call_method" and node.target == "flatten" and node.args[1:] in ((1,), ()) \
                and not node.kwargs:
            return "flatten"
        return "other"

    seen: set = {start}
    forward = [(start, 1)]   # nodes whose output carries the group's channels (features per channel)
    backward = []            # nodes whose inputs carry them too (channel-wise ops and adds reached by a residual)
    while forward or backward:
        while backward:
            node = backward.pop()
            for arg in node.args:
                if not isinstance(arg, fx.Node) or arg in seen:
                    continue
                k = kind(arg)
                if k == "layer":
                    deps.producers.append(arg.target)
                elif k in ("pass", "bn", "add"):
                    if k == "bn":
                        deps.batchnorms.append(arg.target)
                    backward.append(arg)
                else:
                    refuse(arg, "which feeds a residual add")
                seen.add(arg)
                forward.append((arg, 1))
        if not forward:
            break
        node, factor = forward.pop()
        for user in node.users:
            k = kind(user)
            if k == "layer" and (factor == 1 or type(modules[user.target]) is nn.Linear):
                if user.args[0] is node:
                    deps.consumers.append((user.target, factor))
                    continue
            if user in seen:
                continue
            if k == "flatten":
                shape = node.meta.get("tensor_meta")
                if shape is None:
                    raise ValueError(f"pruning {producer!r} needs the spatial size at {user.name!r}: "
                                     f"pass example_inputs")
                spatial = 1
                for d in shape.shape[2:]:
                    spatial *= d
                seen.add(user)
                forward.append((user, factor * spatial))
            elif k == "pass" or (k in ("bn", "add") and factor == 1):  # after flatten only element-wise ops
                if k == "bn":
                    deps.batchnorms.append(user.target)
                seen.add(user)
                forward.append((user, factor))
                if k == "add":
                    backward.append(user)   # every other operand must keep the same channels
            else:
                refuse(user)
    if not deps.consumers:
        raise ValueError(f"{producer!r} has no consumer layer to fix")
    deps.producers = list(dict.fromkeys(deps.producers))
    deps.batchnorms = list(dict.fromkeys(deps.batchnorms))
    deps.consumers = list(dict.fromkeys(deps.consumers))
    return deps


def channel_importance(model: nn.Module, layer: str, criterion: str = "l1", calibration=None,
                       labels=None) -> torch.Tensor:
    """Importance of each output channel of ``layer`` (higher = keep).

    ``taylor`` uses the cross-entropy against ``labels`` (one tensor per calibration batch) when given; without
    labels (e.g. a sentence encoder) it uses the model output projected on a fixed random direction, so the
    score estimates how much removing the channel moves the output to first order."""
    module = model.get_submodule(layer)
    w = module.weight.detach().reshape(module.weight.shape[0], -1)
    if criterion == "l1":
        return w.abs().sum(1)
    if criterion == "l2":
        return w.pow(2).sum(1).sqrt()
    if criterion != "taylor":
        raise ValueError(f"criterion must be 'l1', 'l2' or 'taylor', got {criterion!r}")
    if not calibration:
        raise ValueError("the taylor criterion needs calibration batches (and labels for a classifier)")
    if labels is not None and len(labels) != len(calibration):
        raise ValueError(f"got {len(labels)} label tensors for {len(calibration)} calibration batches")
    store = {}

    def hook(mod, args, out):
        out.retain_grad()
        store["out"] = out

    score = torch.zeros(w.shape[0], dtype=torch.float64)
    handle = module.register_forward_hook(hook)
    was_training = model.training
    model.eval()
    try:
        for i, batch in enumerate(calibration):
            batch = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
            model.zero_grad(set_to_none=True)
            out = model(*batch)
            if labels is not None:
                loss = F.cross_entropy(out, labels[i])
            else:
                direction = torch.randn(out.shape, generator=torch.Generator().manual_seed(i)).to(out)
                loss = (out * direction).sum()
            loss.backward()
            a, g = store["out"], store["out"].grad      # Conv: (B, C, ...); Linear: (B, ..., C)
            ag = a * g
            if isinstance(module, nn.Linear):
                per_sample = ag.reshape(ag.shape[0], -1, ag.shape[-1]).sum(1)   # (B, C): sum over positions
            else:
                per_sample = ag.reshape(ag.shape[0], ag.shape[1], -1).sum(-1)   # (B, C)
            score += per_sample.abs().sum(0).double().detach()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return score.float()


def _take(module: nn.Module, out_idx: torch.Tensor | None = None, in_idx: torch.Tensor | None = None) -> nn.Module:
    w = module.weight.detach()
    if out_idx is not None:
        w = w[out_idx]
    if in_idx is not None:
        w = w[:, in_idx]
    bias = module.bias.detach() if module.bias is not None else None
    if bias is not None and out_idx is not None:
        bias = bias[out_idx]
    if isinstance(module, nn.Linear):
        new = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
    else:
        m = module
        new = nn.Conv2d(w.shape[1], w.shape[0], m.kernel_size, stride=m.stride, padding=m.padding,
                        dilation=m.dilation, groups=m.groups, bias=bias is not None, padding_mode=m.padding_mode)
    new = new.to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w)
        if bias is not None:
            new.bias.copy_(bias)
    return new.train(module.training)


def _take_bn(bn: nn.Module, idx: torch.Tensor) -> nn.Module:
    new = type(bn)(len(idx), eps=bn.eps, momentum=bn.momentum, affine=bn.affine,
                   track_running_stats=bn.track_running_stats).to(bn.weight.device if bn.affine else "cpu")
    with torch.no_grad():
        if bn.affine:
            new.weight.copy_(bn.weight[idx])
            new.bias.copy_(bn.bias[idx])
        if bn.track_running_stats:
            new.running_mean.copy_(bn.running_mean[idx])
            new.running_var.copy_(bn.running_var[idx])
            new.num_batches_tracked.copy_(bn.num_batches_tracked)
    return new.train(bn.training)


def channels(model: nn.Module, amounts: dict[str, float], criterion: str = "l1", example_inputs=None,
             calibration=None, labels=None, consumers: dict[str, list[str]] | None = None) -> nn.Module:
    """A copy of ``model`` with ``amounts[pattern]`` of the output channels of each matching Linear / Conv2d
    removed, and every dependent layer fixed (see the module docstring).

    ``consumers`` maps a producer's name to the layers that read its channels, for models torch.fx cannot
    trace (e.g. transformers): the path between them must be channel-wise (no BatchNorm in between);
    `transformer_ffn_consumers` builds it for BERT- and GPT-style feed-forward blocks."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    target = copy.deepcopy(model)
    gm = None if consumers is not None else _trace(target, example_inputs)
    names = [n for n, m in target.named_modules() if type(m) in (nn.Linear, nn.Conv2d)]
    chosen: dict[str, float] = {}
    for pattern, amount in amounts.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 <= amount < 1:
            raise ValueError(f"amount for {pattern!r} must be in [0, 1), got {amount!r}")
        match = _matcher(pattern)
        hits = [n for n in names if match(n)]
        if not hits:
            raise ValueError(f"pattern {pattern!r} matches no nn.Linear / nn.Conv2d layer")
        for n in hits:
            chosen.setdefault(n, float(amount))
    plans: dict[str, torch.Tensor] = {}   # producer -> kept output channels
    groups: list[_Dependents] = []
    for name, amount in chosen.items():  # resolve everything before changing anything
        if name in plans:
            continue
        if consumers is not None:
            if name not in consumers:
                raise ValueError(f"consumers= does not say which layers read the channels of {name!r}")
            deps = _Dependents([name], [], [(c, 1) for c in consumers[name]])
        else:  # a consumer may be pruned too: its input and output sides are independent
            deps = _dependents(gm, name)
        amounts_in_group = {chosen[p] for p in deps.producers if p in chosen}
        if len(amounts_in_group) > 1:
            raise ValueError(f"{deps.producers} add their outputs together and must be pruned alike, but were "
                             f"given different amounts {sorted(amounts_in_group)}")
        out = target.get_submodule(name).weight.shape[0]
        keep = out - round(amount * out)
        if keep < 1:
            raise ValueError(f"pruning {amount} of {name!r} would remove all of its {out} channels")
        score = sum(channel_importance(target, p, criterion, calibration, labels) for p in deps.producers)
        idx = torch.sort(torch.topk(score, keep).indices).values
        for p in deps.producers:
            plans[p] = idx
        groups.append(deps)
    replacements: dict[str, nn.Module] = {}
    in_keep: dict[str, torch.Tensor] = {}
    for deps in groups:
        idx = plans[deps.producers[0]]
        for bn in deps.batchnorms:
            replacements[bn] = _take_bn(target.get_submodule(bn), idx)
        for consumer, factor in deps.consumers:
            cols = (idx[:, None] * factor + torch.arange(factor)[None, :]).reshape(-1) if factor > 1 else idx
            in_keep[consumer] = cols
    for name in set(plans) | set(in_keep):
        module = target.get_submodule(name)
        replacements[name] = _take(module, plans.get(name), in_keep.get(name))
    for name, new in replacements.items():
        target.set_submodule(name, new)
    _record(target, model, replacements)
    return target


def transformer_ffn_consumers(model: nn.Module) -> dict[str, list[str]]:
    """``{ffn input projection: [ffn output projection]}`` for BERT-style (``intermediate.dense`` ->
    ``output.dense``) and GPT-style (``mlp.c_fc`` -> ``mlp.c_proj``) blocks, found by module structure."""
    out = {}
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        inter, outp = getattr(m, "intermediate", None), getattr(m, "output", None)
        if isinstance(getattr(inter, "dense", None), nn.Linear) and isinstance(getattr(outp, "dense", None), nn.Linear):
            out[f"{prefix}intermediate.dense"] = [f"{prefix}output.dense"]
        mlp = getattr(m, "mlp", None)
        if isinstance(getattr(mlp, "c_fc", None), nn.Linear) and isinstance(getattr(mlp, "c_proj", None), nn.Linear):
            out[f"{prefix}mlp.c_fc"] = [f"{prefix}mlp.c_proj"]
    if not out:
        raise ValueError(f"found no transformer feed-forward block in {type(model).__name__}")
    return out


def _attention_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """BERT-style attention blocks: ``.self`` with query/key/value Linears and ``.output.dense``."""
    out = {}
    for name, m in model.named_modules():
        sa = getattr(m, "self", None)
        if all(isinstance(getattr(sa, k, None), nn.Linear) for k in ("query", "key", "value")) and \
                isinstance(getattr(getattr(m, "output", None), "dense", None), nn.Linear) and \
                hasattr(sa, "attention_head_size"):
            out[name] = m
    if not out:
        raise ValueError(f"found no BERT-style attention block (self.query/key/value, output.dense) in "
                         f"{type(model).__name__}")
    return out


def head_importance(model: nn.Module, calibration, reference=None) -> dict[str, torch.Tensor]:
    """Per attention block, the importance of each head: how far the model output moves (1 - cosine similarity,
    averaged over the calibration batches) when that head alone is switched off."""
    blocks = _attention_blocks(model)
    batches = [(b,) if isinstance(b, torch.Tensor) else tuple(b) for b in calibration]
    with torch.inference_mode():
        ref = reference if reference is not None else [model(*b) for b in batches]
        scores = {}
        for name, block in blocks.items():
            v, d = block.self.value, block.self.attention_head_size
            heads = v.out_features // d
            s = torch.zeros(heads)
            for h in range(heads):
                rows = slice(h * d, (h + 1) * d)
                saved_w, saved_b = v.weight[rows].clone(), v.bias[rows].clone()
                v.weight[rows] = 0   # a head with zero values outputs zero
                v.bias[rows] = 0
                try:
                    s[h] = sum(float(1 - F.cosine_similarity(model(*b).flatten(1), r.flatten(1)).mean())
                               for b, r in zip(batches, ref, strict=True)) / len(batches)
                finally:
                    v.weight[rows] = saved_w
                    v.bias[rows] = saved_b
            scores[name] = s
    return scores


def attention_heads(model: nn.Module, heads: int, calibration, importance: dict[str, torch.Tensor] | None = None):
    """A copy of ``model`` with the ``heads`` least important heads of every BERT-style attention block removed:
    the query/key/value rows and the output projection's columns of those heads are cut out."""
    if not isinstance(heads, int) or heads < 0:
        raise ValueError(f"heads must be a non-negative int, got {heads!r}")
    target = copy.deepcopy(model)
    blocks = _attention_blocks(target)
    importance = importance if importance is not None else head_importance(target, calibration)
    for name, block in blocks.items():
        sa = block.self
        d = sa.attention_head_size
        total = sa.query.out_features // d
        if heads >= total:
            raise ValueError(f"removing {heads} heads would remove every head of {name!r} ({total} heads)")
        keep = torch.sort(torch.topk(importance[name], total - heads).indices).values
        rows = (keep[:, None] * d + torch.arange(d)[None, :]).reshape(-1)
        sa.query, sa.key, sa.value = (_take(getattr(sa, k), out_idx=rows) for k in ("query", "key", "value"))
        block.output.dense = _take(block.output.dense, in_idx=rows)
        sa.num_attention_heads = total - heads
        sa.all_head_size = len(rows)
    _record(target, model, [f"{name}.{part}" for name in blocks
                            for part in ("self.query", "self.key", "self.value", "output.dense")])
    return target


class _KeptHandler:
    """Rebuilds the shapes structured pruning left, so `wb.load` can restore a structurally pruned model."""

    def supports(self, module: nn.Module, config) -> bool:
        return type(module) in (nn.Linear, nn.Conv2d, *_BATCHNORMS)

    def needs_calibration(self, config) -> bool:
        return False

    def apply(self, name, module, config, inputs):
        raise ValueError(f"{name!r}: Kept records what wb.prune.channels / attention_heads removed; it cannot "
                         f"choose channels itself - call those functions instead")

    def skeleton(self, name, module, config):
        out_n = config.out_channels
        if isinstance(module, _BATCHNORMS):
            return _take_bn(module, torch.arange(out_n))
        out_idx = torch.arange(out_n) if out_n is not None else None
        in_idx = torch.arange(config.in_channels) if config.in_channels is not None else None
        return _take(module, out_idx, in_idx)


@register_config(_KeptHandler(), kind="prune.Kept")
@dataclass(frozen=True)
class Kept(Config):
    """Recorded per layer by structured pruning: how many output / input channels remain."""

    out_channels: int | None = None
    in_channels: int | None = None


def _record(model: nn.Module, before: nn.Module, names) -> None:
    """Append a plan of `Kept` entries for the layers whose shapes changed."""
    entries = {}
    for name in sorted(names):
        old, new = before.get_submodule(name), model.get_submodule(name)
        if isinstance(new, _BATCHNORMS):
            entries[name] = Kept(out_channels=new.num_features)
            continue
        w_old, w_new = old.weight, new.weight
        entries[name] = Kept(out_channels=w_new.shape[0] if w_new.shape[0] != w_old.shape[0] else None,
                             in_channels=w_new.shape[1] if w_new.shape[1] != w_old.shape[1] else None)
    object.__setattr__(model, PLANS_ATTR, (*applied_plans(before), Plan(entries)))
