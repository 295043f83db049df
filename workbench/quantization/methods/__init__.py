"""Post-training quantization methods of `wb.quant.WeightOnly`, one registered class per file: `rtn` (round to
nearest), `gptq` (Hessian error feedback), `awq` (activation-aware scaling), `hqq` (half-quadratic zero points).

A method says what `WeightOnly`'s handler needs to know of it - whether it calibrates, what it keeps of a layer's
inputs batch by batch (its `Accumulator`), what calibrating costs, which layers it takes (fused experts or not), and
the stored tensors it makes for a Linear's weight (and for fused experts) - so a new method is a new file here with a
`PTQMethod` subclass registered for its `Method` name (and that name in the enum); the handler has no branch per
method. The numerics live beside (`workbench.quantization.gptq`, `.awq`, `.hqq`).
"""
from __future__ import annotations

import enum
from typing import Sequence

import torch
from torch import nn

__all__ = ["Method", "PTQMethod", "register_method", "method_for", "registered_methods"]


class Method(str, enum.Enum):
    RTN = "rtn"    # round to nearest (data-free)
    GPTQ = "gptq"  # Hessian-aware error feedback (needs calibration; nn.Linear)
    AWQ = "awq"    # activation-aware per-input-channel scaling (needs calibration; nn.Linear)
    HQQ = "hqq"    # half-quadratic zero-point optimisation (data-free; nn.Linear; symmetric=False)


class PTQMethod:
    """One method (the defaults are round to nearest's). ``config`` is the `WeightOnly` config asking."""

    name: Method
    calibrated: bool = False      # needs calibration inputs
    linear_only: bool = False     # takes nn.Linear layers only (not embeddings / convolutions)
    float_zero: bool = False      # stores real-valued zero points (the format's ``float_zero``)

    def check(self, config) -> None:
        """Raise ValueError naming the field when ``config`` cannot run this method."""

    def takes_experts(self, config) -> bool:
        """Whether fused mixture-of-experts projections are quantized with this method (per expert)."""
        return False

    def experts(self, name: str, module: nn.Module, config, fmt, inputs) -> nn.Module | None:
        """The quantized experts module, or None for round to nearest per expert."""
        return None

    def accumulator(self, name: str, module: nn.Module, config):
        """What is kept of a Linear's calibration inputs, fed batch by batch (None: the inputs themselves)."""
        return None

    def calibration_cost(self, module: nn.Module, config, tokens: int) -> tuple[int, float]:
        """(peak working bytes, floating-point operations) of quantizing a Linear on ``tokens`` inputs."""
        N, K = module.weight.shape[0], module.weight[0].numel()
        return 4 * 3 * N * K, 20.0 * N * K

    def linear_tensors(self, name: str, module: nn.Module, config, fmt, inputs: Sequence | None
                       ) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor | None]:
        """(the stored tensors of the Linear's weight, AWQ-style per-input-channel factors) - (None, None): round to
        nearest."""
        return None, None

    def smooth(self, config) -> bool:
        """Whether the stored weight is scaled per input channel (the layer divides its input back)."""
        return False

    def permuted(self, config) -> bool:
        """Whether the stored weight has permuted input columns (the layer gathers its input)."""
        return False


_METHODS: dict[Method, PTQMethod] = {}


def register_method(cls: type[PTQMethod]) -> type[PTQMethod]:
    """Class decorator: make ``cls`` the method of its ``name``."""
    if not isinstance(getattr(cls, "name", None), Method):
        raise TypeError(f"{cls.__name__}.name must be a Method")
    if cls.name in _METHODS and type(_METHODS[cls.name]) is not cls:
        raise ValueError(f"method {cls.name.value!r} is already registered by {type(_METHODS[cls.name]).__name__}")
    _METHODS[cls.name] = cls()
    return cls


def method_for(config) -> PTQMethod:
    """The registered method of ``config.method``."""
    try:
        return _METHODS[config.method]
    except KeyError:
        raise ValueError(f"no quantization method {config.method!r} is registered "
                         f"(known: {[m.value for m in _METHODS]})") from None


def registered_methods() -> list[Method]:
    return list(_METHODS)


from workbench.quantization.methods import awq, gptq, hqq, rtn  # noqa: E402,F401  (each registers itself)
