"""BatchNorm folding: a convolution (or Linear) followed by an inference-mode BatchNorm becomes one convolution
with rescaled weights and a new bias, and the BatchNorm an ``nn.Identity`` - so quantization and pruning act on
the weights the model really applies.

    s  = gamma / sqrt(running_var + eps)                  per output channel
    W' = W * s        b' = (b - running_mean) * s + beta

Usage, on a model the caller already copied and put in eval mode::

    result = fold_batchnorm(model)        # result.folded == [("features.0", "features.1"), ...]

Pairs are found by tracing the model with ``torch.fx`` (the BatchNorm's input is the producer's output and
nothing else reads that output), or, for a model fx cannot trace, by module order inside ``nn.Sequential``
containers; ``method=`` chooses ("auto" traces and, when tracing fails, uses the order and says so in the
result). Every BatchNorm that is not folded is listed in ``result.skipped`` with the reason.

Producers: ``nn.Conv1d`` / ``Conv2d`` / ``Conv3d`` / ``nn.Linear`` and subclasses that keep the parent's
``forward``, EfficientNet's same-padding convolutions (``efficientnet_lite_pytorch``, when it is imported), and
any class given to `register_foldable` (its output channel ``j`` must be ``weight[j]`` applied to the input plus
``bias[j]``). ConvTranspose (output channels on the weight's dim 1) is not folded. Folding uses the running
statistics, i.e. eval semantics: a model or BatchNorm in training mode is refused.

ReLU / ReLU6 after the folded convolution stay as they are: on the CPU there is no fused conv+ReLU kernel to
gain from in eager PyTorch (oneDNN fuses them itself under ``torch.compile``), so "fusing" them would only
rename modules.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
import torch.fx
from torch import nn

__all__ = ["FoldResult", "fold_batchnorm", "fold_pair", "is_foldable", "register_foldable"]

_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_PARENT_FORWARDS = {nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward, nn.Linear.forward}
_REGISTERED: set[type] = set()


def register_foldable(cls: type) -> type:
    """Declare that ``cls``'s output channel ``j`` is ``weight[j]`` applied to its input plus ``bias[j]`` (so a
    following BatchNorm folds into it). Usable as a class decorator."""
    _REGISTERED.add(cls)
    return cls


def _known_types() -> set[type]:
    extra = set(_REGISTERED)
    if "efficientnet_lite_pytorch" in sys.modules:        # a model holding these convs has imported the package
        from efficientnet_lite_pytorch.utils import Conv2dDynamicSamePadding, Conv2dStaticSamePadding

        extra |= {Conv2dStaticSamePadding, Conv2dDynamicSamePadding}
    return extra


def is_foldable(module: nn.Module) -> bool:
    """Whether a BatchNorm after ``module`` can be folded into it (see the module docstring)."""
    return (isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear))
            and (type(module).forward in _PARENT_FORWARDS or type(module) in _known_types()))


@dataclass
class FoldResult:
    """What `fold_batchnorm` did: ``folded`` (producer name, BatchNorm name) pairs in model order, ``skipped``
    (BatchNorm name, reason) for every BatchNorm left in place, ``method`` "fx" or "sequential" and, when "auto"
    fell back to the order in Sequential containers, ``trace_error``."""
    folded: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    method: str = "fx"
    trace_error: str | None = None


@torch.no_grad()
def fold_pair(producer: nn.Module, bn: nn.Module) -> None:
    """Fold ``bn``'s running statistics and affine parameters into ``producer``'s weight and bias, in place
    (computed in float64, stored in the weight's dtype). The caller replaces ``bn`` afterwards."""
    w = producer.weight                                               # (out, ...)
    var, mean = bn.running_var.double(), bn.running_mean.double()
    gamma = bn.weight.double() if bn.weight is not None else torch.ones_like(var)
    beta = bn.bias.double() if bn.bias is not None else torch.zeros_like(var)
    s = gamma / torch.sqrt(var + bn.eps)                              # (out,)
    b = producer.bias.double() if producer.bias is not None else torch.zeros_like(var)
    w.copy_((w.double() * s.view(-1, *([1] * (w.dim() - 1)))).to(w.dtype))
    new_bias = ((b - mean) * s + beta).to(w.dtype)
    if producer.bias is None:
        producer.bias = nn.Parameter(new_bias, requires_grad=w.requires_grad)
    else:
        producer.bias.copy_(new_bias)


def _why_not(producer_name: str, producer: nn.Module, bn_name: str, bn: nn.Module) -> str | None:
    """None if the pair folds, else the reason it does not."""
    if not is_foldable(producer):
        return f"its input comes from {producer_name!r}, a {type(producer).__name__}, which is not a foldable " \
               "convolution / Linear (see register_foldable)"
    if bn.running_mean is None or bn.running_var is None:
        return "it has no running statistics (track_running_stats=False), so it normalises with batch statistics"
    out = producer.weight.shape[0]
    if bn.num_features != out:
        return f"it has {bn.num_features} features but {producer_name!r} has {out} output channels"
    if isinstance(producer, nn.Linear) and not isinstance(bn, nn.BatchNorm1d):
        return f"{type(bn).__name__} after a Linear normalises another dimension"
    return None


class _Tracer(torch.fx.Tracer):
    """Keeps producers, BatchNorms and any module without either inside it as single graph nodes."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if is_foldable(m) or isinstance(m, _BN):
            return True
        return (super().is_leaf_module(m, qualname)
                or not any(is_foldable(c) or isinstance(c, _BN) for c in m.modules()))


def _pairs_fx(model: nn.Module, bns: dict[str, nn.Module]) -> tuple[list, list]:
    graph = _Tracer().trace(model)
    modules = dict(model.named_modules(remove_duplicate=False))
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    pairs, skipped, seen = [], [], set()
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in bns or node.target in seen:
            continue
        seen.add(node.target)
        src = node.args[0] if node.args else None
        if calls[node.target] > 1:
            skipped.append((node.target, f"it is called {calls[node.target]} times in the forward"))
        elif not isinstance(src, torch.fx.Node) or src.op != "call_module":
            what = getattr(src, "target", src)
            skipped.append((node.target, f"its input is not a module's output (it comes from {what!r})"))
        elif len(src.users) > 1:
            skipped.append((node.target, f"the output of {src.target!r} is also used by "
                                         f"{sorted(str(u) for u in src.users if u is not node)}"))
        elif calls[src.target] > 1:
            skipped.append((node.target, f"{src.target!r} is called {calls[src.target]} times in the forward"))
        else:
            why = _why_not(src.target, modules[src.target], node.target, bns[node.target])
            (skipped.append((node.target, why)) if why else pairs.append((src.target, node.target)))
    skipped += [(n, "it is not called in the traced forward") for n in bns if n not in seen]
    return pairs, skipped


def _pairs_sequential(model: nn.Module, bns: dict[str, nn.Module]) -> tuple[list, list]:
    pairs, placed = [], set()
    for name, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        items = list(seq.named_children())
        for (pn, p), (bn_n, bn) in zip(items, items[1:]):
            full_p, full_bn = (f"{name}.{pn}" if name else pn), (f"{name}.{bn_n}" if name else bn_n)
            if full_bn in bns:
                why = _why_not(full_p, p, full_bn, bn)
                if why is None:
                    pairs.append((full_p, full_bn))
                    placed.add(full_bn)
    skipped = [(n, "not directly after a foldable module inside an nn.Sequential (and fx could not trace the "
                   "model to see its real input)") for n in bns if n not in placed]
    return pairs, skipped


def fold_batchnorm(model: nn.Module, method: str = "auto") -> FoldResult:
    """Fold every BatchNorm that follows a foldable producer into it and replace the BatchNorm by
    ``nn.Identity``, in place (see the module docstring). ``method``: "fx" (tracing; a model fx cannot trace
    raises, naming the error), "sequential" (order inside nn.Sequential only) or "auto" (fx, else sequential,
    recorded in the result). A producer or BatchNorm reachable under several names, or called more than once, is
    left alone (reported in ``skipped``)."""
    if method not in ("auto", "fx", "sequential"):
        raise ValueError(f"fold_batchnorm: method must be 'auto', 'fx' or 'sequential', got {method!r}")
    bns = {n: m for n, m in model.named_modules() if isinstance(m, _BN)}
    training = [n for n, m in bns.items() if m.training]
    if model.training or training:
        raise ValueError(f"fold_batchnorm: the model is in training mode (BatchNorm {training[:3]} ...); folding "
                         "uses the running statistics, i.e. eval semantics: call model.eval() first")
    result = FoldResult(method="sequential" if method == "sequential" else "fx")
    if method != "sequential":
        try:
            pairs, skipped = _pairs_fx(model, bns)
        except Exception as e:     # any tracing failure: fx raises many types; reported, never silent
            if method == "fx":
                raise RuntimeError(f"fold_batchnorm: torch.fx could not trace {type(model).__name__} ({e}); use "
                                   "method='sequential' to fold by module order inside nn.Sequential") from e
            result.method, result.trace_error = "sequential", f"{type(e).__name__}: {e}"
    if result.method == "sequential":
        pairs, skipped = _pairs_sequential(model, bns)
    counts: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        counts[id(m)] = counts.get(id(m), 0) + 1
    for p_name, bn_name in pairs:
        producer, bn = model.get_submodule(p_name), model.get_submodule(bn_name)
        if counts[id(producer)] > 1 or counts[id(bn)] > 1:
            skipped.append((bn_name, f"{p_name!r} or {bn_name!r} is reachable under several names (shared module)"))
            continue
        fold_pair(producer, bn)
        parent, _, child = bn_name.rpartition(".")
        setattr(model.get_submodule(parent), child, nn.Identity())
        result.folded.append((p_name, bn_name))
    order = {n: i for i, n in enumerate(bns)}
    result.skipped = sorted(skipped, key=lambda s: order.get(s[0], -1))
    return result
