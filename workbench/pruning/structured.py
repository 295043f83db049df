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

In models torch.fx cannot trace (Hugging Face transformers) and inside modules it keeps whole
(nn.TransformerEncoderLayer), blocks are found by layout (`BLOCK_LAYOUTS`, or say who reads what with
``consumers=``; `transformer_ffn_consumers` lists the known blocks): the feed-forward blocks of BERT, GPT-2
(transformers' Conv1D, weight stored (in, out), is cut on the right axis and becomes the equivalent nn.Linear, the
form the core's canonicalisation gives it), Llama (SwiGLU: producers that feed the same consumer - gate and up
projections - are cut together, like a residual group), Phi-3 (gate and up fused in one ``gate_up_proj`` split by
``.chunk(2)``: channel j is rows j and I + j), T5, ViT, GPT-NeoX and Falcon (``FalconLinear``, a Linear subclass
whose own forward computes nn.Linear's, checked on a probe input) and nn.TransformerEncoderLayer; and Hugging Face
ResNet's conv -> BatchNorm -> activation layers and its residual streams (`workbench.pruning.streams`): a stream's
channels are cut from every layer writing it - the blocks' last convolutions, the shortcut projection, the embedder
where identity shortcuts carry its output on - with their BatchNorms, ranked by their summed importance, and from
the input of every layer reading it (the next blocks' first convolutions and projections, the classifier); a
selection must name every writer but the projections (cut along), else it is refused naming the missing ones. A
selected layer outside them is refused, naming it and the module that reads it. A pattern that selects a mixture of
experts' fused experts module (transformers 5's ``MixtralExperts`` ...) cuts every expert's intermediate channels
(`workbench.pruning.moe`). Attention heads: see `workbench.pruning.heads`. Calibration batches may be tensors,
tuples, or dicts of keyword inputs; a Hugging Face ModelOutput is read through its logits / last_hidden_state
(`main_output`).

The remaining channel counts are recorded on the result as a plan of `Kept` (and `moe.KeptExperts`) entries, so
`wb.save` / `wb.load` restore a structurally pruned model (the counts rebuild the shapes; the file holds the values).
"""
from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from workbench.plans.layers import applied_plans, record_plan, swap_layers
from workbench.plans.lookalike import computation
from workbench.plans.plan import Plan, layer_matcher
from workbench.plans.registry import Config, Handler, register_config
from workbench.pruning import moe
from workbench.pruning.streams import resnet_streams

__all__ = ["Kept", "Layout", "BLOCK_LAYOUTS", "channels", "channel_importance", "transformer_ffn_consumers",
           "main_output", "run", "out_in", "hf_conv1d"]

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
    chunks: int = 1                   # the producers' output is this many equal consecutive blocks, read channel
                                      # by channel (Phi-3's gate_up_proj = [gate; up]): channel j is row j of each
    required: list[str] = field(default_factory=list)   # producers the selection must name (a residual stream)
    refusal: str = ""                 # why these channels cannot be cut at all (they are the model's output)


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
    """A layer structured pruning can cut: nn.Linear (or a subclass whose own forward computes nn.Linear's, checked
    on a probe input by `workbench.plans.lookalike`: Falcon's ``FalconLinear``), a plain nn.Conv2d, or a
    transformers Conv1D. The cut layer is a plain nn.Linear / nn.Conv2d."""
    if isinstance(module, nn.Linear):
        if type(module).forward is nn.Linear.forward:
            return True
        found = computation(module)
        return found.taken and found.transform is None
    return type(module) is nn.Conv2d or is_conv1d_hf(module)


def _ungrouped(module: nn.Module) -> bool:
    return not isinstance(module, nn.Conv2d) or module.groups == 1


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
    removed, and every dependent layer fixed (see the module docstring). A pattern matching a mixture of experts'
    fused experts module (transformers 5's ``MixtralExperts`` ...) cuts that share of every expert's intermediate
    channels (`workbench.pruning.moe`).

    ``consumers`` maps a producer's name to the layers that read its channels, for models torch.fx cannot
    trace (e.g. transformers): the path between them must be channel-wise (no BatchNorm in between, unless the
    block is one of `BLOCK_LAYOUTS`, whose norms and fused halves are then cut too);
    `transformer_ffn_consumers` builds it for the blocks of `BLOCK_LAYOUTS`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    for pattern, amount in amounts.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 <= amount < 1:
            raise ValueError(f"amount for {pattern!r} must be in [0, 1), got {amount!r}")
    target = copy.deepcopy(model)
    chosen, chosen_experts = _select(target, amounts)
    group_of = _group_finder(target, chosen, consumers, example_inputs) if chosen else None
    plans: dict[str, torch.Tensor] = {}   # producer -> kept output rows
    groups: list[tuple[_Dependents, torch.Tensor]] = []   # (group, kept channels)
    for name, amount in chosen.items():  # resolve everything before changing anything
        if name in plans:
            continue
        deps = group_of(name)
        if deps.refusal:
            raise ValueError(f"cannot cut the output channels of {name!r}: {deps.refusal}")
        missing = [p for p in deps.required if p not in chosen]
        if missing:
            raise ValueError(f"{name!r} writes a residual stream that {missing} write too (the block outputs added "
                             f"into it, or passed through by identity shortcuts), so its channels can only be cut "
                             f"from all of them at once: select them too")
        amounts_in_group = {chosen[p] for p in deps.producers if p in chosen}
        if len(amounts_in_group) > 1:
            raise ValueError(f"{deps.producers} are cut together (their outputs are added, or read channel by "
                             f"channel by the same layers) and must be pruned alike, but were given different "
                             f"amounts {sorted(amounts_in_group)}")
        width = out_in(target.get_submodule(name))[0] // deps.chunks
        for consumer, factor in deps.consumers:
            reads = out_in(target.get_submodule(consumer))[1]
            if reads != width * factor:
                raise ValueError(f"{consumer!r} reads {reads} input features, but {name!r} gives it {width} "
                                 f"channels of {factor} feature(s): it does not read {name!r}'s channels directly")
        keep = width - round(amount * width)
        if keep < 1:
            raise ValueError(f"pruning {amount} of {name!r} would remove all of its {width} channels")
        score = sum(channel_importance(target, p, criterion, calibration, labels) for p in deps.producers)
        score = score.reshape(deps.chunks, width).sum(0)                     # a fused channel's rows together
        idx = torch.sort(torch.topk(score, keep).indices).values
        rows = torch.cat([idx + k * width for k in range(deps.chunks)])      # the kept rows of every chunk
        for p in deps.producers:
            plans[p] = rows
        groups.append((deps, idx))
    replacements: dict[str, nn.Module] = {}
    in_keep: dict[str, torch.Tensor] = {}
    for deps, idx in groups:
        for bn in deps.batchnorms:
            replacements[bn] = _take_bn(target.get_submodule(bn), idx)
        for consumer, factor in deps.consumers:
            cols = (idx[:, None] * factor + torch.arange(factor)[None, :]).reshape(-1) if factor > 1 else idx
            in_keep[consumer] = cols
    for name in set(plans) | set(in_keep):
        module = target.get_submodule(name)
        replacements[name] = _take(module, plans.get(name), in_keep.get(name))
    swap_layers(target, replacements)
    kept_experts = {}
    for name, amount in chosen_experts.items():   # each expert keeps its own best channels, as many as the others
        module = target.get_submodule(name)
        keep = moe.kept_width(name, moe.intermediate_layout(name, module).width, amount)
        score = moe.intermediate_importance(name, module, criterion)            # (E, I)
        moe.keep_intermediate(name, module, torch.sort(torch.topk(score, keep, dim=1).indices, dim=1).values)
        kept_experts[name] = moe.KeptExperts(intermediate=keep)
    _record(target, model, replacements, kept_experts)
    return target


def _select(model: nn.Module, amounts: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """The layers and the fused experts modules the patterns select, with their amounts (first pattern wins)."""
    modules = [(n, m) for n, m in model.named_modules() if n]
    layers = [n for n, m in modules if _is_layer(m)]
    experts = [n for n, m in modules if moe.is_experts(m)]
    chosen: dict[str, float] = {}
    chosen_experts: dict[str, float] = {}
    for pattern, amount in amounts.items():
        match = layer_matcher(pattern)
        hits, expert_hits = [n for n in layers if match(n)], [n for n in experts if match(n)]
        if not hits and not expert_hits:
            other = next(((n, m) for n, m in modules if match(n)), None)
            if other is None:
                raise ValueError(f"pattern {pattern!r} matches no nn.Linear / nn.Conv2d / Conv1D layer")
            raise ValueError(f"pattern {pattern!r} matches no nn.Linear / nn.Conv2d / Conv1D layer nor fused experts "
                             f"module: it matches {other[0]!r} ({type(other[1]).__name__}), whose output channels "
                             f"structured pruning cannot cut")
        for n in hits:
            chosen.setdefault(n, float(amount))
        for n in expert_hits:
            chosen_experts.setdefault(n, float(amount))
    return chosen, chosen_experts


def _group_finder(model: nn.Module, chosen: dict[str, float], consumers: dict[str, list[str]] | None,
                  example_inputs):
    """``name -> _Dependents``: from ``consumers`` (a known block's norms and fused halves taken from its layout),
    else from a torch.fx trace (a layer the graph never calls, inside a module fx keeps whole, from its layout),
    else - a model fx cannot trace - from `BLOCK_LAYOUTS`, refusing a selected layer outside them with the trace
    error and the block that reads it."""
    known = _blocks(model)
    if consumers is not None:
        def group_of(name: str) -> _Dependents:
            if name not in consumers:
                raise ValueError(f"consumers= does not say which layers read the channels of {name!r}")
            block = known.get(name)
            if block is not None and [c for c, _ in block.consumers] == list(consumers[name]):
                return block
            return _consumer_group(consumers, name)
        return group_of
    try:
        gm = _trace(model, example_inputs)
    except ValueError as e:
        outside = [n for n in chosen if n not in known]
        if outside:
            raise ValueError(f"{e}; {_unknown_block(model, outside[0])}") from None
        return known.__getitem__
    called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    # a layer inside a module fx keeps whole (torch.nn's own, e.g. nn.TransformerEncoderLayer) is never called in
    # the graph: its block is found by layout, like in a model fx cannot trace
    return lambda name: known[name] if name not in called and name in known else _dependents(gm, name)


def _unknown_block(model: nn.Module, name: str) -> str:
    """Why layer ``name`` is not the input of a known block: who reads it, and the layouts that are known."""
    parent = name.rpartition(".")[0]
    reader = f"{type(model.get_submodule(parent)).__name__} {parent!r}" if parent else type(model).__name__
    known = "; ".join(lay.describe() for lay in BLOCK_LAYOUTS)
    return (f"{name!r} ({type(model.get_submodule(name)).__name__}) is not the input projection of a block whose "
            f"layout structured pruning knows: its output is read inside {reader}, which matches none of the "
            f"known layouts ({known}) with matching shapes, nor writes a Hugging Face ResNet residual stream")


@dataclass(frozen=True)
class Layout:
    """A block whose channels are cut by name: ``producers`` (cut together: their outputs are combined channel by
    channel), the BatchNorms on their output (``norms``, statistics cut too) and the layer reading them
    (``consumer``), as paths relative to one module of type ``inside``. ``chunks``: the producers' output is that
    many equal consecutive blocks, each read channel by channel (Phi-3's ``gate_up_proj`` = [gate; up], split by
    ``.chunk(2)``): channel j is row j of every block. A layout matches only if the shapes agree."""

    producers: tuple[str, ...]
    consumer: str
    norms: tuple[str, ...] = ()
    chunks: int = 1
    inside: type = nn.Module

    def describe(self) -> str:
        fused = f" ({self.chunks} chunks)" if self.chunks > 1 else ""
        norms = f" -> {' + '.join(self.norms)}" if self.norms else ""
        return f"{' + '.join(self.producers)}{fused}{norms} -> {self.consumer}"


# One row per family. Feed-forward blocks: (input projections, output projection); CNN blocks: a sequence of
# conv -> BatchNorm -> activation layers, the next one's convolution reading the channels.
BLOCK_LAYOUTS: tuple[Layout, ...] = (
    Layout(("intermediate.dense",), "output.dense"),               # BERT, MiniLM, DeBERTa, Swin
    Layout(("mlp.c_fc",), "mlp.c_proj"),                           # GPT-2 (Conv1D or Linear)
    Layout(("gate_proj", "up_proj"), "down_proj"),                 # Llama, Mistral, Qwen, Gemma (SwiGLU)
    Layout(("gate_up_proj",), "down_proj", chunks=2),              # Phi-3: gate and up fused, split by .chunk(2)
    Layout(("wi",), "wo"),                                         # T5 (ReLU)
    Layout(("wi_0", "wi_1"), "wo"),                                # T5 v1.1 / Flan-T5 (gated GELU)
    Layout(("fc1",), "fc2"),                                       # ViT (transformers 5), CLIP, OPT
    Layout(("linear1",), "linear2"),                               # nn.TransformerEncoderLayer / DecoderLayer
    Layout(("dense_h_to_4h",), "dense_4h_to_h"),                   # GPT-NeoX / Pythia, Falcon (FalconLinear)
    Layout(("0.convolution",), "1.convolution", ("0.normalization",), inside=nn.Sequential),   # HF ResNet layers
    Layout(("1.convolution",), "2.convolution", ("1.normalization",), inside=nn.Sequential),   # (bottleneck)
)
FFN_LAYOUTS = BLOCK_LAYOUTS   # the former name


def _blocks(model: nn.Module) -> dict[str, _Dependents]:
    """``{producer: its block}`` for every block of ``model`` in `BLOCK_LAYOUTS`, found by module structure and
    checked by shape (the width the producers give is what the norms hold and, per chunk, what the consumer
    reads); convolutions must be ungrouped."""
    out: dict[str, _Dependents] = {}
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        for lay in BLOCK_LAYOUTS:
            if not isinstance(m, lay.inside):
                continue
            try:
                producers = [m.get_submodule(p) for p in lay.producers]
                consumer = m.get_submodule(lay.consumer)
                norms = [m.get_submodule(p) for p in lay.norms]
            except AttributeError:
                continue
            if not all(_is_layer(x) and _ungrouped(x) for x in (*producers, consumer)):
                continue
            widths = {out_in(x)[0] for x in producers}
            width = widths.pop()
            if widths or width != lay.chunks * out_in(consumer)[1]:
                continue
            if not all(isinstance(b, _BATCHNORMS) and b.num_features == width for b in norms):
                continue
            block = _Dependents([prefix + p for p in lay.producers], [prefix + b for b in lay.norms],
                                [(prefix + lay.consumer, 1)], lay.chunks)
            for p in block.producers:
                out[p] = block
    for stream in resnet_streams(model):
        block = _stream_block(model, stream)
        for p in block.producers if block is not None else ():
            out[p] = block
    return out


def _stream_block(model: nn.Module, stream) -> _Dependents | None:
    """A Hugging Face ResNet residual stream (`workbench.pruning.streams`) as a channel group: every writer cut
    alike with its BatchNorm, every reader's input channels; None if its layers are not all plain ungrouped
    convolutions / Linear layers of one width."""
    layers = [model.get_submodule(x) for x in (*stream.producers, *stream.consumers)]
    norms = [model.get_submodule(x) for x in stream.norms]
    if not all(_is_layer(x) and _ungrouped(x) for x in layers):
        return None
    widths = {out_in(model.get_submodule(x))[0] for x in stream.producers}
    if len(widths) > 1 or not all(isinstance(b, _BATCHNORMS) and b.num_features in widths for b in norms):
        return None
    refusal = "" if stream.output is None else (
        f"they are a residual stream that leaves the model as the output of {stream.output}, which nothing inside "
        f"it reads to fix (written by {stream.producers})")
    return _Dependents(list(stream.producers), list(stream.norms), [(c, 1) for c in stream.consumers],
                       required=list(stream.required), refusal=refusal)


def transformer_ffn_consumers(model: nn.Module) -> dict[str, list[str]]:
    """``{block input projection: [block output projection]}`` for every block of ``model`` whose layout is in
    `BLOCK_LAYOUTS` (the feed-forward blocks of BERT, GPT-2, Llama's SwiGLU - gate and up projections then share
    their consumer and `channels` cuts them together -, Phi-3's fused gate_up_proj, T5, ViT, GPT-NeoX, Falcon,
    nn.TransformerEncoder; Hugging Face ResNet's conv layers), found by module structure and checked by shape.
    `channels` recovers a known block's BatchNorms and fused halves from its layout."""
    found = _blocks(model)
    if not found:
        known = "; ".join(lay.describe() for lay in BLOCK_LAYOUTS)
        raise ValueError(f"found no transformer feed-forward block in {type(model).__name__} (known layouts: "
                         f"{known}); pass consumers= to wb.prune.channels yourself")
    return {p: [c for c, _ in block.consumers] for p, block in found.items() if not block.refusal}


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


def _record(model: nn.Module, before: nn.Module, names, kept_experts: dict[str, Config]) -> None:
    """Append a plan of `Kept` entries for the layers whose shapes changed, and ``kept_experts``."""
    entries: dict[str, Config] = dict(kept_experts)
    for name in sorted(names):
        old, new = before.get_submodule(name), model.get_submodule(name)
        if isinstance(new, _BATCHNORMS):
            entries[name] = Kept(out_channels=new.num_features)
            continue
        (o_old, i_old), (o_new, i_new) = out_in(old), out_in(new)
        entries[name] = Kept(out_channels=o_new if o_new != o_old else None,
                             in_channels=i_new if i_new != i_old else None)
    record_plan(model, (*applied_plans(before), Plan(entries)))
