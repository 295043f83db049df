"""Bit-packing of low-bit codes into uint8, table-driven (bits -> values per byte).

Codes are unsigned ``0 .. 2^bits - 1`` (signed codes are offset by ``2^(bits-1)`` by the caller) and are
packed along the last dimension, lowest bits first: byte ``j`` of a row holds values
``j*k .. j*k + k - 1`` with ``k = 8 // bits``. A last dimension that is not a multiple of ``k`` is padded
with zero codes (e.g. a 3x3 conv with one input channel has 9 values per row); `unpack` takes the true
``length`` to drop them. ``unpack(pack(q), bits, q.shape[-1]) == q`` exactly (the round-trip tests).
"""
from __future__ import annotations

import torch

__all__ = ["PACKABLE_BITS", "values_per_byte", "pack", "unpack", "packed_shape"]

# bits -> values per byte: a new width is a new row (3-bit codes would need a non-byte-aligned layout)
PACKABLE_BITS = {2: 4, 4: 2, 8: 1}


def values_per_byte(bits: int) -> int:
    try:
        return PACKABLE_BITS[bits]
    except KeyError:
        raise ValueError(f"packing supports {sorted(PACKABLE_BITS)} bits, got {bits!r}") from None


def packed_shape(shape: tuple[int, ...], bits: int) -> tuple[int, ...]:
    k = values_per_byte(bits)
    return (*shape[:-1], -(-shape[-1] // k))


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit codes (any integer dtype, values in range) into uint8 along the last dim."""
    k = values_per_byte(bits)
    if codes.is_floating_point():
        raise TypeError(f"pack expects integer codes, got {codes.dtype}")
    if k == 1:
        return codes.to(torch.uint8)
    c = codes.to(torch.uint8)
    if c.shape[-1] % k:
        c = torch.nn.functional.pad(c, (0, k - c.shape[-1] % k))
    c = c.reshape(*c.shape[:-1], -1, k)                               # (..., ceil(n/k), k)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (c << shifts).sum(dim=-1, dtype=torch.uint8)               # disjoint bits: sum == bitwise or


def unpack(packed: torch.Tensor, bits: int, length: int | None = None) -> torch.Tensor:
    """Inverse of `pack`: uint8 codes, the last dimension ``length`` (default: ``k`` times the packed one)."""
    k = values_per_byte(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack expects uint8, got {packed.dtype}")
    if k == 1:
        return packed if length is None else packed[..., :length]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    c = (packed.unsqueeze(-1) >> shifts) & mask                        # (..., n/k, k)
    c = c.reshape(*packed.shape[:-1], -1)
    return c if length is None or length == c.shape[-1] else c[..., :length]
