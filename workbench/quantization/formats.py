"""Weight storage formats: how a float weight matrix becomes the bytes a quantized module keeps.

A format encodes a 2-D weight ``(rows, K)`` (Linear: ``(out, in)``; Embedding: ``(num, dim)``; Conv:
``(out, in * kh * kw)``) into named tensors, and decodes them back. Groups run along K.

| format | tensors | bytes per value |
|---|---|---|
| `IntFormat(bits, group_size, symmetric, float_zero)` | ``qweight`` uint8 packed codes, ``scale`` fp16 per group, ``zero`` per group (asymmetric only: uint8 code, or fp16 for HQQ) | bits/8 + 2/g (+1/g or 2/g) |
| `NF4Format(group_size)` | ``qweight`` uint8, two codes per byte; ``scale`` fp16 absmax per group | 0.5 + 2/g |
| `FP8Format(dtype)` | ``qweight`` float8; ``scale`` fp32 per row | 1 + 4/K |
| `MXFP4Format()` (OCP MX v1.0) | ``qweight`` uint8, two E2M1 codes per byte; ``scale`` uint8 E8M0 per 32 values | 0.5 + 1/32 |
| `MXFP8Format()` (OCP MX v1.0) | ``qweight`` float8 e4m3fn; ``scale`` uint8 E8M0 per 32 values | 1 + 1/32 |
| `NVFP4Format()` (NVIDIA) | ``qweight`` uint8, two E2M1 codes per byte; ``scale`` float8 e4m3fn per 16 values; ``global_scale`` fp32 per tensor | 0.5 + 1/16 |

Each format is one class derived from `WeightFormat` that implements the whole protocol - ``validate``,
``encode``, ``empty``, ``decode``, and which kernels read it (``triton_kind``, ``cpu_layout``) - and is
registered in `FORMATS`: a new format is a new class, not a branch in four functions. The module-level
`encode` / `decode` / `empty` / `validate` call the format's methods.

Integer codes are stored unsigned (``u = q - qmin``), with the zero point in the same unsigned space;
3-bit codes sit in 4-bit slots (there is no byte-aligned 3-bit layout), so they cost 4 bits. Scales are
rounded to fp16 *before* the codes are computed (`primitives.fp16_scale`), so stored scales and codes agree.

When ``group_size`` does not divide K, the last group of each row is short (``K % group_size`` values):
scales and zero points are ``(rows, ceil(K / g))`` and the codes are still exactly K per row. The short
group is quantized as if zero-padded to ``g`` values, which changes nothing (every range includes 0), so
this is the same as a padded last group without storing the padding. `short_group_note` says so in words.
"""
from __future__ import annotations

import abc
import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from workbench.quantization import packing
from workbench.quantization.primitives import (
    FLOAT8_DTYPES,
    MX_BLOCK,
    NVFP4_BLOCK,
    PerChannel,
    choose_qparams,
    dequantize_packed,
    e2m1_values,
    e8m0_to_float,
    float8_quantize,
    fp16_scale,
    mx_quantize,
    nf4_codebook,
    nf4_codes,
    nvfp4_global_scale,
    nvfp4_quantize,
    qrange,
    quantize,
)

__all__ = ["WeightFormat", "IntFormat", "NF4Format", "FP8Format", "MXFP4Format", "MXFP8Format", "NVFP4Format",
           "FORMATS", "register_format", "encode", "decode", "empty", "validate", "check_finite", "int_qparams",
           "int_codes", "pack_int", "groups", "padded_groups", "short_group_note"]

FORMATS: dict[str, type["WeightFormat"]] = {}   # name -> format class, filled by `register_format`


def register_format(cls: type["WeightFormat"]) -> type["WeightFormat"]:
    """Class decorator: add a `WeightFormat` subclass to `FORMATS` under its ``name``."""
    if cls.name in FORMATS:
        raise ValueError(f"weight format name {cls.name!r} is taken by {FORMATS[cls.name].__name__}")
    FORMATS[cls.name] = cls
    return cls


class WeightFormat(abc.ABC):
    """How one kind of low-bit weight is stored. Subclasses are frozen dataclasses (hashable, comparable)."""

    name: ClassVar[str]
    cpu_kernel: ClassVar[bool] = False   # `workbench_kernels.weight_only_cpu` reads it (see ``cpu_layout``)
    shared: ClassVar[tuple[str, ...]] = ()   # tensors that hold one value for all rows (not gathered by row)
    group_size: int | None = None   # values per scale along K; None: one group per row

    @abc.abstractmethod
    def validate(self) -> None:
        """Raise ValueError naming the bad field."""

    @abc.abstractmethod
    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Round-to-nearest encoding of a 2-D float weight ``(rows, K)`` (checked by the module-level `encode`)."""

    @abc.abstractmethod
    def empty(self, shape: tuple[int, int], device=None) -> dict[str, torch.Tensor]:
        """Correctly shaped and typed, uninitialised tensors (what `wb.load` fills)."""

    @abc.abstractmethod
    def decode(self, t: dict[str, torch.Tensor], K: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The rows held in ``t`` (all rows, or a gathered subset for embeddings) as float ``(rows, K)``."""

    @property
    def triton_kind(self) -> str | None:
        """Which Triton weight-only GEMM serves this format: "int8", "int4" or None (none does)."""
        return None

    def triton_tensors(self, t: dict[str, torch.Tensor]) -> tuple:
        """(scale, zero or None, 16-value table or None) as the Triton int4 kernel takes them (``triton_kind``
        "int4"): the stored scale and zero point; a table format's fp32 block scales and its table."""
        return t["scale"], t.get("zero"), None

    def cpu_layout(self, t: dict[str, torch.Tensor], K: int) -> dict | None:
        """The stored tensors as `workbench_kernels.weight_only_cpu` reads them (its `CpuWeight` fields:
        codes as stored, fp32 scale and zero or a lookup table); None when ``cpu_kernel`` is False."""
        return None

    def groups(self, K: int) -> tuple[int, int]:
        """(values per group g, groups per row G = ceil(K / g)) of a K-wide row."""
        g = K if self.group_size is None else self.group_size
        return g, -(-K // g)


def _check_group_size(group_size) -> None:
    if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"group_size must be a positive int or None (per channel), got {group_size!r}")


def padded_groups(w: torch.Tensor, g: int) -> torch.Tensor:
    """``(rows, K)`` -> ``(rows * G, g)``, zero-padding the short last group of each row."""
    rows, K = w.shape
    if K % g:
        w = torch.nn.functional.pad(w, (0, g - K % g))
    return w.reshape(-1, g)


@register_format
@dataclass(frozen=True)
class IntFormat(WeightFormat):
    """Integer codes of 2, 3, 4 or 8 bits with an fp16 scale (and, asymmetric, a zero point) per group."""

    name: ClassVar[str] = "int"
    cpu_kernel: ClassVar[bool] = True
    bits: int = 4
    group_size: int | None = 64  # None: one group per row (per-channel)
    symmetric: bool = True
    float_zero: bool = False     # HQQ: a real-valued (fp16) zero point per group instead of an integer code

    @property
    def slot_bits(self) -> int:
        return 4 if self.bits == 3 else self.bits

    def validate(self) -> None:
        if self.bits not in (2, 3, 4, 8):
            raise ValueError(f"weight-only integer quantization supports 2, 3, 4 and 8 bits, got {self.bits!r}")
        _check_group_size(self.group_size)
        if self.float_zero and self.symmetric:
            raise ValueError("a float zero point needs asymmetric quantization (symmetric=False)")

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        scale, zero = int_qparams(w, self)
        return pack_int(int_codes(w, scale, zero, self), scale, zero, self)

    def empty(self, shape: tuple[int, int], device=None) -> dict[str, torch.Tensor]:
        rows, K = shape
        _, G = self.groups(K)
        out = {"qweight": torch.empty(packing.packed_shape((rows, K), self.slot_bits), dtype=torch.uint8,
                                      device=device),
               "scale": torch.empty(rows, G, dtype=torch.float16, device=device)}
        if not self.symmetric:
            out["zero"] = torch.empty(rows, G, dtype=torch.float16 if self.float_zero else torch.uint8, device=device)
        return out

    def _zero(self, t: dict[str, torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
        """The zero points in fp32, ``(rows, G)``: stored, or the symmetric mid-point 2^(bits-1)."""
        return t["zero"].float() if "zero" in t else torch.full_like(scale, float(1 << (self.bits - 1)))

    def decode(self, t: dict[str, torch.Tensor], K: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = t["scale"].float()                                                 # (rows, G)
        w = dequantize_packed(t["qweight"], self.slot_bits, K, scale, self.groups(K)[0], self._zero(t, scale))
        return w.to(dtype)

    @property
    def triton_kind(self) -> str | None:
        if self.bits == 8 and self.group_size is None and self.symmetric:
            return "int8"
        return "int4" if self.bits == 4 else None

    def cpu_layout(self, t: dict[str, torch.Tensor], K: int) -> dict:
        scale = t["scale"].float().contiguous()
        stored = t["scale"]
        return {"qweight": t["qweight"].contiguous(), "scale": scale, "zero": self._zero(t, scale).contiguous(),
                "lut": None, "bits": self.slot_bits, "group_size": self.groups(K)[0], "K": K,
                # the decode path reads the stored fp16 scales and, symmetric, no zero points (the same values)
                "scale16": stored if stored.dtype == torch.float16 and stored.is_contiguous() else None,
                "zconst": float("nan") if "zero" in t else float(1 << (self.bits - 1))}


@register_format
@dataclass(frozen=True)
class NF4Format(WeightFormat):
    """QLoRA's 4-bit normal-float codes (two per byte) with an fp16 absmax scale per group."""

    name: ClassVar[str] = "nf4"
    cpu_kernel: ClassVar[bool] = True
    group_size: int | None = 64  # None: one absmax scale per row

    def validate(self) -> None:
        _check_group_size(self.group_size)

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        rows, K = w.shape
        g, G = self.groups(K)
        wg = padded_groups(w.float(), g)                                                  # (rows * G, g)
        scale = fp16_scale(wg.abs().amax(dim=1, keepdim=True))                      # (rows * G, 1)
        codes = nf4_codes(wg, scale)                                                # (rows * G, g)
        return {"qweight": packing.pack(codes.reshape(rows, -1)[:, :K], 4), "scale": scale.reshape(rows, G).half()}

    def empty(self, shape: tuple[int, int], device=None) -> dict[str, torch.Tensor]:
        rows, K = shape
        _, G = self.groups(K)
        return {"qweight": torch.empty(packing.packed_shape((rows, K), 4), dtype=torch.uint8, device=device),
                "scale": torch.empty(rows, G, dtype=torch.float16, device=device)}

    def decode(self, t: dict[str, torch.Tensor], K: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = dequantize_packed(t["qweight"], 4, K, t["scale"].float(), self.groups(K)[0], lut=nf4_codebook())
        return w.to(dtype)

    def cpu_layout(self, t: dict[str, torch.Tensor], K: int) -> dict:
        return {"qweight": t["qweight"].contiguous(), "scale": t["scale"].float().contiguous(), "zero": None,
                "lut": nf4_codebook().float().contiguous(), "bits": 4, "group_size": self.groups(K)[0], "K": K}


@register_format
@dataclass(frozen=True)
class FP8Format(WeightFormat):
    """float8 values (e4m3fn or e5m2) with an fp32 scale per row."""

    name: ClassVar[str] = "fp8"
    dtype: torch.dtype = torch.float8_e4m3fn

    def validate(self) -> None:
        if self.dtype not in FLOAT8_DTYPES:
            raise ValueError(f"fp8 dtype must be one of {FLOAT8_DTYPES}, got {self.dtype!r}")

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = float8_quantize(w, PerChannel(0), self.dtype)
        return {"qweight": q, "scale": scale}

    def empty(self, shape: tuple[int, int], device=None) -> dict[str, torch.Tensor]:
        rows, K = shape
        return {"qweight": torch.empty(rows, K, dtype=self.dtype, device=device),
                "scale": torch.empty(rows, 1, dtype=torch.float32, device=device)}

    def decode(self, t: dict[str, torch.Tensor], K: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (t["qweight"].float() * t["scale"]).to(dtype)


@functools.cache
def _e2m1_table(device: torch.device) -> torch.Tensor:
    """The 16 E2M1 values on ``device``, made once per device (the Triton path reads it at every call)."""
    return e2m1_values().to(device)


class _BlockFP4(WeightFormat):
    """E2M1 codes, two per byte (`packing.pack`), with one scale per block of ``group_size`` values; the CPU kernel
    reads them as a 16-value table times an fp32 scale per block (NF4's path)."""

    cpu_kernel: ClassVar[bool] = True
    group_size: ClassVar[int]

    def validate(self) -> None:
        pass

    def block_scales(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each block's fp32 scale ``(rows, G)``, as the values decode with it."""
        raise NotImplementedError

    def decode(self, t: dict[str, torch.Tensor], K: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = dequantize_packed(t["qweight"], 4, K, self.block_scales(t), self.group_size, lut=e2m1_values())
        return w.to(dtype)

    @property
    def triton_kind(self) -> str | None:
        return "int4"   # the int4 kernel with the E2M1 table in place of u - z

    def triton_tensors(self, t: dict[str, torch.Tensor]) -> tuple:
        scale = self.block_scales(t)
        return scale, None, _e2m1_table(scale.device)

    def cpu_layout(self, t: dict[str, torch.Tensor], K: int) -> dict:
        return {"qweight": t["qweight"].contiguous(), "scale": self.block_scales(t).contiguous(), "zero": None,
                "lut": e2m1_values(), "bits": 4, "group_size": self.group_size, "K": K}


@register_format
@dataclass(frozen=True)
class MXFP4Format(_BlockFP4):
    """OCP MX v1.0 MXFP4: E2M1 codes with an E8M0 (power-of-two) scale per 32 values (``scale``: uint8 biased
    exponents; 255 is NaN); 4.25 bits a value."""

    name: ClassVar[str] = "mxfp4"
    group_size: ClassVar[int] = MX_BLOCK

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        rows, K = w.shape
        codes, scale = mx_quantize(padded_groups(w.float(), MX_BLOCK), "e2m1")
        return {"qweight": packing.pack(codes.reshape(rows, -1)[:, :K], 4), "scale": scale.reshape(rows, -1)}

    def empty(self, shape: tuple[int, int], device=None) -> dict[str, torch.Tensor]:
        rows, K = shape
        return {"qweight": torch.empty(packing.packed_shape((rows, K), 4), dtype=torch.uint8, device=device),
                "scale": torch.empty(rows, self.groups(K)[1], dtype=torch.uint8, device=device)}

    def block_scales(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        return e8m0_to_float(t["scale"])


@register_format
@dataclass(frozen=True)
class NVFP4Format(_BlockFP4):
    """NVIDIA's NVFP4: E2M1 codes with a float8 e4m3fn scale per 16 values and one fp32 ``global_scale`` per tensor;
    a value is ``e2m1 * (scale / global_scale)``; 4.5 bits a value."""

    name: ClassVar[str] = "nvfp4"
    group_size: ClassVar[int] = NVFP4_BLOCK
    shared: ClassVar[tuple[str, ...]] = ("global_scale",)

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        rows, K = w.shape
        wf = w.float()
        global_scale = nvfp4_global_scale(wf.abs().amax())
        codes, scale = nvfp4_quantize(padded_groups(wf, NVFP4_BLOCK), global_scale)
        return {"qweight": packing.pack(codes.reshape(rows, -1)[:, :K], 4), "scale": scale.reshape(rows, -1),
                "global_scale": global_scale}

    def empty(self, shape: tuple[int, int], device=None) -> dict[str, torch.Tensor]:
        rows, K = shape
        return {"qweight": torch.empty(packing.packed_shape((rows, K), 4), dtype=torch.uint8, device=device),
                "scale": torch.empty(rows, self.groups(K)[1], dtype=torch.float8_e4m3fn, device=device),
                "global_scale": torch.empty(1, dtype=torch.float32, device=device)}

    def block_scales(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        # (the global scale is (1,) for a layer, one per row where rows of several tensors are stacked: experts)
        return t["scale"].float() / t["global_scale"].float().reshape(-1, 1)


@register_format
@dataclass(frozen=True)
class MXFP8Format(WeightFormat):
    """OCP MX v1.0 MXFP8 (E4M3 elements): float8 e4m3fn values with an E8M0 scale per 32 values (``scale``: uint8
    biased exponents); 8.25 bits a value. Decoded to the layer's dtype for the matmul (no CPU kernel reads it)."""

    name: ClassVar[str] = "mxfp8"
    group_size: ClassVar[int] = MX_BLOCK

    def validate(self) -> None:
        pass

    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        rows, K = w.shape
        values, scale = mx_quantize(padded_groups(w.float(), MX_BLOCK), "e4m3")
        return {"qweight": values.reshape(rows, -1)[:, :K].contiguous(), "scale": scale.reshape(rows, -1)}

    def empty(self, shape: tuple[int, int], device=None) -> dict[str, torch.Tensor]:
        rows, K = shape
        return {"qweight": torch.empty(rows, K, dtype=torch.float8_e4m3fn, device=device),
                "scale": torch.empty(rows, self.groups(K)[1], dtype=torch.uint8, device=device)}

    def decode(self, t: dict[str, torch.Tensor], K: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows = t["qweight"].shape[0]
        values = padded_groups(t["qweight"].float(), MX_BLOCK).reshape(rows, -1, MX_BLOCK)
        w = (values * e8m0_to_float(t["scale"]).unsqueeze(-1)).reshape(rows, -1)[:, :K]
        return w.to(dtype)


def _format(fmt) -> WeightFormat:
    if not isinstance(fmt, WeightFormat):
        known = sorted(c.__name__ for c in FORMATS.values())
        raise TypeError(f"unknown weight format {fmt!r} (expected one of {known})")
    return fmt


def check_finite(name: str, w: torch.Tensor) -> None:
    if not torch.isfinite(w).all():
        bad = int((~torch.isfinite(w)).sum())
        raise ValueError(f"weight of {name!r} contains {bad} NaN/Inf value(s); refusing to quantize it")


def groups(fmt: WeightFormat, K: int) -> tuple[int, int]:
    """(values per group g, groups per row G = ceil(K / g)) of a K-wide row in ``fmt``."""
    return _format(fmt).groups(K)


def short_group_note(fmt: WeightFormat, K: int) -> str | None:
    """A sentence for a layer whose rows end in a short group (None when ``group_size`` divides K)."""
    g, G = groups(fmt, K)
    if K % g == 0:
        return None
    if G == 1:
        return f"input size {K} is smaller than group_size {g}: one group per row (per channel)"
    return (f"group_size {g} does not divide the input size {K}: the last group of each row holds {K % g} values "
            f"({G} groups, the last one zero-padded)")


def int_qparams(w: torch.Tensor, fmt: IntFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16-representable scale and unsigned zero point, each ``(rows, K // g)``."""
    rows, K = w.shape
    g, G = fmt.groups(K)
    wg = padded_groups(w.float(), g)                                        # (rows * G, g)
    scale, zp = choose_qparams(wg, fmt.bits, fmt.symmetric, signed=True)
    scale = fp16_scale(scale)
    qmin, _ = qrange(fmt.bits, True)
    return scale.reshape(rows, G), (zp - qmin).reshape(rows, G)


def int_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: IntFormat) -> torch.Tensor:
    """Unsigned codes ``(rows, K)`` of ``w`` for given per-group scale / zero (used by RTN and GPTQ)."""
    rows, K = w.shape
    g, _ = fmt.groups(K)                                              # (the last group may be short)
    u = quantize(padded_groups(w.float(), g), scale.reshape(-1, 1), zero.reshape(-1, 1), 0, (1 << fmt.bits) - 1,
                 torch.uint8)
    return u.reshape(rows, -1)[:, :K]


def pack_int(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: IntFormat) -> dict[str, torch.Tensor]:
    out = {"qweight": packing.pack(codes, fmt.slot_bits), "scale": scale.to(torch.float16)}
    if not fmt.symmetric:
        out["zero"] = zero.to(torch.float16 if fmt.float_zero else torch.uint8)
    return out


def encode(w: torch.Tensor, fmt: WeightFormat) -> dict[str, torch.Tensor]:
    """Round-to-nearest encoding of a 2-D weight in ``fmt``."""
    fmt = _format(fmt)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    return fmt.encode(w)


def empty(shape: tuple[int, int], fmt: WeightFormat, device=None) -> dict[str, torch.Tensor]:
    """Correctly shaped and typed, uninitialised tensors of ``fmt`` (what `wb.load` fills)."""
    return _format(fmt).empty(shape, device)


def decode(t: dict[str, torch.Tensor], fmt: WeightFormat, K: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize the rows held in ``t`` (all rows, or a gathered subset for embeddings) to ``(rows, K)``."""
    return _format(fmt).decode(t, K, dtype)


def validate(fmt: WeightFormat) -> None:
    _format(fmt).validate()
