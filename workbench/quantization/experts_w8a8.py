"""Fused experts as W8A8 (`Dynamic` / `Static` on a mixture of experts, `workbench.quantization.experts`): int8
weights per output channel, and every product of an expert's matrix quantizing its activations to int8 first - per
token at run time, or with the expert's own calibrated scale."""
from __future__ import annotations

from typing import Callable, ClassVar

import torch
from torch import nn

from workbench.quantization import formats as fm
from workbench.quantization.experts import _PRODUCTS, DecodedExperts, WeightOnlyExperts, _build, _layout
from workbench.quantization.experts_calibration import MIN_EXPERT_TOKENS, _calls, expert_inputs
from workbench.quantization.primitives import quantize_per_tensor, quantize_per_token

__all__ = ["W8A8Experts", "w8a8_experts", "W8A8_WEIGHTS", "quantized_input"]


W8A8_WEIGHTS = fm.IntFormat(8, None, True)   # int8 per output channel, symmetric (WeightOnly(bits=8)'s format)


class _ActQuantMatrix(torch.Tensor):
    """One expert's dequantized int8 matrix whose products (``F.linear(x, W[e])``, ``x @ W[e]``) first quantize
    ``x`` to int8 - per token at run time, or with the expert's calibrated scale - and compute on those values:
    ``(q_x s_x)(q_w s_w)^T``, what W8A8's integer product gives (in fp32 here, as `W8A8Linear`'s reference path).
    Any other operation sees the dequantized matrix; every result is a plain tensor."""

    _act_scale: torch.Tensor | None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _PRODUCTS and len(args) >= 2 and isinstance(args[1], _ActQuantMatrix) \
                and isinstance(args[0], torch.Tensor) and not isinstance(args[0], _ActQuantMatrix):
            args = (quantized_input(args[0], args[1]._act_scale), *args[1:])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def quantized_input(x: torch.Tensor, act_scale: torch.Tensor | None) -> torch.Tensor:
    """``x``'s int8 values (per token, or with the calibrated ``act_scale``), dequantized in ``x``'s dtype."""
    flat = x.reshape(-1, x.shape[-1])
    q, scale = quantize_per_token(flat) if act_scale is None else quantize_per_tensor(flat, act_scale)
    return (q.float() * scale).to(x.dtype).reshape(x.shape)


class _W8A8Stack(DecodedExperts):
    """A W8A8 experts module's fused projection: indexing one expert gives its `_ActQuantMatrix` (or, on the CPU
    kernel path, its `_KernelExpert` quantizing the activations first)."""

    act_scale: Callable[[int], torch.Tensor | None]

    def _index(self, index) -> torch.Tensor | None:
        if isinstance(index, torch.Tensor) and index.dim() == 0 and not index.is_floating_point():
            index = int(index)
        if isinstance(index, int) and not isinstance(index, bool) and getattr(self, "one", None) is None:
            matrix = super()._index(index)
            with torch._C.DisableTorchFunctionSubclass():
                out = matrix.as_subclass(_ActQuantMatrix)
            out._act_scale = self.act_scale(index)
            return out
        return super()._index(index)


class W8A8Experts(WeightOnlyExperts):
    """Fused experts as W8A8 (`Dynamic` / `Static` on a mixture of experts): each expert's matrices int8 per output
    channel (stored as `WeightOnlyExperts` stores ``WeightOnly(bits=8)``), and every product of an expert's matrix
    quantizes its activations to int8 first - per token (dynamic) or with the expert's own calibrated scale
    (static, buffer ``<projection>_act_scale`` (E,)). The class's eager per-expert loop runs unchanged."""

    prefix: ClassVar[str] = "W8A8"
    static: bool

    def _expert_tensor(self, name: str) -> DecodedExperts:
        m = next(x for x in self.matrices if x.name == name)
        device = self.get_buffer(f"{name}_qweight").device
        stack = _W8A8Stack(lambda ids: self.decode(name, ids), m.shape, self.weight_dtype, device)
        scales = self._buffers.get(f"{name}_act_scale")
        stack.act_scale = (lambda e: scales[e]) if scales is not None else (lambda e: None)
        if self._on_cpu_kernel(device):   # the int8 codes on the CPU kernel, on the activations' int8 values
            def one(e: int):
                t = self._kernel_expert(m, e, device)
                act = stack.act_scale(e)
                t.quantize_input = lambda x: quantized_input(x, act)
                return t
            stack.one = one
        return stack

    def decode(self, name: str, experts: torch.Tensor) -> torch.Tensor:
        m = next(x for x in self.matrices if x.name == name)
        tensors = {key: self.get_buffer(f"{name}_{key}").index_select(0, experts.to(self.get_buffer(
            f"{name}_qweight").device)) for key in self.keys}
        return m.decode(tensors, self.fmt, self.weight_dtype)


def w8a8_experts(name: str, module: nn.Module, static: bool, calls=None, observer: Callable | None = None,
                 values: bool = True) -> W8A8Experts:
    """``module``'s experts as `W8A8Experts`. ``static``: each expert's activation scale per projection from
    ``observer()`` (a fresh activation observer) over the tokens routed to it (`expert_inputs`, projections in
    chain order on the int8 weights); an expert routed fewer than `MIN_EXPERT_TOKENS` tokens takes the scale of
    all the tokens that reached the projection, and says so (``coverage``). ``values=False``: the structure only
    (what `wb.load` fills)."""
    layout = _layout(name, module)
    device = module.get_parameter(layout[0].name).device
    if not values:
        tensors = {m.name: m.empty(W8A8_WEIGHTS, device) for m in layout}
        if static:
            for m in layout:
                tensors[m.name]["act_scale"] = torch.empty(m.experts, device=device)
        new = _build(module, layout, W8A8_WEIGHTS, tensors, device, kind=W8A8Experts)
    else:
        tensors = {}
        for m in layout:
            param = module.get_parameter(m.name)
            fm.check_finite(f"{name}.{m.name}", param)
            tensors[m.name] = m.encode(param, W8A8_WEIGHTS)
        rows: list[tuple[str, int, int, str]] = []
        if static:
            calls = _calls(name, calls, "static W8A8")
            dtype = module.get_parameter(layout[0].name).dtype
            current = {m.name: m.decode(tensors[m.name], W8A8_WEIGHTS, dtype) for m in layout}
            for m in layout:
                inputs = expert_inputs(module, calls, m.name, current)
                if not any(inputs):
                    raise ValueError(f"static quantization of {name!r} needs calibration inputs, and no token "
                                     f"reached {m.name}")
                everything = observer()
                for xs in inputs:
                    for x in xs:
                        everything.observe(x.float())
                overall, _ = everything.qparams(8, symmetric=True)
                scales = []
                for e, xs in enumerate(inputs):
                    tokens = sum(x.shape[0] for x in xs)
                    if tokens >= MIN_EXPERT_TOKENS:
                        own = observer()
                        for x in xs:
                            own.observe(x.float())
                        scales.append(own.qparams(8, symmetric=True)[0].reshape(()))
                        rows.append((m.name, e, tokens, "static"))
                    else:
                        scales.append(overall.reshape(()))
                        rows.append((m.name, e, tokens, "all tokens"))
                tensors[m.name]["act_scale"] = torch.stack(scales).float().to(device)
        new = _build(module, layout, W8A8_WEIGHTS, tensors, None, kind=W8A8Experts)
        new.coverage = rows
    new.keys = tuple(k for k in new.keys if k != "act_scale")
    new.static = static
    E = layout[0].experts
    how = "a calibrated scale per expert and projection" if static else "per token at run time"
    new.note = (f"W8A8: {E} experts' {', '.join(m.name for m in layout)} int8 per output channel, activations int8 "
                f"({how}); each call decodes only the experts its router selects (the class's eager per-expert loop); "
                f"the router stays in full precision")
    fallback = sorted({e for _, e, _, how in getattr(new, "coverage", ()) if how == "all tokens"})
    if fallback:
        new.note += (f"; expert(s) {fallback} saw fewer than {MIN_EXPERT_TOKENS} tokens in some projection and take "
                     f"the scale of all its tokens there")
    return new
