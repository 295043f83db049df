"""Quantization configs (frozen dataclasses registered with the plan registry) and their handlers.

    wb.quant.WeightOnly(bits=4, group_size=64, method="gptq")   # Linear, Embedding, Conv2d
    wb.quant.NF4(group_size=64)                                 # Linear, Embedding
    wb.quant.FP8()                                              # Linear (float8 e4m3 weights, per-row scales)
    wb.quant.Dynamic(bits=8, kernel="cpu")                      # Linear: W8A8, per-token activations
    wb.quant.Static(observer="percentile", smooth_alpha=0.5)    # Linear: W8A8, calibrated activations

Group sizes must divide the layer's input dimension: groups are never padded, and a layer whose
dimension does not fit is refused with an error naming it (use a divisor, or ``group_size=None``
for one group per output channel).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from workbench.plans.registry import Config, register_config
from workbench.quantization import formats as fm
from workbench.quantization.modules import (
    KERNELS, W8A8Conv2d, W8A8Linear, WeightOnlyConv2d, WeightOnlyEmbedding, WeightOnlyLinear, conv_args,
    triton_weight_kind,
)
from workbench.quantization.observers import OBSERVERS

__all__ = ["Method", "WeightOnly", "NF4", "FP8", "Dynamic", "Static"]


class Method(str, enum.Enum):
    RTN = "rtn"    # round to nearest (data-free)
    GPTQ = "gptq"  # Hessian-aware error feedback (needs calibration; nn.Linear)
    AWQ = "awq"    # activation-aware per-input-channel scaling (needs calibration; nn.Linear)
    HQQ = "hqq"    # half-quadratic zero-point optimisation (data-free; nn.Linear; symmetric=False)


_CALIBRATED = (Method.GPTQ, Method.AWQ)


def _check_divides(name: str, fmt, K: int) -> None:
    g = getattr(fmt, "group_size", None)
    if g is not None and K % g:
        raise ValueError(f"group_size {g} does not divide the input dimension {K} of {name!r}; use a divisor of "
                         f"{K} or group_size=None")


def _weight_rows(module: nn.Module) -> int:
    if isinstance(module, nn.Embedding):
        return module.embedding_dim
    return module.weight[0].numel()


class _WeightHandler:
    """Shared by WeightOnly, NF4 and FP8: build the module for Linear / Embedding / Conv2d."""

    types: tuple[type, ...] = (nn.Linear, nn.Embedding, nn.Conv2d)

    def supports(self, module: nn.Module, config) -> bool:
        if getattr(config, "method", Method.RTN) is not Method.RTN:  # the algorithms are written for Linear
            return type(module) is nn.Linear
        if getattr(config, "kernel", "reference") in ("cpu", "triton"):   # the fast paths are matmuls
            return type(module) is nn.Linear
        return type(module) in self.types

    def needs_calibration(self, config) -> bool:
        return getattr(config, "method", Method.RTN) in _CALIBRATED

    def calibration_cost(self, module: nn.Module, config, tokens: int) -> tuple[int, float]:
        """(peak working bytes, floating-point operations) of calibrating ``module`` on ``tokens`` inputs."""
        N, K = module.weight.shape[0], module.weight[0].numel()
        method = getattr(config, "method", Method.RTN)
        if method is Method.GPTQ:  # float64 Hessian and its inverse, fp32 weight copies, error block
            return 2 * 8 * K * K + 4 * 4 * N * K, 2.0 * tokens * K * K + 2.0 * K ** 3 + 2.0 * N * K * K
        if method is Method.AWQ:   # inputs (tokens, K), reference and candidate outputs (tokens, N), 21+20 steps
            return 4 * (2 * tokens * K + 2 * tokens * N + 3 * N * K), 2.0 * tokens * K * N * (1 + 21 + 20)
        return 4 * 3 * N * K, 20.0 * N * K

    def apply(self, name: str, module: nn.Module, config, inputs: Sequence[tuple[torch.Tensor, ...]] | None):
        fmt = config.format()
        _check_divides(name, fmt, _weight_rows(module))
        if isinstance(module, nn.Embedding):
            return WeightOnlyEmbedding.from_float(module, fmt, name)
        if isinstance(module, nn.Conv2d):
            return WeightOnlyConv2d.from_float(module, fmt, name)
        method = getattr(config, "method", Method.RTN)
        fm.check_finite(name, module.weight)
        tensors = smooth = None
        if method is Method.GPTQ:
            from workbench.quantization.gptq import gptq_quantize

            tensors = gptq_quantize(module.weight.detach(), inputs, fmt, damp=config.damp,
                                    act_order=config.act_order, name=name)
        elif method is Method.AWQ:
            from workbench.quantization.awq import awq_search

            tensors, smooth, _ = awq_search(module.weight.detach(), inputs, fmt, name=name)
        elif method is Method.HQQ:
            from workbench.quantization.hqq import hqq_quantize

            tensors = hqq_quantize(module.weight.detach(), fmt)
        return WeightOnlyLinear.from_float(module, fmt, name, tensors=tensors, smooth=smooth,
                                           kernel=getattr(config, "kernel", "reference"))

    def skeleton(self, name: str, module: nn.Module, config):
        fmt = config.format()
        _check_divides(name, fmt, _weight_rows(module))
        if isinstance(module, nn.Embedding):
            return WeightOnlyEmbedding(module.num_embeddings, module.embedding_dim, fmt, padding_idx=module.padding_idx,
                                       output_dtype=module.weight.dtype, device=module.weight.device)
        if isinstance(module, nn.Conv2d):
            return WeightOnlyConv2d(conv_args(module), fmt, module.bias is not None, device=module.weight.device)
        return WeightOnlyLinear(module.in_features, module.out_features, fmt, module.bias is not None,
                                device=module.weight.device, bias_dtype=module.weight.dtype,
                                smooth=getattr(config, "method", Method.RTN) is Method.AWQ,
                                kernel=getattr(config, "kernel", "reference"))


class _LinearOnly(_WeightHandler):
    types = (nn.Linear,)


class _LinearEmbedding(_WeightHandler):
    types = (nn.Linear, nn.Embedding)


@register_config(_WeightHandler(), kind="quant.WeightOnly")
@dataclass(frozen=True)
class WeightOnly(Config):
    """Integer weight-only quantization: ``bits`` in {2, 3, 4, 8}; ``group_size`` along the input dimension
    (None: per output channel); symmetric or asymmetric (with a zero point); ``method`` one of
    rtn, gptq, awq, hqq (the last three for nn.Linear; hqq needs ``symmetric=False``)."""

    bits: int = 4
    group_size: int | None = 64
    symmetric: bool = True
    method: Method = Method.RTN
    damp: float = 0.01        # GPTQ: fraction of the mean Hessian diagonal added for stability
    act_order: bool = False   # GPTQ: quantize columns in order of decreasing Hessian diagonal
    kernel: str = "reference"  # Linear matmul: "reference", "cpu" (bf16), "triton" (int8 per-channel, int4) or "auto"

    def __post_init__(self):
        if isinstance(self.method, str) and not isinstance(self.method, Method):
            try:
                object.__setattr__(self, "method", Method(self.method))
            except ValueError:
                raise ValueError(f"WeightOnly.method must be one of {[m.value for m in Method]}, "
                                 f"got {self.method!r}") from None
        if not isinstance(self.bits, int) or isinstance(self.bits, bool):
            raise ValueError(f"WeightOnly.bits must be an int, got {self.bits!r}")
        if self.method is Method.HQQ and self.symmetric:
            raise ValueError("method='hqq' optimises zero points: pass symmetric=False")
        fm.validate(self.format())
        if self.kernel not in KERNELS:
            raise ValueError(f"WeightOnly.kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.kernel == "triton" and triton_weight_kind(self.format()) is None:
            raise ValueError(f"WeightOnly(kernel='triton') serves int8 per-channel symmetric (group_size=None) and "
                             f"int4 weights; bits={self.bits}, group_size={self.group_size}, "
                             f"symmetric={self.symmetric} has only 'reference' and 'cpu'")
        if not 0 < self.damp < 1:
            raise ValueError(f"WeightOnly.damp must be in (0, 1), got {self.damp!r}")

    def format(self) -> fm.IntFormat:
        return fm.IntFormat(self.bits, self.group_size, self.symmetric, float_zero=self.method is Method.HQQ)


@register_config(_LinearEmbedding(), kind="quant.NF4")
@dataclass(frozen=True)
class NF4(Config):
    """4-bit NormalFloat weights (QLoRA codebook) with an absmax scale per ``group_size`` values."""

    group_size: int = 64

    def __post_init__(self):
        fm.validate(self.format())

    def format(self) -> fm.NF4Format:
        return fm.NF4Format(self.group_size)


@register_config(_LinearOnly(), kind="quant.FP8")
@dataclass(frozen=True)
class FP8(Config):
    """float8 weights (e4m3fn or e5m2) with one fp32 scale per output channel."""

    dtype: torch.dtype = torch.float8_e4m3fn

    def __post_init__(self):
        if isinstance(self.dtype, str):
            named = getattr(torch, self.dtype.removeprefix("torch."), None)
            if isinstance(named, torch.dtype):
                object.__setattr__(self, "dtype", named)
        fm.validate(self.format())

    def format(self) -> fm.FP8Format:
        return fm.FP8Format(self.dtype)


class _W8A8Handler:
    """Dynamic and Static W8A8 of nn.Linear (optionally SmoothQuant-smoothed); Static also for nn.Conv2d."""

    def supports(self, module: nn.Module, config) -> bool:
        if isinstance(config, Static) and config.smooth_alpha is None and config.kernel in ("reference", "auto"):
            return type(module) in (nn.Linear, nn.Conv2d)
        return type(module) is nn.Linear

    def needs_calibration(self, config) -> bool:
        return isinstance(config, Static) or config.smooth_alpha is not None

    def calibration_cost(self, module: nn.Module, config, tokens: int) -> tuple[int, float]:
        """(peak working bytes, floating-point operations): observing each input batch, fp32 copies."""
        K = module.weight[0].numel()
        return 4 * (2 * tokens * K + 3 * module.weight.numel()), 10.0 * tokens * K + 10.0 * module.weight.numel()

    def apply(self, name, module, config, inputs):
        from workbench.quantization.smoothquant import activation_absmax, smoothing_factors

        fm.check_finite(name, module.weight)
        if isinstance(module, nn.Conv2d):
            return W8A8Conv2d.from_float(module, self._act_scale(name, config, inputs, None), name)
        smooth = None
        if config.smooth_alpha is not None:
            smooth = smoothing_factors(activation_absmax(inputs, module.in_features, name), module.weight,
                                       config.smooth_alpha).to(module.weight.device)
        act_scale = self._act_scale(name, config, inputs, smooth) if isinstance(config, Static) else None
        return W8A8Linear.from_float(module, name, kernel=config.kernel, act_scale=act_scale, smooth=smooth)

    @staticmethod
    def _act_scale(name, config, inputs, smooth) -> torch.Tensor:
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
        if isinstance(module, nn.Conv2d):
            return W8A8Conv2d(conv_args(module), module.bias is not None, device=module.weight.device)
        return W8A8Linear(module.in_features, module.out_features, module.bias is not None,
                          static=isinstance(config, Static), smooth=config.smooth_alpha is not None,
                          device=module.weight.device, kernel=config.kernel)


def _check_w8a8(config) -> None:
    if config.bits != 8:
        raise ValueError(f"{type(config).__name__} quantization supports 8 bits, got {config.bits!r}")
    if config.kernel not in KERNELS:
        raise ValueError(f"{type(config).__name__}.kernel must be one of {KERNELS}, got {config.kernel!r}")
    if config.kernel == "triton" and isinstance(config, Static):
        raise ValueError("Static W8A8 has 'reference' and 'cpu' kernels; the Triton W8A8 kernel quantizes activations "
                         "per token at run time: use wb.quant.Dynamic(kernel='triton')")
    if config.smooth_alpha is not None and not 0.0 <= config.smooth_alpha <= 1.0:
        raise ValueError(f"{type(config).__name__}.smooth_alpha must be in [0, 1] or None, got {config.smooth_alpha!r}")


_W8A8 = _W8A8Handler()


@register_config(_W8A8, kind="quant.Dynamic")
@dataclass(frozen=True)
class Dynamic(Config):
    """W8A8 of a Linear: int8 per-channel weights, int8 activations quantized per token at run time.
    ``smooth_alpha``: SmoothQuant migration strength (needs calibration), None for plain W8A8."""

    bits: int = 8
    kernel: str = "reference"  # "reference" (fp32 math), "cpu" (torch._int_mm), "triton" (CUDA) or "auto"
    smooth_alpha: float | None = None

    def __post_init__(self):
        _check_w8a8(self)


@register_config(_W8A8, kind="quant.Static")
@dataclass(frozen=True)
class Static(Config):
    """W8A8 of a Linear (or, without smoothing, a Conv2d) with one per-tensor activation scale calibrated by
    ``observer`` (one of ``minmax``, ``moving_average``, ``percentile``, ``mse``, ``histogram``)."""

    bits: int = 8
    observer: str = "minmax"
    kernel: str = "reference"
    smooth_alpha: float | None = None

    def __post_init__(self):
        _check_w8a8(self)
        if self.observer not in OBSERVERS:
            raise ValueError(f"Static.observer must be one of {sorted(OBSERVERS)}, got {self.observer!r}")
