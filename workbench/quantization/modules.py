"""Modules that really store low-bit data (so `measure().size_bytes` drops for real).

- `WeightOnlyLinear`, `WeightOnlyEmbedding`, `WeightOnlyConv2d`: a weight in one of the `formats`
  (int8/int4/int3/int2, NF4, fp8) plus a float bias; activations stay in floating point.
- `W8A8Linear`: int8 per-channel weights and int8 activations, quantized per token at run time
  (dynamic) or with a calibrated scale (static), optionally SmoothQuant-smoothed.
- `W8A8Conv2d` (and `W8A8Conv1d`, `W8A8ConvTranspose2d`): static W8A8 convolution (int8 per-channel weights,
  calibrated activation scale). `WeightOnlyConv1d` / `WeightOnlyConvTranspose2d` as `WeightOnlyConv2d`.

Every module is a drop-in for the layer it replaces: ``.weight`` is a `DecodedWeight` (the float weight's shape,
dtype and device; decoded only when something computes with it), ``.bias``, ``in_features`` / ``out_features``
(Linear), ``in_channels`` / ``out_channels`` ... (convolutions) are there. A convolution that padded its input
itself (a "same"-padding subclass such as EfficientNet's) keeps that padding (`InputPadding`). A layer whose
last weight group is short (``group_size`` not dividing its input size) says so in ``module.note``.

Each module has a pure-PyTorch ``reference`` path (dequantize, then a float matmul) that runs anywhere.
Faster paths are chosen with ``kernel=`` (or `set_kernel`) and recorded in ``module.kernel``; `wb.measure`
reports the kernels that ran. Asking for a path that cannot run here raises, naming the module and what it
would need; ``kernel="auto"`` (the default) picks the device's fast path where the module has one and it is
faster than the reference on this machine (Triton on a CUDA GPU, "cpu" on the CPU - for W8A8 only on CPUs with
an int8 dot-product instruction), the reference otherwise, once when the module is built - and records which.

| module | ``"cpu"`` (CPU tensors) | ``"triton"`` (CUDA, or ``TRITON_INTERPRET=1``) |
|---|---|---|
| `WeightOnlyLinear` | `workbench_kernels.weight_only_cpu` (integer formats, NF4): decode rows in registers for few rows of x, blocks of decoded rows + fp32 GEMM for many | int8 per-channel (`workbench_kernels.int8_weight_only`), int4 any group / zero (`workbench_kernels.int4_weight_only`) |
| `W8A8Linear` | per block of rows: one fused quantization pass, ``torch._int_mm``, one fused rescale pass (``torch.compile``) | dynamic: fused per-token quantization + int8 GEMM + rescale (`workbench_kernels.w8a8`) |
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workbench.quantization import formats as fm
from workbench.quantization.primitives import (
    EPS,
    PerToken,
    choose_qparams,
    quantize,
    quantize_per_tensor,
    quantize_per_token,
    to_groups,
)

__all__ = ["conv_args", "WeightOnlyLinear", "WeightOnlyEmbedding", "WeightOnlyConv1d", "WeightOnlyConv2d",
           "WeightOnlyConvTranspose2d", "W8A8Linear", "W8A8Conv1d", "W8A8Conv2d", "W8A8ConvTranspose2d",
           "weight_only_conv", "w8a8_conv", "DecodedWeight", "ConvOp", "InputPadding", "layer_type",
           "input_padding_of", "selectable", "lookalike_reason", "FORWARD_BYPASSED", "LAYER_TYPES", "CONV_TYPES", "KERNELS", "PATHS", "KernelPath",
           "choose_kernel", "round_per_token"]


# --- drop-in weights ----------------------------------------------------------------------------------------

class DecodedWeight(torch.Tensor):
    """What ``.weight`` of a quantized module returns: a tensor with the float weight's shape, dtype and device
    that holds no data of its own.

    Reading metadata (``dtype``, ``shape``, ``device``, ``requires_grad``, ``ndim``, ``size()``) costs nothing;
    any computation with it (``F.linear(x, m.weight)``, ``m.weight.float()``, printing) first decodes the stored
    weight with ``decode`` - the numbers the module computes with - and runs on that plain tensor. Being a
    tensor subclass it also makes ``torch.overrides.has_torch_function`` true, which is what PyTorch's fused
    fast paths (``TransformerEncoderLayer``, ``MultiheadAttention``) test before bypassing sub-modules: they
    then run each sub-module's own forward. It is never stored (not a parameter or buffer)."""

    @staticmethod
    def __new__(cls, decode: Callable[[], torch.Tensor], shape, dtype: torch.dtype, device: torch.device):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        t.decode = decode
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        from torch.utils._pytree import tree_map

        def plain(t):
            return t.decode() if isinstance(t, DecodedWeight) else t

        return func(*tree_map(plain, args), **tree_map(plain, kwargs))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # only reachable by bypassing torch_function
        raise RuntimeError(f"DecodedWeight holds no data ({func} reached it directly); compute with "
                           f"module.weight.decode()")


_T = torch.Tensor
_METADATA = frozenset({_T.dtype.__get__, _T.shape.__get__, _T.device.__get__, _T.requires_grad.__get__,
                       _T.ndim.__get__, _T.layout.__get__, _T.is_cuda.__get__, _T.is_meta.__get__,
                       _T.is_quantized.__get__, _T.is_sparse.__get__, _T.size, _T.dim, _T.numel,
                       _T.is_floating_point, _T.element_size, _T.get_device})


# --- which layers: chosen by what they compute ---------------------------------------------------------------

LAYER_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.ConvTranspose2d, nn.Embedding)
CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.ConvTranspose2d)


def layer_type(module: nn.Module) -> type | None:
    """The PyTorch layer (one of `LAYER_TYPES`) whose computation ``module`` performs exactly: its own class, or
    the parent of a subclass that keeps the parent's ``forward`` (e.g. ``NonDynamicallyQuantizableLinear``).
    None for anything else - including a subclass with its own ``forward``, which `input_padding_of` may still
    identify (a convolution that pads its input first)."""
    for base in LAYER_TYPES:
        if isinstance(module, base):
            kind = type(module)
            same = kind.forward is base.forward and getattr(kind, "_conv_forward", None) is getattr(
                base, "_conv_forward", None)
            return base if same else None
    return None


# Layers whose parent computes with their weight and bias itself, never calling their forward: nn.MultiheadAttention's
# out_proj (torch names the class for exactly that). A technique that changes what forward does to the *input*
# (activation quantization, casting the input to the weight's dtype) cannot act there; weight-only formats can
# (the parent reads the decoded ``.weight``).
FORWARD_BYPASSED = (nn.modules.linear.NonDynamicallyQuantizableLinear,)


def selectable(module: nn.Module, types: tuple[type, ...] = LAYER_TYPES) -> bool:
    """Whether a technique over ``types`` takes ``module``: an instance of one of them whose computation is known
    (a subclass with its own forward is checked by running it, `workbench.plans.lookalike.computation`: the
    parent's computation, a known transform around it, or a "same"-padding convolution), but never a layer the
    workbench itself produced (a class of the ``workbench`` package, e.g. a cast, pruned or QAT layer): that is a
    result, not an input."""
    return _candidate(module, types) and _lookalike().computation(module).taken


def lookalike_reason(module: nn.Module, types: tuple[type, ...] = LAYER_TYPES) -> str | None:
    """Why `selectable` refuses an instance of ``types`` whose own forward computes something else (None for any
    other module: the technique's generic sentence applies)."""
    return _lookalike().computation(module).reason if _candidate(module, types) else None


def _candidate(module: nn.Module, types: tuple[type, ...]) -> bool:
    return isinstance(module, types) and type(module).__module__.partition(".")[0] != "workbench"


def _lookalike():
    from workbench.plans import lookalike  # (imports this module: not at import time)

    return lookalike


@dataclass(frozen=True)
class InputPadding:
    """Padding a convolution applies to its input before convolving: fixed amounts in `F.pad` order
    (``(left, right, top, bottom)``) with ``mode`` ("constant" zeros, "reflect", "replicate", "circular" - what
    ``padding_mode`` does), or ``same=True``: TensorFlow's "SAME" padding computed from each input's size
    (``ceil(i / stride)`` outputs, the odd pixel at the end)."""

    fixed: tuple[int, ...] = ()
    mode: str = "constant"
    same: bool = False

    def __call__(self, x: torch.Tensor, a: dict) -> torch.Tensor:  # x: (B, C, *spatial)
        if not self.same:
            return F.pad(x, self.fixed, mode=self.mode) if any(self.fixed) else x
        pads = []
        for i, k, s, d in zip(x.shape[2:], a["kernel_size"], a["stride"], a["dilation"]):
            total = max((math.ceil(i / s) - 1) * s + (k - 1) * d + 1 - i, 0)
            pads.append((total // 2, total - total // 2))
        flat = [p for pair in reversed(pads) for p in pair]              # F.pad: last dimension first
        return F.pad(x, flat) if any(flat) else x

    def __str__(self) -> str:
        return "same (from the input size)" if self.same else f"{self.mode} {self.fixed}"


class ConvOp(enum.Enum):
    """The convolution a quantized conv module runs (its weight layout and functional)."""

    CONV1D = "conv1d"
    CONV2D = "conv2d"
    CONV_TRANSPOSE2D = "conv_transpose2d"

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, a: dict) -> torch.Tensor:
        if a["input_padding"] is not None:
            x = a["input_padding"](x, a)
        if self is ConvOp.CONV_TRANSPOSE2D:
            return F.conv_transpose2d(x, w, bias, a["stride"], a["padding"], a["output_padding"], a["groups"],
                                      a["dilation"])
        conv = F.conv1d if self is ConvOp.CONV1D else F.conv2d
        return conv(x, w, bias, a["stride"], a["padding"], a["dilation"], a["groups"])


_OPS = {nn.Conv1d: ConvOp.CONV1D, nn.Conv2d: ConvOp.CONV2D, nn.ConvTranspose2d: ConvOp.CONV_TRANSPOSE2D}


def _same_padding_candidates(conv: nn.Module) -> list[InputPadding]:
    """What a Conv2d subclass with its own forward may do before convolving: a fixed zero padding held by a
    child module (nn.ZeroPad2d / ConstantPad2d(0)), no padding at all (an identity child), or "same" padding
    computed from the input size."""
    found = [InputPadding(tuple(m.padding)) for m in conv.children()
             if isinstance(m, nn.ConstantPad2d) and m.value == 0]
    return [*found, InputPadding((0, 0, 0, 0)), InputPadding(same=True)]


def input_padding_of(name: str, conv: nn.Module) -> InputPadding | None:
    """The input padding of a convolution: None for a plain one; for a subclass of nn.Conv2d whose own
    ``forward`` pads the input and then runs nn.Conv2d's convolution (TensorFlow-style "same" layers such as
    EfficientNet's ``Conv2dStaticSamePadding`` / ``Conv2dDynamicSamePadding``), the padding it applies -
    identified by running it (with random weights, on two input sizes) against each candidate. Raises,
    naming the layer, when its computation is none of these."""
    if layer_type(conv) is not None:
        return None
    kind = type(conv).__name__
    if not isinstance(conv, nn.Conv2d) or conv.padding_mode != "zeros":
        parent = next(b.__name__ for b in LAYER_TYPES if isinstance(conv, b))
        raise ValueError(f"{name!r} is a {kind}, a subclass of nn.{parent} with its own forward: what it computes "
                         f"is not known, so it is not compressed (exclude it from the plan with "
                         f"{{{name!r}: None}})")
    a = conv_args(conv)
    gen = torch.Generator().manual_seed(0)
    params = {"weight": torch.randn(conv.weight.shape, generator=gen)}
    if conv.bias is not None:
        params["bias"] = torch.randn(conv.bias.shape, generator=gen)
    kh, kw = a["kernel_size"]
    sizes = [(kh * a["dilation"][0] + 2 * a["stride"][0] + 1, kw * a["dilation"][1] + 3 * a["stride"][1] + 2)]
    sizes.append((sizes[0][0] + 1, sizes[0][1] + 3))
    inputs = [torch.randn(1, conv.in_channels, h, w, generator=gen) for h, w in sizes]
    device = torch.device("cpu") if conv.weight.device.type == "meta" else conv.weight.device   # (a wb.load skeleton)
    with torch.no_grad():
        cpu = {k: v.to(device) for k, v in params.items()}
        try:
            outs = [torch.func.functional_call(conv, cpu, (x.to(device),)).cpu() for x in inputs]
        except Exception as e:
            raise ValueError(f"{name!r} ({kind}) could not be run to identify its padding: {type(e).__name__}: "
                             f"{e}") from e
        for cand in _same_padding_candidates(conv):
            b = dict(a, input_padding=cand)
            ok = all(y.shape == (ref := ConvOp.CONV2D(x, params["weight"], params.get("bias"), b)).shape
                     and torch.allclose(y, ref, rtol=1e-4, atol=1e-4) for x, y in zip(inputs, outs))
            if ok:
                return cand
    raise ValueError(f"{name!r} is a {kind}, a subclass of nn.Conv2d with its own forward that is neither a plain "
                     f"convolution nor an input padding (fixed or 'same') followed by one; it is not compressed "
                     f"(exclude it from the plan with {{{name!r}: None}})")

class KernelPath(enum.StrEnum):
    """Which implementation a quantized module runs. Chosen once, when the module is built or `set_kernel` is
    called (`choose_kernel` turns the user's string, "auto" included, into one of these), kept in
    ``module.kernel`` and compared by identity in ``forward``; `wb.measure` reports it. A `StrEnum`, so it
    prints and serialises as its name ("cpu") and equals that string."""

    REFERENCE = "reference"   # PyTorch ops: decode / quantize, then a float matmul; runs anywhere
    CPU = "cpu"               # the C++ CPU kernels (`workbench_kernels.*_cpu`)
    CPU_INT8 = "cpu-int8"     # weight-only: activations rounded to int8 per 32 on the CPU (`workbench_kernels.act_int8_cpu`)
    TRITON = "triton"         # the Triton kernels (CUDA, or TRITON_INTERPRET=1)


PATHS = tuple(p.value for p in KernelPath)
KERNELS = PATHS + ("auto",)   # what the API accepts


def choose_kernel(owner: str, kernel: str, supported: tuple[str, ...], device: torch.device,
                  int8_gemm: bool = False) -> KernelPath:
    """The path to run: ``kernel`` itself if it is one of ``supported`` and can run on ``device`` here (else an
    error naming ``owner``), or for ``"auto"`` the device's fast path - "triton" on a CUDA GPU, "cpu" on the
    CPU - where ``supported`` has it, and "reference" otherwise. ``int8_gemm``: the CPU path is an int8 GEMM,
    which "auto" takes only on a CPU with an int8 dot-product instruction (`workbench_kernels.w8a8_cpu.int8_dot_product`:
    without one oneDNN's int8 GEMM is tens of times slower than the reference)."""
    if kernel not in KERNELS:
        raise ValueError(f"{owner}: kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "auto":
        from workbench_kernels import triton_available

        if device.type == "cuda" and "triton" in supported and triton_available(device):
            return KernelPath.TRITON
        if device.type == "cpu" and "cpu" in supported:
            if int8_gemm:
                from workbench_kernels.w8a8_cpu import int8_dot_product

                return KernelPath.CPU if int8_dot_product() else KernelPath.REFERENCE
            return KernelPath.CPU
        return KernelPath.REFERENCE
    if kernel not in supported:
        raise ValueError(f"{owner} has no {kernel!r} kernel; it supports {supported}")
    if kernel in ("cpu", "cpu-int8") and device.type not in ("cpu", "meta"):
        raise ValueError(f"{owner}: kernel={kernel!r} needs the module on the CPU, it is on {device}")
    if kernel == "triton" and device.type != "meta":
        from workbench_kernels import triton_available

        if not triton_available(device):
            raise RuntimeError(f"{owner}: kernel='triton' needs a CUDA GPU (or TRITON_INTERPRET=1 for testing); the "
                               f"module is on {device}. Use kernel='cpu' or 'reference' here.")
    return KernelPath(kernel)


def _conv_repr(m: nn.Module, what: str) -> str:
    """The description a quantized convolution prints: its shape, ``what`` it stores, any input padding."""
    pad = m.conv_args["input_padding"]
    return (f"{m.in_channels}, {m.out_channels}, kernel_size={m.kernel_size}, stride={m.stride}, "
            f"groups={m.groups}, {what}" + ("" if pad is None else f", input_padding={pad}"))


def conv_args(conv: nn.Module, input_padding: InputPadding | None = None) -> dict:
    """What a quantized convolution needs to rebuild the computation of ``conv`` (an nn.Conv1d / Conv2d /
    ConvTranspose2d): its `ConvOp`, weight shape, stride, padding, ... and the `InputPadding` applied before
    (``input_padding``, from `input_padding_of`; a ``padding_mode`` other than zeros becomes one too)."""
    op = next(o for t, o in _OPS.items() if isinstance(conv, t))
    padding = conv.padding
    if conv.padding_mode != "zeros":  # what nn.Conv's _conv_forward does: pad with the mode, then convolve
        input_padding = InputPadding(tuple(conv._reversed_padding_repeated_twice), conv.padding_mode)
        padding = (0,) * len(conv.kernel_size)
    return {"op": op, "weight_shape": tuple(conv.weight.shape), "kernel_size": tuple(conv.kernel_size),
            "stride": conv.stride, "padding": padding, "dilation": conv.dilation, "groups": conv.groups,
            "output_padding": getattr(conv, "output_padding", None), "input_padding": input_padding}


def _conv_attributes(module: nn.Module, a: dict) -> None:
    """The attributes code written for nn.Conv reads (in_channels, out_channels, kernel_size, ...)."""
    shape, groups = a["weight_shape"], a["groups"]
    transposed = a["op"] is ConvOp.CONV_TRANSPOSE2D
    module.in_channels = shape[0] if transposed else shape[1] * groups
    module.out_channels = shape[1] * groups if transposed else shape[0]
    module.kernel_size, module.stride, module.padding = a["kernel_size"], a["stride"], a["padding"]
    module.dilation, module.groups, module.transposed = a["dilation"], groups, transposed
    if transposed:
        module.output_padding = a["output_padding"]


def _fill(new: nn.Module, source: nn.Module, **tensors: torch.Tensor | None) -> nn.Module:
    """Copy ``tensors`` (the ones that are not None) into ``new``'s buffers of those names, and ``source``'s bias."""
    with torch.no_grad():
        for name, t in tensors.items():
            if t is not None:
                getattr(new, name).copy_(t)
        if source.bias is not None:
            new.bias.copy_(source.bias)
    return new


class _FollowsDevice:
    """For modules with a ``kernel`` choice: ``kernel="auto"`` is chosen again when ``.to()`` / ``.cuda()`` /
    ``.cpu()`` moves the module to another device (quantize on the CPU, then move to the GPU: the GPU's fast path,
    not the CPU's C++ kernel on CUDA tensors). An explicit kernel is kept as asked."""

    kernel_request = "auto"

    def _kernel_device(self) -> torch.device:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        before = self._kernel_device()
        out = super()._apply(fn, recurse)
        if self.kernel_request == "auto" and self._kernel_device() != before:
            self.set_kernel("auto")
        return out


def _weight_only_cpu():
    """`workbench_kernels.weight_only_cpu`, imported on first use (it is not needed off the CPU path)."""
    from workbench_kernels import weight_only_cpu

    return weight_only_cpu


def _act_int8_cpu():
    """`workbench_kernels.act_int8_cpu`, imported on first use (it is not needed off the CPU path)."""
    from workbench_kernels import act_int8_cpu

    return act_int8_cpu


def _w8a8_cpu():
    """`workbench_kernels.w8a8_cpu`, imported on first use (it is not needed off the CPU path)."""
    from workbench_kernels import w8a8_cpu

    return w8a8_cpu


def apply_keeping_dtypes(module: nn.Module, names, fn, apply):
    """``module._apply`` for a module holding a format's stored tensors (buffers ``names``): moves take them along,
    but a dtype conversion (model.half(), .to(torch.bfloat16)) does not change them - the codes and scales (fp16,
    float8, E8M0, NVFP4's fp32 tensor scale) are the format's, and converted they would decode to other values (an
    fp16 tensor scale overflows: the layer would read zeros). ``apply()`` runs nn.Module's own ``_apply``."""
    module.__dict__.pop("_cpu_packed", None)
    packed = {k: module._buffers[k] for k in names if module._buffers.get(k) is not None}
    order = list(module._buffers)
    for k in packed:
        del module._buffers[k]
    try:
        out = apply()
    except BaseException:
        module._buffers.update(packed)
        raise
    for k, t in packed.items():
        moved = fn(t)
        packed[k] = moved if moved.dtype == t.dtype else t.to(moved.device)
    rebuilt = {k: packed[k] if k in packed else module._buffers[k] for k in order}
    module._buffers.clear()
    module._buffers.update(rebuilt)
    return out


class _PackedWeight(nn.Module):
    """Holds a format's tensors as buffers (saved by state_dict, counted by size_bytes)."""

    def _init_weight(self, rows: int, K: int, fmt: fm.WeightFormat, tensors: dict[str, torch.Tensor] | None,
                     device=None) -> None:
        fm.validate(fmt)
        self.fmt = fmt
        self.K = K
        expected = fm.empty((rows, K), fmt, device="meta")
        tensors = tensors if tensors is not None else fm.empty((rows, K), fmt, device=device)
        if set(tensors) != set(expected):
            raise ValueError(f"{type(self).__name__}: expected tensors {sorted(expected)}, got {sorted(tensors)}")
        for name, t in tensors.items():
            e = expected[name]
            if t.shape != e.shape or t.dtype != e.dtype:
                raise ValueError(f"{type(self).__name__}.{name}: expected {e.dtype} {tuple(e.shape)}, got "
                                 f"{t.dtype} {tuple(t.shape)}")
            self.register_buffer(name, t)
        self._weight_names = tuple(expected)
        self.note = fm.short_group_note(fmt, K)   # None, or how a short last group was handled (for reports)

    def _apply(self, fn, recurse=True):
        return apply_keeping_dtypes(self, self.__dict__.get("_weight_names", ()), fn,
                                    lambda: super(_PackedWeight, self)._apply(fn, recurse))

    def _tensors(self) -> dict[str, torch.Tensor]:
        names = self.__dict__.get("_weight_names", ("qweight", "scale", "zero"))   # the format's tensors
        return {name: buf for name, buf in self.named_buffers(recurse=False) if name in names}

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the module computes with, as a float ``(rows, K)`` matrix."""
        return fm.decode(self._tensors(), self.fmt, self.K, dtype)

    def effective_weight(self) -> torch.Tensor:
        """The weight in the float layer's shape and dtype, as this module computes with it."""
        return self.dequantized_weight(self.weight_dtype).reshape(self.weight_shape)

    @property
    def weight(self) -> DecodedWeight:
        """Drop-in ``.weight`` (see `DecodedWeight`): metadata for free, decoded when computed with."""
        return DecodedWeight(self.effective_weight, self.weight_shape, self.weight_dtype, self.qweight.device)

    def _note_repr(self) -> str:
        return f", note={self.note!r}" if self.note else ""


class WeightOnlyLinear(_FollowsDevice, _PackedWeight):
    """y = x W^T + b with W stored in a low-bit format and dequantized on the fly (``reference``)."""

    act_bits: int | None = None   # (the class default: a module made before the attribute existed rounds nothing)

    def __init__(self, in_features: int, out_features: int, fmt: fm.WeightFormat, bias: bool = True,
                 tensors: dict[str, torch.Tensor] | None = None, device=None, bias_dtype=torch.float32,
                 smooth: bool = False, kernel: str = "auto", perm: bool = False, act_bits: int | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.act_bits = act_bits   # (None, or the input rounded per token to act_bits first: W4A8, W4A4)
        self.weight_shape, self.weight_dtype = (out_features, in_features), bias_dtype
        self._init_weight(out_features, in_features, fmt, tensors, device)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device)) if bias else None
        if smooth:  # AWQ: the stored weight is W * s per input channel; inputs are divided by s
            self.register_buffer("smooth", torch.ones(in_features, device=device))
        if perm:  # GPTQ act-order: the stored weight is W[:, perm]; inputs are gathered the same way
            self.register_buffer("perm", torch.arange(in_features, dtype=torch.int32, device=device))
        self.kernel, self.kernel_request = KernelPath.REFERENCE, "reference"
        if kernel != "reference":
            self.set_kernel(kernel)

    def set_kernel(self, kernel: str) -> "WeightOnlyLinear":
        """Choose the matmul path (see the module docstring); raises if it cannot serve this format here."""
        from workbench_kernels import weight_only_cpu

        whole_groups = self.K % fm.groups(self.fmt, self.K)[0] == 0   # the Triton kernels need whole groups
        supported = ("reference",) + (("cpu",) if weight_only_cpu.supports(self.fmt) else ()) + (
            ("triton",) if self.fmt.triton_kind and whole_groups else ())
        if kernel == "cpu-int8" and self.act_bits is not None:
            raise ValueError(f"WeightOnlyLinear({self.fmt}): kernel='cpu-int8' rounds the input to int8 per 32 values, "
                             f"act_bits={self.act_bits} per token: one rounding of the activations or the other")
        if kernel == "cpu-int8":
            from workbench_kernels import act_int8_cpu

            reason = (act_int8_cpu.unsupported_reason(self.fmt.slot_bits, self.fmt.group_size, self.K)
                      if isinstance(self.fmt, fm.IntFormat) else f"{self.fmt} has no integer codes")
            if reason is not None:
                raise ValueError(f"WeightOnlyLinear({self.fmt}) has no 'cpu-int8' kernel: {reason}")
            supported += ("cpu-int8",)
        self.kernel = choose_kernel(f"WeightOnlyLinear({self.fmt})", kernel, supported, self.qweight.device)
        self.kernel_request = kernel
        return self

    def _kernel_device(self) -> torch.device:
        return self.qweight.device

    def _packed_for_compile(self):
        """The packed weight the last eager call made (`_cpu_weight` reads data pointers, which dynamo cannot)."""
        packed = self.__dict__.get("_cpu_packed")
        if packed is None:
            raise RuntimeError("WeightOnlyLinear: run the model once eagerly before torch.compile traces it "
                               "(the CPU kernel's packed weight is made by an eager call)")
        return packed[1]

    def _cpu_weight(self):
        """The stored weight as `workbench_kernels.weight_only_cpu` reads it (fp32 scales / zeros), made once and made
        again only when the stored tensors change (loading a state dict, ``copy_``, moving the module)."""
        buffers = self._buffers
        q, s, z = buffers["qweight"], buffers["scale"], buffers.get("zero", buffers.get("global_scale"))
        tensors = (q, s, z)
        # the key: which tensors, where their data is and how often it was written in place (this runs on every
        # forward, so it is kept to a few attribute reads, spelled out rather than a generator over the tensors:
        # 0.88 -> 0.57 us in two runs of one timing script). Inference tensors - a module built under torch.inference_mode - have no version counter;
        # loading a state dict drops the cache in any case, see _load_from_state_dict.
        try:
            key = (q.data_ptr(), q._version, q.dtype, s.data_ptr(), s._version, s.dtype,
                   None if z is None else (z.data_ptr(), z._version, z.dtype))
        except RuntimeError:
            key = tuple((t.data_ptr(), None if t.is_inference() else t._version, t.dtype)
                        for t in tensors if t is not None)
        cached = self.__dict__.get("_cpu_packed")
        if cached is None or cached[0] != key:
            cached = (key, _weight_only_cpu().pack(self._tensors(), self.fmt, self.K))
            self.__dict__["_cpu_packed"] = cached
        return cached[1]

    def _load_from_state_dict(self, *args, **kwargs):
        self.__dict__.pop("_cpu_packed", None)   # new stored tensors: the CPU kernel's view is made again
        super()._load_from_state_dict(*args, **kwargs)

    @classmethod
    def from_float(cls, linear: nn.Linear, fmt: fm.WeightFormat, name: str = "linear",
                   tensors: dict[str, torch.Tensor] | None = None,
                   smooth: torch.Tensor | None = None, kernel: str = "auto",
                   perm: torch.Tensor | None = None, act_bits: int | None = None) -> "WeightOnlyLinear":
        """Round-to-nearest unless ``tensors`` (from GPTQ, AWQ, HQQ) are given. ``smooth``: per-input-channel
        factors already multiplied into the weight that ``tensors`` encode; ``perm``: the input-column order
        ``tensors`` encode (GPTQ act-order); ``act_bits``: the input is rounded per token to that many bits first
        (`round_per_token`)."""
        w = linear.weight.detach()
        fm.check_finite(name, w)
        tensors = fm.encode(w, fmt) if tensors is None else tensors
        new = cls(linear.in_features, linear.out_features, fmt, linear.bias is not None, tensors,
                  bias_dtype=w.dtype, smooth=smooth is not None, device=w.device, perm=perm is not None,
                  act_bits=act_bits)
        return _fill(new, linear, smooth=smooth, perm=perm).set_kernel(kernel)

    @property
    def rounds_activations(self) -> bool:
        """Whether the layer rounds its input (to int8 per 32 values: ``kernel="cpu-int8"``; per token to
        ``act_bits``); a model-wide attribute of the modules that do (`workbench.measurement.decode` widens its
        compiled-vs-eager check)."""
        return self.kernel is KernelPath.CPU_INT8 or self.act_bits is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in)
        # (module attributes are read from nn.Module's own dicts: on small layers the per-call Python cost is a
        # measurable share of the whole forward, see docs/kernels.md)
        smooth, perm = self._buffers.get("smooth"), self._buffers.get("perm")
        if smooth is not None:
            x = x / smooth.to(x.dtype)
        act_bits = self.act_bits
        if act_bits is not None:   # the activations a WxAy integer kernel multiplies (computed here in floats)
            x = round_per_token(x, act_bits)
        if perm is not None:   # every path below computes with the stored (permuted) K order
            x = x.index_select(-1, perm)
        bias = self._parameters.get("bias")
        if self.kernel is KernelPath.CPU and torch.compiler.is_compiling() and not (
                x.requires_grad and torch.is_grad_enabled()):
            # the same kernel as a custom op, a node of the compiled graph (dynamo cannot trace the pybind call
            # below); it reads the packed weight the last eager call made (made on demand, _cpu_weight reads data
            # pointers, which dynamo cannot): a compiled caller runs the model eagerly first
            from workbench_kernels.ops import weight_only_linear_cpu

            return weight_only_linear_cpu(x, self._packed_for_compile(), bias)
        if self.kernel is KernelPath.CPU_INT8 and not (x.requires_grad and torch.is_grad_enabled()):
            # activations rounded to int8 per 32 whatever the rows: the int8 dot product for decode-sized calls,
            # the exact kernel on the rounded activations for longer ones (prefill: the same numbers)
            fmt, buffers = self.fmt, self._buffers
            if x.numel() <= _act_int8_cpu().rows_for(self.out_features, self.K, fmt.slot_bits) * self.K:
                args = (x, buffers["qweight"], buffers["scale"], buffers.get("zero"), float(1 << (fmt.bits - 1)),
                        fmt.slot_bits, self.K if fmt.group_size is None else fmt.group_size, self.K, bias)
                if torch.compiler.is_compiling():   # the same call as a custom op, a node of the compiled graph
                    from workbench_kernels.ops import act_int8_linear_cpu

                    return act_int8_linear_cpu(*args)
                return _act_int8_cpu().linear_unchecked(*args)
            if torch.compiler.is_compiling():   # the rounding in PyTorch ops (the same numbers), the exact kernel's op
                from workbench_kernels.ops import weight_only_linear_cpu

                rounded = _act_int8_cpu().round_activations(x)
                return weight_only_linear_cpu(rounded, self._packed_for_compile(), bias).to(x.dtype)
            rounded = _act_int8_cpu().round_activations_cpu(x)
            return _weight_only_cpu().linear_unchecked(rounded, self._cpu_weight(), bias).to(x.dtype)
        if self.kernel is KernelPath.CPU and not (x.requires_grad and torch.is_grad_enabled()):
            # an inference kernel (result in x's dtype, the bias taken in it; records no autograd graph); when
            # autograd needs the input's gradient (training through the layer) the reference's differentiable
            # math below runs instead
            return _weight_only_cpu().linear_unchecked(x, self._cpu_weight(), bias)
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        if self.kernel is KernelPath.TRITON:
            return self._triton(x, bias)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def _triton(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fmt.triton_kind == "int8":
            from workbench_kernels.int8_weight_only import int8_weight_only_mm

            return int8_weight_only_mm(x, self.qweight, self.scale, bias)
        from workbench_kernels.int4_weight_only import int4_weight_only_mm

        scale, zero, lut = self.fmt.triton_tensors(self._tensors())
        return int4_weight_only_mm(x, self.qweight, scale, zero, self.K // scale.shape[1], bias, lut)

    def effective_weight(self) -> torch.Tensor:
        w = self.dequantized_weight(torch.float32)
        if hasattr(self, "perm"):   # back to the float layer's column order
            w = torch.empty_like(w).index_copy_(1, self.perm.long(), w)
        if hasattr(self, "smooth"):  # AWQ stores W * s
            w = w / self.smooth.float()
        return w.to(self.weight_dtype)

    def extra_repr(self) -> str:
        acts = "" if self.act_bits is None else f", act_bits={self.act_bits} per token"
        return (f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}{acts}, "
                f"kernel={self.kernel}{self._note_repr()}")


def round_per_token(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` rounded per row (the last dimension) to a symmetric ``bits``-bit grid, in ``x``'s dtype: the package's
    grid (`primitives.choose_qparams`: scale max|x| / ((2^bits - 1) / 2), codes in [-2^(bits-1), 2^(bits-1) - 1]),
    computed in fp32; for 8 bits the numbers `quantize_per_token` gives. A row holding NaN or Inf gives NaN."""
    xf = x.float()
    half = float(1 << (bits - 1))
    scale = (xf.abs().amax(-1, keepdim=True) / (half - 0.5)).clamp_(min=EPS)
    scale = torch.where(torch.isfinite(scale), scale, float("nan"))
    return (torch.round(xf * (1.0 / scale)).clamp_(-half, half - 1) * scale).to(x.dtype)   # (quantize_per_token's steps)


class WeightOnlyEmbedding(_PackedWeight):
    """Embedding table in a low-bit format; only the looked-up rows are dequantized."""

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: fm.WeightFormat,
                 tensors: dict[str, torch.Tensor] | None = None, padding_idx: int | None = None,
                 output_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.output_dtype = output_dtype
        self.weight_shape, self.weight_dtype = (num_embeddings, embedding_dim), output_dtype
        self._init_weight(num_embeddings, embedding_dim, fmt, tensors, device)
        self.kernel = KernelPath.REFERENCE

    @classmethod
    def from_float(cls, emb: nn.Embedding, fmt: fm.WeightFormat, name: str = "embedding") -> "WeightOnlyEmbedding":
        if emb.max_norm is not None:
            raise ValueError(f"{name!r}: embeddings with max_norm renormalise their weights in place and cannot be "
                             f"stored quantized")
        w = emb.weight.detach()
        fm.check_finite(name, w)
        return cls(emb.num_embeddings, emb.embedding_dim, fmt, fm.encode(w, fmt), emb.padding_idx, w.dtype)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # idx: (...) int64
        flat = idx.reshape(-1)
        rows = {name: t if name in self.fmt.shared else t.index_select(0, flat)   # gather, then dequantize
                for name, t in self._tensors().items()}
        out = fm.decode(rows, self.fmt, self.K, self.output_dtype)                # (N, dim)
        return out.reshape(*idx.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fmt={self.fmt}{self._note_repr()}"


class _WeightOnlyConv(_PackedWeight):
    """A convolution whose weight (``(out, in/groups, *k)``; transposed: ``(in, out/groups, *k)``) is stored as
    low-bit rows of ``weight[0].numel()`` values; ``conv_args`` (from `conv_args`) says which convolution."""

    def __init__(self, args: dict, fmt: fm.WeightFormat, bias: bool = True,
                 tensors: dict[str, torch.Tensor] | None = None, device=None, weight_dtype=torch.float32):
        super().__init__()
        self.conv_args = dict(args)
        _conv_attributes(self, args)
        shape = args["weight_shape"]
        self.weight_shape, self.weight_dtype = shape, weight_dtype
        self._init_weight(shape[0], math.prod(shape[1:]), fmt, tensors, device)
        self.bias = nn.Parameter(torch.zeros(self.out_channels, device=device)) if bias else None
        self.kernel = KernelPath.REFERENCE

    @classmethod
    def from_float(cls, conv: nn.Module, fmt: fm.WeightFormat, name: str = "conv",
                   tensors: dict[str, torch.Tensor] | None = None,
                   input_padding: InputPadding | None = None) -> "_WeightOnlyConv":
        """Round-to-nearest unless ``tensors`` (e.g. with QAT's learned scales) are given."""
        w = conv.weight.detach()
        fm.check_finite(name, w)
        tensors = fm.encode(w.reshape(w.shape[0], -1), fmt) if tensors is None else tensors
        return _fill(cls(conv_args(conv, input_padding), fmt, conv.bias is not None, tensors,
                         weight_dtype=w.dtype), conv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, C, *spatial)
        a = self.conv_args
        w = self.dequantized_weight(x.dtype).reshape(a["weight_shape"])
        return a["op"](x, w, None if self.bias is None else self.bias.to(x.dtype), a)

    def extra_repr(self) -> str:
        return _conv_repr(self, f"fmt={self.fmt}") + self._note_repr()


class WeightOnlyConv1d(_WeightOnlyConv):
    """nn.Conv1d with a low-bit weight."""


class WeightOnlyConv2d(_WeightOnlyConv):
    """nn.Conv2d (grouped, depthwise, "same"-padded subclasses too) with a low-bit weight."""


class WeightOnlyConvTranspose2d(_WeightOnlyConv):
    """nn.ConvTranspose2d with a low-bit weight (rows: input channels, the weight's first dimension)."""


_WEIGHT_ONLY_CONV = {ConvOp.CONV1D: WeightOnlyConv1d, ConvOp.CONV2D: WeightOnlyConv2d,
                     ConvOp.CONV_TRANSPOSE2D: WeightOnlyConvTranspose2d}


def weight_only_conv(op: ConvOp) -> type[_WeightOnlyConv]:
    """The weight-only module class for a `ConvOp`."""
    return _WEIGHT_ONLY_CONV[op]


class W8A8Linear(_FollowsDevice, nn.Module):
    """W8A8 Linear: int8 per-output-channel weights and int8 activations.

    y = (q_x q_w^T) * s_x s_w^T + b, the integer product accumulated in int32. Activations are quantized
    per token at run time (``static=False``, "dynamic") or with one calibrated per-tensor scale
    (``static=True``, buffer ``act_scale``). With a ``smooth`` vector (SmoothQuant, Xiao et al. 2023) the
    module computes ``(x / smooth) (W * smooth)^T``: the same product, with activation outliers migrated into
    the weights, which quantize more easily. (Here the division is applied in the module rather than folded
    into the previous LayerNorm, so it works on any Linear; the numerics are those of the folded form.)
    ``kernel="cpu"`` runs `workbench_kernels.w8a8_cpu` (quantization, ``torch._int_mm``'s oneDNN int8 GEMM and the
    rescale fused block by block in C++, bit-identical to the reference); ``"triton"`` the Triton kernel on a GPU;
    ``"reference"`` the same math in fp32.
    """
    rounds_activations = True   # (per token to int8; see WeightOnlyLinear.rounds_activations)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, static: bool = False,
                 smooth: bool = False, device=None, kernel: str = "auto"):
        super().__init__()
        self.in_features, self.out_features, self.static = in_features, out_features, static
        self.register_buffer("qweight_t", torch.empty(in_features, out_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.empty(1, out_features, dtype=torch.float32, device=device))
        if static:
            self.register_buffer("act_scale", torch.empty((), dtype=torch.float32, device=device))
        if smooth:
            self.register_buffer("smooth", torch.empty(in_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        self.set_kernel(kernel)

    def set_kernel(self, kernel: str) -> "W8A8Linear":
        """Choose the matmul path (see the module docstring); raises if it cannot run here."""
        supported = ("reference", "cpu") if self.static else PATHS
        owner = f"W8A8Linear({'static' if self.static else 'dynamic'})"
        self.kernel = choose_kernel(owner, kernel, supported, self.qweight_t.device, int8_gemm=True)
        self.kernel_request = kernel
        if self.kernel == "triton" and not self.qweight_t.t().is_contiguous():
            # K-major codes (the transposed view of an (out, in) row-major tensor), the B layout Hopper's int8
            # wgmma takes: the Triton GEMM ran 2.5x slower on (in, out) row-major codes (docs/kernels.md, GPU)
            self.qweight_t = self.qweight_t.t().contiguous().t()
        return self

    def _kernel_device(self) -> torch.device:
        return self.qweight_t.device

    @classmethod
    def from_float(cls, linear: nn.Linear, name: str = "linear", kernel: str = "auto",
                   act_scale: torch.Tensor | None = None, smooth: torch.Tensor | None = None) -> "W8A8Linear":
        w = linear.weight.detach().float()
        fm.check_finite(name, w)
        if smooth is not None:
            w = w * smooth.reshape(1, -1)                                 # migrate: W' = W diag(s)
        scale, zp = choose_qparams(w, 8, symmetric=True)                 # (out, 1) per output channel
        q = quantize(w, scale, zp, -128, 127, torch.int8)                 # (out, in)
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, static=act_scale is not None,
                  smooth=smooth is not None, device=w.device)   # on the layer's device: kernel="triton" on CUDA
        new = _fill(new, linear, qweight_t=q.t(), scale=scale.t(), act_scale=act_scale, smooth=smooth)
        return new.set_kernel(kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in)
        # (buffers read from nn.Module's own dict: on small layers the per-call Python cost is a measurable share of
        # the forward, and hasattr on a missing buffer raises and formats an AttributeError inside nn.Module)
        smooth = self._buffers.get("smooth")
        xs = x / smooth if smooth is not None else x   # (fp32 smoothing factors promote x: the result is cast back)
        if self.kernel is KernelPath.CPU and not torch.compiler.is_compiling() and not (
                x.requires_grad and torch.is_grad_enabled()):
            # an inference kernel (records no autograd graph); when autograd needs the input's gradient the
            # reference's differentiable math below runs instead, as in WeightOnlyLinear
            buffers, bias = self._buffers, self._parameters.get("bias")
            if xs.shape[-1] != self.in_features:
                raise ValueError(f"W8A8Linear: the input has {xs.shape[-1]} features, the layer takes "
                                 f"{self.in_features}")
            y = _w8a8_cpu().linear_unchecked(xs, buffers["qweight_t"], buffers["scale"], bias,
                                             buffers["act_scale"] if self.static else None)
            return y if y.dtype == x.dtype else y.to(x.dtype)
        if self.kernel is KernelPath.TRITON:
            from workbench_kernels.w8a8 import w8a8_mm

            bias = None if self.bias is None else self.bias.detach()   # an inference kernel: no autograd
            return w8a8_mm(xs.contiguous(), self.qweight_t, self.scale, bias)
        if self.kernel is KernelPath.CPU and torch.compiler.is_compiling():   # the checked custom op
            return self._cpu(xs).to(x.dtype)
        else:
            qx, sx = self._quantize(to_groups(xs, PerToken()))            # (M, in) int8, (M, 1)
            acc = qx.float() @ self.qweight_t.float()                     # the same integers, in fp32
            y = acc.mul_(sx).mul_(self.scale)                             # in place: a fresh (M, out) buffer
            if self.bias is not None:
                y.add_(self.bias)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    @property
    def weight(self) -> DecodedWeight:
        """Drop-in ``.weight`` (see `DecodedWeight`): the int8 weight dequantized (and un-smoothed), fp32."""
        return DecodedWeight(self.effective_weight, (self.out_features, self.in_features), torch.float32,
                             self.qweight_t.device)

    def effective_weight(self) -> torch.Tensor:  # (out, in) fp32: W = (q * s) / smooth
        w = (self.qweight_t.float() * self.scale).t()
        return w / self.smooth if hasattr(self, "smooth") else w

    def _quantize(self, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_per_tensor(x2d, self.act_scale) if self.static else quantize_per_token(x2d)

    def _cpu(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out) in x's dtype
        """`workbench_kernels.w8a8_cpu`'s checked custom op (under ``torch.compile``; eager calls take the
        unchecked one-C++-call path in `forward`)."""
        from workbench_kernels import w8a8_cpu

        act = self.act_scale if self.static else None
        bias = None if self.bias is None else self.bias.detach()   # an inference path: no autograd
        scale = self.scale
        if any(t is not None and t.dtype != torch.float32 for t in (scale, bias, act)):   # after module.half()
            scale, bias, act = (None if t is None else t.float() for t in (scale, bias, act))
        return w8a8_cpu.w8a8_linear_cpu(x, self.qweight_t, scale, bias, act)

    def extra_repr(self) -> str:
        mode = "static" if self.static else "dynamic"
        return (f"in_features={self.in_features}, out_features={self.out_features}, activations={mode}, "
                f"smooth={hasattr(self, 'smooth')}, kernel={self.kernel}")


class _W8A8Conv(nn.Module):
    """Static W8A8 convolution: int8 weights per output channel (per weight row for a transposed convolution),
    int8 activations with one calibrated scale.

    ``kernel="reference"`` only: activations are quantized and dequantized with the stored scale and the
    convolution runs on the dequantized int8 weights (the same numbers an integer kernel would produce).
    """
    rounds_activations = True

    def __init__(self, args: dict, bias: bool = True, device=None):
        super().__init__()
        self.conv_args = dict(args)
        _conv_attributes(self, args)
        shape = args["weight_shape"]
        self.register_buffer("qweight", torch.empty(shape, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.empty(shape[0], *(1,) * (len(shape) - 1), dtype=torch.float32,
                                                  device=device))
        self.register_buffer("act_scale", torch.empty((), dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(self.out_channels, device=device)) if bias else None
        self.kernel = KernelPath.REFERENCE

    @classmethod
    def from_float(cls, conv: nn.Module, act_scale: torch.Tensor, name: str = "conv",
                   input_padding: InputPadding | None = None) -> "_W8A8Conv":
        args = conv_args(conv, input_padding)
        w = conv.weight.detach().float()
        fm.check_finite(name, w)
        w2d = w.reshape(w.shape[0], -1)
        scale, zp = choose_qparams(w2d, 8, symmetric=True)                   # (rows, 1)
        q = quantize(w2d, scale, zp, -128, 127, torch.int8).reshape(w.shape)
        new = cls(args, conv.bias is not None)
        return _fill(new, conv, qweight=q, scale=scale.reshape(new.scale.shape), act_scale=act_scale.reshape(()))

    @property
    def weight(self) -> DecodedWeight:
        """Drop-in ``.weight`` (see `DecodedWeight`): the int8 weight dequantized, fp32."""
        return DecodedWeight(self.effective_weight, self.conv_args["weight_shape"], torch.float32,
                             self.qweight.device)

    def effective_weight(self) -> torch.Tensor:
        return self.qweight.float() * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, C, *spatial)
        a = self.conv_args
        s = self.act_scale
        xq = torch.clamp(torch.round(x.float() * (1.0 / s)), -128, 127) * s   # int8 grid, dequantized
        y = a["op"](xq, self.effective_weight(), self.bias, a)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return _conv_repr(self, "activations=static")


class W8A8Conv1d(_W8A8Conv):
    """Static W8A8 nn.Conv1d."""


class W8A8Conv2d(_W8A8Conv):
    """Static W8A8 nn.Conv2d (grouped, depthwise, "same"-padded subclasses too)."""


class W8A8ConvTranspose2d(_W8A8Conv):
    """Static W8A8 nn.ConvTranspose2d."""


_W8A8_CONV = {ConvOp.CONV1D: W8A8Conv1d, ConvOp.CONV2D: W8A8Conv2d, ConvOp.CONV_TRANSPOSE2D: W8A8ConvTranspose2d}


def w8a8_conv(op: ConvOp) -> type[_W8A8Conv]:
    """The static W8A8 module class for a `ConvOp`."""
    return _W8A8_CONV[op]
