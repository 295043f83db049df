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

Models torch.fx cannot trace (Hugging Face transformers, nn.TransformerEncoder) say who reads what with
``consumers=``: `transformer_ffn_consumers` finds the feed-forward blocks of BERT, GPT-2 (transformers' Conv1D,
weight stored (in, out), is cut on the right axis and becomes the equivalent nn.Linear, the form the core's
canonicalisation gives it), Llama (SwiGLU: producers that feed the same consumer - gate and
up projections - are cut together, like a residual group), T5, ViT and nn.TransformerEncoderLayer (`FFN_LAYOUTS`).
Attention heads: see `workbench.pruning.heads`. Calibration batches may be tensors, tuples, or dicts of keyword
inputs; a Hugging Face ModelOutput is read through its logits / last_hidden_state (`main_output`).

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

from workbench.plans.layers import applied_plans, record_plan, swap_layers
from workbench.plans.plan import Plan, _matcher
from workbench.plans.registry import Config, Handler, register_config

__all__ = ["Kept", "channels", "channel_importance", "transformer_ffn_consumers", "FFN_LAYOUTS", "main_output", "run",
           "out_in", "hf_conv1d"]

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
                         f"be traced ({type(e).__name__}: {e}); say which layers read each pruned layer's channels "
                         f"with consumers= instead (wb.prune.transformer_ffn_consumers(model) builds it for "
                         f"transformer feed-forward blocks)") from None
    if example_inputs is not None:
        from torch.fx.passes.shape_prop import ShapeProp

        with torch.no_grad():
            ShapeProp(gm).propagate(*example_inputs)
    return gm


def _consumer_group(consumers: dict[str, list[str]], name: str) -> _Dependents:
    """With explicit ``consumers``: every producer that feeds one of ``name``'s consumers is cut the same way
    (Llama's gate_proj and up_proj multiply channel by channel before down_proj reads them)."""
    producers, reads = [name], list(consumers[name])
    changed = True
    while changed:
        changed = False
        for p, cs in consumers.items():
            if p not in producers and set(cs) & set(reads):
                producers.append(p)
                reads += [c for c in cs if c not in reads]
                changed = True
    return _Dependents(producers, [], [(c, 1) for c in reads])


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



def hf_conv1d() -> type | None:
    """transformers' ``Conv1D`` (GPT-2's linear layer, weight stored (in, out)) when transformers is installed."""
    import sys

    if "transformers" not in sys.modules:   # a model holding Conv1D layers has imported it already
        return None
    from transformers.pytorch_utils import Conv1D

    return Conv1D


def is_conv1d_hf(module: nn.Module) -> bool:
    cls = hf_conv1d()
    return cls is not None and isinstance(module, cls)


def out_in(module: nn.Module) -> tuple[int, int]:
    """(output channels, input features) of a Linear, Conv2d or transformers Conv1D."""
    w = module.weight
    return (w.shape[1], w.shape[0]) if is_conv1d_hf(module) else (w.shape[0], w.shape[1])


def rows_of(module: nn.Module) -> torch.Tensor:
    """The weight as (output channels, everything else), whatever the layer's storage order."""
    w = module.weight.detach()
    return w.T if is_conv1d_hf(module) else w.reshape(w.shape[0], -1)


def main_output(out) -> torch.Tensor:
    """The tensor a model's output stands for: itself, a Hugging Face ModelOutput's ``logits`` or
    ``last_hidden_state``, or the first tensor of a tuple / ModelOutput."""
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        t = getattr(out, key, None)
        if isinstance(t, torch.Tensor):
            return t
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    for t in items:
        if isinstance(t, torch.Tensor):
            return t
    raise TypeError(f"cannot find the output tensor in a {type(out).__name__}")


def run(model: nn.Module, batch):
    """Call ``model`` on one calibration batch: a dict is keyword inputs (Hugging Face), a tensor or a tuple
    positional inputs; returns `main_output`."""
    if isinstance(batch, dict):
        return main_output(model(**batch))
    return main_output(model(*((batch,) if isinstance(batch, torch.Tensor) else tuple(batch))))


def _is_layer(module: nn.Module) -> bool:
    """A layer structured pruning can cut: nn.Linear (or a subclass computing nn.Linear's forward), a plain
    nn.Conv2d, or a transformers Conv1D."""
    if isinstance(module, nn.Linear):
        return type(module).forward is nn.Linear.forward
    return type(module) is nn.Conv2d or is_conv1d_hf(module)


def channel_importance(model: nn.Module, layer: str, criterion: str = "l1", calibration=None,
                       labels=None) -> torch.Tensor:
    """Importance of each output channel of ``layer`` (higher = keep).

    ``taylor`` uses the cross-entropy against ``labels`` (one tensor per calibration batch) when given; without
    labels (e.g. a sentence encoder) it uses the model output projected on a fixed random direction, so the
    score estimates how much removing the channel moves the output to first order."""
    module = model.get_submodule(layer)
    w = rows_of(module)
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
            model.zero_grad(set_to_none=True)
            out = run(model, batch)
            if labels is not None:
                loss = F.cross_entropy(out, labels[i])
            else:
                direction = torch.randn(out.shape, generator=torch.Generator().manual_seed(i)).to(out)
                loss = (out * direction).sum()
            loss.backward()
            a, g = store["out"], store["out"].grad      # Conv: (B, C, ...); Linear: (B, ..., C)
            ag = a * g
            if not isinstance(module, nn.Conv2d):                           # Linear, Conv1D: channels last
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
    if is_conv1d_hf(module):   # weight (in, out): cut, then store as the equivalent nn.Linear (out, in)
        w = module.weight.detach()
        w = w[:, out_idx] if out_idx is not None else w
        w = w[in_idx] if in_idx is not None else w                                   # (in', out')
        new = nn.Linear(w.shape[0], w.shape[1]).to(device=w.device, dtype=w.dtype)
        with torch.no_grad():
            new.weight.copy_(w.T)
            new.bias.copy_(module.bias[out_idx] if out_idx is not None else module.bias)
        return new.train(module.training)
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
    gm = None
    if consumers is None:
        try:
            gm = _trace(target, example_inputs)
        except ValueError as e:
            # transformers and other untraceable models: their feed-forward blocks are found by structure, when
            # every layer the amounts select is the input projection of such a block
            found = transformer_ffn_consumers(target)
            selected = [n for n, m in target.named_modules() if _is_layer(m)
                        and any(_matcher(p)(n) for p in amounts)]
            if not selected:   # the pattern check below names the pattern that selects nothing
                found = {}
            elif any(n not in found for n in selected):
                outside = [n for n in selected if n not in found][:3]
                raise ValueError(f"{e}; the layers selected ({', '.join(outside or selected[:3])}) are not the "
                                 f"input projections of feed-forward blocks it recognises") from None
            consumers = found
    names = [n for n, m in target.named_modules() if _is_layer(m)]
    chosen: dict[str, float] = {}
    for pattern, amount in amounts.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 <= amount < 1:
            raise ValueError(f"amount for {pattern!r} must be in [0, 1), got {amount!r}")
        match = _matcher(pattern)
        hits = [n for n in names if match(n)]
        if not hits:
            raise ValueError(f"pattern {pattern!r} matches no nn.Linear / nn.Conv2d / Conv1D layer")
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
            deps = _consumer_group(consumers, name)
        else:  # a consumer may be pruned too: its input and output sides are independent
            deps = _dependents(gm, name)
        amounts_in_group = {chosen[p] for p in deps.producers if p in chosen}
        if len(amounts_in_group) > 1:
            raise ValueError(f"{deps.producers} are cut together (their outputs are added, or read channel by "
                             f"channel by the same layers) and must be pruned alike, but were given different "
                             f"amounts {sorted(amounts_in_group)}")
        out = out_in(target.get_submodule(name))[0]
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
    swap_layers(target, replacements)
    _record(target, model, replacements)
    return target


# Feed-forward blocks by layout: (the block's input projections, cut together; its output projection), as
# attribute paths relative to one module. One row per family; a row matches only if the shapes agree.
FFN_LAYOUTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("intermediate.dense",), "output.dense"),    # BERT, MiniLM
    (("mlp.c_fc",), "mlp.c_proj"),                # GPT-2 (Conv1D or Linear)
    (("gate_proj", "up_proj"), "down_proj"),      # Llama, Mistral, Qwen (SwiGLU)
    (("wi",), "wo"),                              # T5 (ReLU)
    (("wi_0", "wi_1"), "wo"),                     # T5 v1.1 / Flan-T5 (gated GELU)
    (("fc1",), "fc2"),                            # ViT (transformers 5), CLIP, OPT
    (("linear1",), "linear2"),                    # nn.TransformerEncoderLayer / DecoderLayer
)


def transformer_ffn_consumers(model: nn.Module) -> dict[str, list[str]]:
    """``{ffn input projection: [ffn output projection]}`` for every transformer feed-forward block of ``model``
    whose layout is in `FFN_LAYOUTS` (BERT, GPT-2, Llama's SwiGLU - gate and up projections then share their
    consumer and `channels` cuts them together -, T5, ViT, nn.TransformerEncoder), found by module structure
    and checked by shape (the hidden width the inputs produce is the width the output projection reads)."""
    out: dict[str, list[str]] = {}
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        for ins, outp in FFN_LAYOUTS:
            try:
                producers = [m.get_submodule(p) for p in ins]
                consumer = m.get_submodule(outp)
            except AttributeError:
                continue
            if not all(_is_layer(x) for x in (*producers, consumer)):
                continue
            if len({out_in(x)[0] for x in producers}) != 1 or out_in(producers[0])[0] != out_in(consumer)[1]:
                continue
            for p in ins:
                out[f"{prefix}{p}"] = [f"{prefix}{outp}"]
    if not out:
        known = "; ".join(f"{' + '.join(i)} -> {o}" for i, o in FFN_LAYOUTS)
        raise ValueError(f"found no transformer feed-forward block in {type(model).__name__} (known layouts: "
                         f"{known}); pass consumers= to wb.prune.channels yourself")
    return out


class _KeptHandler(Handler):
    """Rebuilds the shapes structured pruning left, so `wb.load` can restore a structurally pruned model."""

    def supports(self, module: nn.Module, config) -> bool:
        return _is_layer(module) or isinstance(module, _BATCHNORMS)

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
        (o_old, i_old), (o_new, i_new) = out_in(old), out_in(new)
        entries[name] = Kept(out_channels=o_new if o_new != o_old else None,
                             in_channels=i_new if i_new != i_old else None)
    record_plan(model, (*applied_plans(before), Plan(entries)))
