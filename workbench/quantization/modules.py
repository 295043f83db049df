"""Modules that really store low-bit data (so `measure().size_bytes` drops for real).

- `WeightOnlyLinear`, `WeightOnlyEmbedding`, `WeightOnlyConv2d`: a weight in one of the `formats`
  (int8/int4/int3/int2, NF4, fp8) plus a float bias; activations stay in floating point.
- `W8A8Linear`: int8 per-channel weights and int8 activations, quantized per token at run time
  (dynamic) or with a calibrated scale (static), optionally SmoothQuant-smoothed.
- `W8A8Conv2d`: static W8A8 convolution (int8 per-channel weights, calibrated activation scale).

Each module has a pure-PyTorch ``reference`` path (dequantize, then a float matmul) that runs anywhere.
Faster paths are chosen with ``kernel=`` (or `set_kernel`) and recorded in ``module.kernel``; `wb.measure`
reports the kernels that ran. Asking for a path that cannot run here raises, naming the module and what it
would need; ``kernel="auto"`` picks the device's fast path where the module has one (Triton on a CUDA GPU,
"cpu" on the CPU) and the reference otherwise - and records which.

| module | ``"cpu"`` (CPU tensors) | ``"triton"`` (CUDA, or ``TRITON_INTERPRET=1``) |
|---|---|---|
| `WeightOnlyLinear` | weight decoded to bf16, bf16 GEMM | int8 per-channel (`kernels.int8_weight_only`), int4 any group / zero (`kernels.int4_weight_only`) |
| `W8A8Linear` | per block of rows: one fused quantization pass, ``torch._int_mm``, one fused rescale pass (``torch.compile``) | dynamic: fused per-token quantization + int8 GEMM + rescale (`kernels.w8a8`) |
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.quantization import formats as fm
from workbench.quantization.primitives import EPS, PerToken, choose_qparams, quantize, to_groups

__all__ = ["conv_args", "WeightOnlyLinear", "WeightOnlyEmbedding", "WeightOnlyConv2d", "W8A8Linear", "W8A8Conv2d",
           "KERNELS", "PATHS", "choose_kernel", "triton_weight_kind"]

PATHS = ("reference", "cpu", "triton")
KERNELS = PATHS + ("auto",)


def choose_kernel(owner: str, kernel: str, supported: tuple[str, ...], device: torch.device) -> str:
    """The path to run: ``kernel`` itself if it is one of ``supported`` and can run on ``device`` here (else an
    error naming ``owner``), or for ``"auto"`` the device's fast path - "triton" on a CUDA GPU, "cpu" on the
    CPU - where ``supported`` has it, and "reference" otherwise."""
    if kernel not in KERNELS:
        raise ValueError(f"{owner}: kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "auto":
        from kernels._common import triton_available

        if device.type == "cuda" and "triton" in supported and triton_available(device):
            return "triton"
        return "cpu" if device.type == "cpu" and "cpu" in supported else "reference"
    if kernel not in supported:
        raise ValueError(f"{owner} has no {kernel!r} kernel; it supports {supported}")
    if kernel == "cpu" and device.type not in ("cpu", "meta"):
        raise ValueError(f"{owner}: kernel='cpu' needs the module on the CPU, it is on {device}")
    if kernel == "triton" and device.type != "meta":
        from kernels._common import triton_available

        if not triton_available(device):
            raise RuntimeError(f"{owner}: kernel='triton' needs a CUDA GPU (or TRITON_INTERPRET=1 for testing); the "
                               f"module is on {device}. Use kernel='cpu' or 'reference' here.")
    return kernel


def triton_weight_kind(fmt: fm.WeightFormat) -> str | None:
    """Which Triton weight-only GEMM serves ``fmt``: "int8" (per-channel, symmetric), "int4" or None."""
    if isinstance(fmt, fm.IntFormat):
        if fmt.bits == 8 and fmt.group_size is None and fmt.symmetric:
            return "int8"
        if fmt.bits == 4:
            return "int4"
    return None


def conv_args(conv: nn.Conv2d) -> dict:
    """What a quantized Conv2d needs to rebuild its convolution: weight shape, stride, padding, ..."""
    if conv.padding_mode != "zeros":
        raise ValueError(f"only zero padding is supported, got padding_mode={conv.padding_mode!r}")
    return {"weight_shape": tuple(conv.weight.shape), "stride": conv.stride, "padding": conv.padding,
            "dilation": conv.dilation, "groups": conv.groups}


def _fill(new: nn.Module, source: nn.Module, **tensors: torch.Tensor | None) -> nn.Module:
    """Copy ``tensors`` (the ones that are not None) into ``new``'s buffers of those names, and ``source``'s bias."""
    with torch.no_grad():
        for name, t in tensors.items():
            if t is not None:
                getattr(new, name).copy_(t)
        if source.bias is not None:
            new.bias.copy_(source.bias)
    return new


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

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {name: buf for name, buf in self.named_buffers(recurse=False) if name in ("qweight", "scale", "zero")}

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the module computes with, as a float ``(rows, K)`` matrix."""
        return fm.decode(self._tensors(), self.fmt, self.K, dtype)


class WeightOnlyLinear(_PackedWeight):
    """y = x W^T + b with W stored in a low-bit format and dequantized on the fly (``reference``)."""

    def __init__(self, in_features: int, out_features: int, fmt: fm.WeightFormat, bias: bool = True,
                 tensors: dict[str, torch.Tensor] | None = None, device=None, bias_dtype=torch.float32,
                 smooth: bool = False, kernel: str = "reference"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._init_weight(out_features, in_features, fmt, tensors, device)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device)) if bias else None
        if smooth:  # AWQ: the stored weight is W * s per input channel; inputs are divided by s
            self.register_buffer("smooth", torch.ones(in_features, device=device))
        self.kernel = "reference"
        if kernel != "reference":
            self.set_kernel(kernel)

    def set_kernel(self, kernel: str) -> "WeightOnlyLinear":
        """Choose the matmul path (see the module docstring); raises if it cannot serve this format here."""
        supported = ("reference", "cpu") + (("triton",) if triton_weight_kind(self.fmt) else ())
        self.kernel = choose_kernel(f"WeightOnlyLinear({self.fmt})", kernel, supported, self.qweight.device)
        return self

    @classmethod
    def from_float(cls, linear: nn.Linear, fmt: fm.WeightFormat, name: str = "linear",
                   tensors: dict[str, torch.Tensor] | None = None,
                   smooth: torch.Tensor | None = None, kernel: str = "reference") -> "WeightOnlyLinear":
        """Round-to-nearest unless ``tensors`` (from GPTQ, AWQ, HQQ) are given. ``smooth``: per-input-channel
        factors already multiplied into the weight that ``tensors`` encode."""
        w = linear.weight.detach()
        fm.check_finite(name, w)
        tensors = fm.encode(w, fmt) if tensors is None else tensors
        new = cls(linear.in_features, linear.out_features, fmt, linear.bias is not None, tensors,
                  bias_dtype=w.dtype, smooth=smooth is not None, device=w.device)
        return _fill(new, linear, smooth=smooth).set_kernel(kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in)
        if hasattr(self, "smooth"):
            x = x / self.smooth.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.kernel == "triton":
            return self._triton(x, bias)
        if self.kernel == "cpu":  # bf16 weight and GEMM (the CPU's fast float path), result in x's dtype
            w = self.dequantized_weight(torch.bfloat16)
            return F.linear(x.to(torch.bfloat16), w, None if bias is None else bias.to(torch.bfloat16)).to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def _triton(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if triton_weight_kind(self.fmt) == "int8":
            from kernels.int8_weight_only import int8_weight_only_mm

            return int8_weight_only_mm(x, self.qweight, self.scale, bias)
        from kernels.int4_weight_only import int4_weight_only_mm

        return int4_weight_only_mm(x, self.qweight, self.scale, getattr(self, "zero", None),
                                   self.K // self.scale.shape[1], bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, kernel={self.kernel}"


class WeightOnlyEmbedding(_PackedWeight):
    """Embedding table in a low-bit format; only the looked-up rows are dequantized."""

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: fm.WeightFormat,
                 tensors: dict[str, torch.Tensor] | None = None, padding_idx: int | None = None,
                 output_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.output_dtype = output_dtype
        self._init_weight(num_embeddings, embedding_dim, fmt, tensors, device)
        self.kernel = "reference"

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
        rows = {name: t.index_select(0, flat) for name, t in self._tensors().items()}  # gather, then dequantize
        out = fm.decode(rows, self.fmt, self.K, self.output_dtype)                # (N, dim)
        return out.reshape(*idx.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fmt={self.fmt}"


class WeightOnlyConv2d(_PackedWeight):
    """Conv2d whose weight ``(out, in/groups, kh, kw)`` is stored as ``(out, in/groups * kh * kw)`` low-bit rows."""

    def __init__(self, args: dict, fmt: fm.WeightFormat, bias: bool = True,
                 tensors: dict[str, torch.Tensor] | None = None, device=None):
        super().__init__()
        self.conv_args = dict(args)
        out_c, in_c, kh, kw = args["weight_shape"]
        self._init_weight(out_c, in_c * kh * kw, fmt, tensors, device)
        self.bias = nn.Parameter(torch.zeros(out_c, device=device)) if bias else None
        self.kernel = "reference"

    @classmethod
    def from_float(cls, conv: nn.Conv2d, fmt: fm.WeightFormat, name: str = "conv",
                   tensors: dict[str, torch.Tensor] | None = None) -> "WeightOnlyConv2d":
        """Round-to-nearest unless ``tensors`` (e.g. with QAT's learned scales) are given."""
        w = conv.weight.detach()
        fm.check_finite(name, w)
        tensors = fm.encode(w.reshape(w.shape[0], -1), fmt) if tensors is None else tensors
        return _fill(cls(conv_args(conv), fmt, conv.bias is not None, tensors), conv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, C, H, W)
        a = self.conv_args
        w = self.dequantized_weight(x.dtype).reshape(a["weight_shape"])
        return F.conv2d(x, w, None if self.bias is None else self.bias.to(x.dtype), a["stride"], a["padding"],
                        a["dilation"], a["groups"])


_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per-token quantization of activations: (codes (M, K) int8, scale (M, 1) fp32).

    The same numbers as ``choose_qparams(x, 8, symmetric=True)`` + ``quantize`` (a test checks), in fewer
    passes over the activations: scale = max|x| / 127.5 per row, codes = clamp(round(x / scale))."""
    xg = to_groups(x, PerToken()).float()                          # (M, K)
    lo, hi = xg.amin(dim=1, keepdim=True), xg.amax(dim=1, keepdim=True)  # (aminmax(dim) is 10x slower here)
    scale = (torch.maximum(-lo, hi) / 127.5).clamp_(min=EPS)
    scale = torch.where(torch.isfinite(scale), scale, float("nan"))   # a NaN / Inf row: NaN scale, NaN outputs
    r = xg * (1.0 / scale)                                         # |r| <= 127.5
    # round half to even by adding and removing 1.5 * 2^23 (fp32's ulp is 1 there): the same result as
    # torch.round for |r| < 2^22, and several times faster than aten::round on the CPU
    r.add_(_ROUND_MAGIC).sub_(_ROUND_MAGIC)
    return r.clamp_(-128, 127).to(torch.int8), scale


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of activations with a calibrated scale: (codes (M, K), scale (M, 1)); a row
    holding NaN or Inf gets a NaN scale (so NaN outputs), as in the per-token case."""
    xg = to_groups(x, PerToken()).float()                          # (M, K)
    scale = scale.float().reshape(1, 1)                            # fp32 even after module.half()
    q = quantize(xg, scale, torch.zeros(1, 1, dtype=torch.int32), -128, 127, torch.int8)
    return q, torch.where(torch.isfinite(xg).all(dim=1, keepdim=True), scale, float("nan"))


class W8A8Linear(nn.Module):
    """W8A8 Linear: int8 per-output-channel weights and int8 activations.

    y = (q_x q_w^T) * s_x s_w^T + b, the integer product accumulated in int32. Activations are quantized
    per token at run time (``static=False``, "dynamic") or with one calibrated per-tensor scale
    (``static=True``, buffer ``act_scale``). With a ``smooth`` vector (SmoothQuant, Xiao et al. 2023) the
    module computes ``(x / smooth) (W * smooth)^T``: the same product, with activation outliers migrated into
    the weights, which quantize more easily. (Here the division is applied in the module rather than folded
    into the previous LayerNorm, so it works on any Linear; the numerics are those of the folded form.)
    ``kernel="cpu"`` runs `kernels.w8a8_cpu` (quantization, ``torch._int_mm``'s oneDNN int8 GEMM and the
    rescale fused block by block in C++, bit-identical to the reference); ``"triton"`` the Triton kernel on a GPU;
    ``"reference"`` the same math in fp32.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, static: bool = False,
                 smooth: bool = False, device=None, kernel: str = "reference"):
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
        self.kernel = choose_kernel(owner, kernel, supported, self.qweight_t.device)
        return self

    @classmethod
    def from_float(cls, linear: nn.Linear, name: str = "linear", kernel: str = "reference",
                   act_scale: torch.Tensor | None = None, smooth: torch.Tensor | None = None) -> "W8A8Linear":
        w = linear.weight.detach().float()
        fm.check_finite(name, w)
        if smooth is not None:
            w = w * smooth.reshape(1, -1)                                 # migrate: W' = W diag(s)
        scale, zp = choose_qparams(w, 8, symmetric=True)                 # (out, 1) per output channel
        q = quantize(w, scale, zp, -128, 127, torch.int8)                 # (out, in)
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, static=act_scale is not None,
                  smooth=smooth is not None, kernel=kernel)
        return _fill(new, linear, qweight_t=q.t(), scale=scale.t(), act_scale=act_scale, smooth=smooth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in)
        xs = x / self.smooth if hasattr(self, "smooth") else x
        if self.kernel == "triton":
            from kernels.w8a8 import w8a8_mm

            bias = None if self.bias is None else self.bias.detach()   # an inference kernel: no autograd
            return w8a8_mm(xs.contiguous(), self.qweight_t, self.scale, bias)
        if self.kernel == "cpu":
            return self._cpu(xs)
        else:
            qx, sx = self._quantize(to_groups(xs, PerToken()))            # (M, in) int8, (M, 1)
            acc = qx.float() @ self.qweight_t.float()                     # the same integers, in fp32
            y = acc.mul_(sx).mul_(self.scale)                             # in place: a fresh (M, out) buffer
            if self.bias is not None:
                y.add_(self.bias)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def _quantize(self, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_per_tensor(x2d, self.act_scale) if self.static else quantize_per_token(x2d)

    def _cpu(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out) in x's dtype
        """`kernels.w8a8_cpu` without its per-call argument checks (the module's own tensors are known good);
        under ``torch.compile`` the checked custom op."""
        from kernels import w8a8_cpu

        act = self.act_scale if self.static else None
        bias = None if self.bias is None else self.bias.detach()   # an inference path: no autograd
        scale = self.scale
        if any(t is not None and t.dtype != torch.float32 for t in (scale, bias, act)):   # after module.half()
            scale, bias, act = (None if t is None else t.float() for t in (scale, bias, act))
        if torch.compiler.is_compiling():
            return w8a8_cpu.w8a8_linear_cpu(x, self.qweight_t, scale, bias, act)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"W8A8Linear: the input has {x.shape[-1]} features, the layer takes {self.in_features}")
        return w8a8_cpu.linear_unchecked(x, self.qweight_t, scale, bias, act)

    def extra_repr(self) -> str:
        mode = "static" if self.static else "dynamic"
        return (f"in_features={self.in_features}, out_features={self.out_features}, activations={mode}, "
                f"smooth={hasattr(self, 'smooth')}, kernel={self.kernel}")


class W8A8Conv2d(nn.Module):
    """Static W8A8 Conv2d: int8 weights per output channel, int8 activations with one calibrated scale.

    ``kernel="reference"`` only: activations are quantized and dequantized with the stored scale and the
    convolution runs on the dequantized int8 weights (the same numbers an integer kernel would produce).
    """

    def __init__(self, args: dict, bias: bool = True, device=None):
        super().__init__()
        self.conv_args = dict(args)
        shape = args["weight_shape"]
        self.register_buffer("qweight", torch.empty(shape, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.empty(shape[0], 1, 1, 1, dtype=torch.float32, device=device))
        self.register_buffer("act_scale", torch.empty((), dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(shape[0], device=device)) if bias else None
        self.kernel = "reference"

    @classmethod
    def from_float(cls, conv: nn.Conv2d, act_scale: torch.Tensor, name: str = "conv") -> "W8A8Conv2d":
        args = conv_args(conv)
        w = conv.weight.detach().float()
        fm.check_finite(name, w)
        w2d = w.reshape(w.shape[0], -1)
        scale, zp = choose_qparams(w2d, 8, symmetric=True)                   # (out, 1)
        q = quantize(w2d, scale, zp, -128, 127, torch.int8).reshape(w.shape)
        new = cls(args, conv.bias is not None)
        return _fill(new, conv, qweight=q, scale=scale.reshape(-1, 1, 1, 1), act_scale=act_scale.reshape(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, C, H, W)
        a = self.conv_args
        s = self.act_scale
        xq = torch.clamp(torch.round(x.float() * (1.0 / s)), -128, 127) * s   # int8 grid, dequantized
        w = self.qweight.float() * self.scale
        y = F.conv2d(xq, w, self.bias, a["stride"], a["padding"], a["dilation"], a["groups"])
        return y.to(x.dtype)
