"""Lab 60's exercises: worked solutions (``_solution_*``), their checks (``check_*``) and what only they use."""
from __future__ import annotations

import functools

import torch

from workbench.quantization import formats as fm
from workbench.quantization import kvcache, packing
from workbench.quantization.primitives import PerChannel, PerTensor, PerToken, fake_quantize, nf4_codebook
from workbench.teach import Feedback, check
from workbench.teach.llm.figures import weight_bytes

__all__ = ["check_weight_bytes", "check_roofline_bound", "check_per_token", "check_per_channel", "check_group_scales",
           "check_int4_pack", "check_nf4", "check_kv_quantizer", "check_kv_bytes"]


# --- exercises: worked solutions and checks -----------------------------------------------------------------

def _rounding_ties(answer, expected: torch.Tensor, x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``expected`` with ``answer``'s values where the two differ by one grid step at a value ``x`` that sits on a
    half step (within 1e-3 of one): x / s and x * (1 / s), the package's form, may round such a value either way."""
    if not isinstance(answer, torch.Tensor) or answer.shape != expected.shape:
        return expected
    a, e = answer.detach().double(), expected.double()
    step = step.double().expand_as(e)
    off = ~torch.isclose(a, e, rtol=1e-5, atol=1e-6)
    if not bool(off.any()):
        return expected
    r = (x.double() / step).abs()
    tie = ((r - r.floor()) - 0.5).abs() < 1e-3
    one_step = ((a - e).abs() - step).abs() <= 1e-4 * step + 1e-9
    return torch.where(off, a, e).to(expected.dtype) if bool((one_step & tie)[off].all()) else expected


def _solution_weight_bytes(shapes, bits, group_size):
    answer = 0
    for n, k in shapes.values():
        groups = -(-k // group_size)                                # ceil(k / group_size): a partial group counts
        answer += n * k * bits // 8 + n * groups * 2                # the codes + one fp16 scale per group
    return answer


def check_weight_bytes(answer, shapes, bits: int = 4, group_size: int = 64) -> Feedback:
    """Exercise: bytes of all Linear weights in int``bits`` with an fp16 scale per ``group_size`` (symmetric)."""
    expected = weight_bytes(shapes, fm.IntFormat(bits, group_size))
    codes = sum(n * k for n, k in shapes.values()) * bits / 8
    return check("weight bytes per decoded token", answer, expected, rtol=1e-9, atol=0.5,
                 hint=f"codes: {bits}/8 byte per weight; scales: one fp16 (2 bytes) per group of {group_size} "
                      f"weights of a row",
                 mistakes=[(codes, "that is the codes alone: every group also stores a 2-byte fp16 scale"),
                           (codes * 8, "that counts bits, not bytes"),
                           (sum(n * k for n, k in shapes.values()) * 4,
                            "that is the fp32 model: 4 bytes per weight")],
                 solution=functools.partial(_solution_weight_bytes, shapes, bits, group_size))


def _solution_roofline(bandwidth, w4_bytes, kv_bytes):
    return bandwidth / (w4_bytes + kv_bytes)


def check_roofline_bound(answer, bandwidth: float, weight_bytes: float, kv_bytes: float) -> Feedback:
    """Exercise: the most tokens/s a memory-bound decoder can reach: bandwidth / bytes read per token."""
    expected = bandwidth / (weight_bytes + kv_bytes)
    return check("roofline tokens/s bound", answer, expected, rtol=1e-6,
                 hint="each decoded token reads every weight once and the whole KV cache: time >= bytes / bandwidth",
                 mistakes=[(bandwidth / weight_bytes, "the KV cache is read on every step too: add its bytes"),
                           ((weight_bytes + kv_bytes) / bandwidth, "that is seconds per token; invert it")],
                 solution=functools.partial(_solution_roofline, bandwidth, weight_bytes, kv_bytes))


def _solution_per_token(X):
    scale = X.abs().amax(dim=1, keepdim=True) / 127.5
    answer = torch.clamp(torch.round(X * (1 / scale)), -128, 127) * scale
    return answer


def check_per_token(answer, X: torch.Tensor) -> Feedback:
    """Exercise: int8 symmetric fake-quantization of ``X`` ``(tokens, K)`` with one scale per token (row)."""
    X = X.float()
    expected = _rounding_ties(answer, fake_quantize(X, 8, PerToken()), X, X.abs().amax(1, keepdim=True) / 127.5)
    wrong_127 = torch.clamp(torch.round(X / (X.abs().amax(1, keepdim=True) / 127)), -128, 127) * (
        X.abs().amax(1, keepdim=True) / 127)
    return check("per-token int8 activations", answer, expected, rtol=1e-5, atol=1e-6,
                 hint="one scale per row: max |x| over the row (dim=1), mapped to the edge of the package's int8 grid",
                 mistakes=[(fake_quantize(X, 8, PerTensor()), "that is one scale for the whole tensor; take the "
                                                               "max over each token (row, dim=1)"),
                           (fake_quantize(X, 8, PerChannel(1)), "that is one scale per channel (column); per token "
                                                                "is per row"),
                           (wrong_127, "the package's symmetric grid has half-width 255/2 = 127.5 steps, not 127")],
                 solution=functools.partial(_solution_per_token, X))


def _solution_per_channel(X):
    scale = X.abs().amax(dim=0, keepdim=True) / 127.5
    answer = torch.clamp(torch.round(X * (1 / scale)), -128, 127) * scale
    return answer


def check_per_channel(answer, X: torch.Tensor) -> Feedback:
    """Exercise: the same with one scale per input channel (column) of ``X``."""
    X = X.float()
    expected = _rounding_ties(answer, fake_quantize(X, 8, PerChannel(1)), X,
                              X.abs().amax(0, keepdim=True) / 127.5)
    return check("per-channel int8 activations", answer, expected, rtol=1e-5, atol=1e-6,
                 hint="one scale per column: max |x| over the tokens (dim=0)",
                 mistakes=[(fake_quantize(X, 8, PerToken()), "that is per token (rows); take the max over dim=0"),
                           (fake_quantize(X, 8, PerTensor()), "that is one scale for the whole tensor")],
                 solution=functools.partial(_solution_per_channel, X))


def _solution_group_scales(W, group_size):
    groups = W.reshape(W.shape[0], -1, group_size)                  # (N, K / g, g)
    answer = groups.abs().amax(dim=2) / 7.5
    return answer


def check_group_scales(answer, W: torch.Tensor, group_size: int = 64) -> Feedback:
    """Exercise: symmetric int4 scales ``(N, K / group_size)``, one per group of a row (stored as fp16)."""
    W = W.detach().float()
    fmt = fm.IntFormat(4, group_size)
    expected = fm.int_qparams(W, fmt)[0]
    g = W.reshape(W.shape[0], -1, group_size).abs().amax(2)
    return check("int4 group scales", answer, expected, rtol=2e-3, atol=1e-7,
                 hint="max |w| of each group of a row, over the int4 grid's half-width (16 levels: 15/2 steps)",
                 mistakes=[(g / 7, "the package's symmetric int4 grid has half-width 15/2 = 7.5 steps, not 7"),
                           (g / 8, "the half-width is (qmax - qmin) / 2 = 7.5 steps, not 8"),
                           (W.abs().amax(1, keepdim=True).expand_as(g) / 7.5,
                            "that is one scale per row; take the max within each group of the row")],
                 solution=functools.partial(_solution_group_scales, W, group_size))


def _solution_int4_pack(codes):
    pairs = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2)    # (N, K / 2, 2)
    answer = pairs[..., 0] | (pairs[..., 1] << 4)
    return answer


def check_int4_pack(answer, codes: torch.Tensor) -> Feedback:
    """Exercise: pack unsigned 4-bit codes ``(N, K)`` two per byte, the even column in the low nibble."""
    expected = packing.pack(codes, 4)
    c = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2)
    return check("int4 packing", answer, expected, rtol=0, atol=0,
                 hint="byte j of a row holds codes 2j (low 4 bits) and 2j+1 (high 4 bits)",
                 mistakes=[((c[..., 0] << 4) | c[..., 1], "the nibbles are swapped: the even column goes in the "
                                                         "low 4 bits"),
                           (codes, "that is the codes unpacked: two of them must share each byte")],
                 solution=functools.partial(_solution_int4_pack, codes))


def _solution_nf4(W, group_size, book):
    groups = W.reshape(-1, group_size)                              # (N * K / g, g)
    scale = groups.abs().amax(dim=1, keepdim=True).half().float()
    codes = (groups / scale).unsqueeze(-1).sub(book).abs().argmin(dim=-1)
    answer = (book[codes] * scale).reshape(W.shape)
    return answer


def check_nf4(answer, W: torch.Tensor, group_size: int = 64) -> Feedback:
    """Exercise: NF4 round trip of ``W`` ``(N, K)``: each value to the nearest codebook entry of w / absmax of its
    group (fp16 scale), back to floats."""
    W = W.detach().float()
    fmt = fm.NF4Format(group_size)
    expected = fm.decode(fm.encode(W, fmt), fmt, W.shape[1])
    int4 = fm.IntFormat(4, group_size)
    return check("NF4 quantizer", answer, expected, rtol=1e-5, atol=1e-7,
                 hint="normalise each group by its max |w| (rounded to fp16), pick the nearest of the 16 codebook "
                      "values (argmin of the distance), multiply back",
                 mistakes=[(fm.decode(fm.encode(W, int4), int4, W.shape[1]),
                            "that is the uniform int4 grid; NF4 uses the 16 normal-quantile values of nf4_codebook()")],
                 solution=functools.partial(_solution_nf4, W, group_size, nf4_codebook()))


def _solution_kv_int8(k):
    scale = k.abs().amax(dim=-1, keepdim=True) / 127.5
    answer = torch.clamp(torch.round(k / scale), -128, 127) * scale
    return answer


def check_kv_quantizer(answer, k: torch.Tensor) -> Feedback:
    """Exercise: int8 per-token fake-quantization of a key tensor ``(B, kv_heads, T, head_dim)``."""
    expected = _rounding_ties(answer, kvcache.fake_quantize(k.float(), kvcache.KVCacheFormat(torch.int8, "token")),
                              k.float(), k.float().abs().amax(-1, keepdim=True) / 127.5)
    return check("KV-cache int8 quantizer", answer, expected, rtol=1e-5, atol=1e-6,
                 hint="one scale per (batch, head, position): max |k| over head_dim (the last axis)",
                 mistakes=[(kvcache.fake_quantize(k.float(), kvcache.KVCacheFormat(torch.int8, "head")),
                            "that is one scale per head over all positions; per token takes the max over head_dim "
                            "only (dim=-1)"),
                           (kvcache.fake_quantize(k.float(), kvcache.KVCacheFormat(torch.int8, "channel")),
                            "that is one scale per channel (over positions, dim=2); per token is dim=-1")],
                 solution=functools.partial(_solution_kv_int8, k))


def _solution_kv_bytes(config, bytes_per_value):
    head_dim = config.hidden_size // config.num_attention_heads
    answer = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * bytes_per_value
    return answer


def check_kv_bytes(answer, config, bytes_per_value: int = 2) -> Feedback:
    """Exercise: KV-cache bytes per token of context (all layers, keys and values, batch 1)."""
    expected = kvcache.bytes_per_position(config, None, bytes_per_value)
    head_dim = config.hidden_size // config.num_attention_heads
    mha = 2 * config.num_hidden_layers * config.num_attention_heads * head_dim * bytes_per_value
    return check("KV bytes per token", answer, expected, rtol=1e-9, atol=0.5,
                 hint="keys and values, every layer, every key/value head, head_dim values each",
                 mistakes=[(mha, "grouped-query attention: the cache holds num_key_value_heads heads, not "
                                 "num_attention_heads"),
                           (expected / 2, "the cache holds keys and values: count both")],
                 solution=functools.partial(_solution_kv_bytes, config, bytes_per_value))
