"""Low-bit weights times activations rounded to int8, on the CPU's integer dot-product instructions - the numerics
of llama.cpp's Q4_0 / Q8_0 decode, offered as ``WeightOnly(kernel="cpu-int8")``.

The math (``round_activations`` and `reference` compute it in PyTorch)::

    d_b   = max_{k in b} |x[m, k]| / 127                      each block b of 32 consecutive inputs of a row of x
    q[k]  = round(x[m, k] * 127 / max_{k in b} |x[m, k]|)     to nearest, ties to even; |q| <= 127 (0 when x = 0)
    y[m, n] = sum_k d_b(k) q[k] * w[n, k] + bias[n]           w[n, k] = (u[n, k] - z[n, g]) * s[n, g]

that is, the stored weight's own values (`workbench.quantization.formats.IntFormat.decode`) times x rounded to int8
per block of 32 - llama.cpp's Q8_0 rounding of the activations (it rounds half away from zero, this kernel to even).
The sums of u * q are exact in int32; each lane's sum (four codes of one block) is scaled by d_b * s[n, g] and
accumulated in fp32, and the zero points enter once per group (sum_g s z sum_{b in g} d_b sum_b q), so the result
equals the product of the dequantized weight with the rounded x up to fp32 summation order (tests: within 2e-6 of
the norm). The rounding itself is what costs accuracy: relative to the exact (fp32-activation) product, a block's
error is at most d_b / 2 per input - about 0.4 % of the block's largest value - the same as llama.cpp's.

Which layers: integer codes of 4 bits (int4, and int3 in its 4-bit slots) or 8 bits, groups of a multiple of 32
(or one group per row), K a multiple of 32, any zero points (symmetric, uint8 codes, HQQ's fp16 ones); scales are
read as stored (fp16: 4.5 bits a weight for int4 g32, as Q4_0). ``WeightOnlyLinear`` rounds x the same way
whatever the number of rows: calls of up to `rows_for` rows (decode, small batches: 8-32 by the weight's size)
run this kernel, longer ones (prefill, evaluation) multiply the rounded x (`round_activations_cpu`) on the exact
CPU kernel (`workbench_kernels.weight_only_cpu`), where the GEMM, not the weight's bytes, is the cost - so the
quality measured on a test set is the quality of what decodes.

Vector code chosen at run time: AVX-512 with VNNI (``vpdpbusd``: 64 codes x activations per instruction; Ice
Lake / Sapphire Rapids Xeons, Zen 4, Zen 5) over 64-byte chunks of the codes; AVX2 (``vpmaddubsw`` + ``vpmaddwd``)
over 32-byte chunks elsewhere; a scalar loop as the definition. ``WORKBENCH_CPU_ISA`` caps it as for the other
kernels (`workbench_kernels.isa`). Built by ``make install`` (``python -m workbench_kernels.build``) or on first use
with ``torch.utils.cpp_extension`` (~15 s once, cached), reported on this module's logger, never on stderr.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from workbench_kernels._common import build_extension, extension_or_raise
from workbench_kernels.numerics import dequantize_packed

__all__ = ["cpu_isa", "linear", "linear_unchecked", "load_extension", "reference", "round_activations",
           "round_activations_cpu", "rows_for", "supports", "unsupported_reason"]

SOURCE = Path(__file__).with_name("act_int8_cpu.cpp")
_NAME = "workbench_act_int8_cpu"
_OP = "act_int8_linear_cpu"
_WHAT = "CPU int8-activation kernel"
log = logging.getLogger(__name__)
ISAS = ("auto", "avx512", "avx2", "scalar")


def rows_for(N: int, K: int, bits: int) -> int:   # (no cache: three comparisons, and dynamo traces it plainly)
    """Rows of x up to which `WeightOnlyLinear` runs this kernel on an (N, K) weight of ``bits``-bit codes; above,
    the rounded x goes to the exact kernel's GEMM paths. This kernel's cost grows with every row (each row of x is
    its own dot products) while the GEMM's barely does: measured side by side (one thread, int4 / int8 g32,
    Xeon with AMX and AVX-512 VNNI) they cross near 10 rows on 512 x 512, 24-32 rows on 5632 x 2048 and
    2048 x 5632 (int4 later than int8)."""
    values = N * K
    if values < 1 << 20:
        return 8
    if values < 1 << 22:
        return 16
    return 32 if bits == 4 else 24


def unsupported_reason(bits: int, group_size: int | None, K: int) -> str | None:
    """Why a weight of integer codes in ``bits``-bit slots, groups of ``group_size`` (None: one per row) and K
    inputs cannot take this kernel, or None when it can. (Integer codes only: the caller refuses NF4.)"""
    if bits not in (4, 8):
        return f"{bits}-bit code slots (4- and 8-bit code slots only; int3 is stored in 4-bit slots)"
    if K % 32:
        return f"K = {K} is not a multiple of 32 (activations are rounded in blocks of 32)"
    if group_size is not None and group_size % 32:
        return f"group_size {group_size} is not a multiple of 32"
    return None


def supports(bits: int, group_size: int | None, K: int) -> bool:
    """Whether such a weight can take this kernel (`unsupported_reason` is None)."""
    return unsupported_reason(bits, group_size, K) is None


@functools.cache
def _build():
    """(extension module, None) or (None, the error): a failed build is not retried in this process. Compiling or
    loading is reported on this module's logger (`workbench_kernels._common.build_extension`), not on stderr."""
    return build_extension(_NAME, SOURCE, what=_WHAT, logger=log, expected_s=15,
                           extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"])


def load_extension():
    """The compiled extension; raises a RuntimeError naming what is missing when it cannot be built here."""
    return extension_or_raise(_build(), _OP, _WHAT, "kernel='reference' or 'cpu'")


def cpu_isa() -> str:
    """The vector code used on this CPU: "avx512" (AVX-512 VNNI), "avx2" or "scalar"."""
    return load_extension().cpu_isa()


def linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
           group_size: int | None, K: int, bias: torch.Tensor | None = None, *, zconst: float | None = None,
           isa: str = "auto") -> torch.Tensor:
    """``y (..., N)`` in x's dtype: x ``(..., K)`` rounded to int8 per block of 32 times the stored weight plus
    ``bias``, whatever the number of rows (`rows_for` is the module's rule, not this function's). The weight as
    `workbench.quantization.formats.IntFormat` stores it: ``qweight`` (N, K * bits / 8) uint8 codes in ``bits``-bit
    slots, ``scale`` (N, G) fp16, ``zero`` (N, G) uint8 codes or fp16 values, or None for symmetric codes, whose
    zero point is ``zconst`` (default 2^(bits-1)). Inference only: no autograd graph is recorded."""
    reason = unsupported_reason(bits, group_size, K)
    if reason is not None:
        raise ValueError(f"{_OP}: {reason}")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{_OP}: x must be a float32 / float16 / bfloat16 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim < 1 or x.shape[-1] != K or x.device.type != "cpu":
        raise ValueError(f"{_OP}: x must be a CPU tensor of shape (..., K = {K}), got {tuple(x.shape)} on {x.device}")
    if isa not in ISAS:
        raise ValueError(f"{_OP}: isa must be one of {ISAS}, got {isa!r}")
    if scale.dtype != torch.float16:
        raise ValueError(f"{_OP}: scales must be fp16 as the formats store them, got {scale.dtype}")
    if bias is not None and tuple(bias.shape) != (qweight.shape[0],):
        raise ValueError(f"{_OP}: bias must have shape ({qweight.shape[0]},), got {tuple(bias.shape)}")
    with torch.no_grad():
        return linear_unchecked(x, qweight, scale, zero, float(1 << (bits - 1)) if zconst is None else zconst, bits,
                                K if group_size is None else group_size, K, bias, isa)


def linear_unchecked(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                     zconst: float, bits: int, group: int, K: int, bias: torch.Tensor | None,
                     isa: str = "auto") -> torch.Tensor:
    """`linear` without its checks (for `WeightOnlyLinear`, whose tensors are known good)."""
    lead = x.shape[:-1]
    y = load_extension().linear(x.reshape(-1, K), qweight, scale, zero, zconst, bits, group, K, bias, isa)
    return y.reshape(*lead, y.shape[-1])


def round_activations_cpu(x: torch.Tensor) -> torch.Tensor:
    """`round_activations` by the extension (fp32, x's shape; the same numbers, faster on long inputs)."""
    return load_extension().round_activations(x)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) rounded to int8 per block of 32 and back (``d_b * q``, fp32), in PyTorch: what the kernel
    multiplies."""
    if x.shape[-1] % 32:
        raise ValueError(f"round_activations: the last dimension must be a multiple of 32, got {tuple(x.shape)}")
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # 127 / amax as one IEEE fp32 division, as the kernel computes it (a Python number divided by a tensor is
    # amax.reciprocal() * 127 in PyTorch: one rounding more, and ties such as x = amax / 2 round the other way)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv).clamp(-127, 127)
    return (q * (amax / 127.0)).reshape(*x.shape[:-1], -1)


def reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
              group_size: int | None, K: int, bias: torch.Tensor | None = None, *,
              zconst: float | None = None) -> torch.Tensor:
    """The same math in PyTorch, in fp64: the stored weight's values, (u - z) * s, times `round_activations` (x),
    plus ``bias``."""
    z = (float(1 << (bits - 1)) if zconst is None else zconst) if zero is None else zero
    w = dequantize_packed(qweight, bits, K, scale, K if group_size is None else group_size, z, dtype=torch.float64)
    y = F.linear(round_activations(x).double(), w, None if bias is None else bias.double())
    return y.to(x.dtype)
