"""Look-alike layers: what a subclass of nn.Linear / nn.Conv* / nn.Embedding with its own ``forward`` computes,
decided by running it (issue 35), for every technique (quantization, cast, low-rank, pruning).

A layer is chosen by what it computes, not by its exact class. `computation(module)` returns a `Computation`:

- the parent's computation: the class keeps the parent's forward, or its own forward gives the parent's output on
  a probe input (Falcon's ``FalconLinear``: ``x @ W.T + b``) - taken as the parent;
- the parent's computation with a known transform the compressed layer can keep exactly (`Transform.attach`):
  an embedding whose output is the lookup times a constant (`OutputScale`: Gemma-2's ``embed_scale``), or one whose
  forward computes which rows to read from its arguments and reads them (`RowsFromForward`: OPT's learned
  positions, an offset added to positions computed from the attention mask);
- a Conv2d that pads its input first ("same" padding, `workbench.quantization.modules.input_padding_of`);
- otherwise not taken: ``reason`` says what the forward does differently; a glob passes the layer over with that
  reason, an exact name refuses it (`Plan.survey`).

Probes are deterministic (seeded inputs; the layer's own weights, or seeded random ones for a `wb.load` skeleton's
meta tensors), small (a few rows) and run once per module instance (cached). Two computations of the same layer
are compared with a rounding bound: each is a sum of K products plus a bias, within gamma_{K+1} sum|terms| of the
exact value (Higham, Accuracy and Stability of Numerical Algorithms, eq. 3.5; gamma_n = n u / (1 - n u), u the
unit roundoff of the dtype the product runs in - TF32's 2^-11 for fp32 on a CUDA GPU that allows it), so they
differ by at most twice that; a forward that adds 1, transposes, or scales differs by orders of magnitude more.
Gathers and one multiplication by a constant are compared exactly.
"""
from __future__ import annotations

import copy
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Computation", "Transform", "OutputScale", "RowsFromForward", "computation", "kept", "PARENTS"]

PARENTS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.Embedding)


class Transform:
    """A known step a look-alike's forward adds around its parent's computation, kept by the compressed layer."""

    note: str = ""

    def attach(self, new: nn.Module, original: nn.Module) -> nn.Module:
        """``new`` (the compressed parent computation of ``original``) made to compute ``original``'s forward."""
        raise NotImplementedError


@dataclass(frozen=True)
class Computation:
    """What a layer computes: ``parent`` (a `PARENTS` class) with ``transform`` (None: exactly the parent's) and,
    for a Conv2d that pads its input itself, ``padding`` (an `InputPadding`); or ``reason`` why it is not taken."""

    parent: type | None
    transform: Transform | None = None
    padding: Any = None
    reason: str | None = None
    note: str = ""          # what was checked, for the applied report ("" for a plain class)

    @property
    def taken(self) -> bool:
        return self.reason is None


_CACHE: weakref.WeakKeyDictionary[nn.Module, Computation] = weakref.WeakKeyDictionary()


def computation(module: nn.Module) -> Computation:
    """What ``module`` (an instance of one of `PARENTS`) computes; see the module docstring. Cached per instance."""
    parent = next((p for p in PARENTS if isinstance(module, p)), None)
    if parent is None:
        return Computation(None, reason=f"{type(module).__name__} is not one of "
                                        f"{', '.join(p.__name__ for p in PARENTS)}")
    if _keeps_parent_forward(type(module), parent):
        return Computation(parent)
    found = _CACHE.get(module)
    if found is None:
        found = _probe(module, parent)
        _CACHE[module] = found
    return found


def _keeps_parent_forward(cls: Any, parent: Any) -> bool:
    return cls.forward is parent.forward and getattr(cls, "_conv_forward", None) is getattr(
        parent, "_conv_forward", None)


def _probe(module: nn.Module, parent: type) -> Computation:
    kind = type(module).__name__
    if parent is nn.Conv2d:
        from workbench.quantization.modules import input_padding_of

        try:
            padding = input_padding_of("layer", module)
        except ValueError as e:
            return Computation(parent, reason=str(e).replace("'layer' is a", "a", 1))
        return Computation(parent, padding=padding, note=f"{kind}'s own forward pads by {padding} then computes "
                                                         f"nn.Conv2d's (checked on probe inputs)")
    try:
        with torch.no_grad():
            probe = _probe_embedding if parent is nn.Embedding else _probe_weighted
            return probe(_materialized(module), parent, kind)
    except Exception as e:   # a forward that cannot run on its parent's inputs does not compute the parent's
        return Computation(parent, reason=f"its own forward ({kind}) could not be run on a probe input of "
                                          f"nn.{parent.__name__} ({type(e).__name__}: {e}), so what it computes is "
                                          f"not known")


def _materialized(module: nn.Module) -> nn.Module:
    """``module`` itself, or (a `wb.load` skeleton, meta tensors) a CPU copy with seeded random tensors in their
    place: the decision must not depend on the values, only on what the forward does with them."""
    meta = [t for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)) if t.is_meta]
    if not meta:
        return module
    g = torch.Generator().manual_seed(0)
    memo: dict[int, Any] = {}
    for t in meta:
        value = torch.randn(t.shape, generator=g).to(t.dtype) if t.is_floating_point() else torch.zeros(
            t.shape, dtype=t.dtype)
        memo[id(t)] = nn.Parameter(value, requires_grad=False) if isinstance(t, nn.Parameter) else value
    return copy.deepcopy(module, memo)


# --- Linear and convolutions: the parent's computation, or not taken ------------------------------------------

def _reference(parent: Any) -> Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """The parent's computation as a function of (layer, input, weight, bias) (the layer gives the other args)."""
    if parent is nn.Linear:
        return lambda m, x, w, b: F.linear(x, w, b)
    if parent is nn.ConvTranspose2d:
        return lambda m, x, w, b: F.conv_transpose2d(x, w, b, m.stride, m.padding, m.output_padding, m.groups,
                                                     m.dilation)
    return lambda m, x, w, b: parent._conv_forward(m, x, w, b)   # (nn.Conv1d / Conv3d: padding_mode included)


def _probe_input(m: Any, parent: type) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = m.weight
    if parent is nn.Linear:
        return torch.randn(2, 3, m.in_features, generator=g).to(w)                     # (B, T, in)
    span = [d * (k - 1) + 1 + 2 * s for k, d, s in zip(m.kernel_size, m.dilation, m.stride)]
    return torch.randn(2, m.in_channels, *span, generator=g).to(w)                     # (B, C, *spatial)


def _unit_roundoff(t: torch.Tensor) -> float:
    u = torch.finfo(t.dtype).eps / 2
    if t.device.type == "cuda" and t.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        u = max(u, 2.0 ** -11)
    return u


def _probe_weighted(m: Any, parent: type, kind: str) -> Computation:
    x = _probe_input(m, parent)
    out = m(x)
    ref_fn = _reference(parent)
    w, b = m.weight.detach(), None if m.bias is None else m.bias.detach()
    ref = ref_fn(m, x, w, b)
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return Computation(parent, reason=f"its own forward ({kind}) returns {got} where nn.{parent.__name__} "
                                          f"returns {tuple(ref.shape)} on the same input")
    terms = ref_fn(m, x.abs(), w.abs(), None if b is None else b.abs()).float()     # sum |x_i w_i| + |b|
    k = w[0].numel() + 1
    u = _unit_roundoff(out)
    gamma = k * u / (1 - k * u)
    diff = (out.float() - ref.float()).abs()
    bound = 2 * gamma * terms
    if bool(torch.isfinite(out).all()) and bool((diff <= bound).all()):
        return Computation(parent, note=f"{kind}'s own forward computes nn.{parent.__name__}'s (checked on a probe "
                                        f"input: max difference {float(diff.max()):.2g}, rounding bound "
                                        f"{float(bound.max()):.2g})")
    worst = int((diff - bound).flatten().argmax())
    return Computation(parent, reason=f"its own forward ({kind}) does not compute nn.{parent.__name__}'s: on a probe "
                                      f"input it differs by up to {float(diff.flatten()[worst]):.3g} where rounding "
                                      f"explains {float(bound.flatten()[worst]):.2g}")


# --- Embedding: the lookup, the lookup times a constant, or rows the forward computes ---------------------------

def _lookup(m: Any, idx: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    return F.embedding(idx, m.weight.detach() if weight is None else weight, m.padding_idx)


def _scale_candidates(m: nn.Module, out: torch.Tensor, ref: torch.Tensor) -> list[torch.Tensor]:
    """Constants ``out`` may be ``ref`` times: the layer's one-element tensors, then the ratio at ref's largest
    entry (for a constant that is not stored); each as a 0-d tensor of the output's dtype."""
    found = [t.detach().reshape(()) for t in (*m.buffers(recurse=False), *m.parameters(recurse=False))
             if t.numel() == 1 and t.is_floating_point()]
    at = int(ref.abs().flatten().argmax())
    if float(ref.flatten()[at]) != 0.0:
        found.append(out.flatten()[at] / ref.flatten()[at])
    return [c.to(out.dtype) for c in found if bool(torch.isfinite(c)) and float(c) not in (0.0, 1.0)]


def _probe_embedding(m: Any, parent: type, kind: str) -> Computation:
    if m.max_norm is not None:
        return Computation(parent, reason="it renormalises its rows in place (max_norm): its stored weight is not "
                                          "what it computes with")
    g = torch.Generator().manual_seed(0)
    n, device = m.num_embeddings, m.weight.device
    # 0/1 first: valid as indices for any table and as an attention mask (a forward computing positions from it)
    mask = torch.randint(0, min(n, 2), (2, 8), generator=g).to(device)
    mask[:, 0] = min(n - 1, 1)
    out = m(mask)
    if not isinstance(out, torch.Tensor):
        return Computation(parent, reason=f"its own forward ({kind}) returns a {type(out).__name__}, not a tensor")
    ref = _lookup(m, mask)
    if out.shape == ref.shape:
        wide = torch.randint(0, n, (2, 8), generator=g).to(device)   # every row, once the forward is known to take
        if torch.equal(out, ref) and torch.equal(m(wide), _lookup(m, wide)):   # indices (a mask could overflow)
            return Computation(parent, note=f"{kind}'s own forward computes nn.Embedding's lookup (checked on probe "
                                            f"indices)")
        for c in _scale_candidates(m, out, ref):
            if torch.equal(out, ref * c) and torch.equal(m(wide), _lookup(m, wide) * c):
                scale = OutputScale(c.clone())
                return Computation(parent, scale, note=f"{kind}'s own forward multiplies nn.Embedding's lookup by "
                                                       f"a constant (checked on probe indices); {scale.note}")
    rows = RowsFromForward.rows(m, mask)
    if rows is not None and rows.shape == out.shape[:-1] and not torch.equal(rows, mask) and bool(
            (rows >= 0).all()) and bool((rows < n).all()) and torch.equal(out, _lookup(m, rows)):
        gather = RowsFromForward()
        return Computation(parent, gather, note=f"{kind}'s own forward reads the rows it computes from its "
                                                f"arguments (checked on a probe); {gather.note}")
    return Computation(parent, reason=f"its own forward ({kind}) returns neither nn.Embedding's lookup of its input, "
                                      f"nor that lookup times a constant, nor rows it computes from its arguments "
                                      f"(checked on a probe input)")


# --- the transforms, kept around the compressed layer ---------------------------------------------------------

class _ScaledOutput:
    """Mixed in ahead of a compressed embedding's class: its output times the ``output_scale`` buffer."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)   # type: ignore[misc]
        return out * self.output_scale.to(out.dtype)   # type: ignore[attr-defined]


class _RowsFromForward:
    """Mixed in ahead of a compressed embedding's class: the original layer's own forward, run on a table of row
    numbers (``_rows_of``, not a registered sub-module: it holds no weights and is not a layer to compress), says
    which rows to read; the compressed lookup reads them."""

    def forward(self, *args, **kwargs):
        rows = self._rows_of(*args, **kwargs)[..., 0]   # type: ignore[attr-defined]   # (...) int64
        return super().forward(rows)   # type: ignore[misc]

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)   # type: ignore[misc]
        held = next((t for t in (*self.parameters(), *self.buffers()) if not t.is_meta), None)   # type: ignore
        if held is not None:   # follow the layer's device (its row table is an index table: no dtype to change)
            self._rows_of.to(held.device)   # type: ignore[attr-defined]
        return out


@functools.cache
def _transformed_class(base: Any, mixin: type) -> type:
    name = f"{mixin.__name__.strip('_')}{base.__name__}"
    return type(name, (mixin, base), {"__module__": __name__, "__qualname__": name})


def _with_mixin(new: nn.Module, mixin: type) -> nn.Module:
    base: Any = type(new)
    new.__class__ = _transformed_class(base, mixin)
    return new


@dataclass(frozen=True)
class OutputScale(Transform):
    """The forward returns the parent's output times ``scale`` (a 0-d tensor of the output's dtype)."""

    scale: torch.Tensor = field(compare=False)

    @property
    def note(self) -> str:   # type: ignore[override]
        return f"keeps its forward's constant output scale x{float(self.scale):.6g}"

    def attach(self, new: nn.Module, original: nn.Module) -> nn.Module:
        device = next((t.device for t in (*new.parameters(), *new.buffers())), torch.device("cpu"))
        new = _with_mixin(new, _ScaledOutput)
        new.register_buffer("output_scale", self.scale.clone().to(device))
        return new


@dataclass(frozen=True)
class RowsFromForward(Transform):
    """The forward computes from its arguments which rows to read (an offset, positions from a mask) and reads them:
    the compressed layer runs the original forward on a table of row numbers, then reads those rows."""

    note = "keeps its forward's computation of which rows to read"

    @staticmethod
    def row_table(original: Any) -> nn.Module:
        """A copy of ``original`` (its forward, its other state) whose weight is the column of row numbers."""
        w = original.weight
        device = torch.device("cpu") if w.is_meta else w.device
        table = copy.deepcopy(original, {id(w): None})
        del table._parameters["weight"]
        table.register_buffer("weight", torch.arange(original.num_embeddings, device=device).unsqueeze(1),
                              persistent=False)                                         # (rows, 1) int64
        return table.requires_grad_(False)

    @staticmethod
    def rows(original: nn.Module, *args) -> torch.Tensor | None:
        out = RowsFromForward.row_table(original)(*args)
        return out[..., 0] if isinstance(out, torch.Tensor) and out.shape[-1:] == (1,) and \
            out.dtype == torch.int64 else None

    def attach(self, new: nn.Module, original: nn.Module) -> nn.Module:
        new = _with_mixin(new, _RowsFromForward)
        object.__setattr__(new, "_rows_of", self.row_table(original))
        return new


def kept(original: nn.Module, new: nn.Module) -> nn.Module:
    """``new``, the compressed parent computation of ``original``, with ``original``'s transform attached (if any)
    and what was checked added to its ``note`` (shown in `wb.applied_report`)."""
    found = computation(original)
    if found.transform is not None:
        new = found.transform.attach(new, original)
    if found.note:
        object.__setattr__(new, "note", "; ".join(x for x in (getattr(new, "note", None), found.note) if x))
    return new
