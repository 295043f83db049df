"""fp8 training recipes, emulated on any device: e4m3 for the forward's inputs and weights, e5m2 for the
gradients, each tensor with its own per-tensor scale from *current* or *delayed* scaling.

fp8 has too little range for raw training tensors (e4m3: largest 448, smallest normal 2^-6; e5m2: 57,344 and
2^-14), so every tensor is multiplied by a scale ``s`` before the cast, ``q = fp8(clamp(s * x, -max, max))``, and
divided by it after: ``x ~ q / s``. The recipes differ in where ``s`` comes from (Micikevicius et al. 2022, "FP8
Formats for Deep Learning"; NVIDIA Transformer Engine's ``DelayedScaling``):

- **current** scaling: ``s = max_fp8 / amax(x)`` from the tensor itself - never saturates, but needs a full pass
  over the tensor (an amax reduction) before it can be cast, which a fused GPU kernel would rather not wait for;
- **delayed** scaling: ``s = max_fp8 / max(amax history)``, the largest amax of the last ``history`` steps; this
  step's amax is recorded *after* the cast. Cheap, but a tensor whose values jump above its history saturates
  (clamped to +-max_fp8) for as long as the history lags - `Fp8State.saturated` counts those values.

``margin`` backs the scale off by 2^margin (headroom, as Transformer Engine's ``margin``). Forward: inputs and
weights in e4m3 (more mantissa). Backward: the output gradient in e5m2 (more range); the weight and input
gradients are computed from the fp8 values, as an fp8 GEMM would. The arithmetic runs in fp32 on the dequantized
values - the *numerics* of fp8 training on hardware without fp8 matmuls (this CPU), not its speed.

`fp8_training(model, recipe)` returns a copy whose ``nn.Linear`` layers are `Fp8Linear` (fp32 master weights,
trained by any optimizer and loop, e.g. `wb.training.fit_classifier`); `fp8_restore` turns them back into plain
``nn.Linear`` layers holding the trained weights.
"""
from __future__ import annotations

import copy
import fnmatch
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["Fp8Recipe", "Fp8State", "Fp8Linear", "fp8_training", "fp8_restore", "fp8_layers"]

_SCALINGS = ("current", "delayed")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class Fp8Recipe:
    """How an `Fp8Linear` scales and casts: ``scaling`` "current" or "delayed" (see the module docstring),
    ``history`` steps of amax kept for delayed scaling, ``margin`` (scale backed off by 2^margin), the fp8 dtype of
    the forward (inputs, weights) and of the backward (output gradients)."""
    scaling: str = field(default="delayed", metadata={"choices": _SCALINGS})
    history: int = 16
    margin: int = 0
    forward_dtype: torch.dtype = field(default=torch.float8_e4m3fn, metadata={"choices": _FP8})
    backward_dtype: torch.dtype = field(default=torch.float8_e5m2, metadata={"choices": _FP8})

    def __post_init__(self):
        if self.scaling not in _SCALINGS:
            raise ValueError(f"Fp8Recipe.scaling must be one of {_SCALINGS}, got {self.scaling!r}")
        if not isinstance(self.history, int) or isinstance(self.history, bool) or self.history < 1:
            raise ValueError(f"Fp8Recipe.history must be a positive int, got {self.history!r}")
        if not isinstance(self.margin, int) or isinstance(self.margin, bool) or self.margin < 0:
            raise ValueError(f"Fp8Recipe.margin must be an int >= 0, got {self.margin!r}")
        for name in ("forward_dtype", "backward_dtype"):
            if getattr(self, name) not in _FP8:
                raise ValueError(f"Fp8Recipe.{name} must be torch.float8_e4m3fn or torch.float8_e5m2, "
                                 f"got {getattr(self, name)!r}")


class Fp8State:
    """The scaling state of one tensor role (a layer's input, weight or output gradient): its amax history, the
    values clamped so far (``saturated``) and the values cast so far (``seen``)."""

    def __init__(self, dtype: torch.dtype, recipe: Fp8Recipe):
        self.dtype, self.recipe = dtype, recipe
        self.fmax = torch.finfo(dtype).max
        self.history: list[float] = []
        self.saturated = 0
        self.seen = 0

    def scale(self, x: torch.Tensor) -> float:
        """The multiplier for ``x`` under the recipe (before this step's amax is recorded)."""
        if self.recipe.scaling == "current" or not self.history:   # delayed: the first step has no history yet
            amax = float(x.detach().abs().max())
        else:
            amax = max(self.history)
        return self.fmax / amax / 2.0 ** self.recipe.margin if amax > 0 else 1.0

    def cast(self, x: torch.Tensor, record: bool = True) -> torch.Tensor:
        """``x`` through fp8 and back (fp32): scale, clamp to the format's range, cast, unscale; ``record``: count
        the saturated values and add this step's amax to the history."""
        s = self.scale(x)
        scaled = x.detach().float() * s
        q = scaled.clamp(-self.fmax, self.fmax).to(self.dtype)      # saturate explicitly (never rely on the cast)
        if record:   # beyond the range in exact arithmetic: |x| > max / s (not a rounding of s * amax onto max)
            self.saturated += int((x.detach().abs() > self.fmax / s * (1 + 2.0 ** -20)).sum())
            self.seen += x.numel()
            self.history = [*self.history, float(x.detach().abs().max())][-self.recipe.history:]
        return q.float() / s


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        xq, wq = layer.input_state.cast(x, layer.training), layer.weight_state.cast(weight, layer.training)
        ctx.save_for_backward(xq, wq)
        ctx.layer, ctx.has_bias = layer, bias is not None
        out = xq @ wq.t()
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_out):
        xq, wq = ctx.saved_tensors
        gq = ctx.layer.grad_state.cast(grad_out)                      # e5m2: the gradient's range matters most
        grad_x = gq @ wq
        grad_w = gq.reshape(-1, gq.shape[-1]).t() @ xq.reshape(-1, xq.shape[-1])
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class Fp8Linear(nn.Module):
    """An ``nn.Linear`` trained with fp8 numerics (see the module docstring); ``weight`` / ``bias`` stay fp32
    master parameters. In eval mode it casts the same way but records nothing (no amax history, no counts)."""

    rounds_activations = True   # (to fp8; see WeightOnlyLinear.rounds_activations)

    def __init__(self, linear: nn.Linear, recipe: Fp8Recipe):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"Fp8Linear wraps an nn.Linear, got {type(linear).__name__}")
        self.in_features, self.out_features, self.recipe = linear.in_features, linear.out_features, recipe
        self.weight, self.bias = linear.weight, linear.bias
        self.input_state = Fp8State(recipe.forward_dtype, recipe)
        self.weight_state = Fp8State(recipe.forward_dtype, recipe)
        self.grad_state = Fp8State(recipe.backward_dtype, recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Fp8Matmul.apply(x, self.weight, self.bias, self)

    def states(self) -> dict[str, Fp8State]:
        return {"input": self.input_state, "weight": self.weight_state, "grad": self.grad_state}

    def to_linear(self) -> nn.Linear:
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=self.weight.device, dtype=self.weight.dtype)
        out.weight, out.bias = self.weight, self.bias
        return out

    def extra_repr(self) -> str:
        r = self.recipe
        return (f"in_features={self.in_features}, out_features={self.out_features}, scaling={r.scaling}, "
                f"history={r.history}, forward={str(r.forward_dtype).removeprefix('torch.')}, "
                f"backward={str(r.backward_dtype).removeprefix('torch.')}")


def fp8_training(model: nn.Module, recipe: Fp8Recipe | None = None, layers: str = "*",
                 inplace: bool = False) -> nn.Module:
    """``model`` (a copy unless ``inplace``) with every ``nn.Linear`` whose name matches the glob ``layers``
    replaced by an `Fp8Linear` sharing its parameters. A pattern that matches no Linear is an error."""
    recipe = recipe or Fp8Recipe()
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"recipe must be an Fp8Recipe, got {type(recipe).__name__}")
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear and fnmatch.fnmatchcase(n, layers)]
    passed = {n: why for n, why in _not_fp8(model).items() if fnmatch.fnmatchcase(n, layers)}
    if not names:
        found = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        raise ValueError(f"fp8_training: no nn.Linear matches {layers!r} in {type(model).__name__} "
                         f"(its Linear layers: {found[:8]}{' ...' if len(found) > 8 else ''})"
                         + "".join(f"; {n}: {why}" for n, why in list(passed.items())[:4]))
    if passed:   # nothing silent: the matched layers that stay in full precision, each with its reason
        items = [f"{n} ({why})" for n, why in passed.items()]
        warnings.warn(f"fp8_training passed over {len(items)} matched layer(s), which keep training in full "
                      f"precision: {'; '.join(items[:3])}{f'; and {len(items) - 3} more' if len(items) > 3 else ''}",
                      UserWarning, stacklevel=2)
    out = model if inplace else copy.deepcopy(model)
    for name in names:
        parent, _, leaf = name.rpartition(".")
        holder = out.get_submodule(parent) if parent else out
        setattr(holder, leaf, Fp8Linear(getattr(holder, leaf), recipe))
    return out


def _not_fp8(model: nn.Module) -> dict[str, str]:
    """Linear-like layers `fp8_training` does not replace, each with the reason: an ``nn.Linear`` subclass (its
    forward, or its owner, may not go through ``nn.Linear.forward`` - ``nn.MultiheadAttention`` reads its
    ``out_proj`` weight directly) and Hugging Face's ``Conv1D`` (GPT-2's Linear, weight stored (in, out))."""
    owners = {}
    for name, m in model.named_modules():
        for child, sub in m.named_children():
            owners[f"{name}.{child}" if name else child] = m
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear) or type(m) is nn.Linear:
            continue
        if isinstance(m, nn.Linear):
            owner = owners.get(name)
            out[name] = (f"{type(owner).__name__} uses its weight directly, not through its forward"
                         if isinstance(owner, nn.MultiheadAttention) else
                         f"{type(m).__name__} is a subclass of nn.Linear whose forward may differ")
        elif type(m).__name__ == "Conv1D" and getattr(getattr(m, "weight", None), "ndim", 0) == 2:
            out[name] = "a transformers Conv1D (GPT-2's Linear, weight stored (in, out)), not an nn.Linear"
    return out


def fp8_layers(model: nn.Module) -> dict[str, Fp8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


def fp8_restore(model: nn.Module) -> nn.Module:
    """``model`` with every `Fp8Linear` turned back into a plain ``nn.Linear`` holding its weights (in place)."""
    for name in list(fp8_layers(model)):
        parent, _, leaf = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        setattr(holder, leaf, getattr(holder, leaf).to_linear())
    return model
