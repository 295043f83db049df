"""Export to ONNX for ONNX Runtime: one ``model.onnx`` in which each weight-only Linear is a ``MatMulNBits`` node, each
weight-only convolution a ``DequantizeLinear`` feeding the float Conv / ConvTranspose's weight and each static W8A8
layer a QDQ group (``QuantizeLinear`` -> ``DequantizeLinear`` around a float Conv / Gemm / MatMul).

    x = torch.randn(1, 64)
    wb.export(small, "mlp-int4", format=ONNX(example_inputs=(x,)))
    session = onnxruntime.InferenceSession("mlp-int4/model.onnx", providers=["CPUExecutionProvider"])

The graph is traced with PyTorch's TorchScript exporter (``torch.onnx.export(dynamo=False)``, opset 17; a graph
holding a blocked or 4-bit ``DequantizeLinear`` - opset 21 - is traced at the tracer's newest, 20, and converted by
``onnx.version_converter``; `Prepared.opset` says which), so the ``example_inputs`` (positional arguments of
``model.forward``) are required: tracing needs one call. Each quantized layer is swapped, in a copy of the model,
for a module whose forward is one autograd function with an ONNX ``symbolic`` (a writer per layer type). Each
`WeightOnlyLinear` becomes ONNX Runtime's contrib op ``com.microsoft.MatMulNBits`` (domain ``com.microsoft``, version 1),
holding the workbench's own codes, scales and zero points - exact, nothing quantized again:

| MatMulNBits | from the workbench layer (`IntFormat`, codes ``u`` unsigned, weight ``(N, K)``) |
|---|---|
| attributes ``K``, ``N``, ``bits``, ``block_size``, ``accuracy_level`` | in / out features, 2, 4 or 8, the group size (per channel: ``K``), 0 |
| ``B`` uint8 ``(N, n_blocks, blob_size)`` | the codes, ``blob_size = block_size * bits / 8`` bytes per block, lowest bits first |
| ``scales`` ``(N * n_blocks,)`` in A's dtype | the fp16 scales, as fp32 (or fp16 for an fp16 layer): exact |
| ``zero_points`` uint8 ``(N, ceil(n_blocks * bits / 8))`` | asymmetric: the integer zero points, packed as B; symmetric: absent (MatMulNBits' default is ``2^(bits-1)``, the workbench's implicit zero) |

A short last group (K not a multiple of the group size) is a last block padded with zero codes, which MatMulNBits
ignores (it reads K values). The bias is a separate ``Add``. ``accuracy_level=0`` keeps A in its own precision
(level 4 would quantize activations to int8 inside the kernel).

Each weight-only convolution (`WeightOnlyConv1d`, `WeightOnlyConv2d`, `WeightOnlyConvTranspose2d`: `IntFormat`
rows of ``K = weight[0].numel()`` values, grouped along that flattened input) becomes a ``DequantizeLinear`` whose
output is the float ``Conv`` / ``ConvTranspose`` weight, holding the workbench's own codes and scales:

| DequantizeLinear | from the workbench layer (codes ``u`` unsigned, weight ``(rows, *)``: Conv ``(out, in/groups, *k)``, transposed ``(in, out/groups, *k)``) |
|---|---|
| ``x``: ``{name}.qweight`` | the codes, unpacked: 8-bit as uint8, 2-, 3- and 4-bit as uint4 (opset 21; IR version 10) |
| ``x_scale``: ``{name}.scale`` float32 | the fp16 scales cast to fp32 (exact; an fp16 scale would make the output fp16, rounding the weight) |
| ``x_zero_point``: ``{name}.zero_point``, x's type | asymmetric: the stored integer zero points; symmetric: ``2^(bits-1)``, the workbench's implicit zero |
| per channel (``group_size=None``, or one group per row): ``axis=0`` | codes in the weight's layout ``(rows, *)``, scale and zero point ``(rows,)`` (opset 17 for 8-bit codes) |
| groups of ``g``: ``axis=1``, ``block_size=g`` (opset 21), then ``Reshape`` | codes ``(rows, K)``, scale and zero point ``(rows, ceil(K / g))``; a short last group is DequantizeLinear's short last block |

It computes ``(u - z) * s`` in fp32, as the workbench decodes (bit for bit), then the float convolution with the
float bias (an fp16 model: a ``Cast`` of the weight to fp16 first, as the workbench casts); only the convolution's
summation order differs. A convolution's own input padding is a ``Pad`` before it, as for W8A8.

Each static W8A8 layer (`wb.quant.Static`: `W8A8Linear` with ``static=True``, `W8A8Conv1d`, `W8A8Conv2d`,
`W8A8ConvTranspose2d`) becomes the QDQ form ONNX Runtime's graph optimizer recognises, holding the workbench's own
int8 codes and fp32 scales - stored, never quantized again:

| QDQ group | from the workbench layer (int8 weights per output channel, one calibrated activation scale) |
|---|---|
| ``QuantizeLinear(x, act_scale, 0)`` -> int8 -> ``DequantizeLinear`` | ``act_scale`` (fp32 scalar), zero point int8 0: symmetric signed, ``clamp(round_half_even(x / s), -128, 127)`` |
| ``DequantizeLinear(qweight, scale, 0, axis=0)`` | ``qweight`` int8 in the float layer's weight layout (Linear ``(out, in)``, conv ``(out, in/groups, *k)``, transposed ``(in, out/groups, *k)``), ``scale`` ``(rows,)`` fp32, zero points int8 0 |
| ``Conv`` / ``ConvTranspose`` / ``Gemm`` (``transB=1``) | the float op on the two dequantized tensors and the float bias, as PyTorch's exporter writes ``F.conv*`` / ``F.linear`` (a Linear on inputs of more than 2 dimensions: ``MatMul`` on the transposed weight, ``Add``) |
| ``Pad`` before the ``QuantizeLinear`` | a convolution's own input padding ("same" padding, ``padding_mode``): padded zeros and copied values quantize to the codes the workbench pads with |
| ``Div(x, smooth)`` before the ``QuantizeLinear`` | SmoothQuant (``Static(smooth_alpha=...)``, Linear): the inputs divided by the fp32 smoothing vector |

The layer's output stays float, as in the workbench (where BatchNorm, activations and pooling follow in float), so
ONNX Runtime fuses a group into ``QLinearConv`` only where the output goes straight into the next layer's
``QuantizeLinear`` (rounding the float bias to int32 at ``s_x s_w`` itself); elsewhere, e.g. before a BatchNorm, it
runs ``DequantizeLinear`` and the float op as written. Outputs differ from the workbench's reference path only by
rounding: ``QuantizeLinear`` divides by the scale where the workbench multiplies by its fp32 reciprocal and sums run
in another order, so an activation at a rounding tie can take the neighbouring code
(``tests/export/test_onnx_qdq.py`` checks this code by code).

Layers the plan left in floating point, and everything else, are exported as PyTorch's exporter writes them.

``wb.export(..., requantize=True)`` re-quantizes what the export cannot hold as it is into the nearest grid it holds
(`ONNX.nearest`: 3-bit and NF4 -> 4 bits, a group that is not a power of two >= 16 -> the nearest one that is).

Refused before anything is written, naming the layer: weight-only Linears and convolutions with NF4 and FP8 weights,
HQQ's real-valued zero points, AWQ smoothing, GPTQ act-order permutations or bf16 layers (their fp16 scales are not
bf16 values; a bf16 Conv is not what ONNX Runtime's CPU runs); Linears with 3-bit codes or group sizes that are not a
power of two >= 16 (per channel: an input that is not); dynamic W8A8 layers (activations quantized per token at run
time: ``QuantizeLinear`` takes a stored scale), W8A8 layers whose scales were cast from fp32 (e.g. by
``model.half()``), quantized embeddings, pruned, low-rank, cast and every other layer the workbench made; a model
without ``example_inputs``, or one the tracer cannot export (the exporter's error is re-raised as a TypeError). The graph is checked by loading it in ONNX Runtime before anything
is written. Models over 2 GB (protobuf's limit) are not supported.
"""
from __future__ import annotations

import copy
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

import numpy as np
import torch
from torch import nn

from workbench.export import ExportFormat, integer_weight_problem, register_export_format
from workbench.quantization import packing
from workbench.quantization.modules import (
    W8A8Conv1d,
    W8A8Conv2d,
    W8A8ConvTranspose2d,
    W8A8Linear,
    WeightOnlyConv1d,
    WeightOnlyConv2d,
    WeightOnlyConvTranspose2d,
    WeightOnlyEmbedding,
    WeightOnlyLinear,
)

__all__ = ["ONNX", "FILE_NAME", "OPSET", "BLOCKED_OPSET", "NBitsWeight", "nbits_weight", "QDQWeight", "qdq_weight",
           "DQWeight", "dq_weight"]

FILE_NAME = "model.onnx"
OPSET = 17           # the default: MatMulNBits, QDQ groups, per-channel uint8 DequantizeLinear
BLOCKED_OPSET = 21   # DequantizeLinear's ``block_size`` and uint4 codes (only graphs that hold them)
TRACER_OPSET = 20    # the TorchScript exporter's newest; a graph that needs more is traced at it and converted
MS_DOMAIN = "com.microsoft"
BITS = (2, 4, 8)   # what MatMulNBits' ``bits`` accepts
ALLOWED = ("integer weight-only nn.Linear layers (WeightOnly, 2/4/8 bits, symmetric or with integer zero points, "
           "group size a power of two >= 16, or per channel over such an input) as MatMulNBits, integer weight-only "
           "convolutions (WeightOnly, 2/3/4/8 bits, symmetric or with integer zero points, per channel or any group "
           "size) as DequantizeLinear feeding the float Conv / ConvTranspose, static W8A8 Linear and convolution "
           "layers (wb.quant.Static: int8 per-channel weights, one calibrated fp32 activation scale) as "
           "QuantizeLinear / DequantizeLinear groups, and floating-point layers")
W8A8_CONVS = (W8A8Conv1d, W8A8Conv2d, W8A8ConvTranspose2d)
WEIGHT_ONLY_CONVS = (WeightOnlyConv1d, WeightOnlyConv2d, WeightOnlyConvTranspose2d)


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


def _nbits_layer(name: str, m: WeightOnlyLinear) -> tuple[NBitsWeight, nn.Module]:
    w = nbits_weight(name, m)
    return w, _NBitsLinear(w, m.dequantized_weight(m.weight_dtype).detach().cpu(), m._parameters.get("bias"))


# --- static W8A8: QuantizeLinear / DequantizeLinear around the float op ----------------------------------------------

@dataclass(frozen=True)
class QDQWeight:
    """One static W8A8 layer's QDQ initializers (numpy, as they go into the graph); zero points are int8 zeros."""

    qweight: np.ndarray          # int8 in the float layer's weight layout; rows (axis 0) are the scale's channels
    scale: np.ndarray            # (rows,) float32: DequantizeLinear's per-channel scale, axis=0
    act_scale: np.ndarray        # () float32: the calibrated activation scale of QuantizeLinear / DequantizeLinear
    smooth: np.ndarray | None    # (in,) float32: SmoothQuant, the inputs are divided by it first; None: absent


def qdq_weight(name: str, m: nn.Module) -> QDQWeight:
    """A static `W8A8Linear` or W8A8 convolution's stored codes and scales as the QDQ graph holds them; refuses
    what it cannot hold (dynamic activations, scales cast from fp32)."""
    if isinstance(m, W8A8Linear):
        if not m.static:
            raise _refuse(name, "is a W8A8 layer with dynamic activations (int8 per token, scales computed at run "
                                "time): a QDQ graph holds one stored activation scale, so it is not written "
                                "(DynamicQuantizeLinear is per-tensor uint8); quantize it with wb.quant.Static")
        qweight, smooth = m.qweight_t.t(), getattr(m, "smooth", None)                   # (out, in) int8
    else:
        qweight, smooth = m.qweight, None                                              # (rows, *) int8
    tensors = {"qweight": qweight, "scale": m.scale, "act_scale": m.act_scale, "smooth": smooth}
    for what, t in tensors.items():
        wanted = torch.int8 if what == "qweight" else torch.float32
        if t is not None and t.dtype != wanted:
            raise _refuse(name, f"holds {what} in {t.dtype}, not {wanted} as a static W8A8 layer is built (was the "
                                f"model cast after quantization?); QDQ stores the workbench's own {wanted} values")
    scale = m.scale.detach().cpu().reshape(-1)                                         # (rows,)
    act = m.act_scale.detach().cpu().reshape(())
    if scale.numel() != qweight.shape[0]:
        raise _refuse(name, f"has {scale.numel()} weight scales for {qweight.shape[0]} weight rows; QDQ holds one "
                            f"per row (axis 0)")
    for what, t in (("weight scales", scale), ("an activation scale", act)):
        if not (torch.isfinite(t) & (t > 0)).all():
            raise _refuse(name, f"has {what} that are not finite and positive")
    return QDQWeight(qweight.detach().cpu().contiguous().numpy(), scale.numpy(), act.numpy(),
                     None if smooth is None else smooth.detach().cpu().numpy())


def _int8_zeros(g, shape: tuple[int, ...]):
    """The zero points, a constant of the node (not a shared initializer: the exporter would merge equal ones
    across layers behind ``Identity`` nodes)."""
    return g.op("Constant", value_t=torch.zeros(shape, dtype=torch.int8))


class _QuantizeDequantize(torch.autograd.Function):
    """The workbench's static int8 activation grid, ``clamp(round(x / s), -128, 127) * s``; exported as
    ``QuantizeLinear`` -> ``DequantizeLinear`` with scale ``s`` and the int8 zero point 0."""

    @staticmethod
    def forward(ctx, x, scale):  # x: (...) float32, scale () float32
        # (as `quantize_per_tensor` / W8A8 conv compute it: times the fp32 reciprocal)
        return torch.clamp(torch.round(x * (1.0 / scale)), -128, 127) * scale

    @staticmethod
    def symbolic(g, x, scale):
        q = g.op("QuantizeLinear", x, scale, _int8_zeros(g, ()))
        return g.op("DequantizeLinear", q, scale, _int8_zeros(g, ()))


class _Dequantize(torch.autograd.Function):
    """``codes * scale`` per row (axis 0) in fp32; exported as one ``DequantizeLinear(axis=0)``, zero points 0."""

    @staticmethod
    def forward(ctx, codes, scale):  # codes: (rows, *) int8, scale (rows,) float32
        return codes.float() * scale.reshape(-1, *(1,) * (codes.dim() - 1))

    @staticmethod
    def symbolic(g, codes, scale):
        rows = codes.type().sizes()[0]
        return g.op("DequantizeLinear", codes, scale, _int8_zeros(g, (rows,)), axis_i=0)


class _QDQLayer(nn.Module):
    """What a static W8A8 layer becomes in the copy that is traced: its buffers become the QDQ initializers
    (``{name}.qweight``, ``{name}.scale``, ``{name}.act_scale``, ...), ``op`` the float Linear / convolution and
    ``pad`` a convolution's input padding, applied before quantizing (zeros and copied values quantize to the same
    codes either way) so that the ``DequantizeLinear`` feeds the op directly, the form ONNX Runtime fuses."""

    def __init__(self, w: QDQWeight, bias: torch.Tensor | None,
                 op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
                 pad: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self.op, self.pad = op, pad
        self.register_buffer("qweight", torch.from_numpy(w.qweight))
        self.register_buffer("scale", torch.from_numpy(w.scale))
        self.register_buffer("act_scale", torch.from_numpy(w.act_scale))
        self.register_buffer("smooth", None if w.smooth is None else torch.from_numpy(w.smooth))
        self.bias = None if bias is None else nn.Parameter(bias.detach().cpu().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in) or (B, C, *spatial), float32
        if self.smooth is not None:
            x = x / self.smooth
        if self.pad is not None:
            x = self.pad(x)
        xq = _QuantizeDequantize.apply(x, self.act_scale)
        w = _Dequantize.apply(self.qweight, self.scale)
        return self.op(xq, w, self.bias)


def _qdq_linear(name: str, m: W8A8Linear) -> tuple[QDQWeight, nn.Module]:
    w = qdq_weight(name, m)
    return w, _QDQLayer(w, m.bias, nn.functional.linear)


def _qdq_conv(name: str, m: nn.Module) -> tuple[QDQWeight, nn.Module]:
    w = qdq_weight(name, m)
    a = dict(m.conv_args, input_padding=None)   # the module's `ConvOp`, as the workbench runs it
    padding = m.conv_args["input_padding"]
    pad = None if padding is None else (lambda x: padding(x, a))
    return w, _QDQLayer(w, m.bias, lambda x, weight, bias: a["op"](x, weight, bias, a), pad)


# --- weight-only convolutions: DequantizeLinear -> the float Conv / ConvTranspose ------------------------------------

@dataclass(frozen=True)
class DQWeight:
    """One weight-only convolution's ``DequantizeLinear`` initializers (numpy, the workbench's own values)."""

    codes: np.ndarray              # uint8 unsigned codes: per channel in the weight's layout (rows, *); groups (rows, K)
    scale: np.ndarray              # float32, (rows,) per channel / (rows, G) groups: the fp16 scales, cast exactly
    zero_point: np.ndarray         # uint8, the scale's shape: the stored zero points, or 2^(bits-1) (symmetric)
    element_bits: int              # the codes' ONNX element type: 8 -> uint8, 4 -> uint4 (2-, 3- and 4-bit codes)
    block_size: int | None         # None: per channel (axis 0); else groups along the flattened input (axis 1)
    weight_shape: tuple[int, ...]  # the float weight's: Conv (out, in/groups, *k), ConvTranspose (in, out/groups, *k)

    @property
    def opset(self) -> int:
        """The opset the node needs: ``block_size`` and uint4 came with opset 21."""
        return OPSET if self.block_size is None and self.element_bits == 8 else BLOCKED_OPSET


def dq_weight(name: str, m: nn.Module) -> DQWeight:
    """A weight-only convolution's stored codes, scales and zero points as ``DequantizeLinear`` holds them; refuses
    what it cannot hold."""
    why = integer_weight_problem(m)
    if why:
        raise _refuse(name, why)
    fmt = m.fmt
    if m.weight_dtype not in (torch.float32, torch.float16):
        raise _refuse(name, f"computes in {m.weight_dtype}; the exported Conv runs in float32 or float16")
    rows, K = m.weight_shape[0], m.K
    g, G = fmt.groups(K)
    codes = packing.unpack(m.qweight.detach().cpu(), fmt.slot_bits, K)                 # (rows, K) uint8
    if int(codes.max()) >= 1 << fmt.bits:
        raise _refuse(name, f"holds codes above the {fmt.bits}-bit range (up to {int(codes.max())})")
    scale = m.scale.detach().cpu()                                                     # (rows, G) fp16
    if not torch.isfinite(scale).all():
        raise _refuse(name, "has scales that are not finite")
    zero = (m.zero.detach().cpu() if not fmt.symmetric
            else torch.full_like(scale, 1 << (fmt.bits - 1), dtype=torch.uint8))       # (rows, G) uint8
    # fp16 -> fp32 is exact; an fp16 scale would make DequantizeLinear's output fp16 (opset 21), rounding w
    scale = scale.float()
    if G == 1:   # per channel (or one group per row): axis 0 on the codes in the weight's own layout
        codes, scale, zero, block = codes.reshape(m.weight_shape), scale.reshape(rows), zero.reshape(rows), None
    else:
        block = g   # a short last group is a short last block: DequantizeLinear's blocks are ceil(K / block_size)
    return DQWeight(codes.contiguous().numpy(), scale.numpy(), zero.contiguous().numpy(), 8 if fmt.bits == 8 else 4,
                    block, tuple(m.weight_shape))


class _DequantizeCodes(torch.autograd.Function):
    """``(codes - zero) * scale`` in fp32, per row or per block of ``block_size`` along the row, as the workbench
    decodes; exported as one ``DequantizeLinear`` (axis 0, or axis 1 with ``block_size``)."""

    @staticmethod
    def forward(ctx, codes, scale, zero, block_size):  # codes: (rows, *) or (rows, K) uint8; scale, zero: (rows, [G])
        if block_size is None:
            per_row = (-1, *(1,) * (codes.dim() - 1))
            return (codes.float() - zero.float().reshape(per_row)) * scale.reshape(per_row)
        K = codes.shape[1]
        return ((codes.float() - zero.float().repeat_interleave(block_size, 1)[:, :K])
                * scale.repeat_interleave(block_size, 1)[:, :K])                        # (rows, K)

    @staticmethod
    def symbolic(g, codes, scale, zero, block_size):
        if block_size is None:
            return g.op("DequantizeLinear", codes, scale, zero, axis_i=0)
        return g.op("DequantizeLinear", codes, scale, zero, axis_i=1, block_size_i=block_size)


class _DQConv(nn.Module):
    """What a weight-only convolution becomes in the copy that is traced: its buffers become the
    ``DequantizeLinear`` initializers (``{name}.qweight``, ``{name}.scale``, ``{name}.zero_point``), whose output is
    the weight of the float convolution the module's `ConvOp` runs (with its own input padding)."""

    def __init__(self, w: DQWeight, conv_args: dict, bias: torch.Tensor | None):
        super().__init__()
        self.w, self.conv_args = w, conv_args
        self.register_buffer("qweight", torch.from_numpy(w.codes))
        self.register_buffer("scale", torch.from_numpy(w.scale))
        self.register_buffer("zero_point", torch.from_numpy(w.zero_point))
        self.bias = None if bias is None else nn.Parameter(bias.detach().cpu().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, C, *spatial)
        w = _DequantizeCodes.apply(self.qweight, self.scale, self.zero_point, self.w.block_size)   # float32
        if self.w.block_size is not None:
            w = w.reshape(self.w.weight_shape)        # (rows, K) -> the float weight's layout
        bias = self.bias
        if x.dtype != w.dtype:                        # an fp16 model: the workbench decodes in fp32, then casts
            w, bias = w.to(x.dtype), None if bias is None else bias.to(x.dtype)
        a = self.conv_args
        return a["op"](x, w, bias, a)


def _dq_conv(name: str, m: nn.Module) -> tuple[DQWeight, nn.Module]:
    w = dq_weight(name, m)
    return w, _DQConv(w, m.conv_args, m.bias)


def _uint4_codes(model, layers: dict) -> None:
    """Store the 2-, 3- and 4-bit layers' codes and zero points as uint4 (opset 21): the traced graph holds them as
    uint8 (PyTorch has no 4-bit dtype). Their ``DequantizeLinear`` is found by its ``{name}.qweight`` input."""
    import onnx

    graph = model.graph
    wanted = {f"{name}.qweight": (name, w) for name, w in layers.items()
              if isinstance(w, DQWeight) and w.element_bits == 4}
    fresh: list = []
    for node in graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in wanted:
            name, w = wanted.pop(node.input[0])
            for i, (what, array) in ((0, ("qweight", w.codes)), (2, ("zero_point", w.zero_point))):
                node.input[i] = f"{name}.{what}"
                fresh.append(onnx.helper.make_tensor(node.input[i], onnx.TensorProto.UINT4, array.shape,
                                                     array.reshape(-1).tolist()))
    if wanted:
        raise RuntimeError(f"onnx export: no DequantizeLinear reads {sorted(wanted)} in the traced graph")
    _drop_unused(graph, {t.name for t in fresh})
    graph.initializer.extend(fresh)
    model.ir_version = max(model.ir_version, 10)   # (4-bit element types came with IR version 10)


def _drop_unused(graph, replaced: set[str]) -> None:
    """Remove the initializers or nodes that define the names ``replaced`` (the exporter's uint8 tensors, or an
    ``Identity`` of an equal tensor it merged them with) and what that leaves unread."""
    for t in [t for t in graph.initializer if t.name in replaced]:
        graph.initializer.remove(t)
    for n in [n for n in graph.node if set(n.output) & replaced]:
        graph.node.remove(n)
    while True:
        read = {i for node in graph.node for i in node.input} | {o.name for o in graph.output}
        dead = [n for n in graph.node if n.op_type in ("Identity", "Constant") and not set(n.output) & read]
        unread = [t for t in graph.initializer if t.name not in read]
        if not dead and not unread:
            break
        for n in dead:
            graph.node.remove(n)
        for t in unread:
            graph.initializer.remove(t)


# What each quantized layer the export writes becomes: (what is recorded, the module traced in its place).
Layer = NBitsWeight | QDQWeight | DQWeight
_LAYERS: dict[type, Callable[[str, nn.Module], tuple[Layer, nn.Module]]] = {
    WeightOnlyLinear: _nbits_layer, W8A8Linear: _qdq_linear, **{t: _qdq_conv for t in W8A8_CONVS},
    **{t: _dq_conv for t in WEIGHT_ONLY_CONVS}}


def _writer(module: nn.Module) -> Callable[[str, nn.Module], tuple[Layer, nn.Module]] | None:
    return next((_LAYERS[t] for t in type(module).__mro__ if t in _LAYERS), None)


def _check_layer(name: str, module: nn.Module) -> None:
    """Refuse the compressed layers the export does not write (named, with what they are)."""
    if isinstance(module, WeightOnlyEmbedding):
        raise _refuse(name, "is a quantized embedding; MatMulNBits is a matrix product (GatherBlockQuantized is not "
                            "written by this exporter yet)")
    kind = type(module).__module__
    if kind.partition(".")[0] == "workbench" and not kind.startswith("workbench.models"):
        raise _refuse(name, f"is a {type(module).__name__} ({kind}), which this exporter does not write (not "
                            f"exported as its dense float equivalent either: that would not be the compressed model)")


def _with_producer(data: bytes, model: nn.Module) -> bytes:
    """The graph with who wrote it: ``producer_name`` / ``producer_version`` (the workbench) and ``metadata_props``
    with the versions of torch (its tracer), onnx and onnxruntime (the reader the graph was checked with before
    writing) and the plans applied to the model."""
    import importlib.metadata
    import json

    import onnx

    import workbench
    from workbench.plans import applied_plans

    proto = onnx.load_from_string(data)
    proto.producer_name, proto.producer_version = "workbench", workbench.__version__
    props = {"workbench.torch_version": torch.__version__, "workbench.onnx_version": onnx.__version__,
             "workbench.onnxruntime_version": importlib.metadata.version("onnxruntime"),
             "workbench.plans": json.dumps([p.to_dict() for p in applied_plans(model)])}
    onnx.helper.set_model_props(proto, props)
    return proto.SerializeToString()


@dataclass
class Prepared:
    """What `ONNX.write` writes: the serialized model, what each quantized layer became, ONNX Runtime's check."""

    model: bytes
    layers: dict[str, Layer] = field(default_factory=dict)   # workbench layer -> what it became
    max_abs_diff: float = 0.0   # ONNX Runtime vs the workbench model on the example inputs (informational)
    opset: int = OPSET          # the graph's default-domain opset: ``ONNX.opset``, or more where a layer needs it


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

    @classmethod
    def for_task(cls, task, batch_size: int = 1) -> ONNX:
        """The format for a model of ``task`` (a `wb.tasks.Task`): traced with the task's example batch, inputs
        named ``input0``, ``input1``, ... with their first (batch) dimension left free."""
        import torch

        batch = task.example_inputs(batch_size)
        if isinstance(batch, torch.Tensor):
            batch = (batch,)
        if not isinstance(batch, (tuple, list)):
            raise ValueError(f"onnx export traces the model with positional inputs; the task {task.name!r} gives a "
                             f"{type(batch).__name__}: pass format=ONNX(example_inputs=...) yourself")
        names = tuple(f"input{i}" for i in range(len(batch)))
        return cls(example_inputs=tuple(batch), input_names=names, dynamic_axes={n: {0: "batch"} for n in names})

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
        layers: dict[str, Layer] = {}
        for name, module in model.named_modules():
            writer = _writer(module)
            if writer is None:
                _check_layer(name, module)
                continue
            layers[name], new = writer(name, module)
            parent, _, leaf = name.rpartition(".")
            setattr(traced.get_submodule(parent), leaf, new)
        opset = max([self.opset, *(w.opset for w in layers.values() if isinstance(w, DQWeight))])
        data = _with_producer(self._trace(traced, opset, layers), model)
        return Prepared(data, layers, self._check(model, data), opset)

    # --- the nearest grid the ONNX export holds, for a layer it cannot hold as it is (`workbench.export.fit`) -------

    def nearest(self, name: str, module: nn.Module):
        """None where the export holds the layer as it is; else integer codes the layer's writer takes: a Linear's
        MatMulNBits 2/4/8 bits (3-bit and NF4 -> 4, FP8 -> 8) in groups of the power of two >= 16 nearest its group
        (a tie: the smaller), a convolution's DequantizeLinear any integer grid (NF4 -> 4, FP8 -> 8 bits, the same
        group); HQQ -> integer zero points, AWQ smoothing and act-order permutations -> the effective weight on the
        same grid. Refuses what no grid fixes: bf16 layers, W8A8 layers (a static activation scale needs
        calibration), quantized embeddings, pruned, low-rank and cast layers."""
        from workbench.export.fit import holds_as_is, weight_grid
        from workbench.quantization.configs import WeightOnly

        writer = _writer(module)
        if writer is None:
            _check_layer(name, module)   # (refuses every other layer the workbench made)
            return None
        if holds_as_is(writer, name, module):
            return None
        if not isinstance(module, (WeightOnlyLinear, *WEIGHT_ONLY_CONVS)):
            raise _refuse(name, f"is a {type(module).__name__} the export cannot hold, and re-quantizing it would "
                                f"need calibration data (a static activation scale): apply wb.quant.Static()")
        if module.weight_dtype not in (torch.float32, torch.float16):
            raise _refuse(name, f"computes in {module.weight_dtype}; the export holds float32 and float16 layers in "
                                f"any grid - cast the model first")
        grid = weight_grid(module)
        if isinstance(module, WeightOnlyLinear):
            bits = min(b for b in BITS if b >= grid.bits)
            g = grid.group_size
            K = module.in_features
            have = K if g is None else g
            if have < 16 or have & (have - 1):
                g = min((1 << k for k in range(4, max(4, (K - 1).bit_length()) + 1)), key=lambda c: (abs(c - have), c))
            return WeightOnly(bits=bits, group_size=g, symmetric=grid.symmetric)
        return WeightOnly(bits=grid.bits, group_size=grid.group_size, symmetric=grid.symmetric)

    def _trace(self, traced: nn.Module, opset: int, layers: dict[str, Layer]) -> bytes:
        """The traced graph at ``opset``: beyond the tracer's newest, traced at that and converted by ONNX's version
        converter (every node adapted or refused by it), then the 4-bit codes retyped to uint4."""
        data = self._export(traced, min(opset, TRACER_OPSET))
        if opset <= TRACER_OPSET:
            return data
        import onnx
        from onnx import version_converter

        model = version_converter.convert_version(onnx.load_from_string(data), opset)
        _uint4_codes(model, layers)
        return model.SerializeToString()

    def _export(self, traced: nn.Module, opset: int) -> bytes:
        buffer = io.BytesIO()
        try:
            with torch.no_grad():
                torch.onnx.export(traced, self.example_inputs, buffer, dynamo=False, opset_version=opset,
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
