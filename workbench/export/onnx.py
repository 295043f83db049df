"""Export to ONNX for ONNX Runtime: one ``model.onnx`` in which each weight-only Linear is a ``MatMulNBits`` node.

    x = torch.randn(1, 64)
    wb.export(small, "mlp-int4", format=ONNX(example_inputs=(x,)))
    session = onnxruntime.InferenceSession("mlp-int4/model.onnx", providers=["CPUExecutionProvider"])

The graph is traced with PyTorch's TorchScript exporter (``torch.onnx.export(dynamo=False)``, opset 17), so the
``example_inputs`` (positional arguments of ``model.forward``) are required: tracing needs one call. Each
`WeightOnlyLinear` is swapped, in a copy of the model, for a module whose forward is one autograd function with an
ONNX ``symbolic``: ONNX Runtime's contrib op ``com.microsoft.MatMulNBits`` (domain ``com.microsoft``, version 1),
holding the workbench's own codes, scales and zero points - exact, nothing quantized again:

| MatMulNBits | from the workbench layer (`IntFormat`, codes ``u`` unsigned, weight ``(N, K)``) |
|---|---|
| attributes ``K``, ``N``, ``bits``, ``block_size``, ``accuracy_level`` | in / out features, 2, 4 or 8, the group size (per channel: ``K``), 0 |
| ``B`` uint8 ``(N, n_blocks, blob_size)`` | the codes, ``blob_size = block_size * bits / 8`` bytes per block, lowest bits first |
| ``scales`` ``(N * n_blocks,)`` in A's dtype | the fp16 scales, as fp32 (or fp16 for an fp16 layer): exact |
| ``zero_points`` uint8 ``(N, ceil(n_blocks * bits / 8))`` | asymmetric: the integer zero points, packed as B; symmetric: absent (MatMulNBits' default is ``2^(bits-1)``, the workbench's implicit zero) |

A short last group (K not a multiple of the group size) is a last block padded with zero codes, which MatMulNBits
ignores (it reads K values). The bias is a separate ``Add``. ``accuracy_level=0`` keeps A in its own precision
(level 4 would quantize activations to int8 inside the kernel). Layers the plan left in floating point, and
everything else, are exported as PyTorch's exporter writes them.

Refused before anything is written, naming the layer: NF4 and FP8 weights, HQQ's real-valued zero points, AWQ
smoothing, GPTQ act-order permutations, 3-bit codes, group sizes that are not a power of two >= 16 (per channel: an
input that is not), bf16 layers (their fp16 scales are not bf16 values), W8A8 layers (a QDQ graph is not written
yet), quantized embeddings, pruned, low-rank, cast and every other layer the workbench made; a model without
``example_inputs``, or one the tracer cannot export (the exporter's error is re-raised as a TypeError). The
graph is checked by loading it in ONNX Runtime before anything is written. Models over 2 GB (protobuf's limit) are
not supported.
"""
from __future__ import annotations

import copy
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from workbench.export import ExportFormat, integer_weight_problem, register_export_format
from workbench.quantization import packing
from workbench.quantization.modules import W8A8Linear, WeightOnlyEmbedding, WeightOnlyLinear

__all__ = ["ONNX", "FILE_NAME", "OPSET", "NBitsWeight", "nbits_weight"]

FILE_NAME = "model.onnx"
OPSET = 17
MS_DOMAIN = "com.microsoft"
BITS = (2, 4, 8)   # what MatMulNBits' ``bits`` accepts
ALLOWED = ("integer weight-only nn.Linear layers (WeightOnly, 2/4/8 bits, symmetric or with integer zero points, "
           "group size a power of two >= 16, or per channel over such an input) as MatMulNBits, and floating-point "
           "layers")


def _refuse(name: str, what: str) -> ValueError:
    return ValueError(f"onnx export: {name!r} {what}. The ONNX export holds {ALLOWED}.")


@dataclass(frozen=True)
class NBitsWeight:
    """One layer's MatMulNBits inputs and attributes (numpy, as they go into the graph)."""

    K: int
    N: int
    bits: int
    block_size: int
    B: np.ndarray                    # (N, n_blocks, blob_size) uint8
    scales: np.ndarray               # (N * n_blocks,) float32 / float16
    zero_points: np.ndarray | None   # (N, ceil(n_blocks * bits / 8)) uint8; None: the default 2^(bits - 1)


def nbits_weight(name: str, m: WeightOnlyLinear) -> NBitsWeight:
    """The layer's stored codes, scales and zero points as MatMulNBits holds them; refuses what it cannot hold."""
    why = integer_weight_problem(m)
    if why:
        raise _refuse(name, why)
    fmt = m.fmt
    if fmt.bits not in BITS:
        raise _refuse(name, f"stores {fmt.bits}-bit codes; MatMulNBits packs {list(BITS)} bits")
    if m.weight_dtype not in (torch.float32, torch.float16):
        raise _refuse(name, f"computes in {m.weight_dtype}; MatMulNBits' scales have A's dtype and the workbench's "
                            f"fp16 scales are exact only in float32 or float16")
    N, K = m.weight_shape
    g, G = fmt.groups(K)
    if g < 16 or g & (g - 1):
        what = f"is per channel over an input of {K}" if fmt.group_size is None else f"has groups of {g}"
        raise _refuse(name, f"{what}; MatMulNBits' block_size must be a power of two >= 16")
    codes = packing.unpack(m.qweight.detach().cpu(), fmt.slot_bits, K)                 # (N, K) uint8
    if int(codes.max()) >= 1 << fmt.bits:
        raise _refuse(name, f"holds codes above the {fmt.bits}-bit range (up to {int(codes.max())})")
    scale = m.scale.detach().cpu()                                                     # (N, G) fp16
    if not torch.isfinite(scale).all():
        raise _refuse(name, "has scales that are not finite")
    codes = nn.functional.pad(codes, (0, G * g - K))                                   # (N, G * g): zero padding
    B = packing.pack(codes.reshape(N * G, g), fmt.bits).reshape(N, G, g * fmt.bits // 8)   # (N, G, blob)
    zero = None
    if not fmt.symmetric:
        zero = packing.pack(m.zero.detach().cpu(), fmt.bits).numpy()                  # (N, ceil(G * bits / 8))
    scales = scale.to(m.weight_dtype).reshape(-1).numpy()                              # (N * G,)
    return NBitsWeight(K, N, fmt.bits, g, B.numpy(), scales, zero)


class _MatMulNBits(torch.autograd.Function):
    """``x @ W^T`` with W the layer's dequantized weight; exported as one ``com.microsoft::MatMulNBits`` node."""

    @staticmethod
    def forward(ctx, x, B, scales, zero_points, weight, K, N, bits, block_size):  # x: (..., K) -> (..., N)
        return x @ weight.to(x.dtype).T

    @staticmethod
    def symbolic(g, x, B, scales, zero_points, weight, K, N, bits, block_size):
        inputs = (x, B, scales) if zero_points is None else (x, B, scales, zero_points)
        out = g.op(f"{MS_DOMAIN}::MatMulNBits", *inputs, K_i=K, N_i=N, bits_i=bits, block_size_i=block_size,
                   accuracy_level_i=0)
        sizes = x.type().varyingSizes() if x.isCompleteTensor() else None
        if sizes is not None:   # (shape inference does not know the contrib op: give the exporter its type)
            out.setType(x.type().with_sizes([*sizes[:-1], N]))
        return out


class _NBitsLinear(nn.Module):
    """What a `WeightOnlyLinear` becomes in the copy that is traced; its buffers become the node's initializers."""

    def __init__(self, w: NBitsWeight, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.w = w
        self.register_buffer("qweight", torch.from_numpy(w.B))
        self.register_buffer("scales", torch.from_numpy(w.scales))
        self.register_buffer("zero_points", None if w.zero_points is None else torch.from_numpy(w.zero_points))
        self.weight = weight   # (N, K) float: used by the traced call only, not exported (a plain attribute)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., K)
        w = self.w
        y = _MatMulNBits.apply(x, self.qweight, self.scales, self.zero_points, self.weight, w.K, w.N, w.bits,
                               w.block_size)                                           # (..., N)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def _check_layer(name: str, module: nn.Module) -> None:
    """Refuse the compressed layers that are not weight-only Linears (named, with what they are)."""
    if isinstance(module, W8A8Linear):
        raise _refuse(name, "is a W8A8 layer (int8 activations); a QDQ graph (QuantizeLinear / DequantizeLinear "
                            "around an integer MatMul) is not written by this exporter yet")
    if isinstance(module, WeightOnlyEmbedding):
        raise _refuse(name, "is a quantized embedding; MatMulNBits is a matrix product (GatherBlockQuantized is not "
                            "written by this exporter yet)")
    kind = type(module).__module__
    if kind.partition(".")[0] == "workbench" and not kind.startswith("workbench.models"):
        raise _refuse(name, f"is a {type(module).__name__} ({kind}), which this exporter does not write (not "
                            f"exported as its dense float equivalent either: that would not be the compressed model)")


@dataclass
class Prepared:
    """What `ONNX.write` writes: the serialized model, what each quantized layer became, ONNX Runtime's check."""

    model: bytes
    layers: dict[str, NBitsWeight] = field(default_factory=dict)   # workbench layer -> its MatMulNBits weight
    max_abs_diff: float = 0.0   # ONNX Runtime vs the workbench model on the example inputs (informational)


@register_export_format
@dataclass(frozen=True)
class ONNX(ExportFormat):
    """An ONNX model for ONNX Runtime (see the module docstring for what each layer becomes).

    ``example_inputs``: positional arguments of ``model.forward`` for tracing (required). ``input_names`` /
    ``output_names`` / ``dynamic_axes``: as `torch.onnx.export` takes them (e.g. ``{"x": {0: "batch"}}``).
    """

    name: ClassVar[str] = "onnx"
    example_inputs: tuple = field(default=(), compare=False)
    input_names: tuple[str, ...] | None = None
    output_names: tuple[str, ...] | None = None
    dynamic_axes: dict | None = field(default=None, compare=False)
    opset: int = OPSET

    def __post_init__(self):
        if not isinstance(self.example_inputs, tuple):
            object.__setattr__(self, "example_inputs", (self.example_inputs,))
        if self.opset < OPSET:
            raise ValueError(f"onnx export: opset must be >= {OPSET}, got {self.opset}")

    def prepare(self, model: nn.Module, base_folder: Path | None) -> Prepared:
        if not self.example_inputs:
            raise ValueError("onnx export traces the model and needs example inputs: pass "
                             "format=ONNX(example_inputs=(x,)) with positional arguments of model.forward")
        traced = copy.deepcopy(model).eval()
        layers: dict[str, NBitsWeight] = {}
        for name, module in model.named_modules():
            if isinstance(module, WeightOnlyLinear):
                w = nbits_weight(name, module)
                bias = module._parameters.get("bias")
                new = _NBitsLinear(w, module.dequantized_weight(module.weight_dtype).detach().cpu(), bias)
                parent, _, leaf = name.rpartition(".")
                setattr(traced.get_submodule(parent), leaf, new)
                layers[name] = w
            else:
                _check_layer(name, module)
        data = self._trace(traced)
        return Prepared(data, layers, self._check(model, data))

    def _trace(self, traced: nn.Module) -> bytes:
        buffer = io.BytesIO()
        try:
            with torch.no_grad():
                torch.onnx.export(traced, self.example_inputs, buffer, dynamo=False, opset_version=self.opset,
                                  custom_opsets={MS_DOMAIN: 1}, do_constant_folding=True,
                                  input_names=list(self.input_names) if self.input_names else None,
                                  output_names=list(self.output_names) if self.output_names else None,
                                  dynamic_axes=self.dynamic_axes)
        except Exception as e:   # the tracer's own refusal, said as ours
            raise TypeError(f"onnx export: torch.onnx.export (TorchScript tracer) could not export "
                            f"{type(traced).__name__}: {type(e).__name__}: {e}") from e
        return buffer.getvalue()

    def _check(self, model: nn.Module, data: bytes) -> float:
        """Load the graph in ONNX Runtime and run the example inputs: the max |difference| from the workbench."""
        import onnxruntime

        session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
        feeds = {i.name: t.detach().cpu().numpy() for i, t in zip(session.get_inputs(), self.example_inputs)}
        with torch.no_grad():
            expected = model(*self.example_inputs)
        expected = [t for t in torch.utils._pytree.tree_leaves(expected) if isinstance(t, torch.Tensor)]
        got = session.run(None, feeds)
        return max((float(np.abs(o - e.float().numpy()).max()) for o, e in zip(got, expected)), default=0.0)

    def write(self, prepared: Prepared, folder: Path) -> None:
        (folder / FILE_NAME).write_bytes(prepared.model)
