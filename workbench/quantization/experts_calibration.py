"""Calibration of fused experts, expert by expert, on the tokens routed to each (`workbench.quantization.experts`).

The class's own forward runs on the experts module's recorded calls with each expert's matrix standing in as a
tensor that records what it is multiplied with (`expert_inputs`): whatever the layout - ``F.linear(x, W[e])`` or
``x @ W[e]``, a gate interleaved or fused - each expert's matrix is calibrated on exactly its inputs, projection
after projection (``down_proj`` sees the outputs of the already-compressed ``gate_up_proj``). `calibrated_experts`
quantizes that way (GPTQ, AWQ); an expert that received fewer than `MIN_EXPERT_TOKENS` tokens is rounded to nearest
instead, and says so: `coverage(model)` is the table of tokens per expert and the method each got.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from workbench.quantization import formats as fm
from workbench.quantization.experts import (
    _PRODUCTS,
    EXPERT_MATRICES,
    SMOOTH,
    WeightOnlyExperts,
    _build,
    _layout,
    eager_forward,
)

__all__ = ["MIN_EXPERT_TOKENS", "expert_inputs", "calibrated_experts", "coverage"]


MIN_EXPERT_TOKENS = 16   # an expert routed fewer calibration tokens than this is rounded to nearest, and said so

class _Tap(torch.Tensor):
    """One expert's matrix during calibration: a product with it (``F.linear(x, W[e])``, ``x @ W[e]``) records
    ``x`` (as rows) under its key; every result is a plain tensor."""

    _key: tuple[str, int]
    _sink: dict

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if len(args) >= 2:
            # x @ W[e] reaches here as W[e].__rmatmul__(x): Python asks the subclass on the right first
            x, tap = (args[1], args[0]) if func is torch.Tensor.__rmatmul__ else (args[0], args[1])
            if (func in _PRODUCTS or func is torch.Tensor.__rmatmul__) and isinstance(tap, _Tap) \
                    and isinstance(x, torch.Tensor) and not isinstance(x, _Tap):
                tap._sink.setdefault(tap._key, []).append(x.detach().reshape(-1, x.shape[-1]))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class _TapExperts(torch.Tensor):
    """A fused projection during calibration: indexing one expert (what the eager per-expert loop does) gives a
    `_Tap` of that expert's matrix."""

    _name: str
    _sink: dict

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.__getitem__ and isinstance(args[0], _TapExperts) and not kwargs:
            index = args[1]
            if isinstance(index, torch.Tensor) and index.dim() == 0 and not index.is_floating_point():
                index = int(index)
            if isinstance(index, int) and not isinstance(index, bool):
                tap = out.as_subclass(_Tap)
                tap._key, tap._sink = (args[0]._name, index % args[0].shape[0]), args[0]._sink
                return tap
        return out


def _tapped(tensor: torch.Tensor, name: str, sink: dict) -> _TapExperts:
    t = tensor.detach().as_subclass(_TapExperts)
    t._name, t._sink = name, sink
    return t


def _shadow(module: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A shallow stand-in for ``module`` whose expert projections are ``tensors`` (the module is not changed)."""
    shadow = object.__new__(type(module))
    shadow.__dict__.update(module.__dict__)
    shadow.__dict__["_parameters"] = {**module._parameters, **tensors}
    return shadow


def _calls(name: str, calls, method: str) -> list[tuple]:
    calls = [tuple(c) for c in calls or () if c]
    if not calls:
        raise ValueError(f"{method} needs calibration inputs for {name!r}, and none were recorded (no token reached "
                         f"its experts)")
    return calls


def expert_inputs(module: nn.Module, calls, projection: str,
                  tensors: dict[str, torch.Tensor] | None = None) -> list[list[torch.Tensor]]:
    """Per expert, the inputs (each (tokens, K)) its matrix of ``projection`` is multiplied with when the class's
    eager forward runs on ``calls`` (the experts module's recorded positional arguments) - exactly the tokens the
    router sent to it, whatever the layout. ``tensors``: the fused projections to compute with (default: the
    module's own), e.g. earlier projections already compressed. The module is not changed."""
    current = tensors if tensors is not None else {
        n: p.detach() for n, p in module.named_parameters(recurse=False) if n in EXPERT_MATRICES}
    sink: dict = {}
    shadow = _shadow(module, {n: _tapped(t, n, sink) if n == projection else t for n, t in current.items()})
    forward = eager_forward(type(module))
    with torch.inference_mode():
        for call in calls:
            forward(shadow, *call)
    experts = current[projection].shape[0]
    return [sink.get((projection, e), []) for e in range(experts)]


def calibrated_experts(name: str, module: nn.Module, fmt: fm.WeightFormat, calls, quantize: Callable,
                       method: str, smooth: bool = False) -> "WeightOnlyExperts":
    """``module``'s experts quantized one by one with ``quantize(label, weight (out, in), inputs)`` (e.g. GPTQ) on
    the tokens routed to each, recorded by running the class's eager forward on ``calls`` (the experts module's
    recorded positional arguments, e.g. ``(hidden_states, top_k_index, top_k_weights)``). Projections are taken in
    chain order, each calibrated on the outputs of the ones already quantized; an expert with fewer than
    `MIN_EXPERT_TOKENS` routed tokens is rounded to nearest. ``smooth``: ``quantize`` also returns AWQ's factors
    (key ``"smooth"``, (K,)). The result's ``coverage`` lists (projection, expert, tokens, method) and its note sums
    it up."""
    layout = _layout(name, module)
    calls = _calls(name, calls, method)
    dtype = module.get_parameter(layout[0].name).dtype
    current = {m.name: module.get_parameter(m.name).detach() for m in layout}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    rows: list[tuple[str, int, int, str]] = []
    for m in layout:
        inputs = expert_inputs(module, calls, m.name, current)
        per_expert = []
        for e in range(m.experts):
            xs = inputs[e]
            tokens = sum(x.shape[0] for x in xs)
            w = current[m.name][e]
            w = w.t() if m.transposed else w                             # (rows, K): the Linear weight it is
            if tokens >= MIN_EXPERT_TOKENS:
                per_expert.append(quantize(f"{name}.{m.name}[{e}]", w, [(x,) for x in xs]))
                rows.append((m.name, e, tokens, method))
            else:
                per_expert.append(fm.encode(w, fmt))
                if smooth:   # (factors of one: the plain rounded weight)
                    per_expert[-1][SMOOTH] = torch.ones(m.K, device=w.device)
                rows.append((m.name, e, tokens, "rtn"))
        keys = set(per_expert[0])
        if any(set(t) != keys for t in per_expert):
            raise ValueError(f"{name!r}: {method} and round to nearest store different tensors for {m.name}")
        tensors[m.name] = {k: torch.stack([t[k] for t in per_expert]) for k in per_expert[0]}
        current[m.name] = m.decode(tensors[m.name], fmt, dtype)         # the next projection sees these weights
    new = _build(module, layout, fmt, tensors, device=None)
    new.coverage = rows
    fallback = sorted({e for _, e, _, how in rows if how == "rtn"})
    first = [t for n, _, t, _ in rows if n == layout[0].name]
    new.note = (f"{method} per expert on its routed calibration tokens ({layout[0].name}: {first} tokens per "
                f"expert); " + (f"expert(s) {fallback} saw fewer than {MIN_EXPERT_TOKENS} tokens in some projection "
                                f"and were rounded to nearest there; " if fallback else "") + new.note)
    return new


def coverage(model: nn.Module):
    """The experts' calibration coverage of a compressed model: one row per (layer, projection, expert) with the
    tokens routed to it during calibration and the method it got ("rtn" where too few arrived) (a DataFrame; empty
    when no experts module was calibrated)."""
    import pandas as pd

    rows = [(n, p, e, t, how) for n, m in model.named_modules() for p, e, t, how in getattr(m, "coverage", ())]
    return pd.DataFrame(rows, columns=["layer", "projection", "expert", "tokens", "method"])
