"""Lesson 50's exercises: worked solutions (``_solution_*``), their checks (``check_*``) and what only they use."""
from __future__ import annotations

import functools

import torch

from workbench.teach import Feedback, check

__all__ = ["intensity", "int4_layer", "check_int4_pack", "check_int4_linear", "check_bound"]


def intensity(M: int, K: int, N: int, weight_bytes_per_value: float, act_bytes: int = 4) -> float:
    """FLOPs per byte of ``y (M, N) = x (M, K) @ W^T``: 2MKN over weight + input + output bytes."""
    return 2.0 * M * K * N / (K * N * weight_bytes_per_value + act_bytes * (M * K + M * N))


def _solution_int4_pack(codes):
    low, high = codes[:, 0::2], codes[:, 1::2]                  # code 2j -> low nibble, code 2j+1 -> high nibble
    return (low | (high << 4)).to(torch.uint8)


def _solution_int4_linear(x, stored, group_size):
    q = stored["qweight"]                                                     # (N, K / 2) uint8
    codes = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(q.shape[0], -1)    # code 2j: low nibble, 2j+1: high
    scale = stored["scale"].float().repeat_interleave(group_size, dim=1)      # each group's scale on its 64 inputs
    weight = (codes.float() - 8) * scale                                      # zero point 8: code 8 is 0.0
    return x @ weight.T


def _solution_bound(M, K, N, weight_bytes, act_bytes, bandwidth, peak):
    intensity = 2 * M * K * N / (K * N * weight_bytes + act_bytes * (M * K + M * N))
    return "memory" if intensity < peak / bandwidth else "compute"     # below the ridge point: memory-bound


def check_int4_pack(answer, codes: torch.Tensor) -> Feedback:
    """Exercise: unsigned 4-bit ``codes`` (rows of an even length) packed two per byte in the package's layout
    (`workbench.quantization.packing`): byte j of a row holds code 2j in its low nibble, code 2j+1 in its high."""
    from workbench.quantization.packing import pack

    expected = pack(codes, 4)
    name = "int4 packing"
    hint = "low nibble = the even-indexed code, high nibble = the odd one shifted left by 4; the result is uint8"
    if isinstance(answer, torch.Tensor) and answer.shape == expected.shape and answer.dtype != torch.uint8:
        return check(name, answer, expected, hint=f"packed bytes are uint8, found {answer.dtype}: convert with "
                                                  f".to(torch.uint8) (the values may be right)",
                     solution=functools.partial(_solution_int4_pack, codes))
    c = codes.to(torch.uint8)
    mistakes = [((c[..., 0::2] << 4) | c[..., 1::2], "the nibbles are swapped: the even-indexed code goes in the "
                                                     "low 4 bits"),
                (c[..., 0::2] + c[..., 1::2], "adding the codes loses which is which: shift one of them by 4 bits")]
    return check(name, answer, expected, hint=hint, rtol=0, atol=0, mistakes=mistakes,
                 solution=functools.partial(_solution_int4_pack, codes))


def int4_layer(out_features: int = 1536, in_features: int = 384, group_size: int = 64, seed: int = 0):
    """A Linear weight ``(out, in)`` (random, of MiniLM's FFN shape by default) as an int4 weight-only layer stores
    it: `formats.encode` with `IntFormat(4, group_size)` - packed codes ``qweight`` (uint8, two per byte) and one
    fp16 ``scale`` per group of ``group_size`` inputs of a row."""
    from workbench.quantization import formats

    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    return formats.encode(w, formats.IntFormat(4, group_size))


def check_int4_linear(answer, x: torch.Tensor, stored: dict, group_size: int) -> Feedback:
    """Exercise: the reference int4 weight-only path by hand - unpack the codes (two per byte, low nibble first),
    subtract the symmetric zero point 8, multiply by each group's scale, and compute ``x @ W.T`` in fp32
    (expected: ``x @ formats.decode(stored, IntFormat(4, group_size), K).T``)."""
    from workbench.quantization import formats

    q = stored["qweight"]
    K = q.shape[1] * 2
    fmt = formats.IntFormat(4, group_size)
    xf = x.detach().float()
    expected = xf @ formats.decode(stored, fmt, K).T
    solution = functools.partial(_solution_int4_linear, x, stored, group_size)
    low, high = (q & 0xF).long(), (q >> 4).long()
    in_order = torch.stack([low, high], dim=-1).reshape(q.shape[0], -1)
    swapped = torch.stack([high, low], dim=-1).reshape(q.shape[0], -1)
    scale = stored["scale"].float()
    per_group = scale.repeat_interleave(group_size, dim=1)
    tiled = scale.repeat(1, group_size)

    def y(codes, s=per_group, zero=8):
        return xf @ ((codes.float() - zero) * s).T

    mistakes = [
        (y(swapped), "the nibbles are swapped: code 2j is in the *low* 4 bits of byte j, code 2j+1 in the high ones"),
        (y(in_order, zero=0), "the codes are unsigned, 0 ... 15, with the symmetric grid's zero point 8: subtract it "
                              "before scaling"),
        (y(torch.where(in_order >= 8, in_order - 16, in_order), zero=0),
         "the codes are not two's complement: the format stores code - 8 offset by 8 (code 8 is 0.0, code 0 is -8)"),
        (y(in_order, s=tiled), f"scale column g belongs to inputs g*{group_size} ... (g+1)*{group_size} - 1: "
                               f"repeat each scale {group_size} times in place (repeat_interleave), not the row of "
                               f"scales {group_size} times over"),
        (y(in_order, s=torch.ones_like(per_group)), "the codes must be multiplied by their group's scale"),
    ]
    hint = (f"three steps: the codes in order from the bytes, their values on the grid (zero point, the scale of "
            f"each group of {group_size} inputs), then x times the weight's transpose")
    if isinstance(answer, torch.Tensor) and answer.shape == (expected.shape[1], expected.shape[0]):
        hint = "y has one row per row of x: x @ W.T, (M, K) x (K, N)"
    return check("int4 g64 weight-only matmul by hand", answer, expected, hint=hint, rtol=1e-4, atol=1e-4,
                 mistakes=mistakes, solution=solution)


def check_bound(answer, M: int, K: int, N: int, weight_bytes_per_value: float, bandwidth_GBs: float,
                peak_GFLOPs: float, act_bytes: int = 4) -> Feedback:
    """``answer``: "memory" or "compute" - which roof limits this layer on this machine."""
    I = intensity(M, K, N, weight_bytes_per_value, act_bytes)  # noqa: E741 - intensity, as in the roofline formula
    ridge = peak_GFLOPs / bandwidth_GBs
    expected = "memory" if I < ridge else "compute"
    other = "compute" if expected == "memory" else "memory"
    why = (f"the intensity here is {I:.3g} FLOP/B, {'below' if I < ridge else 'above'} this machine's ridge point "
           f"{ridge:.3g} FLOP/B (peak / bandwidth): the {expected} roof is the lower one")
    return check(f"bound at M={M}", answer, expected, mistakes=[(other, why)],
                 hint=f"compare the intensity {I:.3g} FLOP/B with the ridge point peak / bandwidth = {ridge:.3g} "
                      f"FLOP/B: below it the memory roof is the lower one",
                 solution=functools.partial(_solution_bound, M, K, N, weight_bytes_per_value, act_bytes,
                                            bandwidth_GBs, peak_GFLOPs))
