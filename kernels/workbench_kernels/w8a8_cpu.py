"""W8A8 Linear on the CPU: per-token int8 activations x int8 per-channel weights, oneDNN's int8 GEMM between a
fused quantization pass and a fused rescale, block by block of rows so the int32 product never leaves L2.

The math (the numbers of ``workbench.quantization.modules.W8A8Linear``, reference path)::

    s_x[m] = max(max_k |x[m, k]| / 127.5, eps)          per token; or one calibrated scale (static)
    q_x[m, k] = clamp(round_half_even(x[m, k] * (1 / s_x[m])), -128, 127)               fp32
    y[m, n] = float(sum_k q_x[m, k] q_w[k, n]) * s_x[m] * s_w[n] + bias[n]                int32 sum, fp32

A row of x holding NaN or Inf gets a NaN scale, hence a NaN output row, on every path.

Blocking (``w8a8_cpu.cpp``): rows of x are taken ``block_rows`` at a time (by default 64-512 rows, the block's
int32 product ``block_rows x N x 4`` bytes at most 3 MB; the per-thread buffers keep their largest size for
the next call). For each block: quantize its rows into a
per-thread int8 buffer (max |x| and the codes in one read of each row; the row is still in L1 for the second
sweep), ``at::_int_mm_out`` into a per-thread int32 buffer (oneDNN's s8 x s8 -> s32 GEMM, VNNI where the CPU
has it; without an int8 dot product oneDNN's pair sums saturate at 16 bits - measured: off by up to 8e4 - and the
product is taken by an exact fp64 GEMM instead, ``int_mm_exact()`` in the extension), then one pass that
converts, multiplies by both scales, adds the bias and writes the fp32 output.
Compared with quantize -> ``torch._int_mm`` -> rescale as whole tensors, the int32 product (as many bytes as
the output) never goes to DRAM and back, no M x N temporary is allocated per call, and nothing goes through
Python between the three steps. With several threads each thread takes whole row blocks (its GEMM runs
single-threaded); below ``32 x threads`` rows (decode) one thread walks the blocks and the GEMM uses them all.

Vector code: AVX-512 or AVX2 intrinsics chosen at run time from what the CPU reports (``cpu_isa()``, capped by
``WORKBENCH_CPU_ISA``: `workbench_kernels.isa`), a scalar loop elsewhere (e.g. ARM); ``isa=`` forces one for tests.
Every float operation is the reference's, in the same order, built with ``-ffp-contract=off`` (no multiply-add
contraction): the output equals the reference bit for bit whenever the reference's fp32 matmul of the codes is
exact (every partial sum below 2^24, e.g. K <= 1024; past that the int32 sum here is the more exact of the two).
Tests check each ISA, ragged shapes, static scales, non-finite rows.

Build: ``make install`` builds it ahead of time (``python -m workbench_kernels.build``), else it is compiled on first
use with ``torch.utils.cpp_extension.load`` (ninja and the system C++ compiler; about 30 s once, then cached under
``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``), reported on this module's logger at INFO, never
on stderr. No ``-march=native``: the cached library runs on any x86-64 and picks its ISA at run time. A machine
without a compiler gets an error that says so and names ``kernel='reference'`` as the way out.

``workbench::w8a8_linear_cpu`` is also a ``torch.library`` custom op with a fake implementation, so modules
that call it trace under ``torch.compile``; eager calls go straight to the extension (the op's dispatch costs
~6 us a call, measured, as much as the argument checks).
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

from workbench_kernels._common import build_extension, check, check_same_device, extension_libraries, extension_or_raise

__all__ = ["w8a8_linear_cpu", "linear_unchecked", "reference", "cpu_isa", "load_extension", "ISAS"]

SOURCE = Path(__file__).with_name("w8a8_cpu.cpp")
ISAS = ("auto", "avx512", "avx2", "scalar")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_OP = "w8a8_linear_cpu"
_NAME = "workbench_w8a8_cpu"
_WHAT = "CPU W8A8 kernel"
log = logging.getLogger(__name__)


def _ninja_on_path() -> None:
    """torch.utils.cpp_extension runs ``ninja`` from PATH; the pip-installed one lives in the environment's bin
    directory, which is not on PATH when the interpreter is run without activating its venv (as ``make test``
    does). Add it when no other ninja is found."""
    if shutil.which("ninja"):
        return
    try:
        import ninja

        bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):
        bin_dir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


ensure_ninja_on_path = _ninja_on_path   # shared with the other C++ kernels (workbench_kernels._common.build_extension)


def _looks_built() -> bool:
    """Whether a compiled library is already in the extension's build directory (then loading takes ~0.1 s,
    else ~30 s). A guess: a changed source is rebuilt under a new name."""
    try:
        return bool(extension_libraries(_NAME, SOURCE))
    except Exception:  # a private helper of torch: assume built rather than fail
        return True


@functools.cache
def _build():
    """(extension module, None) or (None, the error): a failed build is not retried in this process. Compiling or
    loading is reported on this module's logger (`workbench_kernels._common.build_extension`), not on stderr."""
    # -fopenmp: at::parallel_for is an OpenMP pragma in ATen's headers - without it the kernel runs on one
    # thread whatever torch.get_num_threads() says (the pragma is compiled away); the OpenMP runtime is the
    # libgomp torch already loaded
    return build_extension(_NAME, SOURCE, what=_WHAT, logger=log, expected_s=30,
                           extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"])


def load_extension():
    """The compiled extension (built on first use, then cached on disk); raises a RuntimeError that says what
    is missing when it cannot be built here."""
    return extension_or_raise(_build(), _OP, _WHAT)


def int8_dot_product() -> bool:
    """Whether this CPU has an int8 dot-product instruction (AVX-512 VNNI, AVX-VNNI or AMX on x86) that oneDNN's
    int8 GEMM - the heart of the W8A8 CPU path - runs on. Without one (e.g. an AVX2-only x86) oneDNN runs a
    generic loop that is many times slower than an fp32 GEMM, so ``kernel="auto"`` does not choose that path.
    Read from /proc/cpuinfo on Linux x86; assumed present elsewhere (ARM has its own dot-product path). Capped as
    the CPU is by ``ONEDNN_MAX_CPU_ISA`` (an ISA below VNNI: oneDNN runs without one) and ``WORKBENCH_CPU_ISA``
    (``avx2`` or ``scalar``: run as an AVX2-only x86 would), so one machine can take the other ISAs' choices."""
    return _int8_dot_product() and not _int8_dot_product_capped()


# oneDNN's ISA names that still have an int8 dot product (VNNI, AVX-VNNI, AMX; the AVX10 family has VNNI too)
_ONEDNN_VNNI_ISAS = ("AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX512_CORE_FP16",
                     "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512", "AVX10_1_512_AMX",
                     "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "ALL", "DEFAULT")


def _int8_dot_product_capped() -> bool:
    from workbench_kernels.isa import isa_cap

    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return isa_cap() in ("avx2", "scalar") or bool(onednn and onednn not in _ONEDNN_VNNI_ISAS)


@functools.lru_cache(maxsize=None)
def _int8_dot_product() -> bool:
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return True
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return True
    if flags is None:
        return True
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags))


def cpu_isa() -> str:
    """The vector ISA the kernel uses on this CPU: "avx512", "avx2" or "scalar"."""
    return load_extension().cpu_isa()


def _check(x: torch.Tensor, qweight_t: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
           act_scale: torch.Tensor | None, block_rows: int, isa: str) -> None:
    check("x", x, dtypes=_FLOAT_DTYPES, contiguous=False, op=_OP)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"{_OP}: x must have shape (..., K) with K >= 1, got {tuple(x.shape)}")
    check("qweight_t", qweight_t, dtypes=(torch.int8,), ndim=2, contiguous=False, op=_OP)
    K, N = qweight_t.shape
    if x.shape[-1] != K:
        raise ValueError(f"{_OP}: x has K = {x.shape[-1]} columns but qweight_t is (K, N) = {(K, N)}")
    check("scale", scale, dtypes=(torch.float32,), contiguous=False, op=_OP)
    if scale.numel() != N:
        raise ValueError(f"{_OP}: scale must hold one value per output column (N = {N}), got shape "
                         f"{tuple(scale.shape)}")
    if bias is not None:
        check("bias", bias, dtypes=_FLOAT_DTYPES, shape=(N,), contiguous=False, op=_OP)
    if act_scale is not None:
        check("act_scale", act_scale, dtypes=(torch.float32,), contiguous=False, op=_OP)
        if act_scale.numel() != 1:
            raise ValueError(f"{_OP}: act_scale must be one value (static activations), got shape "
                             f"{tuple(act_scale.shape)}")
    device = check_same_device(_OP, x=x, qweight_t=qweight_t, scale=scale, bias=bias, act_scale=act_scale)
    if device.type != "cpu":
        raise ValueError(f"{_OP}: the CPU kernel needs CPU tensors, got {device}; use kernel='triton' on a GPU")
    if isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 0:
        raise ValueError(f"{_OP}: block_rows must be an int >= 0 (0 picks it from N), got {block_rows!r}")
    if isa not in ISAS:
        raise ValueError(f"{_OP}: isa must be one of {ISAS}, got {isa!r}")


def linear_unchecked(x, qweight_t, scale, bias, act_scale, block_rows: int = 0, isa: str = "auto") -> torch.Tensor:
    """`w8a8_linear_cpu` without its argument checks, for callers whose tensors are known good (W8A8Linear):
    the checks cost ~6 us a call, 5 % of a 128-token MiniLM Linear. One C++ call (``linear`` in w8a8_cpu.cpp)
    reshapes x, takes what is not already fp32 and contiguous as fp32, and gives the result in x's dtype."""
    return load_extension().linear(x, qweight_t, scale, bias, act_scale, block_rows, isa)


@torch.library.custom_op("workbench::w8a8_linear_cpu", mutates_args=())
def _w8a8_linear_cpu_op(x: torch.Tensor, qweight_t: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                        act_scale: torch.Tensor | None) -> torch.Tensor:
    return linear_unchecked(x, qweight_t, scale, bias, act_scale)


@_w8a8_linear_cpu_op.register_fake
def _(x, qweight_t, scale, bias, act_scale):
    _check(x, qweight_t, scale, bias, act_scale, 0, "auto")
    return x.new_empty((*x.shape[:-1], qweight_t.shape[1]))


def w8a8_linear_cpu(x: torch.Tensor, qweight_t: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                    act_scale: torch.Tensor | None = None, *, block_rows: int = 0, isa: str = "auto") -> torch.Tensor:
    """``y (..., N)`` in x's dtype: x ``(..., K)`` quantized per token (or with the one static ``act_scale``)
    times ``qweight_t`` int8 ``(K, N)``, rescaled by the row scale and ``scale`` (N values), plus ``bias``.
    ``block_rows`` (0: chosen from N) and ``isa`` ("auto" or one of "avx512" / "avx2" / "scalar") exist for
    tests and tuning. Inference only: no autograd graph is recorded."""
    _check(x, qweight_t, scale, bias, act_scale, block_rows, isa)
    if torch.compiler.is_compiling():
        return _w8a8_linear_cpu_op(x, qweight_t, scale, bias, act_scale)
    return linear_unchecked(x, qweight_t, scale, bias, act_scale, block_rows, isa)


def reference(x: torch.Tensor, qweight_t: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              act_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The same math in PyTorch: the module's reference path (its quantization functions, then an fp32 matmul
    of the integer codes)."""
    from workbench_kernels.numerics import quantize_per_tensor, quantize_per_token

    x2 = x.reshape(-1, x.shape[-1])                                        # (M, K)
    q, s = quantize_per_token(x2) if act_scale is None else quantize_per_tensor(x2, act_scale)
    y = (q.float() @ qweight_t.float()) * s * scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], qweight_t.shape[1]).to(x.dtype)
