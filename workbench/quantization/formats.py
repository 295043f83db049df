"""Weight storage formats: how a float weight matrix becomes the bytes a quantized module keeps.

A format encodes a 2-D weight ``(rows, K)`` (Linear: ``(out, in)``; Embedding: ``(num, dim)``; Conv:
``(out, in * kh * kw)``) into named tensors, and decodes them back. Groups run along K.

| format | tensors | bytes per value |
|---|---|---|
| `IntFormat(bits, group_size, symmetric, float_zero)` | ``qweight`` uint8 packed codes, ``scale`` fp16 per group, ``zero`` per group (asymmetric only: uint8 code, or fp16 for HQQ) | bits/8 + 2/g (+1/g or 2/g) |
| `NF4Format(group_size)` | ``qweight`` uint8, two codes per byte; ``scale`` fp16 absmax per group | 0.5 + 2/g |
| `FP8Format(dtype)` | ``qweight`` float8; ``scale`` fp32 per row | 1 + 4/K |

Integer codes are stored unsigned (``u = q - qmin``), with the zero point in the same unsigned space;
3-bit codes sit in 4-bit slots (there is no byte-aligned 3-bit layout), so they cost 4 bits. Scales are
rounded to fp16 *before* the codes are computed, so stored scales and codes are consistent.

When ``group_size`` does not divide K, the last group of each row is short (``K % group_size`` values):
scales and zero points are ``(rows, ceil(K / g))`` and the codes are still exactly K per row. The short
group is quantized as if zero-padded to ``g`` values, which changes nothing (every range includes 0), so
this is the same as a padded last group without storing the padding. `short_group_note` says so in words.
"""  # noqa: E501 - the table rows above are one line each (markdown)
from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.quantization import packing
from workbench.quantization.primitives import (
    FLOAT8_DTYPES,
    PerChannel,
    choose_qparams,
    float8_quantize,
    nf4_codebook,
    qrange,
    quantize,
)

__all__ = ["IntFormat", "NF4Format", "FP8Format", "WeightFormat", "encode", "decode", "empty",
           "validate", "check_finite", "int_qparams", "int_codes", "pack_int", "groups", "short_group_note"]


@dataclass(frozen=True)
class IntFormat:
    bits: int = 4
    group_size: int | None = 64  # None: one group per row (per-channel)
    symmetric: bool = True
    float_zero: bool = False     # HQQ: a real-valued (fp16) zero point per group instead of an integer code

    @property
    def slot_bits(self) -> int:
        return 4 if self.bits == 3 else self.bits


@dataclass(frozen=True)
class NF4Format:
    group_size: int | None = 64  # None: one absmax scale per row


@dataclass(frozen=True)
class FP8Format:
    dtype: torch.dtype = torch.float8_e4m3fn


WeightFormat = IntFormat | NF4Format | FP8Format


def check_finite(name: str, w: torch.Tensor) -> None:
    if not torch.isfinite(w).all():
        bad = int((~torch.isfinite(w)).sum())
        raise ValueError(f"weight of {name!r} contains {bad} NaN/Inf value(s); refusing to quantize it")


def groups(fmt, K: int) -> tuple[int, int]:
    """(values per group g, groups per row G = ceil(K / g)) of a K-wide row in ``fmt``."""
    g = K if getattr(fmt, "group_size", None) is None else fmt.group_size
    return g, -(-K // g)


def short_group_note(fmt, K: int) -> str | None:
    """A sentence for a layer whose rows end in a short group (None when ``group_size`` divides K)."""
    g, G = groups(fmt, K)
    if K % g == 0:
        return None
    if G == 1:
        return f"input size {K} is smaller than group_size {g}: one group per row (per channel)"
    return (f"group_size {g} does not divide the input size {K}: the last group of each row holds {K % g} values "
            f"({G} groups, the last one zero-padded)")


def _padded(w: torch.Tensor, g: int) -> torch.Tensor:
    """``(rows, K)`` -> ``(rows * G, g)``, zero-padding the short last group of each row."""
    rows, K = w.shape
    if K % g:
        w = torch.nn.functional.pad(w, (0, g - K % g))
    return w.reshape(-1, g)


def int_qparams(w: torch.Tensor, fmt: IntFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16-representable scale and unsigned zero point, each ``(rows, K // g)``."""
    rows, K = w.shape
    g, G = groups(fmt, K)
    wg = _padded(w.float(), g)                                        # (rows * G, g)
    scale, zp = choose_qparams(wg, fmt.bits, fmt.symmetric, signed=True)
    scale = scale.to(torch.float16).float().clamp(min=torch.finfo(torch.float16).tiny)
    qmin, _ = qrange(fmt.bits, True)
    return scale.reshape(rows, G), (zp - qmin).reshape(rows, G)


def int_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: IntFormat) -> torch.Tensor:
    """Unsigned codes ``(rows, K)`` of ``w`` for given per-group scale / zero (used by RTN and GPTQ)."""
    rows, K = w.shape
    g, _ = groups(fmt, K)                                             # (the last group may be short)
    u = quantize(_padded(w.float(), g), scale.reshape(-1, 1), zero.reshape(-1, 1), 0, (1 << fmt.bits) - 1,
                 torch.uint8)
    return u.reshape(rows, -1)[:, :K]


def pack_int(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: IntFormat) -> dict[str, torch.Tensor]:
    out = {"qweight": packing.pack(codes, fmt.slot_bits), "scale": scale.to(torch.float16)}
    if not fmt.symmetric:
        out["zero"] = zero.to(torch.float16 if fmt.float_zero else torch.uint8)
    return out


def encode(w: torch.Tensor, fmt: WeightFormat) -> dict[str, torch.Tensor]:
    """Round-to-nearest encoding of a 2-D weight."""
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    if isinstance(fmt, IntFormat):
        scale, zero = int_qparams(w, fmt)
        return pack_int(int_codes(w, scale, zero, fmt), scale, zero, fmt)
    if isinstance(fmt, NF4Format):
        rows, K = w.shape
        g, G = groups(fmt, K)
        wg = _padded(w.float(), g)                                                  # (rows * G, g)
        scale = wg.abs().amax(dim=1, keepdim=True).to(torch.float16).float().clamp(min=torch.finfo(torch.float16).tiny)
        book = nf4_codebook().to(w.device)
        codes = ((wg / scale).unsqueeze(-1) - book).abs().argmin(dim=-1).to(torch.uint8)   # (rows * G, g)
        return {"qweight": packing.pack(codes.reshape(rows, -1)[:, :K], 4), "scale": scale.reshape(rows, G).half()}
    if isinstance(fmt, FP8Format):
        q, scale = float8_quantize(w, PerChannel(0), fmt.dtype)
        return {"qweight": q, "scale": scale}
    raise TypeError(f"unknown weight format {fmt!r}")


def empty(shape: tuple[int, int], fmt: WeightFormat, device=None) -> dict[str, torch.Tensor]:
    """Correctly shaped and typed, uninitialised tensors of ``fmt`` (what `wb.load` fills)."""
    rows, K = shape
    if isinstance(fmt, IntFormat):
        _, G = groups(fmt, K)
        out = {"qweight": torch.empty(packing.packed_shape((rows, K), fmt.slot_bits), dtype=torch.uint8, device=device),
               "scale": torch.empty(rows, G, dtype=torch.float16, device=device)}
        if not fmt.symmetric:
            out["zero"] = torch.empty(rows, G, dtype=torch.float16 if fmt.float_zero else torch.uint8, device=device)
        return out
    if isinstance(fmt, NF4Format):
        _, G = groups(fmt, K)
        return {"qweight": torch.empty(packing.packed_shape((rows, K), 4), dtype=torch.uint8, device=device),
                "scale": torch.empty(rows, G, dtype=torch.float16, device=device)}
    if isinstance(fmt, FP8Format):
        return {"qweight": torch.empty(rows, K, dtype=fmt.dtype, device=device),
                "scale": torch.empty(rows, 1, dtype=torch.float32, device=device)}
    raise TypeError(f"unknown weight format {fmt!r}")


def decode(t: dict[str, torch.Tensor], fmt: WeightFormat, K: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize the rows held in ``t`` (all rows, or a gathered subset for embeddings) to ``(rows, K)``."""
    q = t["qweight"]
    rows = q.shape[0]
    if isinstance(fmt, IntFormat):
        scale = t["scale"].float()                                                 # (rows, G)
        g, G = groups(fmt, K)
        codes = _unpack_padded(q, fmt.slot_bits, K, G * g)                         # (rows, G * g) uint8
        zero = t["zero"].float() if "zero" in t else torch.full_like(scale, float(1 << (fmt.bits - 1)))
        w = (codes.reshape(rows, G, g).float() - zero.unsqueeze(-1)) * scale.unsqueeze(-1)
        return w.reshape(rows, G * g)[:, :K].to(dtype)
    if isinstance(fmt, NF4Format):
        scale = t["scale"].float()
        g, G = groups(fmt, K)
        codes = _unpack_padded(q, 4, K, G * g)
        w = nf4_codebook().to(q.device)[codes.long()].reshape(rows, G, g) * scale.unsqueeze(-1)
        return w.reshape(rows, G * g)[:, :K].to(dtype)
    if isinstance(fmt, FP8Format):
        return (q.float() * t["scale"]).to(dtype)
    raise TypeError(f"unknown weight format {fmt!r}")


def _unpack_padded(q: torch.Tensor, bits: int, K: int, width: int) -> torch.Tensor:
    """K codes per row, padded with zeros to ``width`` (a whole number of groups); no copy when K == width."""
    codes = packing.unpack(q, bits, K)
    return codes if width == K else torch.nn.functional.pad(codes, (0, width - K))


def validate(fmt: WeightFormat) -> None:
    if isinstance(fmt, IntFormat):
        if fmt.bits not in (2, 3, 4, 8):
            raise ValueError(f"weight-only integer quantization supports 2, 3, 4 and 8 bits, got {fmt.bits!r}")
        if fmt.group_size is not None and (not isinstance(fmt.group_size, int) or fmt.group_size < 1):
            raise ValueError(f"group_size must be a positive int or None (per-channel), got {fmt.group_size!r}")
        if fmt.float_zero and fmt.symmetric:
            raise ValueError("a float zero point needs asymmetric quantization (symmetric=False)")
    elif isinstance(fmt, NF4Format):
        if fmt.group_size is not None and (not isinstance(fmt.group_size, int) or fmt.group_size < 1):
            raise ValueError(f"group_size must be a positive int or None (per channel), got {fmt.group_size!r}")
    elif isinstance(fmt, FP8Format):
        if fmt.dtype not in FLOAT8_DTYPES:
            raise ValueError(f"fp8 dtype must be one of {FLOAT8_DTYPES}, got {fmt.dtype!r}")

