"""Weight-only Linear on the CPU: the package's low-bit weights (int8 / int4 / int3 / int2 with any group size and
zero point, NF4) times float activations, without ever holding the float weight for decode-sized inputs.

The math (the numbers of ``WeightOnlyLinear``'s reference path, fp32)::

    w[n, k] = (u[n, k] - z[n, g]) * s[n, g]        integer formats, g = k // group_size (z = 2^(bits-1) if symmetric)
    w[n, k] = nf4[u[n, k]] * s[n, g]               NF4
    y[m, n] = sum_k x[m, k] w[n, k] + bias[n]

Four paths, picked per call by the number of rows M of x and the weight (`CpuWeight.split_rows`,
`CpuWeight.prefill_rows`, `CpuWeight.brgemm_rows`; defaults from measurements in ``docs/kernels.md``):

- **split** (fp32 x, a CPU with AMX, integer codes with integer zero points, `SPLIT_MIN_ROWS` < M <=
  `split_rows_for`: weights of ~0.5 M values and more, and smaller ones per channel or in groups of >= 64 from
  K = 128 and 32 output features): x is split into three bf16 parts, x = x1 + x2 + x3 exactly (each
  holds the next 8 bits of x's 24-bit significand), and the weight enters as its integers u - z (exact in bf16),
  so every product is exact and AMX tiles (PyTorch's oneDNN brgemm micro-kernels) accumulate in fp32; each
  group's sums are then scaled by s[n, g]. The fp32 product without an fp32 GEMM: three bf16 passes on AMX cost
  less than one fp32 GEMM on AVX-512 on large layers (docs/kernels.md, side by side: 1.05-3.0x faster than the paths
  below within its default rows, 1.07-2.3x faster than fp32 ``F.linear``). As exact as an fp32 GEMM (tests: its
  error against an fp64 product is at most 3x the fp32 reference's), in another summation order. Outside the
  range of real activations it is not: the unscaled group sums overflow fp32 from |x| ~ 1e35 (the reference's
  scaled products do not), x's third part is flushed to zero below ~1e-30 (1e-33: 2e-6 relative error instead of
  3e-7), and a non-finite x gives NaN where an fp32 GEMM may give +-inf.
- **decode** (M <= prefill_rows otherwise): output rows are split across threads; each decodes one weight row
  into an L1-resident fp32 buffer (unpack the codes, subtract the zero, scale: the reference's fp32 operations,
  in its order) and takes its dot product with every row of x (four rows of x per sweep, AVX2 FMA). The weight
  is read once, as the bytes it is stored in - the memory traffic of the compressed layer, not of the float one.
- **fp32 brgemm** (fp32 x on an AVX-512 CPU, prefill_rows < M <= `brgemm_rows_for`, where the split path does
  not run - any format): blocks of up to 64 decoded fp32 weight rows (the reference's values bit for bit) times
  x^T by oneDNN's fp32 brgemm micro-kernels, each thread multiplying the rows it decoded; on these shapes 1.1-3.6x
  faster than the decode-then-MKL path below (docs/kernels.md, one thread).
- **prefill** (more rows): the whole weight is decoded (the same per-row routine, all threads) into an fp32
  matrix and multiplied by PyTorch's fp32 GEMM. The decode is bit for bit the reference's, so this path returns
  exactly the reference's result for fp32 inputs; the decode is a pass over N x K values against the GEMM's
  M x N x K multiply-adds.

Numerics: activations are computed in fp32 whatever their dtype (bf16 / fp16 inputs are converted, the result is
converted back): on CPUs without native bf16 arithmetic (AVX2) an fp32 GEMM is several times faster than a bf16
one, and fp32 is at least as exact as the bf16 reference. Exceptions for bf16 inputs on a CPU with bf16
arithmetic: the split path with x as its single part (exact products, fp32 sums, one rounding to bf16: within one
bf16 rounding of the exact product, at least as close to it as the reference); above its rows the reference's own
bf16 math - each block of decoded rows rounded to bf16, fp32-accumulated products rounded to bf16 - on AMX with
the blocks packed for brgemm up to `AMX_BF16_ROWS` rows, by oneDNN's bf16 GEMM above. The decode and split paths
sum in a different order from the reference's GEMM: fp32 outputs agree to ~1e-6 relative (tests: 1e-5; the fp32
brgemm path within the error bound of any fp32 summation order); the fp32 prefill path is bit-identical.

PyTorch's packed kernels (``aten._weight_int4pack_mm_for_cpu``, ``aten._weight_int8pack_mm``) are not used: they
need bf16 activations (fp32 ones fall to a scalar loop), keep scales and zeros in bf16 (the package's fp16 scales
would lose 3 bits) and take int4 only in groups of multiples of 32 (no uint8 zero points as such, no NF4 / int2).
Their speed against this kernel differs by CPU (docs/kernels.md; `python -m workbench.benchmarks.kernels_cpu`
measures both side by side).

Vector code chosen at run time (``cpu_isa()``; ``WORKBENCH_CPU_ISA`` caps it, `workbench_kernels.isa`): AVX-512
for the decode path of 4- and 8-bit integer codes in whole 32-value groups (16 lanes; 4-bit codes meet x
reordered to their nibble order instead of being put back in order; groups of 32 two at a time), AVX2 + FMA for
the rest and on AVX2-only CPUs, a scalar loop elsewhere. That decode path reads the weight as stored: the fp16 scales
(`CpuWeight.scale16`, converted a row at a time) and, for symmetric formats, no zero points (`CpuWeight.zconst`),
so int4 g32 streams 4.5 bits a value, not the fp32 copies' 6;
``isa=`` forces one for tests. The decode paths prefetch the weight a few KB ahead of the row they are on (one
core's stream of a weight that is not in cache otherwise stalls on memory latency at a fraction of the bandwidth).
Built like `workbench_kernels.w8a8_cpu`: by ``make install`` (``python -m workbench_kernels.build``) or on first use
with ``torch.utils.cpp_extension`` (~20 s once, cached), reported on this module's logger, never on stderr; no
``-march=native``.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from workbench_kernels._common import build_extension, extension_or_raise
from workbench_kernels.numerics import dequantize_packed

__all__ = [
    "ISAS",
    "PREFILL_ROWS",
    "CpuWeight",
    "cpu_isa",
    "linear_unchecked",
    "load_extension",
    "pack",
    "prefill_rows_for",
    "reference",
    "split_available",
    "split_eligible",
    "split_rows_for",
    "supports",
    "weight_only_linear_cpu",
]

SOURCE = Path(__file__).with_name("weight_only_cpu.cpp")
ISAS = ("auto", "avx512", "avx2", "scalar")
_OP = "weight_only_linear_cpu"
_NAME = "workbench_weight_only_cpu"
_WHAT = "CPU weight-only kernel"
log = logging.getLogger(__name__)
# Rows of x above which the whole weight is decoded once and an fp32 GEMM runs. Measured on this machine's
# 4096 x 4096 layer, one thread (docs/kernels.md): the decode path costs ~0.35 ms per extra row of x,
# the fp32
# GEMM ~0.6 ms per row plus the decode (~25 ms for int4): the paths cross near 16 rows (a per-row dot product
# that streams x from L2 cannot match a blocked GEMM).
PREFILL_ROWS = 16
# A small weight is cheap to decode whole, and its fp32 copy stays in cache: the decode path's unblocked dot
# products lose to decode + GEMM at far fewer rows. Measured crossovers on this machine (one thread, int4 g64 and
# int8, interleaved medians; docs/kernels.md): 192 x 192 and 576 x 192 near 3 rows, 512 x 512 near 5,
# 1024 x 512 above 6, 4096 x 4096 near 16 - about one row per `_VALUES_PER_ROW` weight values, between 2 and 16.
_VALUES_PER_ROW = 40_000
# The split path (fp32 x on AMX) runs above SPLIT_MIN_ROWS rows of x (at 8 rows it ties the decode path) up to
# `split_rows_for` rows: its longest ranges on weights of SPLIT_MIN_VALUES values or more, shorter ones on smaller
# weights, longer from SPLIT_SMALL_VALUES. Where it does not run, fp32 x above the decode path's rows goes to the
# fp32 brgemm path up to `brgemm_rows_for` rows.
SPLIT_MIN_ROWS = 8
SPLIT_MIN_VALUES = 1 << 19
SPLIT_SMALL_VALUES = 96 * 1024
# bf16 x above the split path's rows: blocks of decoded bf16 rows packed for AMX and multiplied by brgemm (no
# per-call reorder of the weight) up to this many rows; oneDNN's bf16 GEMM on decoded blocks above (measured:
# docs/kernels.md).
AMX_BF16_ROWS = 256


def prefill_rows_for(N: int, K: int) -> int:
    """The rows of x up to which the decode path runs for an (N, K) weight: ~N*K / 40k, clamped to [2, 16]."""
    return max(2, min(PREFILL_ROWS, round(N * K / _VALUES_PER_ROW)))


@dataclass(frozen=True)
class CpuWeight:
    """A stored weight as the kernel reads it: the packed codes as stored (no copy) and fp32 scale / zero (or the
    NF4 table). Built by `pack` once per weight (when a module is built, loaded, or its tensors change)."""

    qweight: torch.Tensor            # (N, ceil(K / per byte)) uint8, the storage layout
    scale: torch.Tensor              # (N, G) fp32
    zero: torch.Tensor | None        # (N, G) fp32 for integer formats
    lut: torch.Tensor | None         # (16,) fp32 for NF4
    bits: int                        # code slot width: 2, 4 or 8
    group_size: int
    K: int
    scale16: torch.Tensor | None = None   # (N, G) the stored fp16 scales (no copy), read by the decode path
    zconst: float = float("nan")          # the one zero point of a symmetric format (NaN: per group, `zero`)

    @property
    def N(self) -> int:
        return self.qweight.shape[0]

    @functools.cached_property
    def split_ok(self) -> bool:
        """`split_eligible` (worked out once per packed weight)."""
        return split_eligible(self)

    @functools.cached_property
    def call_args(self) -> tuple:
        """The weight's arguments of the extension's ``linear``, in order (worked out once)."""
        return (self.qweight, self.scale, self.zero, self.lut, self.bits, self.group_size, self.K, self.scale16,
                self.zconst)

    @functools.cached_property
    def call_rules(self) -> tuple:
        """The path rules' arguments of the extension's ``linear`` for the default call (worked out once)."""
        return (self.prefill_rows, self.split_rows, self.split_rows_bf16, self.split_ok, self.amx_ok, SPLIT_MIN_ROWS,
                AMX_BF16_ROWS, self.brgemm_rows, self.brgemm_rows_threads)

    @functools.cached_property
    def amx_ok(self) -> bool:
        """Whether the AMX bf16 prefill takes ``w``: 4- or 8-bit code slots in whole 32-value groups (the one-pass
        AVX-512 decode), any zero point; not NF4."""
        return self.lut is None and self.bits in (4, 8) and self.group_size % 32 == 0 and self.K % 32 == 0

    @functools.cached_property
    def split_rows(self) -> int:
        """Rows of fp32 x up to which the split path runs (above `SPLIT_MIN_ROWS`, on a CPU with AMX; 0: never;
        `split_rows_for`)."""
        return split_rows_for(self)

    @functools.cached_property
    def split_rows_bf16(self) -> int:
        """The same for bf16 x (one part: x itself; `split_rows_for`)."""
        return split_rows_for(self, bf16=True)

    @functools.cached_property
    def brgemm_rows(self) -> int:
        """Rows of fp32 x up to which the fp32 brgemm path runs where neither the split nor the decode path does
        (`brgemm_rows_for`)."""
        return brgemm_rows_for(self.N, self.K)

    @functools.cached_property
    def brgemm_rows_threads(self) -> int:
        """The same when the call runs on more than one thread (`brgemm_rows_for` with ``threads=2``)."""
        return brgemm_rows_for(self.N, self.K, threads=2)

    @functools.cached_property
    def prefill_rows(self) -> int:
        """Rows of x up to which the decode path runs by default (`prefill_rows_for` this weight's size; worked
        out once per packed weight, not per call)."""
        return prefill_rows_for(self.N, self.K)


def split_eligible(w: "CpuWeight") -> bool:
    """Whether the split path can compute with ``w`` exactly: integer codes with integer zero points such that
    every u - z is an integer of at most 256 in magnitude (exact in bf16) and groups of even size or one group per
    row. Not NF4 (its table values are not bf16) nor HQQ's real-valued zero points."""
    if w.lut is not None or w.zero is None:
        return False
    if w.scale.shape[1] > 1 and w.group_size % 2:
        return False
    # integers, and |u - z| <= 256 for every code u in [0, 2^bits): bf16 holds integers exactly up to 256
    z = w.zero
    return bool(torch.equal(z, z.round())) and float(z.min()) >= (1 << w.bits) - 257 and float(z.max()) <= 256


def split_rows_for(w: "CpuWeight", bf16: bool = False) -> int:
    """Rows of x up to which the split path runs for ``w`` (above `SPLIT_MIN_ROWS`; 0: never), from the
    side-by-side measurements in docs/kernels.md (one thread, against what runs without it).

    fp32 x (three parts; one brgemm chain per group, so short groups cost chains): on weights of ~0.5 M values
    and more it is 1.6-2.8x faster per channel and 1.1-1.7x with groups of 64 and more from 16 rows up: up to
    2048 rows per channel (512 below 1 M values), 512 with groups of 128 or more, 128 with groups of 64; groups of
    32 only up to 32 rows on weights of 4 M values and more (1.1-1.3x; 0.7-0.85x from 128 rows). On smaller
    weights, per channel or with groups of 128 or more, from K = 128 and 32 output features: 1.04-2.0x up to 256
    rows (512 from 96 k values); with groups of 64 from 96 k values up to 64 rows (1.04-1.3x). Not on K = 64 (a
    tie), on a few output features (10: 0.5-0.9x) nor with groups of 32 on small weights (0.4-0.9x).

    bf16 x (one part, against the decode path's fp32 arithmetic up to 16 rows and the bf16 prefill above): 1.5-3.6x
    faster at 12-16 rows on every weight shape measured; from 32 rows only on weights of ~0.5 M values and more
    (1.05-2.1x), to 64 rows from 1 M values per channel or with groups of >= 128 (1.15-1.7x); the bf16 prefill
    path (oneDNN's bf16 GEMM on decoded blocks) is faster above."""
    values = w.N * w.K
    if not w.split_ok:
        return 0
    per_channel = w.scale.shape[1] == 1
    group = w.K if per_channel else w.group_size
    if bf16:
        if values < SPLIT_MIN_VALUES:
            return 16
        return 64 if values >= 2 * SPLIT_MIN_VALUES and (per_channel or group >= 128) else 32
    if values >= SPLIT_MIN_VALUES:
        if per_channel:
            return 2048 if values >= 2 * SPLIT_MIN_VALUES else 512
        if group >= 128:
            return 512
        if group >= 64:
            return 128
        return 32 if values >= 8 * SPLIT_MIN_VALUES else 0
    if w.K < 128 or w.N < 32:
        return 0
    if group >= 128:
        return 512 if values >= SPLIT_SMALL_VALUES else 256
    return 64 if group >= 64 and values >= SPLIT_SMALL_VALUES else 0


def brgemm_rows_for(N: int, K: int, threads: int = 1) -> int:
    """Rows of fp32 x up to which blocks of decoded fp32 weight rows are multiplied by oneDNN's fp32 brgemm (on
    an AVX-512 CPU) instead of MKL's fp32 GEMM on decoded blocks (`bench_cpu.brgemm_table`, one thread, against
    the paths without it, every format alike): 1.1-3.6x faster from 16 to 64 rows on every shape measured (10 x
    128 to 4096 x 1024 and 1024 x 4096); at 128 rows 0.98-1.12x on small weights from K = 128 (1.0-1.3x from
    256 k values up to K = 2048, 0.9x at K = 4096); 1.0-1.1x at 256 rows from 512 k to 1 M values; slower above
    (0.8-0.98x) and at 128 rows on K = 64 (0.94-1.0x).

    ``threads`` > 1: on two threads the path it replaces also pays for the second core reading the weight the
    first one just decoded (128 x 256 at 128 rows: F.linear on a fresh decode 59 us, on a settled weight 36), and
    brgemm measured 1.08-1.4x faster at 256 rows on weights below 512 k values from K = 128 (int4 g64; two threads
    only measured): up to 256 rows there."""
    values = N * K
    if K <= 64:
        return 64
    if values < 1 << 19:
        return 256 if threads > 1 else 128
    if values <= 1 << 20:
        return 256
    return 128 if K <= 2048 else 64


def supports(fmt) -> bool:
    """Whether `pack` takes weights of ``fmt``, a `workbench.quantization.formats.WeightFormat` (every integer
    format and NF4; not fp8): the format says so (``cpu_kernel``)."""
    return fmt.cpu_kernel


def pack(tensors: dict[str, torch.Tensor], fmt, K: int) -> CpuWeight:
    """The kernel's view of a format's tensors (``qweight``, ``scale``, optional ``zero``): what the format's
    ``cpu_layout`` gives - scales and zero points widened to fp32 (the values the reference computes with), or
    a lookup table, and the codes untouched."""
    layout = fmt.cpu_layout(tensors, K)
    if layout is None:
        raise ValueError(f"{_OP}: no CPU kernel for {fmt} (integer formats and NF4 only)")
    return CpuWeight(**layout)


@functools.cache
def _build():
    """(extension module, None) or (None, the error): a failed build is not retried in this process. Compiling or
    loading is reported on this module's logger (`workbench_kernels._common.build_extension`), not on stderr."""
    # -fopenmp: at::parallel_for is an OpenMP pragma in ATen's headers (compiled away without it: one thread).
    # The runtime is resolved by soname (libgomp.so.1): the copy torch loaded, one thread pool (checked in
    # /proc/self/maps); a torch whose OpenMP library has another name would get a second runtime here.
    return build_extension(_NAME, SOURCE, what=_WHAT, logger=log, expected_s=20,
                           extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"])


def split_available() -> bool:
    """Whether the split path runs here now: AMX bf16 tiles, as PyTorch's oneDNN micro-kernels report them (asked
    each time, as the kernel does: the answer follows ``torch.backends.mkldnn.enabled``)."""
    return bool(load_extension().split_available())


def brgemm_available() -> bool:
    """Whether the fp32 brgemm path runs on this CPU (oneDNN's fp32 micro-kernels need AVX-512 F / BW / VL / DQ)."""
    return bool(load_extension().brgemm_f32_here())


def load_extension():
    """The compiled extension; raises a RuntimeError naming what is missing when it cannot be built here."""
    return extension_or_raise(_build(), _OP, _WHAT)


def cpu_isa() -> str:
    """The vector ISA the kernel uses on this CPU: "avx512", "avx2" or "scalar"."""
    return load_extension().cpu_isa()


def linear_unchecked(x: torch.Tensor, w: CpuWeight, bias: torch.Tensor | None, prefill_rows: int | None = None,
                     isa: str = "auto", split_rows: int | None = None,
                     brgemm_rows: int | None = None) -> torch.Tensor:
    """`weight_only_linear_cpu` without its argument checks (for `WeightOnlyLinear`, whose tensors are known
    good): one C++ call (``linear`` in weight_only_cpu.cpp) picks the path - split (AMX; fp32 or bf16 x) from
    `SPLIT_MIN_ROWS` + 1 up to ``split_rows`` / ``split_rows_bf16``, decode up to ``prefill_rows``, the AMX bf16
    prefill (bf16 x, up to `AMX_BF16_ROWS`), the bf16 GEMM on decoded blocks (bf16 x above 16 rows on a CPU with
    bf16 arithmetic: the reference's bf16 math), the fp32 prefill otherwise."""
    if prefill_rows is None and split_rows is None and brgemm_rows is None and isa == "auto":
        return load_extension().linear(x, *w.call_args, bias, *w.call_rules, isa)
    amx = split_rows != 0
    return load_extension().linear(
        x, *w.call_args, bias, w.prefill_rows if prefill_rows is None else prefill_rows,
        w.split_rows if split_rows is None else split_rows, w.split_rows_bf16 if split_rows is None else split_rows,
        amx and w.split_ok, amx and w.amx_ok, SPLIT_MIN_ROWS, AMX_BF16_ROWS,
        w.brgemm_rows if brgemm_rows is None else brgemm_rows,
        w.brgemm_rows_threads if brgemm_rows is None else brgemm_rows, isa)


def weight_only_linear_cpu(x: torch.Tensor, w: CpuWeight, bias: torch.Tensor | None = None, *,
                           prefill_rows: int | None = None, isa: str = "auto",
                           split_rows: int | None = None, brgemm_rows: int | None = None) -> torch.Tensor:
    """``y (..., N)`` in x's dtype = x ``(..., K)`` times the weight held in ``w`` (from `pack`), plus ``bias``.
    ``split_rows`` (rows of x up to which the split path runs, above `SPLIT_MIN_ROWS`, where the CPU has AMX and
    the weight allows; None: `CpuWeight.split_rows` / ``split_rows_bf16``; 0: no AMX micro-kernel path at all,
    the AMX bf16 prefill included), ``prefill_rows`` (rows of x up to which
    the decode path runs otherwise; None: `CpuWeight.prefill_rows`), ``brgemm_rows`` (rows of fp32 x up to which
    the fp32 brgemm path runs above those; None: `CpuWeight.brgemm_rows`; 0: never) and ``isa`` exist for tests
    and tuning.
    Inference only: no autograd graph is recorded."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype not in (
            torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{_OP}: x must be a float32 / float16 / bfloat16 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim < 1 or x.shape[-1] != w.K:
        raise ValueError(f"{_OP}: x must have shape (..., K = {w.K}), got {tuple(x.shape)}")
    if x.device.type != "cpu" or w.qweight.device.type != "cpu":
        raise ValueError(f"{_OP}: the CPU kernel needs CPU tensors, got x on {x.device}, the weight on "
                         f"{w.qweight.device}")
    if bias is not None and tuple(bias.shape) != (w.N,):
        raise ValueError(f"{_OP}: bias must have shape ({w.N},), got {tuple(bias.shape)}")
    if prefill_rows is not None and (isinstance(prefill_rows, bool) or not isinstance(prefill_rows, int)
                                     or prefill_rows < 0):
        raise ValueError(f"{_OP}: prefill_rows must be an int >= 0, got {prefill_rows!r}")
    for name, v in (("split_rows", split_rows), ("brgemm_rows", brgemm_rows)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"{_OP}: {name} must be an int >= 0, got {v!r}")
    if isa not in ISAS:
        raise ValueError(f"{_OP}: isa must be one of {ISAS}, got {isa!r}")
    with torch.no_grad():
        return linear_unchecked(x, w, bias, prefill_rows, isa, split_rows, brgemm_rows)


def reference(x: torch.Tensor, w: CpuWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same math in PyTorch: decode every weight row in fp32, then an fp32 matmul."""
    weight = dequantize_packed(w.qweight, w.bits, w.K, w.scale, w.group_size, w.zero, w.lut)   # (N, K) fp32
    y = F.linear(x.float(), weight, None if bias is None else bias.float())
    return y.to(x.dtype)
