"""Quantization configs (frozen dataclasses registered with the plan registry) and their handlers.

    wb.quant.WeightOnly(bits=4, group_size=64, method="gptq")   # Linear, Conv1d/2d, ConvTranspose2d, Embedding
    wb.quant.NF4(group_size=64)                                 # the same layers
    wb.quant.FP8()                                              # the same layers (float8 weights, per-row scales)
    wb.quant.Dynamic(bits=8, kernel="cpu")                      # Linear: W8A8, per-token activations
    wb.quant.Static(observer="percentile", smooth_alpha=0.5)    # Linear, Conv1d/2d, ConvTranspose2d: W8A8

Layers are chosen by what they compute (`workbench.plans.lookalike`): subclasses of those layers that keep the
parent's forward, or whose own forward computes the parent's (checked on a probe input: Falcon's ``FalconLinear``),
are taken as the parent; an embedding whose forward adds a known step (a constant output scale, rows computed from
its arguments) is taken with that step kept (weight-only formats); a Conv2d subclass that pads its input itself
("same" padding, as in EfficientNet) is taken with its padding; any other subclass with its own forward is passed
over by a glob, with the reason, and refused by an exact name.

Groups: ``WeightOnly(bits=8)`` is per output channel (``group_size=None``); other bit widths and NF4 default to
groups of 64. A group size that does not divide a layer's input size leaves a short last group in each row
(quantized as if zero-padded: the same numbers); ``module.note`` says so. GPTQ chooses the short group's scale from
its own columns like any other group; AWQ's clipping search and HQQ's zero-point optimisation see only the short
group's real columns (the padding has zero inputs, and is masked out of HQQ's objective).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Sequence

import torch
from torch import nn

from workbench.plans.lookalike import kept
from workbench.plans.registry import Config, Handler, register_config
from workbench.quantization import experts
from workbench.quantization import formats as fm
from workbench.quantization.methods import Method, method_for
from workbench.quantization.modules import (
    CONV_TYPES,
    FORWARD_BYPASSED,
    KERNELS,
    W8A8Linear,
    WeightOnlyEmbedding,
    WeightOnlyLinear,
    conv_args,
    lookalike_reason,
    selectable,
    w8a8_conv,
    weight_only_conv,
)
from workbench.quantization.observers import OBSERVERS, ObserverAccumulator
from workbench.quantization.primitives import fp16_scale

__all__ = ["Method", "WeightOnly", "NF4", "FP8", "MXFP4", "MXFP8", "NVFP4", "Dynamic", "Static", "W8A8_KERNELS",
           "STATIC_KERNELS"]

# the kernels the W8A8 configs accept (their ``choices``, which the generated forms offer): "cpu-int8" is a
# weight-only path, and Static W8A8 has no Triton kernel (see `_check_w8a8`)
W8A8_KERNELS = tuple(k for k in KERNELS if k != "cpu-int8")
STATIC_KERNELS = tuple(k for k in W8A8_KERNELS if k != "triton")


def _computation(name: str, module: nn.Module, technique: str, transforms: bool = False):
    """(the layer type ``module`` computes as, its `InputPadding` or None), from
    `workbench.plans.lookalike.computation`; raises, naming the layer, when a subclass's own forward computes
    something else, or (``transforms=False``) adds a step around its parent's computation."""
    from workbench.plans.lookalike import computation

    found = computation(module)
    if not found.taken:
        raise ValueError(f"{name!r} is a {type(module).__name__}, a subclass of nn.{found.parent.__name__} with its "
                         f"own forward: {found.reason}; {technique} would replace what that forward computes, so it "
                         f"is refused (exclude it with {{{name!r}: None}} in the plan)")
    if found.transform is not None and not transforms:
        raise ValueError(f"{name!r} is a {type(module).__name__}, whose own forward adds a step around "
                         f"nn.{found.parent.__name__}'s computation ({found.note}); {technique} cannot keep that "
                         f"step, so it is refused (exclude it with {{{name!r}: None}} in the plan)")
    return found.parent, found.padding


class _FormatHandler(Handler):
    """Round-to-nearest weight storage in the config's format (`NF4`, `FP8`; the base of `WeightOnly`'s handler):
    builds the module for Linear / Conv1d / Conv2d / ConvTranspose2d / Embedding (and subclasses computing the
    same, see `modules.layer_type`). The hooks below the Handler ones are what `WeightOnly` adds."""

    def supports(self, module: nn.Module, config) -> bool:
        return selectable(module) or experts.takes_experts(module)

    def why_not(self, module: nn.Module, config) -> str | None:
        return experts.experts_refusal(module) or experts.router_note(module) or lookalike_reason(module)

    def _check(self, name: str, module: nn.Module, config):
        """(the layer type ``module`` computes as, its input padding); raises naming the layer. A transform its
        own forward adds (an embedding's constant scale) is kept by `apply` / `skeleton`."""
        return _computation(name, module, type(config).__name__, transforms=True)

    def _linear_tensors(self, name: str, module: nn.Module, config, fmt: fm.WeightFormat, inputs):
        """(tensors, smooth) for a Linear's weight; (None, None): round to nearest."""
        return None, None

    def _kernel(self, config) -> str:
        """The matmul path asked for (a `KERNELS` string)."""
        return "auto"

    def _smooth(self, config) -> bool:
        """Whether the stored weight is scaled per input channel (AWQ)."""
        return False

    def _permuted(self, config) -> bool:
        """Whether the stored weight has permuted input columns (GPTQ act-order with dynamic groups)."""
        return False

    def _act_bits(self, config) -> int | None:
        """The bits a Linear's input is rounded to per token (None: as it comes)."""
        return None

    def from_trained(self, name, layer, config, weight_scale=None, input_padding=None):
        """The stored module for a QAT-trained float ``layer``: round to nearest on the trained weights, or, with
        learned ``weight_scale`` (LSQ), those scales (rounded to fp16, as every stored scale is)."""
        fmt = config.format()
        tensors = None
        if weight_scale is not None:
            w2d = layer.weight.reshape(layer.weight.shape[0], -1)
            rows, K = w2d.shape
            scale = fp16_scale(weight_scale.detach().abs().reshape(rows, -1))
            _, zero = fm.int_qparams(w2d, fmt)
            if fmt.symmetric:
                zero = torch.full_like(zero, 1 << (fmt.bits - 1))
            tensors = fm.pack_int(fm.int_codes(w2d, scale, zero, fmt), scale, zero, fmt)
        if isinstance(layer, nn.Embedding):
            new = WeightOnlyEmbedding.from_float(layer, fmt, name)
            for key, t in (tensors or {}).items():
                getattr(new, key).copy_(t)
            return new
        if isinstance(layer, nn.Linear):
            return WeightOnlyLinear.from_float(layer, fmt, name, tensors=tensors, kernel=self._kernel(config),
                                               act_bits=self._act_bits(config))
        return weight_only_conv(conv_args(layer, input_padding)["op"]).from_float(
            layer, fmt, name, tensors=tensors, input_padding=input_padding)

    def apply(self, name: str, module: nn.Module, config, inputs: Sequence[tuple[torch.Tensor, ...]] | None):
        if experts.takes_experts(module):   # fused mixture-of-experts projections: round to nearest per expert
            return experts.WeightOnlyExperts.from_float(name, module, config.format())
        return kept(module, self._build(name, module, config, inputs))

    def _build(self, name: str, module: nn.Module, config, inputs):
        kind, padding = self._check(name, module, config)
        fmt = config.format()
        if kind is nn.Embedding:
            return WeightOnlyEmbedding.from_float(module, fmt, name)
        if kind in CONV_TYPES:
            args = conv_args(module, padding)
            return weight_only_conv(args["op"]).from_float(module, fmt, name, input_padding=padding)
        fm.check_finite(name, module.weight)
        tensors, smooth = self._linear_tensors(name, module, config, fmt, inputs)
        perm = tensors.pop("perm", None) if tensors is not None else None
        return WeightOnlyLinear.from_float(module, fmt, name, tensors=tensors, smooth=smooth,
                                           kernel=self._kernel(config), perm=perm, act_bits=self._act_bits(config))

    def skeleton(self, name: str, module: nn.Module, config):
        if experts.takes_experts(module):
            return experts.WeightOnlyExperts.skeleton(name, module, config.format(), smooth=self._smooth(config))
        return kept(module, self._empty(name, module, config))

    def _empty(self, name: str, module: nn.Module, config):
        kind, padding = self._check(name, module, config)
        fmt = config.format()
        if kind is nn.Embedding:
            return WeightOnlyEmbedding(module.num_embeddings, module.embedding_dim, fmt, padding_idx=module.padding_idx,
                                       output_dtype=module.weight.dtype, device=module.weight.device)
        if kind in CONV_TYPES:
            args = conv_args(module, padding)
            return weight_only_conv(args["op"])(args, fmt, module.bias is not None, device=module.weight.device,
                                                weight_dtype=module.weight.dtype)
        return WeightOnlyLinear(module.in_features, module.out_features, fmt, module.bias is not None,
                                device=module.weight.device, bias_dtype=module.weight.dtype,
                                smooth=self._smooth(config), kernel=self._kernel(config),
                                perm=self._permuted(config), act_bits=self._act_bits(config))


class _NF4Handler(_FormatHandler):
    """`NF4`: round to nearest into `formats.NF4Format`, every weight layer; the CPU kernel where it runs."""


class _FP8Handler(_FormatHandler):
    """`FP8`: round to nearest into `formats.FP8Format`, every weight layer (reference path)."""


class _WeightOnlyHandler(_FormatHandler):
    """`WeightOnly`: integer formats with a method (`workbench.quantization.methods`: one class per method, e.g.
    GPTQ / AWQ calibrated, HQQ data-free, nn.Linear only) and a kernel choice (the fast paths are matmuls: nn.Linear
    only)."""

    def supports(self, module: nn.Module, config) -> bool:
        if config.act_bits is not None:   # the input rounded per token: a Linear's input
            return selectable(module, (nn.Linear,))
        if self._experts(module, config):
            return True
        if method_for(config).linear_only or config.kernel in ("cpu", "triton"):
            return selectable(module, (nn.Linear,))
        return super().supports(module, config)

    @staticmethod
    def _experts(module: nn.Module, config) -> bool:
        """Fused experts this config takes: per expert with its method where the method takes them (e.g. GPTQ
        without act-order: groups in column order), on the reference path."""
        return experts.takes_experts(module) and config.kernel in ("auto", "reference") and \
            method_for(config).takes_experts(config)

    def why_not(self, module: nn.Module, config) -> str | None:
        if config.act_bits is not None and not selectable(module, (nn.Linear,)):
            return (lookalike_reason(module, (nn.Linear,)) or
                    f"act_bits={config.act_bits} rounds the input of nn.Linear layers per token; "
                    f"{type(module).__name__} is not one")
        if experts.takes_experts(module):   # (supports said no: a method or kernel only nn.Linear has)
            return (f"fused mixture-of-experts weights are stored round to nearest, GPTQ (without act_order) or AWQ on "
                    f"the reference path (method={config.method.value!r}, act_order={config.act_order}, "
                    f"kernel={config.kernel!r} take nn.Linear layers)")
        return super().why_not(module, config)

    def apply(self, name: str, module: nn.Module, config, inputs):
        if experts.takes_experts(module):
            made = method_for(config).experts(name, module, config, config.format(), inputs)
            if made is not None:
                return made
        return super().apply(name, module, config, inputs)

    def needs_calibration(self, config) -> bool:
        return method_for(config).calibrated

    def accumulator(self, name: str, module: nn.Module, config):
        """What the method keeps of a layer's calibration inputs, fed batch by batch (GPTQ: the Hessian; AWQ
        searches on the inputs themselves: None, keep them)."""
        if experts.takes_experts(module):   # (experts: the calls, routed later)
            return None
        return method_for(config).accumulator(name, module, config)

    def calibration_cost(self, module: nn.Module, config, tokens: int) -> tuple[int, float]:
        """(peak working bytes, floating-point operations) of calibrating ``module`` on ``tokens`` inputs."""
        if experts.takes_experts(module):   # every expert in turn: its matrices' sizes, the tokens routed to it
            cubes = [p for p in module.parameters(recurse=False) if p.dim() == 3]
            N, K = max(p.shape[1] for p in cubes), max(p.shape[2] for p in cubes)
            return 2 * 4 * K * K + 5 * N * K, sum(2.0 * tokens * p[0].numel() for p in cubes) + 4.0 * K ** 3
        return method_for(config).calibration_cost(module, config, tokens)

    def _linear_tensors(self, name: str, module: nn.Module, config, fmt: fm.WeightFormat, inputs):
        return method_for(config).linear_tensors(name, module, config, fmt, inputs)

    def _kernel(self, config) -> str:
        return config.kernel

    def _smooth(self, config) -> bool:
        return method_for(config).smooth(config)

    def _permuted(self, config) -> bool:
        return method_for(config).permuted(config)

    def _act_bits(self, config) -> int | None:
        return config.act_bits


class _DefaultGroupSize(int):
    """The default of ``WeightOnly.group_size``: 64 values per group, or per channel (None) for 8-bit weights.
    ``__post_init__`` replaces it by the concrete value (so a config's repr and JSON always show that)."""


_DEFAULT_GROUP = _DefaultGroupSize(64)


@register_config(_WeightOnlyHandler(), kind="quant.WeightOnly")
@dataclass(frozen=True)
class WeightOnly(Config):
    """Integer weight-only quantization: ``bits`` in {2, 3, 4, 8}; ``group_size`` along the input dimension
    (None: per output channel; default 64, and per channel for 8 bits); symmetric or asymmetric (with a zero
    point); ``method`` one of
    rtn, gptq, awq, hqq (the last three for nn.Linear; hqq needs ``symmetric=False``). ``act_bits``: also round each
    Linear's input per token to that many bits, symmetric (W4A8: ``act_bits=8``, W4A4: ``act_bits=4``): the
    numbers an integer WxAy kernel multiplies, computed here on the weight-only paths with the rounded input (no
    integer kernel for them yet; nn.Linear layers only, not exported)."""

    bits: int = 4
    group_size: int | None = _DEFAULT_GROUP   # 64, or None (per channel) for bits=8
    symmetric: bool = True
    method: Method = Method.RTN
    damp: float = 0.01        # GPTQ: fraction of the mean Hessian diagonal added for stability
    act_order: bool = False   # GPTQ: quantize columns in order of decreasing Hessian diagonal
    static_groups: bool = False   # GPTQ act_order: groups of the original columns (True) or, as the reference
    #                               does, of the activation order (False: the layer stores a column permutation)
    kernel: str = field(default="auto", metadata={"choices": KERNELS})  # Linear matmul: "auto" (the device's
    #                  fastest path), "reference", "cpu", "cpu-int8" (int8-rounded activations), "triton"
    act_bits: int | None = None   # the input rounded per token to act_bits (W4A8, W4A4), or as it comes

    def __post_init__(self):
        if isinstance(self.method, str) and not isinstance(self.method, Method):
            try:
                object.__setattr__(self, "method", Method(self.method))
            except ValueError:
                raise ValueError(f"WeightOnly.method must be one of {[m.value for m in Method]}, "
                                 f"got {self.method!r}") from None
        if not isinstance(self.bits, int) or isinstance(self.bits, bool):
            raise ValueError(f"WeightOnly.bits must be an int, got {self.bits!r}")
        if type(self.group_size) is _DefaultGroupSize:
            object.__setattr__(self, "group_size", None if self.bits == 8 else int(self.group_size))
        method_for(self).check(self)
        fm.validate(self.format())
        if self.kernel not in KERNELS:
            raise ValueError(f"WeightOnly.kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.kernel == "triton" and self.format().triton_kind is None:
            raise ValueError(f"WeightOnly(kernel='triton') serves int8 per-channel symmetric (group_size=None) and "
                             f"int4 weights; bits={self.bits}, group_size={self.group_size}, "
                             f"symmetric={self.symmetric} has only 'reference' and 'cpu'")
        if not 0 < self.damp < 1:
            raise ValueError(f"WeightOnly.damp must be in (0, 1), got {self.damp!r}")
        if self.act_bits is not None:
            if not isinstance(self.act_bits, int) or isinstance(self.act_bits, bool) or not 2 <= self.act_bits <= 8:
                raise ValueError(f"WeightOnly.act_bits must be None or an int from 2 to 8, got {self.act_bits!r}")
            if self.kernel == "cpu-int8":
                raise ValueError("WeightOnly(kernel='cpu-int8') rounds the input to int8 per 32 values; act_bits "
                                 "rounds it per token: use one or the other")

    def format(self) -> fm.IntFormat:
        return fm.IntFormat(self.bits, self.group_size, self.symmetric, float_zero=method_for(self).float_zero)


@register_config(_NF4Handler(), kind="quant.NF4")
@dataclass(frozen=True)
class NF4(Config):
    """4-bit NormalFloat weights (QLoRA codebook) with an absmax scale per ``group_size`` values (None: one
    scale per output channel)."""

    group_size: int | None = 64

    def __post_init__(self):
        fm.validate(self.format())

    def format(self) -> fm.NF4Format:
        return fm.NF4Format(self.group_size)


@register_config(_FP8Handler(), kind="quant.FP8")
@dataclass(frozen=True)
class FP8(Config):
    """float8 weights (e4m3fn or e5m2) with one fp32 scale per output channel."""

    dtype: torch.dtype = field(default=torch.float8_e4m3fn, metadata={"choices": fm.FLOAT8_DTYPES})

    def __post_init__(self):
        if isinstance(self.dtype, str):
            named = getattr(torch, self.dtype.removeprefix("torch."), None)
            if isinstance(named, torch.dtype):
                object.__setattr__(self, "dtype", named)
        fm.validate(self.format())

    def format(self) -> fm.FP8Format:
        return fm.FP8Format(self.dtype)


class _BlockFloatHandler(_FormatHandler):
    """`MXFP4`, `MXFP8`, `NVFP4`: round to nearest into the block-scaled floating-point format, every weight layer;
    the CPU kernel for the 4-bit ones where it runs."""


@register_config(_BlockFloatHandler(), kind="quant.MXFP4")
@dataclass(frozen=True)
class MXFP4(Config):
    """OCP MX v1.0 MXFP4 weights: E2M1 values with a power-of-two (E8M0) scale per 32 (4.25 bits a weight)."""

    def format(self) -> fm.MXFP4Format:
        return fm.MXFP4Format()


@register_config(_BlockFloatHandler(), kind="quant.MXFP8")
@dataclass(frozen=True)
class MXFP8(Config):
    """OCP MX v1.0 MXFP8 weights: float8 e4m3 values with a power-of-two (E8M0) scale per 32 (8.25 bits a weight)."""

    def format(self) -> fm.MXFP8Format:
        return fm.MXFP8Format()


@register_config(_BlockFloatHandler(), kind="quant.NVFP4")
@dataclass(frozen=True)
class NVFP4(Config):
    """NVIDIA NVFP4 weights: E2M1 values with a float8 e4m3 scale per 16 and an fp32 scale per tensor (4.5 bits a
    weight)."""

    def format(self) -> fm.NVFP4Format:
        return fm.NVFP4Format()


class _W8A8Handler(Handler):
    """W8A8 of nn.Linear (optionally SmoothQuant-smoothed); the base of `Dynamic`'s and `Static`'s handlers, which
    differ in ``static``. Static (without smoothing, reference kernel) also takes nn.Conv1d / Conv2d /
    ConvTranspose2d, Dynamic nn.LSTM / nn.GRU. Layers are chosen as `_FormatHandler` chooses them."""

    static: ClassVar[bool]

    def supports(self, module: nn.Module, config) -> bool:
        if isinstance(module, FORWARD_BYPASSED):  # e.g. MultiheadAttention's out_proj: activations never pass
            return False                          # through its forward, so they could not be quantized there
        if experts.takes_experts(module):   # fused experts: int8 experts, activations int8 in each product
            return config.smooth_alpha is None and config.kernel in ("auto", "reference")
        if _recurrent(module) is not None:   # Dynamic W8A8 of nn.LSTM / nn.GRU (workbench.quantization.recurrent)
            return not self.static and config.smooth_alpha is None
        if self.static and config.smooth_alpha is None and config.kernel in ("reference", "auto"):
            return selectable(module, (nn.Linear, *CONV_TYPES))
        return selectable(module, (nn.Linear,))

    def why_not(self, module: nn.Module, config) -> str | None:
        if experts.takes_experts(module):   # (supports said no)
            return (f"fused mixture-of-experts weights take W8A8 without SmoothQuant on the reference path "
                    f"(smooth_alpha={config.smooth_alpha}, kernel={config.kernel!r} take nn.Linear layers)")
        return experts.experts_refusal(module) or experts.router_note(module) or \
            lookalike_reason(module, (nn.Linear, *CONV_TYPES))

    def needs_calibration(self, config) -> bool:
        return self.static or config.smooth_alpha is not None

    def accumulator(self, name: str, module: nn.Module, config):
        """What is kept of a layer's calibration inputs, fed batch by batch: the activation observer (Static) or
        the per-channel max |x| (SmoothQuant). Both together need two passes (the observer sees x / s, and s
        needs every batch first): None, keep the inputs."""
        from workbench.quantization.smoothquant import AbsMaxAccumulator

        if _recurrent(module) is not None or experts.takes_experts(module):   # (experts: the calls, routed later)
            return None
        if self.static and config.smooth_alpha is None:
            return ObserverAccumulator(OBSERVERS[config.observer]())
        if not self.static and config.smooth_alpha is not None:
            return AbsMaxAccumulator(module.in_features, name)
        return None

    def calibration_cost(self, module: nn.Module, config, tokens: int) -> tuple[int, float]:
        """(peak working bytes, floating-point operations): observing each input batch, fp32 copies."""
        if experts.takes_experts(module):
            cubes = [p for p in module.parameters(recurse=False) if p.dim() == 3]
            return 4 * 3 * max(p.numel() for p in cubes), 10.0 * sum(tokens * p[0].numel() for p in cubes)
        K = module.weight[0].numel()
        return 4 * (2 * tokens * K + 3 * module.weight.numel()), 10.0 * tokens * K + 10.0 * module.weight.numel()

    def apply(self, name, module, config, inputs):
        from workbench.quantization.smoothquant import activation_absmax, smoothing_factors

        if (rnn := _recurrent(module)) is not None:
            return rnn.from_float(module, name, kernel=_recurrent_kernel(name, config))
        if experts.takes_experts(module):
            observer = OBSERVERS[config.observer] if self.static else None
            return experts.w8a8_experts(name, module, self.static, inputs, observer)
        kind, padding = _computation(name, module, type(config).__name__)
        fm.check_finite(name, module.weight)
        if kind in CONV_TYPES:
            args = conv_args(module, padding)
            return w8a8_conv(args["op"]).from_float(module, self._act_scale(name, config, inputs, None), name,
                                                    input_padding=padding)
        smooth = None
        if config.smooth_alpha is not None:
            smooth = smoothing_factors(activation_absmax(inputs, module.in_features, name), module.weight,
                                       config.smooth_alpha).to(module.weight.device)
        act_scale = self._act_scale(name, config, inputs, smooth) if self.static else None
        return kept(module, W8A8Linear.from_float(module, name, kernel=config.kernel, act_scale=act_scale,
                                                  smooth=smooth))

    @staticmethod
    def _act_scale(name, config, inputs, smooth) -> torch.Tensor:
        if isinstance(inputs, ObserverAccumulator):   # fed batch by batch (no smoothing)
            if inputs.device is None:
                raise ValueError(f"static quantization of {name!r} needs calibration inputs, and none were recorded")
            act_scale, _ = inputs.observer.qparams(8, symmetric=True)
            return act_scale.reshape(()).to(inputs.device)
        if not inputs:
            raise ValueError(f"static quantization of {name!r} needs calibration inputs, and none were recorded")
        observer = OBSERVERS[config.observer]()
        for batch in inputs:
            x = batch[0].float()
            if smooth is not None:
                x = x / smooth.to(x.device)
            observer.observe(x)
        act_scale, _ = observer.qparams(8, symmetric=True)
        return act_scale.reshape(()).to(inputs[0][0].device)

    def skeleton(self, name, module, config):
        if (rnn := _recurrent(module)) is not None:
            return rnn.skeleton(module.input_size, module.hidden_size, module.num_layers, module.bias,
                                module.batch_first, module.dropout, module.bidirectional,
                                kernel=_recurrent_kernel(name, config))
        if experts.takes_experts(module):
            return experts.w8a8_experts(name, module, self.static, values=False)
        kind, padding = _computation(name, module, type(config).__name__)
        if kind in CONV_TYPES:
            args = conv_args(module, padding)
            return w8a8_conv(args["op"])(args, module.bias is not None, device=module.weight.device)
        return W8A8Linear(module.in_features, module.out_features, module.bias is not None,
                          static=self.static, smooth=config.smooth_alpha is not None,
                          device=module.weight.device, kernel=config.kernel)


def _recurrent(module: nn.Module):
    """The int8 recurrent module class for an exact nn.LSTM / nn.GRU (a subclass may compute something else)."""
    from workbench.quantization.recurrent import DynamicQuantGRU, DynamicQuantLSTM

    return {nn.LSTM: DynamicQuantLSTM, nn.GRU: DynamicQuantGRU}.get(type(module))


def _recurrent_kernel(name: str, config) -> str:
    if config.kernel == "triton":
        raise ValueError(f"{name!r}: the int8 LSTM / GRU has 'reference' and 'cpu' paths, no Triton kernel; use "
                         f"Dynamic(kernel='auto') for the recurrent layers")
    return config.kernel


def _check_w8a8(config) -> None:
    if config.bits != 8:
        raise ValueError(f"{type(config).__name__} quantization supports 8 bits, got {config.bits!r}")
    if config.kernel == "triton" and isinstance(config, Static):
        raise ValueError("Static W8A8 has 'reference' and 'cpu' kernels; the Triton W8A8 kernel quantizes activations "
                         "per token at run time: use wb.quant.Dynamic(kernel='triton')")
    kernels = STATIC_KERNELS if isinstance(config, Static) else W8A8_KERNELS
    if config.kernel not in kernels:
        raise ValueError(f"{type(config).__name__}.kernel must be one of {kernels}, got {config.kernel!r}")
    if config.smooth_alpha is not None and not 0.0 <= config.smooth_alpha <= 1.0:
        raise ValueError(f"{type(config).__name__}.smooth_alpha must be in [0, 1] or None, got {config.smooth_alpha!r}")


class _DynamicHandler(_W8A8Handler):
    static = False

    def from_trained(self, name, layer, config, weight_scale=None, input_padding=None):
        """A QAT-trained nn.Linear as W8A8 (int8 per-channel weights of the trained values)."""
        return W8A8Linear.from_float(layer, name, kernel=config.kernel)


class _StaticHandler(_W8A8Handler):
    static = True


@register_config(_DynamicHandler(), kind="quant.Dynamic")
@dataclass(frozen=True)
class Dynamic(Config):
    """W8A8 of a Linear: int8 per-channel weights, int8 activations quantized per token at run time.
    ``smooth_alpha``: SmoothQuant migration strength (needs calibration), None for plain W8A8."""

    bits: int = 8
    kernel: str = field(default="auto", metadata={"choices": W8A8_KERNELS})  # "auto" (fastest here), "reference"
    #                  (fp32 math), "cpu" (torch._int_mm), "triton" (CUDA)
    smooth_alpha: float | None = None

    def __post_init__(self):
        _check_w8a8(self)


@register_config(_StaticHandler(), kind="quant.Static")
@dataclass(frozen=True)
class Static(Config):
    """W8A8 of a Linear (or, without smoothing, a Conv2d) with one per-tensor activation scale calibrated by
    ``observer`` (one of ``minmax``, ``moving_average``, ``percentile``, ``mse``, ``histogram``)."""

    bits: int = 8
    observer: str = field(default="minmax", metadata={"choices": OBSERVERS})  # activation range calibration
    kernel: str = field(default="auto", metadata={"choices": STATIC_KERNELS})  # "auto", "reference", "cpu"
    smooth_alpha: float | None = None

    def __post_init__(self):
        _check_w8a8(self)
        if self.observer not in OBSERVERS:
            raise ValueError(f"Static.observer must be one of {sorted(OBSERVERS)}, got {self.observer!r}")
