"""What every kernel file shares: interpreter detection, autotune configs, input checks, availability.

- ``INTERPRET``: true when ``TRITON_INTERPRET=1`` was set before this module was imported (Triton reads the
  variable when ``@triton.jit`` decorates a function, so it must be set before the kernel modules import).
  Under the interpreter kernels run on CPU tensors with numpy: small shapes only, one autotune config
  (``@triton.autotune`` benchmarks, which the interpreter cannot), and no bf16 operands to ``tl.dot``.
- ``configs(full, interpret)``: the autotune list for the current mode.
- ``check(...)``: launcher-side validation with errors that name the argument, so bad input never reaches a
  Triton compile error or a silent wrong result.
- ``triton_available(device)``: whether a Triton kernel can run on ``device`` here (a CUDA GPU, or any
  device under the interpreter).
- The split-K weight-only GEMMs' shared plumbing: autotune lists for decode (M <= ``SMALL_M``, split-K) and
  prefill, the M bucket of the autotune key, config pruning, pinned-config checks and `launch_split_k`
  (reshape, empty shapes, grid, autotuned or pinned kernel, the fp32 split-K buffer, device guard).
- The C++ CPU kernels' build: `extension_build_dir`, `build_extension` (compile or load from the build cache,
  reported on the kernel module's logger, never on stderr), `last_build` and `extension_or_raise`.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

__all__ = ["INTERPRET", "configs", "graph_bench", "chosen_config", "check", "check_same_device", "triton_available",
           "require_triton",
           "cdiv", "SMALL_M", "GEMV_M", "split_k_configs", "gemv_configs", "m_bucket", "fit_m_bucket",
           "check_pinned_config", "launch_split_k", "extension_build_dir", "extension_libraries", "build_extension",
           "BuildRecord", "last_build", "extension_or_raise"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def configs(full: Iterable[dict], interpret: dict, num_warps: int = 4, num_stages: int = 3) -> list:
    """``triton.Config`` objects: every entry of ``full`` on a GPU, only ``interpret`` under the interpreter.

    Each dict maps block-size names to values; ``num_warps`` / ``num_stages`` keys override the defaults."""
    import triton

    def make(d: dict) -> "triton.Config":
        d = dict(d)
        return triton.Config(d, num_warps=d.pop("num_warps", num_warps), num_stages=d.pop("num_stages", num_stages))

    if INTERPRET:
        return [triton.Config(dict(interpret), num_warps=1, num_stages=1)]
    return [make(d) for d in full]


def graph_bench(fn: Callable, quantiles=None, return_mode: str = "median", warmup: int = 10, rep: int = 50):
    """GPU time of ``fn`` in ms without Python's launch overhead: ``fn`` is captured once in a CUDA graph and
    each replay is timed by ``triton.testing.do_bench`` (which flushes L2 before every replay).

    Why: a Python call of a Triton kernel (custom-op dispatch, checks, autotuner lookup, launch) costs
    ~50-150 us of CPU time on the H100 machine, more than the GPU time of a decode-sized GEMM, so timing eager
    calls measures the host. The autotuners use this too (``do_bench=``), otherwise they rank configs by
    launch noise. A function that cannot be captured (it synchronizes, say) is timed eagerly instead: this
    only changes how a measurement is taken, never what is computed."""
    import triton.testing

    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()                                  # warm-up off the capture: compiles and autotunes here
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception:
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=quantiles, return_mode=return_mode)
    return triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, quantiles=quantiles,
                                   return_mode=return_mode)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check(name: str, t: torch.Tensor, *, dtypes: tuple[torch.dtype, ...] | None = None, ndim: int | None = None,
          shape: tuple[int | None, ...] | None = None, contiguous: bool = True, op: str = "kernel") -> None:
    """Raise a clear error when tensor argument ``name`` of ``op`` is not what the kernel needs."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{op}: {name} must have dtype {allowed}; got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape, strict=True)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{op}: {name} must have shape {want}, got {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (call .contiguous() first); got strides {t.stride()}")


def check_same_device(op: str, **tensors: torch.Tensor | None) -> torch.device:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        raise ValueError(f"{op}: all tensors must be on one device, got " +
                         ", ".join(f"{n} on {d}" for n, d in devices.items()))
    return first


def triton_available(device: torch.device | str | None = None) -> bool:
    """Whether a Triton kernel can run on ``device``: a CUDA device, or anything under the interpreter."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if INTERPRET:
        return True
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def require_triton(op: str, device: torch.device) -> None:
    if not triton_available(device):
        raise RuntimeError(f"{op}: the Triton kernel needs a CUDA GPU (or TRITON_INTERPRET=1 for testing on the "
                           f"CPU); the tensors are on {device}. Use kernel='cpu' or kernel='reference' there.")


# --- split-K weight-only GEMMs (int8_weight_only, int4_weight_only) ------------------------------------------

SMALL_M = 64   # M <= SMALL_M runs the split-K (decode) configs
GEMV_M = 1     # M <= GEMV_M runs the GEMV kernels (no tl.dot, no padding of M to 16 rows): one row of x. A first
               # version for M <= 4 (per-row reductions inside the K loop) lost to the tl.dot kernels at M = 4 on
               # an H100 (int8 0.99x vs 1.45x bf16, int4 0.55x vs 1.88x on 4096 x 14336)
_PREFILL_TILES = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (64, 256, 64, 8, 4),
                  (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 128, 4, 5)]  # (M, N, K blocks, warps, stages)


def chosen_config(module, M: int) -> dict | None:
    """The blocking the autotuner of kernel module ``module`` (`int4_weight_only`, `int8_weight_only`) chose for its
    last call at ``M`` rows: tile sizes, warps and stages; None before any call (or for a kernel without tuners)."""
    tuner = (getattr(module, "_kernel_gemv", None) if M <= GEMV_M else None) or \
        getattr(module, "_kernel_small_m" if M <= SMALL_M else "_kernel_large_m", None)
    best = getattr(tuner, "best_config", None)
    return None if best is None else {**best.kwargs, "warps": best.num_warps, "stages": best.num_stages}


def split_k_configs(small_m: bool, decode_tiles: Iterable[tuple[int, int, int, int]]) -> list:
    """Decode: BLOCK_M in 16/32/64 (pruned to M's bucket) x ``decode_tiles`` (BLOCK_N, BLOCK_K, warps, stages)
    x SPLIT_K 1/2/4/8. Prefill: the usual GEMM tiles, no split."""
    if small_m:
        full = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w, num_stages=s)
                for bm in (16, 32, 64) for bn, bk, w, s in decode_tiles for sk in (1, 2, 4, 8)]
        return configs(full, interpret=dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=2))
    full = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in _PREFILL_TILES]
    return configs(full, interpret=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, SPLIT_K=1))


def gemv_configs(tiles: Iterable[tuple[int, int, int, int]]) -> list:
    """The GEMV kernels' autotune list: (BLOCK_N, BLOCK_K, warps, stages) tiles; one small tile under the
    interpreter."""
    full = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s) for bn, bk, w, s in tiles]
    return configs(full, interpret=dict(BLOCK_N=16, BLOCK_K=32))


def m_bucket(M: int) -> int:
    """The autotune key for M: a power of two >= 16 (decode sizes 1..16 share one tuning, and so on)."""
    return max(16, 1 << max(0, M - 1).bit_length())


def fit_m_bucket(configs: list, bucket: int, K: int) -> list:
    """The configs whose BLOCK_M fits the M bucket and that split K into no more parts than K-tiles."""
    return [c for c in configs
            if (c.kwargs["BLOCK_M"] == min(bucket, SMALL_M) if bucket <= SMALL_M else c.kwargs["BLOCK_M"] <= bucket)
            and c.kwargs["SPLIT_K"] * c.kwargs["BLOCK_K"] <= max(K, c.kwargs["BLOCK_K"])]


def check_pinned_config(op: str, config: dict, min_block_k: int) -> None:
    """A pinned config names the four block sizes, as powers of two a GPU accepts (tl.dot needs every block
    dim >= 16 there)."""
    need, optional = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K"}, {"num_warps", "num_stages"}
    if not isinstance(config, dict) or not need <= set(config) or set(config) - need - optional:
        raise ValueError(f"{op}: config must be a dict with keys {sorted(need)} (and optionally "
                         f"{sorted(optional)}), got {config!r}")
    for name, low in (("BLOCK_M", 16), ("BLOCK_N", 16), ("BLOCK_K", min_block_k), ("SPLIT_K", 1)):
        v = config[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < low or v & (v - 1):
            raise ValueError(f"{op}: config[{name!r}] must be a power of two >= {low}, got {v!r}")


def launch_split_k(op: str, x: torch.Tensor, N: int, K: int, bias: torch.Tensor | None, config: dict | None,
                   autotuned: tuple, jit_kernel, min_block_k: int, call: Callable,
                   gemv: tuple | None = None) -> torch.Tensor:
    """Run a split-K GEMM over x ``(..., K)`` -> ``(..., N)`` in x's dtype. ``autotuned``: the (decode, prefill)
    autotuned kernels; ``config`` pins one blocking of ``jit_kernel`` instead. ``call(kernel, x2, c, M)``
    launches with the kernel's own arguments; ``c`` is an fp32 zeroed buffer when K is split (partial sums
    are added atomically), else the output in x's dtype. ``gemv``: ``(autotuned GEMV kernel, call)``, run
    instead for M <= GEMV_M when no config is pinned (None: this case has no GEMV kernel); its grid is one
    program per BLOCK_N output columns and it writes x's dtype directly."""
    require_triton(op, x.device)
    x2 = x.reshape(-1, K)                                                   # (M, K), a view: x is contiguous
    M = x2.shape[0]
    if M == 0 or N == 0 or K == 0:   # nothing to launch: an empty product (plus the bias)
        y = x.new_zeros(*x.shape[:-1], N)
        return y if bias is None else y + bias.to(x.dtype)

    def grid(meta):
        return cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"]

    device_guard = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
    if config is None and gemv is not None and M <= GEMV_M:
        gemv_kernel, gemv_call = gemv
        c = torch.empty((M, N), device=x.device, dtype=x.dtype)
        with device_guard:
            gemv_call(gemv_kernel[lambda meta: (cdiv(N, meta["BLOCK_N"]),)], x2, c, M)
        return c.reshape(*x.shape[:-1], N)
    if config is None:
        split = M <= SMALL_M
        kernel = autotuned[0 if split else 1][grid]
    else:
        check_pinned_config(op, config, min_block_k)
        split = config["SPLIT_K"] > 1
        kernel = functools.partial(jit_kernel[grid], **config)
    c = (torch.zeros if split else torch.empty)((M, N), device=x.device, dtype=torch.float32 if split else x.dtype)
    with device_guard:
        call(kernel, x2, c, M)
    return c.to(x.dtype).reshape(*x.shape[:-1], N)


def extension_build_dir(name: str, source) -> str:
    """The build folder of the C++ kernel ``name`` compiled from ``source``: torch's extensions folder for
    ``name``, then one sub-folder per checkout (the source's absolute path and the torch version, hashed). Two
    checkouts of the package on one machine (worktrees, a venv per project) then neither rebuild each other's
    library - ninja rebuilds whenever the source path in its build file changes - nor wait on each other's build
    lock."""
    import hashlib
    from pathlib import Path

    from torch.utils.cpp_extension import _get_build_directory  # torch's own rule for the folder of ``name``

    key = hashlib.sha256(f"{Path(source).resolve()}|{torch.__version__}".encode()).hexdigest()[:12]
    path = Path(_get_build_directory(name, False)) / key
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def extension_libraries(name: str, source) -> dict[str, int]:
    """The compiled libraries of the C++ kernel ``name`` in its build folder (`extension_build_dir`), each with
    its modification time in ns: empty before the first build on this machine."""
    from pathlib import Path

    return {str(p): p.stat().st_mtime_ns for p in Path(extension_build_dir(name, source)).glob(f"{name}*.so")}


@dataclass(frozen=True)
class BuildRecord:
    """How a C++ kernel was made available in this process: ``status`` is "built" (compiled now), "cached"
    (loaded from the build folder: already built on this machine) or "failed" (``error`` says why)."""
    name: str
    what: str
    status: str
    seconds: float
    build_dir: str = ""
    error: BaseException | None = None

    @property
    def reason(self) -> str:
        """The first line of the compiler's error ("" unless the build failed)."""
        return "" if self.error is None else _first_error_line(self.error)


_BUILDS: dict[str, BuildRecord] = {}


def last_build(name: str) -> BuildRecord | None:
    """The latest `build_extension` of the kernel ``name`` in this process, or None before the first."""
    return _BUILDS.get(name)


def build_extension(name: str, source, *, what: str, logger: logging.Logger, expected_s: int = 20,
                    **load_kwargs) -> tuple:
    """Compile the C++ kernel ``name`` from ``source`` with ``torch.utils.cpp_extension.load`` (into
    `extension_build_dir`), or load it from there when this machine already built it: ``(module, None)``, or
    ``(None, the error)`` when it cannot be built here (no compiler, no ninja, no Python headers) - what a kernel's
    ``_build()`` returns for `extension_or_raise`. ``load_kwargs`` go to ``load`` (``extra_cflags`` ...).

    Says what it does on ``logger`` (the kernel module's) at INFO - compiling or loading, then how long it took -
    and nothing on stdout / stderr, so notebooks and reports show no build notice; `last_build` keeps the outcome
    (``python -m workbench_kernels.build`` prints it). ``make install`` builds the kernels ahead of time."""
    from torch.utils.cpp_extension import load

    from workbench_kernels.w8a8_cpu import ensure_ninja_on_path

    start = time.perf_counter()
    build_dir = ""
    try:
        ensure_ninja_on_path()
        build_dir = extension_build_dir(name, source)
        before = extension_libraries(name, source)
        if before:
            logger.info("%s: loading the %s from the build cache %s", name, what, build_dir)
        else:
            logger.info("%s: compiling the %s (C++, first use on this machine, ~%d s; cached afterwards in %s) ...",
                        name, what, expected_s, build_dir)
        load_kwargs.setdefault("verbose", False)
        ext = load(name=name, sources=[str(source)], build_directory=build_dir, **load_kwargs)
    except Exception as e:  # no compiler, no ninja, no Python headers: reported by extension_or_raise
        record = BuildRecord(name, what, "failed", time.perf_counter() - start, build_dir, e)
        _BUILDS[name] = record
        logger.info("%s: the %s could not be built here (%.1f s): %s", name, what, record.seconds, record.reason)
        return None, e
    seconds = time.perf_counter() - start
    built = not before or extension_libraries(name, source) != before
    _BUILDS[name] = BuildRecord(name, what, "built" if built else "cached", seconds, build_dir)
    if built:
        logger.info("%s: the %s was built in %.1f s", name, what, seconds)
    else:
        logger.info("%s: the %s was loaded from the build cache in %.2f s", name, what, seconds)
    return ext, None


def _first_error_line(err: BaseException) -> str:
    """The compiler's message in a failed build's error: its first line naming an error (300 characters at most)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return next((line for line in lines if "error" in line.lower() and "error building extension" not in
                 line.lower()), lines[-1] if lines else type(err).__name__)[:300]


def extension_or_raise(result: tuple, op: str, what: str, instead: str = "kernel='reference'"):
    """The compiled extension of a ``(module, None)`` / ``(None, error)`` build result (a kernel's ``_build()``), or
    a RuntimeError naming ``op``, ``what`` failed to build and the compiler's first error line, and ``instead``."""
    ext, err = result
    if ext is None:
        first = _first_error_line(err)   # the compiler's message
        raise RuntimeError(f"{op}: the {what} is C++ compiled on first use (torch.utils.cpp_extension, which needs "
                           f"ninja and a working C++ compiler); building it failed here: {first}. Use {instead} on "
                           "this machine.") from err
    return ext
