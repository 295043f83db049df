"""`Cast(dtype)`: store a layer's weights in fp16 / bf16 and run it in that dtype.

Activations are cast to the layer's dtype on the way in and back to the caller's dtype on the way
out, so a cast layer drops into an fp32 model anywhere. Supported layers: nn.Linear, nn.Conv1d/2d/3d
and nn.Embedding (whose output returns in the original weight dtype, as indices carry no dtype), and their
subclasses that compute the same, checked by running them (`workbench.plans.lookalike`: a Conv2d subclass that
pads its input first keeps that padding, an embedding's constant output scale or computed rows are kept); another
subclass with its own forward is passed over by a glob, with the reason, and refused by an exact name.

A cast layer's weight and bias are `CastParameter`s: ordinary parameters, except that PyTorch's fused fast
paths (``TransformerEncoderLayer`` / ``MultiheadAttention`` in eval under ``no_grad``) see a tensor subclass and
run the sub-modules' own forwards instead of feeding low-precision weights to an fp32 fused kernel (which fails
with a dtype error). The price is one Python call per operation on the weight (see the tests' measurement).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from workbench.plans.lookalike import kept
from workbench.plans.registry import Config, Handler, register_config
from workbench.quantization.experts import takes_experts

__all__ = ["Cast", "CastLinear", "CastConv1d", "CastConv2d", "CastConv3d", "CastEmbedding", "CastParameter"]

CAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class CastParameter(nn.Parameter):
    """A parameter whose ``__torch_function__`` is on (plain parameters turn it off), so
    ``torch.overrides.has_torch_function`` is true for it and fused fast paths leave the layer's forward to run.
    Every operation returns plain tensors. ``source_dtype``: the dtype the weight had before the cast (the dtype
    the model computes in around the cast layer), kept through copies, pickles and `wb.load`.

    Outside its layer's forward, a model may compute with the weight directly (Mamba's ``dt_proj.weight @ x``,
    DeBERTa-v2's slice of ``rel_embeddings.weight``, a mixture of experts' ``W[e]``): there, an operation that
    meets a floating tensor of another dtype reads the stored low-precision values in that dtype (as the cast
    layer's own output returns in its caller's dtype), and a view or slice of the weight alone (`_READS`) is taken
    in the stored dtype and returned in ``source_dtype`` (only the slice is converted), instead of failing later
    with a dtype mismatch. The layer's own forward casts its input to the weight's dtype first, so it never
    converts; in-place operations and attribute reads (``dtype``, sizes) are left alone."""

    def __new__(cls, data=None, requires_grad: bool = True, source_dtype: torch.dtype | None = None):
        p = super().__new__(cls, data, requires_grad)
        p.source_dtype = source_dtype if source_dtype is not None else torch.get_default_dtype()
        return p

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = type(self)(self.data.clone(memory_format=torch.preserve_format), self.requires_grad,
                                        self.source_dtype)
        return memo[id(self)]

    def __reduce_ex__(self, protocol):   # (nn.Parameter's own rebuilds a plain Parameter: the subclass is kept)
        return _rebuild_cast_parameter, (self.data, self.requires_grad, self.source_dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if getattr(func, "__name__", "") != "__get__" and "out" not in kwargs and not _in_place(func):
                target = _other_floating_dtype(args, kwargs)
                if target is not None:
                    args, kwargs = tree_map(lambda t: t.to(target) if isinstance(t, CastParameter) else t,
                                            (args, kwargs))
                elif getattr(func, "__name__", "") in _READS:   # a slice of the weight, alone: the slice converted
                    source = next((t.source_dtype for t in tree_leaves((args, kwargs))
                                   if isinstance(t, CastParameter)), None)
                    out = func(*args, **kwargs)
                    return tree_map(lambda t: t.to(source) if isinstance(t, torch.Tensor) and t.is_floating_point()
                                    and source is not None else t, out)
            return func(*args, **kwargs)


def _rebuild_cast_parameter(data: torch.Tensor, requires_grad: bool, source_dtype: torch.dtype) -> CastParameter:
    return CastParameter(data, requires_grad, source_dtype)


# Views and slices a model takes of a weight it then computes with (DeBERTa-v2 slices ``rel_embeddings.weight``,
# Mamba squeezes ``conv1d.weight``, an experts loop takes ``W[e]``): returned in the weight's source dtype.
_READS = frozenset({"__getitem__", "view", "reshape", "transpose", "t", "permute", "unsqueeze", "squeeze", "narrow",
                    "select", "index_select", "expand", "flatten", "repeat", "contiguous", "split", "chunk"})


def _in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    # (slices, not str.endswith: torch.compile cannot trace that method inside a model's forward)
    return name[-1:] == "_" and name[-2:] != "__" or name in ("__setitem__", "__iadd__", "__imul__")


def _other_floating_dtype(args, kwargs) -> torch.dtype | None:
    """The dtype the operation's other floating tensors agree on (promoted), when a `CastParameter` among its
    arguments has another one; None when nothing needs converting."""
    other, ours = None, set()
    for t in tree_leaves((args, kwargs)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            continue
        if isinstance(t, CastParameter):
            ours.add(t.dtype)
        else:
            other = t.dtype if other is None else torch.promote_types(other, t.dtype)
    return other if other is not None and ours and ours != {other} else None


class CastLinear(nn.Linear):
    """nn.Linear whose parameters are stored in a low-precision dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


class _CastConvMixin:
    input_padding = None  # an InputPadding applied first (a "same"-padding Conv2d subclass), or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_padding is not None:
            x = self.input_padding(x, {"kernel_size": self.kernel_size, "stride": self.stride,
                                       "dilation": self.dilation})
        return self._conv_forward(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


class CastConv1d(_CastConvMixin, nn.Conv1d):
    """nn.Conv1d stored and run in a low-precision dtype."""


class CastConv2d(_CastConvMixin, nn.Conv2d):
    """nn.Conv2d stored and run in a low-precision dtype."""


class CastConv3d(_CastConvMixin, nn.Conv3d):
    """nn.Conv3d stored and run in a low-precision dtype."""


class CastEmbedding(nn.Embedding):
    """nn.Embedding stored in a low-precision dtype; looks up, then returns ``output_dtype``."""

    def __init__(self, *args, output_dtype: torch.dtype = torch.float32, **kwargs):
        super().__init__(*args, **kwargs)
        self.output_dtype = output_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).to(self.output_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, output_dtype={self.output_dtype}"


_CONV = {nn.Conv1d: CastConv1d, nn.Conv2d: CastConv2d, nn.Conv3d: CastConv3d}


def _new_param(t: torch.Tensor | None, dtype: torch.dtype, values: bool) -> nn.Parameter | None:
    if t is None:
        return None
    data = t.detach().to(dtype).clone() if values else torch.empty(t.shape, dtype=dtype, device=t.device)
    return CastParameter(data, requires_grad=t.requires_grad, source_dtype=t.dtype)


def _layer_kind(name: str, module: nn.Module) -> tuple[type, object]:
    """(the layer type ``module`` computes as, its InputPadding or None), from
    `workbench.plans.lookalike.computation`; raises, naming the layer, for a subclass whose own forward computes
    something else."""
    from workbench.plans.lookalike import computation

    found = computation(module)
    if not found.taken:
        raise ValueError(f"{name!r} is a {type(module).__name__}, a subclass of a supported layer with its own "
                         f"forward: {found.reason}; Cast would replace what that forward computes, so it is refused "
                         f"(exclude it with {{{name!r}: None}} in the plan)")
    return found.parent, found.padding


class _EagerForward:
    """A cast experts module's ``forward``: its class's eager per-expert loop (`eager_forward`), as an instance
    attribute that copies and pickles as one (a bound method would unpickle as the class's own dispatcher)."""

    def __init__(self, base: type, module: nn.Module):
        self.base, self.module = base, module

    def __call__(self, *args, **kwargs):
        from workbench.quantization.experts import eager_forward

        return eager_forward(self.base)(self.module, *args, **kwargs)

    def __reduce__(self):
        return _EagerForward, (self.base, self.module)


def cast_experts(module: nn.Module, dtype: torch.dtype, values: bool = True) -> nn.Module:
    """A copy of a mixture of experts' fused experts module (`workbench.quantization.experts`) whose own floating
    parameters (the 3-D expert tensors, their biases) are `CastParameter`s in ``dtype``: the class's forward runs
    unchanged, and each expert's matrix it slices out is read in the caller's dtype (see `CastParameter`)."""
    own = dict(module.named_parameters(recurse=False))
    new = copy.deepcopy(module, {id(p): p for p in own.values()})   # (its own tensors are replaced below)
    for key, p in own.items():
        new._parameters[key] = _new_param(p, dtype, values) if p.is_floating_point() else p
    # transformers' grouped / batched experts paths cast the activations to the weights' dtype: the class's eager
    # per-expert loop runs instead (as for quantized experts), so every expert computes in the caller's dtype
    new.forward = _EagerForward(type(module), new)
    new.note = (f"the experts' {', '.join(k for k, p in own.items() if p.dim() == 3)} stored in {dtype} and read "
                f"in the caller's dtype (each expert's slice, the class's eager per-expert loop); the router stays "
                f"in full precision")
    return new


def cast_module(module: nn.Module, dtype: torch.dtype, values: bool = True, name: str = "layer") -> nn.Module:
    """A new cast copy of ``module`` (``values=False``: same structure, uninitialised values)."""
    if takes_experts(module):
        return cast_experts(module, dtype, values)
    kind, padding = _layer_kind(name, module)
    if kind is nn.Linear:
        new = CastLinear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
    elif kind in _CONV:
        m = module
        new = _CONV[kind](m.in_channels, m.out_channels, m.kernel_size, stride=m.stride, padding=m.padding,
                          dilation=m.dilation, groups=m.groups, bias=m.bias is not None,
                          padding_mode=m.padding_mode, device="meta")
        new.input_padding = padding
    elif kind is nn.Embedding:
        m = module
        new = CastEmbedding(m.num_embeddings, m.embedding_dim, padding_idx=m.padding_idx, max_norm=m.max_norm,
                            norm_type=m.norm_type, scale_grad_by_freq=m.scale_grad_by_freq, sparse=m.sparse,
                            output_dtype=m.weight.dtype, device="meta")
    else:
        raise TypeError(f"{name!r}: Cast supports nn.Linear, nn.Conv1d/2d/3d and nn.Embedding, not {kind.__name__}")
    new.weight = _new_param(module.weight, dtype, values)
    if getattr(module, "bias", None) is not None:
        new.bias = _new_param(module.bias, dtype, values)
    new.train(module.training)
    return kept(module, new)   # a step its own forward adds (an embedding's constant scale) is kept


class _CastHandler(Handler):
    def supports(self, module: nn.Module, config: "Cast") -> bool:
        from workbench.quantization.modules import FORWARD_BYPASSED, selectable

        if isinstance(module, FORWARD_BYPASSED):  # e.g. MultiheadAttention's out_proj: its parent would feed fp32
            return False                          # activations to the cast weight, never calling its forward
        return selectable(module, (nn.Linear, nn.Embedding, *_CONV)) or takes_experts(module)

    def why_not(self, module: nn.Module, config: "Cast") -> str | None:
        from workbench.quantization.experts import experts_refusal, router_note
        from workbench.quantization.modules import lookalike_reason

        return experts_refusal(module) or router_note(module) or \
            lookalike_reason(module, (nn.Linear, nn.Embedding, *_CONV))

    def needs_calibration(self, config: "Cast") -> bool:
        return False

    def apply(self, name: str, module: nn.Module, config: "Cast",
              inputs: Sequence[tuple[torch.Tensor, ...]] | None) -> nn.Module:
        weights = [p for p in module.parameters(recurse=False) if p.is_floating_point()] if takes_experts(module) \
            else [module.weight]
        finfo = torch.finfo(config.dtype)
        for w in weights:
            if not torch.isfinite(w).all():
                raise ValueError(f"weight of {name!r} contains NaN or Inf")
            peak = w.detach().abs().max().item() if w.numel() else 0.0
            if peak > finfo.max:
                raise ValueError(f"weight of {name!r} has magnitude {peak:.3g}, beyond the {config.dtype} "
                                 f"range ({finfo.max:.3g}); casting would give Inf")
        return cast_module(module, config.dtype, name=name)

    def skeleton(self, name: str, module: nn.Module, config: "Cast") -> nn.Module:
        return cast_module(module, config.dtype, values=False, name=name)


@register_config(_CastHandler(), kind="precision.Cast")
@dataclass(frozen=True)
class Cast(Config):
    """Store the layer's weights in ``dtype`` (fp16 or bf16) and compute in it."""

    dtype: torch.dtype = field(default=torch.bfloat16, metadata={"choices": CAST_DTYPES})

    def __post_init__(self):
        if isinstance(self.dtype, str):  # "bfloat16" / "float16" from a widget, a CLI or a parameters cell
            named = getattr(torch, self.dtype.removeprefix("torch."), None)
            if isinstance(named, torch.dtype):
                object.__setattr__(self, "dtype", named)
        if self.dtype not in CAST_DTYPES:
            raise ValueError(f"Cast.dtype must be one of {[str(d) for d in CAST_DTYPES]}, got {self.dtype!r}")
