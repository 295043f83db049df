"""Kernel benchmarks: ``python -m workbench.benchmarks.kernels [--cpu] [--gpu] [--csv data/benchmarks/kernels.csv]``

GPU (CUDA): every Triton kernel against ``torch.matmul`` in bf16 (cuBLAS) and against torchao's matching
configuration where torchao is installed, on weight shapes from real models (MiniLM 384x1536 and 1536x384;
Llama-like 4096x4096, 4096x14336 and 14336x4096, written in x out) and M in {1, 4, 16, 64, 256, 2048}.
Each row has the median time, the speedup over bf16, the effective memory bandwidth (bytes the kernel must
move / time) in GB/s and as a fraction of the device's measured copy bandwidth, and the roofline ceiling of
the speedup beside the measurement: ``16 / (bits + scale bits per weight)`` for the weight-only kernels (bound
by reading the weight at small M) and 2x for the int8 / fp8 tensor-core GEMMs (twice bf16's peak).

CPU: W8A8 on MiniLM (every encoder Linear) at batch 1 and 32 x 128 tokens, one thread: our
``Dynamic(kernel="cpu")`` path (`workbench_kernels.w8a8_cpu`) vs fp32 vs ``torch.ao.quantization.quantize_dynamic`` on
the same layers (and the reference path and bf16 weight-only int8 for context); timed in interleaved rounds,
medians, with the median minor page faults per forward beside each time. ``--malloc-keep`` re-runs the
benchmark with glibc told to keep freed memory (`MALLOC_KEEP`): with the default settings a 32 x 128 forward
takes tens of thousands of page faults that move every path's time by +-10 % from run to run.

Every function is importable (`gpu_table`, `cpu_minilm`, `copy_bandwidth`); tests run them on tiny shapes.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from workbench.paths import data_dir

SHAPES = {"minilm.ffn_in": (384, 1536), "minilm.ffn_out": (1536, 384), "llama.qkvo": (4096, 4096),
          "llama.up": (4096, 14336), "llama.down": (14336, 4096)}
MS = (1, 4, 16, 64, 256, 2048)
KERNELS = ("int8_weight_only", "int4_g128", "w8a8", "w8a8_kmajor", "fp8")
"""``w8a8``: the weight as `W8A8Linear` stores ``qweight_t`` ((K, N) row-major, N contiguous);
``w8a8_kmajor``: the same codes K-major (the transposed view of an (N, K) tensor), the layout Hopper's int8
wgmma reads without a transpose -- the kernel accepts both."""


def _median_ms(fn, device: torch.device, runs: int = 20, warmup: int = 3, eager: bool = False) -> float:
    """Median ms of ``fn``. CUDA: GPU time of a CUDA-graph replay, L2 flushed before each (`graph_bench`;
    ``eager=True``: each Python call timed, host launch overhead included)."""
    if device.type == "cuda":
        import triton.testing

        from workbench_kernels import graph_bench

        if eager:
            return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
        return float(graph_bench(fn, warmup=25, rep=100))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _minor_faults() -> int:
    """Minor page faults of this process so far (0 where the platform does not count them)."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _interleaved(calls: dict, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median ms and median minor page faults of each call over ``rounds`` interleaved rounds (after one warm-up
    call each): slow drift of the machine hits every call alike. Page faults are counted because with glibc's
    default malloc settings a forward pass that frees large buffers hands memory back to the OS and faults it
    in again on the next pass (tens of thousands of faults, ~1-2 us each, on MiniLM at 32 x 128 tokens): they
    move a path's time by +-10 % between runs, so a comparison should show them."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    faults: dict[str, list[int]] = {name: [] for name in calls}
    for fn in calls.values():
        fn()
    for _ in range(rounds):
        for name, fn in calls.items():
            f0 = _minor_faults()
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
            faults[name].append(_minor_faults() - f0)
    return ({name: statistics.median(t) for name, t in times.items()},
            {name: statistics.median(f) for name, f in faults.items()})


def copy_bandwidth(device: torch.device | str = "cpu", nbytes: int = 1 << 28) -> float:
    """Measured device-to-same-device copy bandwidth in bytes/s (read + write counted)."""
    device = torch.device(device)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), device, runs=10)
    return 2 * nbytes / (ms * 1e-3)


def _weights(K: int, N: int, device: torch.device) -> dict:
    """The stored tensors of one (N, K) weight in each kernel's format, built with the package's encoders."""
    from workbench.quantization import formats as fm
    from workbench.quantization.modules import W8A8Linear

    torch.manual_seed(0)
    lin = nn.Linear(K, N, bias=False)
    w = lin.weight.detach()
    int8 = fm.encode(w, fm.IntFormat(8, None, True))
    int4 = fm.encode(w, fm.IntFormat(4, 128 if K % 128 == 0 else 64, True))
    w8a8 = W8A8Linear.from_float(lin)
    fp8 = fm.encode(w, fm.FP8Format(torch.float8_e4m3fn))
    return {"linear": lin.to(device), "int8": {k: v.to(device) for k, v in int8.items()},
            "int4": {k: v.to(device) for k, v in int4.items()}, "int4_g": K // int4["scale"].shape[1],
            "w8a8": (w8a8.qweight_t.to(device), w8a8.scale.to(device)),
            "w8a8_kmajor": (w8a8.qweight_t.t().contiguous().t().to(device), w8a8.scale.to(device)),
            "fp8": {k: v.to(device) for k, v in fp8.items()}}


def _kernel_call(name: str, x: torch.Tensor, W: dict):
    """(callable, weight bytes read, roofline ceiling of the speedup over bf16) for kernel ``name``."""
    N = W["linear"].out_features
    K = W["linear"].in_features
    if name == "int8_weight_only":
        from workbench_kernels.int8_weight_only import int8_weight_only_mm

        t = W["int8"]
        return (lambda: int8_weight_only_mm(x, t["qweight"], t["scale"])), N * K + 2 * N, 16 / (8 + 16 / K)
    if name == "int4_g128":
        from workbench_kernels.int4_weight_only import int4_weight_only_mm

        t, g = W["int4"], W["int4_g"]
        return ((lambda: int4_weight_only_mm(x, t["qweight"], t["scale"], None, g)), N * K // 2 + 2 * N * K // g,
                16 / (4 + 16 / g))
    if name in ("w8a8", "w8a8_kmajor"):
        from workbench_kernels.w8a8 import w8a8_mm

        qw, s = W[name]
        return (lambda: w8a8_mm(x, qw, s)), N * K + 4 * N, 2.0
    if name == "fp8":
        from workbench_kernels.fp8 import fp8_linear

        t = W["fp8"]
        return (lambda: fp8_linear(x, t["qweight"], t["scale"])), N * K + 4 * N, 2.0
    raise ValueError(f"unknown kernel {name!r}; choose from {KERNELS}")


TORCHAO_CONFIGS = {
    # int4: the tinygemm layout (torch's own `_weight_int4pack_mm`); torchao's default "plain" int4 packing
    # needs the separate mslk package
    "int4_g128": lambda tq, g: tq.Int4WeightOnlyConfig(group_size=g, int4_packing_format="tile_packed_to_4d"),
    "int8_weight_only": lambda tq, g: tq.Int8WeightOnlyConfig(),
    "w8a8": lambda tq, g: tq.Int8DynamicActivationInt8WeightConfig(),
    "w8a8_kmajor": lambda tq, g: tq.Int8DynamicActivationInt8WeightConfig(),
    "fp8": lambda tq, g: tq.Float8DynamicActivationFloat8WeightConfig(granularity=tq.PerRow()),
}
TORCHAO_COMPILE = ("int8_weight_only",)
"""torchao configs timed under ``torch.compile`` (its documented way to run them): int8 weight-only has no
fused eager kernel (eager it converts the whole weight on every call); the others dispatch to fused kernels
(tinygemm, ``torch._int_mm``, ``torch._scaled_mm``) in eager mode and are timed eager."""


def _torchao_layer(name: str, W: dict, dtype: torch.dtype):
    """torchao's matching configuration on a copy of the layer: (module or None, note)."""
    try:
        import torchao.quantization as tq
    except ImportError:
        return None, "torchao not installed"
    import copy

    precision = torch.get_float32_matmul_precision()
    try:
        lin = copy.deepcopy(W["linear"]).to(dtype)
        tq.quantize_(lin, TORCHAO_CONFIGS[name](tq, W["int4_g"]))
        return lin, ""
    except Exception as e:  # recorded in the table, never silently dropped
        return None, f"torchao {name}: {type(e).__name__}: {str(e)[:80]}"
    finally:  # quantize_ sets torch.set_float32_matmul_precision("high") (TF32) for the whole process
        torch.set_float32_matmul_precision(precision)


def _torchao_call(name: str, lin, x: torch.Tensor, compile: bool):
    """(callable or None, note) running torchao's layer on x, compiled (fresh dynamo state) if asked."""
    try:
        if compile:
            from workbench_kernels.isa import inductor_cache_per_capability

            inductor_cache_per_capability()
            torch._dynamo.reset()
            fn = torch.compile(lin)
        else:
            fn = lin
        fn(x)
        return (lambda: fn(x)), ("torchao compiled" if compile else "")
    except Exception as e:
        return None, f"torchao {name}: {type(e).__name__}: {str(e)[:80]}"


def _best_config(name: str, M: int) -> str:
    """The blocking the autotuner chose for the last call of weight-only kernel ``name`` at ``M`` rows ('' if none)."""
    from workbench_kernels import chosen_config, int4_weight_only, int8_weight_only

    module = {"int4_g128": int4_weight_only, "int8_weight_only": int8_weight_only}.get(name)
    best = None if module is None else chosen_config(module, M)
    return "" if best is None else " ".join(f"{k}={v}" for k, v in best.items())


def gpu_table(shapes: dict | None = None, ms=MS, kernels=KERNELS, device: str | torch.device = "cuda",
              dtype: torch.dtype = torch.bfloat16, torchao: bool = True, torchao_compile=TORCHAO_COMPILE):
    """One row per (kernel, shape, M); see the module docstring. ``device="cpu"`` only makes sense under
    TRITON_INTERPRET=1 (the smoke test), where the times mean nothing. A kernel that raises gets a row with
    the error in ``note`` (and no time) instead of ending the run."""
    import pandas as pd

    device = torch.device(device)
    shapes = SHAPES if shapes is None else shapes
    bandwidth = copy_bandwidth(device, 1 << 28 if device.type == "cuda" else 1 << 22)
    cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    rows = []
    for shape_name, (K, N) in shapes.items():
        W = _weights(K, N, device)
        w_bf16 = W["linear"].weight.detach().to(dtype)
        ao_layers = {name: _torchao_layer(name, W, dtype) if torchao and (name not in TORCHAO_COMPILE or
                                                                         name in torchao_compile)
                     else (None, "torchao comparison off") for name in kernels if name in TORCHAO_CONFIGS}
        for M in ms:
            x = torch.randn(M, K, device=device, dtype=dtype)
            base_ms = _median_ms(lambda x=x, w=w_bf16: torch.matmul(x, w.t()), device)
            for name in kernels:
                row = {"kernel": name, "shape": shape_name, "K": K, "N": N, "M": M, "bf16_ms": base_ms}
                if name == "fp8" and cc is not None and cc < (8, 9):
                    rows.append({**row, "note": f"fp8 needs sm_89+/sm_90, device is sm_{cc[0]}{cc[1]}"})
                    continue
                fn, weight_bytes, ceiling = _kernel_call(name, x, W)
                try:
                    t = _median_ms(fn, device)
                    eager_ms = _median_ms(fn, device, eager=True) if device.type == "cuda" else t
                except Exception as e:  # a failing kernel is a row with its error, not the end of the run
                    rows.append({**row, "ceiling": ceiling, "note": f"ours: {type(e).__name__}: {str(e)[:120]}"})
                    continue
                moved = weight_bytes + x.numel() * x.element_size() + M * N * x.element_size()
                lin, note = ao_layers[name]
                ao = None
                if lin is not None:
                    ao, note = _torchao_call(name, lin, x, name in torchao_compile and device.type == "cuda")
                ao_ms = _median_ms(ao, device) if ao is not None else float("nan")
                best = _best_config(name, M)
                if best:
                    note = f"{note}; config {best}" if note else f"config {best}"
                rows.append({**row, "ms": t, "eager_ms": eager_ms, "speedup": base_ms / t, "ceiling": ceiling,
                             "GB/s": moved / (t * 1e-3) / 1e9, "bw_fraction": moved / (t * 1e-3) / bandwidth,
                             "torchao_ms": ao_ms, "vs_torchao": ao_ms / t, "note": note})
    df = pd.DataFrame(rows).assign(timing=GRAPH_TIMING if device.type == "cuda" else "Triton interpreter")
    df.attrs["copy_bandwidth_GBs"] = bandwidth / 1e9
    return df


GRAPH_TIMING = "CUDA-graph replay, L2 flushed (GPU time); autotuner ranked graph replays"   # how `ms` is taken


def cpu_minilm(batch_sizes=(1, 32), threads: int = 1, rounds: int = 7, layers: str = "encoder.*"):
    """W8A8 on MiniLM on the CPU: fp32, ours (``Dynamic(kernel="cpu")``), the reference path,
    ``quantize_dynamic`` on the same Linears, and weight-only int8 (`workbench_kernels.weight_only_cpu`); one row per
    (batch, path)."""
    import warnings

    import pandas as pd

    import workbench as wb
    from workbench.measurement import num_threads

    model = wb.models.load("minilm")
    task = wb.tasks.load("minilm")
    Q = wb.quant
    paths = {"fp32": model,
             "w8a8 cpu (ours)": wb.apply(model, {layers: Q.Dynamic(kernel="cpu")}, progress=False),
             "w8a8 reference": wb.apply(model, {layers: Q.Dynamic(kernel="reference")}, progress=False),
             "int8 weight-only cpu": wb.apply(model, {layers: Q.WeightOnly(8, None, kernel="cpu")},
                                                     progress=False)}
    names = [a.name for a in wb.Plan({layers: Q.Dynamic()}).resolve(model)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        import copy

        qd = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model),
                                                    {n: torch.ao.quantization.default_dynamic_qconfig for n in names},
                                                    dtype=torch.qint8)
    paths["torch quantize_dynamic"] = qd
    rows = []
    with num_threads(threads), torch.inference_mode():
        for batch in batch_sizes:
            inputs = task.example_inputs(batch)
            ms, faults = _interleaved({p: functools.partial(m, *inputs) for p, m in paths.items()}, rounds)
            base, qd_ms = ms["fp32"], ms["torch quantize_dynamic"]
            tokens = int(inputs[0].numel())
            for p, t in ms.items():
                rows.append({"batch": batch, "tokens": tokens, "path": p, "ms": t, "speedup_vs_fp32": base / t,
                             "vs_quantize_dynamic": qd_ms / t, "page_faults": faults[p], "threads": threads,
                             "rounds": rounds})
    return pd.DataFrame(rows)


CPU_PATHS = ("fp32", "bf16", "w8a8 cpu", "int8 weight-only cpu", "int4 g64 weight-only")


def cpu_layer_table(shapes: dict | None = None, ms=(1, 32, 512), threads: int = 1, rounds: int = 9,
                    paths=CPU_PATHS):
    """One Linear layer per (shape, M, path) on the CPU, timed in interleaved rounds (medians): time, speedup
    over fp32, the bytes of the stored weight, the byte-ratio ceiling (fp32 weight bytes / the path's weight
    bytes, biases left out of both: int4 g64 gives 32 / 4.25 = 7.53), the
    arithmetic intensity (FLOPs per byte moved: weight + input + output) and achieved GFLOP/s and GB/s.
    Paths: fp32 and bf16 ``F.linear``; ``Dynamic(kernel="cpu")``; weight-only int8 per channel on the CPU
    kernel (`workbench_kernels.weight_only_cpu`); int4 g64 weight-only on the reference path (decode, then fp32
    matmul)."""
    import pandas as pd

    import workbench as wb
    from workbench.measurement import num_threads

    shapes = {k: SHAPES[k] for k in ("minilm.ffn_in", "minilm.ffn_out")} if shapes is None else shapes
    Q = wb.quant
    rows = []
    with num_threads(threads), torch.inference_mode():
        for shape_name, (K, N) in shapes.items():
            torch.manual_seed(0)
            lin = nn.Sequential(nn.Linear(K, N))
            layers = {"fp32": lin, "bf16": wb.apply(lin, {"0": wb.precision.Cast(torch.bfloat16)}, progress=False),
                      "w8a8 cpu": wb.apply(lin, {"0": Q.Dynamic(kernel="cpu")}, progress=False),
                      "int8 weight-only cpu": wb.apply(lin, {"0": Q.WeightOnly(8, None, kernel="cpu")}, progress=False),
                      "int4 g64 weight-only": wb.apply(lin, {"0": Q.WeightOnly(4, 64, kernel="reference")},
                                                       progress=False)}
            layers = {p: layers[p] for p in paths}
            for M in ms:
                x = torch.randn(M, K)
                inputs = {p: x.to(torch.bfloat16) if p == "bf16" else x for p in layers}
                ms_of, _ = _interleaved({p: functools.partial(m, inputs[p]) for p, m in layers.items()}, rounds)
                base = ms_of.get("fp32", float("nan"))
                for p, m in layers.items():
                    t = ms_of[p]
                    wbytes = wb.size_bytes(m)
                    bias = m[0].bias
                    bias_bytes = 0 if bias is None else bias.numel() * bias.element_size()
                    moved = wbytes + (M * K + M * N) * inputs[p].element_size()   # weight, input, output
                    flops = 2.0 * M * K * N
                    rows.append({"shape": shape_name, "K": K, "N": N, "M": M, "path": p, "ms": t,
                                 "speedup": base / t, "weight_bytes": wbytes,
                                 "ceiling": 4 * K * N / (wbytes - bias_bytes),
                                 "intensity": flops / moved, "GFLOP/s": flops / (t * 1e-3) / 1e9,
                                 "GB/s": moved / (t * 1e-3) / 1e9, "threads": threads})
    return pd.DataFrame(rows)


def gpu_results(path: str | Path | None = None, timing: str | None = None):
    """The GPU rows of a results CSV written by ``python -m workbench.benchmarks.kernels`` (default:
    data/benchmarks/kernels.csv);
    an empty frame when none were recorded (no GPU run yet), the newest run first. ``timing``: keep the rows whose
    ``timing`` column starts with it (``"CUDA-graph"``: GPU time; ``"eager"``: Python calls, host launch overhead
    included)."""
    import pandas as pd

    path = data_dir() / "benchmarks" / "kernels.csv" if path is None else Path(path)
    if not path.is_file():
        return pd.DataFrame()
    df = pd.read_csv(path)
    if "part" not in df.columns:
        return pd.DataFrame()
    df = df[df["part"] == "gpu"]
    if timing is not None and "timing" in df.columns:
        df = df[df["timing"].fillna("").str.startswith(timing)]
    if "run" in df.columns:   # the newest run first (runs are appended), each run's rows in their order
        order = df.groupby("run", sort=False).ngroup()
        df = df.assign(_order=-order).sort_values("_order", kind="stable").drop(columns="_order")
    return df.dropna(axis=1, how="all")


MALLOC_KEEP = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
"""glibc settings under which freed memory stays in the process (no mmap per large buffer, no trimming): the
effect PyTorch's CPU performance guide gets from jemalloc / tcmalloc, without page faults in every pass."""


def _malloc_kept() -> bool:
    return all(os.environ.get(k) == v for k, v in MALLOC_KEEP.items())


def environment() -> str:
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    malloc = ("glibc malloc kept (" + ", ".join(f"{k}={v}" for k, v in MALLOC_KEEP.items()) + ")"
              if _malloc_kept() else "default malloc")
    try:
        import torchao

        ao = f"; torchao {torchao.__version__}"
    except ImportError:
        ao = ""
    return (f"{datetime.date.today()}; {platform.processor() or platform.machine()}; {gpu}; torch {torch.__version__}; "
            f"triton {triton.__version__}{ao}; {malloc}")


def main(argv=None) -> None:
    import pandas as pd

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="the CPU W8A8 MiniLM comparison")
    p.add_argument("--gpu", action="store_true", help="the Triton kernels on a CUDA GPU")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None)
    p.add_argument("--ms", nargs="+", type=int, default=list(MS))
    p.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS))
    p.add_argument("--threads", type=int, default=1, help="CPU threads for --cpu (default 1)")
    p.add_argument("--csv", default="data/benchmarks/kernels.csv",
                   help="results file: the run's rows are appended, earlier rows kept")
    p.add_argument("--run", default=None, help="label of this run's rows (default: the parts and the time)")
    p.add_argument("--no-torchao-compile", action="store_true",
                   help="leave out the torchao configs that are timed compiled (a compile per shape and M)")
    p.add_argument("--malloc-keep", action="store_true",
                   help="re-run under glibc settings that keep freed memory (see MALLOC_KEEP); Linux only")
    a = p.parse_args(argv)
    if a.malloc_keep and not _malloc_kept():
        args = [x for x in (sys.argv[1:] if argv is None else argv) if x != "--malloc-keep"]
        os.execve(sys.executable, [sys.executable, "-m", "workbench.benchmarks.kernels", *args, "--malloc-keep"],
                  {**os.environ, **MALLOC_KEEP})
    run_gpu = a.gpu or (not a.cpu and torch.cuda.is_available())
    run_cpu = a.cpu or not torch.cuda.is_available()
    print(environment())
    tables = []
    if run_gpu:
        shapes = None if a.shapes is None else {k: SHAPES[k] for k in a.shapes}
        df = gpu_table(shapes, a.ms, a.kernels, torchao_compile=() if a.no_torchao_compile else TORCHAO_COMPILE)
        print(f"copy bandwidth {df.attrs['copy_bandwidth_GBs']:.0f} GB/s")
        print(df.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
        tables.append(df.assign(part="gpu"))
    if run_cpu:
        df = cpu_minilm(threads=a.threads)
        print(df.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
        tables.append(df.assign(part="cpu"))
    kept, added = record(pd.concat(tables).assign(environment=environment()), a.csv, a.run)
    print(f"{a.csv}: kept {kept} recorded rows, added {added} (run {a.run or 'named by date'})")


def record(df, path, run: str | None = None) -> tuple[int, int]:
    """Append ``df`` to the results CSV at ``path`` as one run (``run``: its label; default the parts and the
    time), keeping every row already recorded - a benchmark run never overwrites earlier ones (the GPU rows of
    the repository's file came from lent machines and cannot be measured again here). Returns (kept, added)."""
    import pandas as pd

    out = Path(path)
    if run is None:
        run = "-".join(sorted(set(df["part"]))) + time.strftime("_%Y%m%d-%H%M%S")
    df = df.assign(run=run)
    old = pd.read_csv(out) if out.is_file() else pd.DataFrame()
    if "run" in old.columns and run in set(old["run"].astype(str)):
        raise ValueError(f"{out} already has a run named {run!r}; give another --run")
    out.parent.mkdir(parents=True, exist_ok=True)
    if len(old.columns) and set(df.columns) <= set(old.columns):   # append lines: the recorded ones stay as written
        df.reindex(columns=old.columns).to_csv(out, mode="a", header=False, index=False)
    else:
        pd.concat([old, df], ignore_index=True).to_csv(out, index=False)
    return len(old), len(df)


if __name__ == "__main__":
    main()
