"""Mixture-of-experts blocks whose experts are fused 3-D parameters, stored in a weight format per expert.

In transformers 5 the experts of a Mixtral-style block are one module holding a tensor per projection with the
experts as its first dimension: ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I) used as
``F.linear(x, W[e])`` (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek), or the transpose (E, H, 2I) / (E, I, H) used as
``x @ W[e]``, with per-expert biases (GPT-OSS). Each expert's matrix is an nn.Linear weight in disguise, so it is
stored exactly as `WeightOnlyLinear` stores that Linear: rows are the expert's outputs, groups run along its
inputs, the same codes, scales and zero points (`formats.encode` of the ``(out, in)`` matrix), stacked over the
experts: buffers ``<name>_qweight`` (E, out, packed in), ``<name>_scale`` (E, out, groups) (and ``<name>_zero``).

The replacement module is a subclass of the model's own experts class (`experts_class`), built without running
its ``__init__``: the float 3-D parameters are gone, and reading ``module.gate_up_proj`` returns a
`DecodedExperts`, a tensor with the parameter's shape, dtype and device that holds no data. The class's own
forward runs unchanged; indexing one expert (``W[e]``, what the per-expert loop does) decodes that expert alone,
indexing a batch of expert ids (``W[ids]``) decodes each distinct expert once, and anything else decodes every
expert. So a call decodes only the experts its router selected, and the output is what the float module computes
with the dequantized weights. transformers wraps the forward of its experts classes in a dispatcher that, unless
``config.experts_implementation == "eager"``, runs a grouped / batched matmul reading all experts' weights at
once; the module runs the class's eager per-expert loop instead (`eager_forward`), whatever the config says.

What is taken (`experts_layout`): a module owning 3-D parameters named ``gate_up_proj`` + ``down_proj``,
``gate_proj`` + ``up_proj`` + ``down_proj`` or ``up_proj`` + ``down_proj``, all with the same expert count (equal to
its ``num_experts`` where it has one), whose shapes chain as an MLP (H -> I -> H), in an orientation known from
transformers' ``is_transposed`` flag or, for a fused ``gate_up_proj``, from the shapes alone (the fused projection
is twice as wide as ``down_proj``'s input: only one orientation fits). Anything else holding such parameters is
refused with the reason (`experts_refusal`): a glob passes it over, an exact name fails. Biases and any other
parameters (1-D or 2-D) stay in floating point. The router is a separate module and is never quantized here.

Calibrated methods (GPTQ, AWQ) run per expert on the tokens the router sent to it
(`workbench.quantization.experts_calibration`, W8A8 in `workbench.quantization.experts_w8a8`): the class's
own forward runs on the recorded calls with each expert's matrix standing in as a tensor that records what it is
multiplied with (so whatever the layout - ``F.linear(x, W[e])`` or ``x @ W[e]``, a gate interleaved or fused -
each expert's matrix is calibrated on exactly its inputs), projection after projection (``down_proj`` sees the
outputs of the already-quantized ``gate_up_proj``). An expert that received fewer than `MIN_EXPERT_TOKENS` tokens
is rounded to nearest instead - never a scale from no data - and says so: `coverage(model)` is the table of tokens
per expert and the method each got, and the layer's note in `wb.applied_report` sums it up.

On the CPU (``kernel="auto"``, the default) each routed expert's products run `workbench_kernels.weight_only_cpu` on
its packed codes (`_KernelExpert`: nothing decoded); elsewhere, and with ``set_kernel("reference")``, the routed
experts are decoded and the class's float matmuls run. One fused kernel over all the routed experts of a call (and a
Triton path) is future work.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from workbench.quantization import formats as fm
from workbench.quantization.modules import DecodedWeight, apply_keeping_dtypes

# (and, from the modules beside this one, reachable here: calibrated_experts, expert_inputs, coverage,
# MIN_EXPERT_TOKENS, W8A8Experts, w8a8_experts - see `__getattr__` at the end)
__all__ = ["EXPERT_MATRICES", "ExpertMatrix", "DecodedExperts", "WeightOnlyExperts", "experts_layout",
           "experts_refusal", "takes_experts", "router_note", "experts_class", "eager_forward", "experts_shell"]

# the names transformers gives an experts module's fused projections (gate and up fused, or apart)
EXPERT_MATRICES = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")
SMOOTH = "smooth"   # AWQ's per-expert input-channel factors, stored beside the codes as "<projection>_smooth"
_LAYOUTS = ({"gate_up_proj", "down_proj"}, {"gate_proj", "up_proj", "down_proj"}, {"up_proj", "down_proj"})


@dataclass(frozen=True)
class ExpertMatrix:
    """One fused projection: ``experts`` matrices of ``rows`` outputs by ``K`` inputs, stored by the model as
    (E, rows, K) and used as ``F.linear(x, W[e])``, or ``transposed``: (E, K, rows) used as ``x @ W[e]``."""

    name: str
    experts: int
    rows: int
    K: int
    transposed: bool

    @property
    def shape(self) -> tuple[int, int, int]:
        """The float parameter's shape."""
        return (self.experts, self.K, self.rows) if self.transposed else (self.experts, self.rows, self.K)

    def encode(self, param: torch.Tensor, fmt: fm.WeightFormat) -> dict[str, torch.Tensor]:
        """Each expert's ``(rows, K)`` matrix encoded as `WeightOnlyLinear` encodes a Linear weight, stacked."""
        per_expert = []
        for e in range(self.experts):
            w = param[e].detach()                                   # (rows, K), or (K, rows) transposed
            per_expert.append(fm.encode(w.t() if self.transposed else w, fmt))
        return {key: torch.stack([t[key] for t in per_expert]) for key in per_expert[0]}

    def empty(self, fmt: fm.WeightFormat, device=None, smooth: bool = False) -> dict[str, torch.Tensor]:
        """The stacked tensors of ``fmt`` (and AWQ's ``smooth`` (E, K)), uninitialised (what `wb.load` fills)."""
        one = fm.empty((self.rows, self.K), fmt, device="meta")
        out = {key: torch.empty(self.experts, *t.shape, dtype=t.dtype, device=device) for key, t in one.items()}
        if smooth:
            out[SMOOTH] = torch.empty(self.experts, self.K, device=device)
        return out

    def decode(self, tensors: dict[str, torch.Tensor], fmt: fm.WeightFormat, dtype: torch.dtype) -> torch.Tensor:
        """The matrices held in ``tensors`` (their first dimension: some experts) in the parameter's layout; with
        AWQ's ``smooth`` factors (the codes encode ``W * s`` per input channel) divided back out, as
        `WeightOnlyLinear`'s ``weight`` does."""
        tensors = dict(tensors)
        smooth = tensors.pop(SMOOTH, None)
        n = next(iter(tensors.values())).shape[0]
        # a tensor holding one value per expert (NVFP4's global scale, (n, 1)) is repeated for each of its rows
        flat = {key: t.reshape(n, 1, *t.shape[1:]).expand(n, self.rows, *t.shape[1:]).reshape(n * self.rows, -1)
                if key in fmt.shared else t.reshape(n * self.rows, *t.shape[2:]) for key, t in tensors.items()}
        w = fm.decode(flat, fmt, self.K, dtype).reshape(n, self.rows, self.K)     # (n, rows, K)
        if smooth is not None:
            w = (w.float() / smooth.float().unsqueeze(1)).to(dtype)
        # the parameter's own layout (a contiguous (K, rows) per expert), so the class's matmul runs as on it
        return w.transpose(1, 2).contiguous() if self.transposed else w


# --- which modules: fused experts, found by their parameters ---------------------------------------------------

def experts_layout(module: nn.Module) -> tuple[ExpertMatrix, ...] | None:
    """The fused expert projections of ``module``; None when it holds no 3-D parameter named as one (it is no
    experts module). Raises ValueError saying why when it holds some in a layout this module cannot represent."""
    own = dict(module.named_parameters(recurse=False))
    cubes = {n: p for n, p in own.items() if p.dim() == 3}
    found = {n: cubes[n] for n in EXPERT_MATRICES if n in cubes}
    if not found:
        return None
    kind = type(module).__name__
    unknown = sorted(set(cubes) - set(found))
    if unknown:
        raise ValueError(f"{kind} also holds 3-D parameter(s) {unknown} whose role is not known")
    if set(found) not in _LAYOUTS:
        raise ValueError(f"{kind} holds expert projections {sorted(found)}, not a known layout (gate_up_proj + "
                         f"down_proj, gate_proj + up_proj + down_proj, or up_proj + down_proj)")
    counts = {p.shape[0] for p in found.values()}
    declared = getattr(module, "num_experts", None)
    if len(counts) != 1 or (isinstance(declared, int) and counts != {declared}):
        raise ValueError(f"{kind}: the expert projections do not share one expert count "
                         f"({ {n: tuple(p.shape) for n, p in found.items()} }, num_experts={declared})")
    if len({p.dtype for p in found.values()}) != 1 or not all(p.is_floating_point() for p in found.values()):
        raise ValueError(f"{kind}: the expert projections are not all of one floating-point dtype")
    transposed = _orientation(kind, module, found)
    E = counts.pop()
    matrices = tuple(ExpertMatrix(n, E, rows=p.shape[2] if transposed else p.shape[1],
                                  K=p.shape[1] if transposed else p.shape[2], transposed=transposed)
                     for n, p in found.items())
    _check_chain(kind, {m.name: m for m in matrices})
    return matrices


def _orientation(kind: str, module: nn.Module, found: dict[str, nn.Parameter]) -> bool:
    """Whether the projections are stored (E, in, out): transformers' ``is_transposed`` flag where the class has
    one; for a fused ``gate_up_proj`` without it, the only orientation its shape and ``down_proj``'s fit."""
    flag = getattr(module, "is_transposed", None)
    if isinstance(flag, bool):
        return flag
    if "gate_up_proj" in found:
        (_, a, b), (_, c, d) = found["gate_up_proj"].shape, found["down_proj"].shape
        fits = {False: b == c and a == 2 * d, True: a == d and b == 2 * c}   # (E, 2I, H) + (E, H, I), or transposed
        if fits[False] != fits[True]:
            return fits[True]
    raise ValueError(f"{kind}: which dimension of its expert projections is the input cannot be told (no "
                     f"is_transposed flag, and the shapes {[tuple(p.shape) for p in found.values()]} fit both ways)")


def _check_chain(kind: str, m: dict[str, ExpertMatrix]) -> None:
    """The projections must compute an MLP per expert: H -> (gate, up) -> I -> H."""
    down = m["down_proj"]
    first = [m[n] for n in ("gate_up_proj", "gate_proj", "up_proj") if n in m]
    width = first[0].rows // 2 if "gate_up_proj" in m else first[0].rows
    fused_even = "gate_up_proj" not in m or first[0].rows % 2 == 0
    if not fused_even or any(f.K != down.rows or f.rows != first[0].rows for f in first) or down.K != width:
        shapes = {n: x.shape for n, x in m.items()}
        raise ValueError(f"{kind}: the expert projections {shapes} do not chain as an MLP (hidden -> intermediate "
                         f"-> hidden) in the orientation {'(E, in, out)' if down.transposed else '(E, out, in)'}")


def takes_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a fused experts module this file can store (see `experts_layout`)."""
    try:
        return experts_layout(module) is not None
    except ValueError:
        return False


def experts_refusal(module: nn.Module) -> str | None:
    """Why a module holding fused expert projections cannot be stored (None: it is none, or it can be)."""
    try:
        experts_layout(module)
    except ValueError as e:
        return f"fused mixture-of-experts weights in an unknown layout: {e}"
    return None


def router_note(module: nn.Module) -> str | None:
    """For a mixture-of-experts router (a module with ``top_k`` and ``num_experts`` holding a ``weight`` of one row
    per expert, as transformers' ``*TopKRouter``), the sentence saying it is kept; None for anything else."""
    w = module._parameters.get("weight")
    n = getattr(module, "num_experts", None)
    if isinstance(n, int) and hasattr(module, "top_k") and w is not None and w.dim() == 2 and w.shape[0] == n:
        return (f"the router of a mixture of experts ({n} experts): kept in full precision (the experts it routes "
                f"to are quantized)")
    return None


# --- the stored module ----------------------------------------------------------------------------------------

class DecodedExperts(DecodedWeight):
    """What a quantized experts module's ``gate_up_proj`` (...) returns: a `DecodedWeight` of the float parameter's
    shape (E, ...), dtype and device whose indexing by one expert (``W[e]``, an int or a 0-d integer tensor)
    decodes that expert alone and by a 1-D tensor of expert ids (``W[ids]``) each distinct expert once; any other
    computation with it decodes every expert."""

    pick: Callable[[torch.Tensor], torch.Tensor]   # (a 1-D tensor of distinct expert ids) -> their matrices

    @staticmethod
    def __new__(cls, pick: Callable[[torch.Tensor], torch.Tensor], shape, dtype: torch.dtype, device: torch.device):
        experts = shape[0]
        t = DecodedWeight.__new__(cls, lambda: pick(torch.arange(experts, device=device)), shape, dtype, device)
        t.pick = pick
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and isinstance(args[0], DecodedExperts) and not kwargs:
            found = args[0]._index(args[1])
            if found is not None:
                return found
        return super().__torch_function__(func, types, args, kwargs)

    def _index(self, index) -> torch.Tensor | None:
        with torch._C.DisableTorchFunctionSubclass():
            experts = self.shape[0]
        if isinstance(index, torch.Tensor) and not index.is_floating_point() and index.dtype != torch.bool \
                and index.dim() <= 1:
            if index.dim() == 0:
                index = int(index)
            else:
                ids, inverse = torch.unique(index.long(), return_inverse=True)   # each routed expert decoded once
                if ids.numel() and not -experts <= int(ids[0]) <= int(ids[-1]) < experts:
                    raise IndexError(f"expert index out of range for {experts} experts")
                return self.pick(ids.remainder(experts))[inverse]
        if isinstance(index, int) and not isinstance(index, bool):
            if not -experts <= index < experts:
                raise IndexError(f"expert {index} is out of range for {experts} experts")
            one = getattr(self, "one", None)   # (the CPU kernel's view of one expert, where the module has one)
            return one(index % experts) if one is not None else self.pick(torch.tensor([index % experts]))[0]
        return None


class _KernelExpert(DecodedWeight):
    """One expert's matrix on the CPU path: a product with it (``F.linear(x, W[e])``, ``x @ W[e]`` for the
    transposed layout) runs `workbench_kernels.weight_only_cpu` on the expert's packed codes - the kernel
    `WeightOnlyLinear` runs on the same codes - instead of decoding the matrix first; anything else decodes it."""

    packed: object
    smooth: torch.Tensor | None
    quantize_input: Callable[[torch.Tensor], torch.Tensor] | None = None   # (W8A8: the activations' int8 values)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _PRODUCTS and len(args) == 2 and not kwargs and isinstance(args[1], _KernelExpert) \
                and type(args[0]) is torch.Tensor and not (args[0].requires_grad and torch.is_grad_enabled()):
            from workbench_kernels import weight_only_cpu

            x, w = args
            if w.smooth is not None:   # AWQ: the codes encode W * s
                x = x / w.smooth.to(x.dtype)
            if w.quantize_input is not None:
                x = w.quantize_input(x)
            return weight_only_cpu.linear_unchecked(x, w.packed, None)
        return super().__torch_function__(func, types, args, kwargs)


_PRODUCTS = (F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)   # a matrix's uses in a loop


_CLASSES: dict[tuple[type, type], type] = {}   # (experts class, kind) -> its quantized subclass (made once)


def experts_class(base: type[nn.Module], kind: type | None = None) -> type[WeightOnlyExperts]:
    """The quantized subclass of the experts class ``base`` (``kind`` - `WeightOnlyExperts` by default, or
    `W8A8Experts` - first in its bases): one per class and kind, made once."""
    kind = WeightOnlyExperts if kind is None else kind
    if (base, kind) not in _CLASSES:
        name = f"{kind.prefix}{base.__name__}"
        _CLASSES[base, kind] = type(name, (kind, base), {"__module__": __name__, "__qualname__": name,
                                                         "float_class": base,
                                                         "per_expert_forward": eager_forward(base)})
    return _CLASSES[base, kind]


def _dispatcher_code():
    """The code object of the forward transformers' `use_experts_implementation` puts on an experts class (one
    code object for every class it wraps); None without transformers."""
    try:
        from transformers.integrations.moe import use_experts_implementation
    except ImportError:
        return None
    probe = use_experts_implementation(type("Probe", (nn.Module,), {"forward": lambda self: None}))
    return probe.forward.__code__


def eager_forward(base: type[nn.Module]) -> Callable:
    """The per-expert forward of ``base``: its own ``forward``, or, where transformers wrapped it in its
    experts-implementation dispatcher, the function it wraps (the eager loop over the routed experts)."""
    forward = base.forward
    wrapped = getattr(forward, "__wrapped__", None)
    if wrapped is not None and getattr(forward, "__code__", None) is _dispatcher_code():
        return wrapped
    return forward


def _unpickle(base: type[nn.Module], kind: type | None = None) -> nn.Module:
    return object.__new__(experts_class(base, kind))


class WeightOnlyExperts(nn.Module):
    """The base of every quantized experts class (`experts_class`): the fused projections (``matrices``) stored in
    ``fmt``, one `WeightOnlyLinear`-identical encoding per expert, read back as `DecodedExperts`; ``forward`` is
    the float class's eager per-expert loop (`eager_forward`). Everything else of the float module (its config,
    activation, biases) is kept as it was."""

    prefix: ClassVar[str] = "WeightOnly"
    float_class: ClassVar[type]
    per_expert_forward: ClassVar[Callable]
    fmt: fm.WeightFormat
    matrices: tuple[ExpertMatrix, ...]
    keys: tuple[str, ...]        # the format's tensors of each projection, stored as buffers "<projection>_<key>"
    weight_dtype: torch.dtype
    note: str

    @classmethod
    def from_float(cls, name: str, module: nn.Module, fmt: fm.WeightFormat) -> "WeightOnlyExperts":
        """Round to nearest, expert by expert (raises naming ``name`` if ``module``'s layout is not known)."""
        layout = _layout(name, module)
        tensors = {}
        for m in layout:
            param = module.get_parameter(m.name)
            fm.check_finite(f"{name}.{m.name}", param)
            tensors[m.name] = m.encode(param, fmt)
        return _build(module, layout, fmt, tensors, device=None)

    @classmethod
    def skeleton(cls, name: str, module: nn.Module, fmt: fm.WeightFormat, smooth: bool = False) -> "WeightOnlyExperts":
        """The same structure with uninitialised tensors on ``module``'s device (what `wb.load` fills); ``smooth``:
        with AWQ's factors."""
        layout = _layout(name, module)
        device = module.get_parameter(layout[0].name).device
        return _build(module, layout, fmt, {m.name: m.empty(fmt, device, smooth) for m in layout}, device)

    def forward(self, *args, **kwargs):
        return type(self).per_expert_forward(self, *args, **kwargs)

    def stored(self, name: str) -> dict[str, torch.Tensor]:
        """The format's tensors of projection ``name``, each (E, ...)."""
        return {key: self.get_buffer(f"{name}_{key}") for key in self.keys}

    def decode(self, name: str, experts: torch.Tensor) -> torch.Tensor:
        """The dequantized matrices of the ``experts`` (a 1-D tensor of ids) of projection ``name``, in the float
        parameter's layout and dtype: (n, out, in), or (n, in, out) for a transposed layout."""
        m = next(x for x in self.matrices if x.name == name)
        tensors = self.stored(name)
        ids = experts.to(next(iter(tensors.values())).device)
        return m.decode({key: t.index_select(0, ids) for key, t in tensors.items()}, self.fmt, self.weight_dtype)

    def _expert_tensor(self, name: str) -> DecodedExperts:
        m = next(x for x in self.matrices if x.name == name)
        device = self.get_buffer(f"{name}_qweight").device
        stack = DecodedExperts(lambda ids: self.decode(name, ids), m.shape, self.weight_dtype, device)
        if self._on_cpu_kernel(device):
            stack.one = lambda e: self._kernel_expert(m, e, device)
        return stack

    def _on_cpu_kernel(self, device: torch.device) -> bool:
        """Whether one expert's products run on `workbench_kernels.weight_only_cpu` (the format has a CPU kernel,
        the codes are on the CPU, and the module was not set to its reference path)."""
        if self.__dict__.get("kernel", "auto") != "auto" or device.type != "cpu":
            return False
        from workbench_kernels import weight_only_cpu

        return weight_only_cpu.supports(self.fmt)

    def _kernel_expert(self, m: ExpertMatrix, e: int, device: torch.device) -> _KernelExpert:
        """Expert ``e``'s matrix of projection ``m`` as the CPU kernel's packed view (made once, made again when
        the stored tensors change: a state dict loaded, a move)."""
        from workbench_kernels import weight_only_cpu

        stored = {key: self.get_buffer(f"{m.name}_{key}") for key in self.keys}
        # the key holds the stored tensors themselves (compared by identity: no freed address can be reused while
        # the entry lives) and their version counters; a state dict load or a move clears the cache (inference
        # tensors, written in place, have no version to compare)
        key = tuple((t, None if t.is_inference() else t._version) for t in stored.values())
        cache = self.__dict__.setdefault("_cpu_packed", {})
        held = cache.get((m.name, e))
        if held is None or len(held[0]) != len(key) or any(
                a is not b or va != vb for (a, va), (b, vb) in zip(held[0], key)):
            codes = {k: t[e] for k, t in stored.items() if k != SMOOTH}
            cache[m.name, e] = (key, weight_only_cpu.pack(codes, self.fmt, m.K))
        t = _KernelExpert.__new__(_KernelExpert, lambda: self.decode(m.name, torch.tensor([e]))[0],
                                  m.shape[1:], self.weight_dtype, device)
        t.packed, t.smooth = cache[m.name, e][1], stored[SMOOTH][e] if SMOOTH in stored else None
        return t

    def set_kernel(self, kernel: str) -> "WeightOnlyExperts":
        """"auto" (default): one expert's products on the CPU kernel where the format has one, else decode and
        matmul; "reference": always decode and matmul."""
        if kernel not in ("auto", "reference"):
            raise ValueError(f"{type(self).__name__}: kernel must be 'auto' or 'reference', got {kernel!r}")
        self.kernel = kernel
        return self

    gate_up_proj = property(lambda self: self._matrix("gate_up_proj"))
    gate_proj = property(lambda self: self._matrix("gate_proj"))
    up_proj = property(lambda self: self._matrix("up_proj"))
    down_proj = property(lambda self: self._matrix("down_proj"))

    def _matrix(self, name: str) -> DecodedExperts:
        if not any(m.name == name for m in self.matrices):
            raise AttributeError(f"{type(self).__name__} has no {name!r}")
        return self._expert_tensor(name)

    def _load_from_state_dict(self, *args, **kwargs):
        self.__dict__.pop("_cpu_packed", None)   # new stored tensors: the CPU kernel's views are made again
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        names = [f"{m.name}_{key}" for m in self.matrices for key in self.keys]
        out = apply_keeping_dtypes(self, names, fn, lambda: super(WeightOnlyExperts, self)._apply(fn, recurse))
        self.weight_dtype = fn(torch.empty(0, dtype=self.weight_dtype)).dtype
        return out

    def __reduce_ex__(self, protocol):
        # the class is made at run time: copies and pickles rebuild it from the float class
        state = {k: v for k, v in self.__getstate__().items() if k != "_cpu_packed"}   # (the kernel's cache)
        return _unpickle, (self.float_class, next(k for k in type(self).__mro__ if "prefix" in k.__dict__)), state

    def extra_repr(self) -> str:
        shown = ", ".join(f"{m.name}={tuple(m.shape)}" for m in self.matrices)
        return f"{shown}, fmt={self.fmt}"


def _layout(name: str, module: nn.Module) -> tuple[ExpertMatrix, ...]:
    try:
        layout = experts_layout(module)
    except ValueError as e:
        raise ValueError(f"{name!r}: {e}; it is not compressed (exclude it with {{{name!r}: None}})") from None
    if layout is None:
        raise ValueError(f"{name!r} ({type(module).__name__}) holds no fused expert projections")
    return layout


_CALIBRATION_STATE = ("coverage", "note", "_cpu_packed")   # what one compression leaves that the next must not inherit


def experts_shell(module: nn.Module, cls: type, without: set[str]) -> nn.Module:
    """An instance of ``cls`` (``module``'s class or a subclass) built without running ``__init__``: ``module``'s
    plain attributes (config, sizes, activation settings) shared, its children deep-copied, its parameters other
    than ``without`` and its buffers cloned (biases and the like stay in floating point); the caller adds the
    expert projections. What an earlier compression recorded on ``module`` (coverage, note, kernel caches) is not
    carried over."""
    new = object.__new__(cls)
    nn.Module.__init__(new)
    internals = set(new.__dict__)
    for key, value in module.__dict__.items():
        if key not in internals and key not in _CALIBRATION_STATE:
            new.__dict__[key] = value
    new.training = module.training
    for key, child in module._modules.items():
        new._modules[key] = copy.deepcopy(child)
    for key, p in module._parameters.items():
        if key not in without:
            new._parameters[key] = None if p is None else nn.Parameter(p.detach().clone(), p.requires_grad)
    for key, b in module._buffers.items():
        new.register_buffer(key, None if b is None else b.clone(),
                            persistent=key not in module._non_persistent_buffers_set)
    return new


def _build(module: nn.Module, layout: tuple[ExpertMatrix, ...], fmt: fm.WeightFormat,
           tensors: dict[str, dict[str, torch.Tensor]], device, kind: type | None = None) -> WeightOnlyExperts:
    """An instance of ``module``'s quantized class (of ``kind``) holding ``tensors``, with the rest of ``module``
    (attributes, children, other parameters and buffers) copied; the float class's ``__init__`` is not run."""
    new = experts_shell(module, experts_class(type(module), kind), {m.name for m in layout})
    for m in layout:
        for key, t in tensors[m.name].items():
            new.register_buffer(f"{m.name}_{key}", t)
    new.fmt, new.matrices, new.keys = fmt, layout, tuple(tensors[layout[0].name])
    new.weight_dtype = module.get_parameter(layout[0].name).dtype
    notes = [f"{layout[0].experts} experts' {', '.join(m.name for m in layout)} stored per expert as "
             f"WeightOnlyLinear stores a Linear; each call decodes only the experts its router selects (the class's "
             f"eager per-expert loop runs, whatever config.experts_implementation says); the router stays in full "
             f"precision"]
    notes += [f"{m.name}: {s}" for m in layout if (s := fm.short_group_note(fmt, m.K))]
    new.note = "; ".join(notes)
    return new


# calibration per expert and W8A8 experts live beside this module (they build on it); their public names are
# reachable from here too, resolved on first use (PEP 562) so that neither module imports the other at import time
_BESIDE = {"MIN_EXPERT_TOKENS": "experts_calibration", "calibrated_experts": "experts_calibration",
           "coverage": "experts_calibration", "expert_inputs": "experts_calibration",
           "W8A8Experts": "experts_w8a8", "w8a8_experts": "experts_w8a8"}


def __getattr__(name: str):
    if name in _BESIDE:
        import importlib

        return getattr(importlib.import_module(f"workbench.quantization.{_BESIDE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
