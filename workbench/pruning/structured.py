"""Structured pruning: physically remove output channels / neurons and fix every layer that depends on them,
so the model really is smaller and faster.

``wb.prune.channels(model, {"fc1": 0.5, "conv*": 0.25}, criterion="l1", example_inputs=...)`` returns a new model
in which each selected producer (nn.Linear or nn.Conv2d) keeps ``out - round(amount * out)`` output channels,
ranked by ``criterion``:

- ``"l1"`` / ``"l2"``: the norm of each channel's weights;
- ``"taylor"``: first-order Taylor importance of the channel's activations (Molchanov et al. 2017): per sample
  |sum over positions of a_c * dL/da_c|, summed over ``calibration`` = [(inputs, labels), ...] batches, with
  cross-entropy gradients.

The dependents are found by tracing the model with torch.fx and walking forward from the producer through
channel-wise operations (activations, dropout, pooling, BatchNorm - whose statistics are pruned too) and
``flatten`` (a channel then owns H*W consecutive features, from a shape propagation with ``example_inputs``)
to the consumers (nn.Linear / nn.Conv2d with groups=1), whose input channels are removed. Anything else on
the way - a residual add, a concatenation, the model's output, a grouped convolution - cannot be resolved
safely, and raises an error naming the layer; the input model is never modified.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from workbench.plans.plan import _matcher

__all__ = ["channels", "channel_importance"]

_CHANNELWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.Dropout,
                        nn.Identity, nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool2d)
_CHANNELWISE_FUNCTIONS = {F.relu, torch.relu, F.gelu, F.silu, torch.sigmoid, torch.tanh, F.leaky_relu, F.dropout,
                          F.max_pool1d, F.max_pool2d, F.avg_pool1d, F.avg_pool2d, F.adaptive_avg_pool2d}
_CHANNELWISE_METHODS = {"relu", "contiguous", "sigmoid", "tanh"}
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d)


@dataclass
class _Dependents:
    batchnorms: list[str]
    consumers: list[tuple[str, int]]  # (consumer module name, features per channel at its input)


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


def _dependents(gm: fx.GraphModule, producer: str) -> _Dependents:
    modules = dict(gm.named_modules())
    start = next((n for n in gm.graph.nodes if n.op == "call_module" and n.target == producer), None)
    if start is None:
        raise ValueError(f"layer {producer!r} is not called in the traced forward pass")
    deps = _Dependents([], [])
    stack = [(u, 1) for u in start.users]
    seen = set()
    while stack:
        node, factor = stack.pop()
        if (node, factor) in seen:
            continue
        seen.add((node, factor))
        passes = False
        if node.op == "call_module":
            mod = modules[node.target]
            if isinstance(mod, _BATCHNORMS):
                deps.batchnorms.append(node.target)
                passes = True
            elif isinstance(mod, _CHANNELWISE_MODULES):
                passes = True
            elif type(mod) is nn.Linear or (type(mod) is nn.Conv2d and mod.groups == 1 and factor == 1):
                deps.consumers.append((node.target, factor))
                continue
        elif node.op == "call_function" and node.target in _CHANNELWISE_FUNCTIONS:
            passes = node.args[0] is not None
        elif node.op == "call_method" and node.target in _CHANNELWISE_METHODS:
            passes = True
        elif node.op == "call_method" and node.target == "flatten" and node.args[1:] in ((1,), ()) and \
                not node.kwargs:
            shape = node.args[0].meta.get("tensor_meta")
            if shape is None:
                raise ValueError(f"pruning {producer!r} needs the spatial size at {node.name!r}: pass example_inputs")
            spatial = 1
            for d in shape.shape[2:]:
                spatial *= d
            stack.extend((u, factor * spatial) for u in node.users)
            continue
        if not passes:
            what = node.target if node.op != "call_function" else getattr(node.target, "__name__", node.target)
            raise ValueError(f"cannot resolve the layers that depend on {producer!r}: its output reaches "
                             f"{node.op} {what!r} ({node.name}), which structured pruning cannot follow "
                             f"(residual adds, concatenations, reshapes and the model output are not supported)")
        stack.extend((u, factor) for u in node.users)
    if not deps.consumers:
        raise ValueError(f"{producer!r} has no consumer layer to fix")
    return deps


def channel_importance(model: nn.Module, layer: str, criterion: str = "l1", calibration=None) -> torch.Tensor:
    """Importance of each output channel of ``layer`` (higher = keep)."""
    module = model.get_submodule(layer)
    w = module.weight.detach().reshape(module.weight.shape[0], -1)
    if criterion == "l1":
        return w.abs().sum(1)
    if criterion == "l2":
        return w.pow(2).sum(1).sqrt()
    if criterion != "taylor":
        raise ValueError(f"criterion must be 'l1', 'l2' or 'taylor', got {criterion!r}")
    if not calibration:
        raise ValueError("the taylor criterion needs calibration=[(inputs, labels), ...] batches")
    store = {}

    def hook(mod, args, out):
        out.retain_grad()
        store["out"] = out

    score = torch.zeros(w.shape[0], dtype=torch.float64)
    handle = module.register_forward_hook(hook)
    was_training = model.training
    model.eval()
    try:
        for inputs, labels in calibration:
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(inputs), labels).backward()
            a, g = store["out"], store["out"].grad                       # (B, C, ...) or (B, C)
            per_sample = (a * g).reshape(a.shape[0], a.shape[1], -1).sum(-1)  # (B, C): sum over positions
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
             calibration=None) -> nn.Module:
    """A copy of ``model`` with ``amounts[pattern]`` of the output channels of each matching Linear / Conv2d
    removed, and every dependent layer fixed (see the module docstring)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    target = copy.deepcopy(model)
    gm = _trace(target, example_inputs)
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
    plans = {}
    for name, amount in chosen.items():  # resolve everything before changing anything
        out = target.get_submodule(name).weight.shape[0]
        keep = out - round(amount * out)
        if keep < 1:
            raise ValueError(f"pruning {amount} of {name!r} would remove all of its {out} channels")
        deps = _dependents(gm, name)  # a consumer may be pruned too: its input and output sides are independent
        score = channel_importance(target, name, criterion, calibration)
        idx = torch.sort(torch.topk(score, keep).indices).values
        plans[name] = (idx, deps)
    replacements: dict[str, nn.Module] = {}
    in_keep: dict[str, torch.Tensor] = {}
    for idx, deps in plans.values():
        for bn in deps.batchnorms:
            replacements[bn] = _take_bn(target.get_submodule(bn), idx)
        for consumer, factor in deps.consumers:
            cols = (idx[:, None] * factor + torch.arange(factor)[None, :]).reshape(-1) if factor > 1 else idx
            in_keep[consumer] = cols
    for name in set(plans) | set(in_keep):
        module = target.get_submodule(name)
        replacements[name] = _take(module, plans[name][0] if name in plans else None, in_keep.get(name))
    for name, new in replacements.items():
        target.set_submodule(name, new)
    return target
