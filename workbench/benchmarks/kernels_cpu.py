"""CPU benchmarks of the weight-only paths:
``python -m workbench.benchmarks.kernels_cpu [--model tiny-lm] [--threads 1]``

1. `weight_only_table`: one Linear (default 4096 x 4096) at M = 1, 16, 256 rows of x: fp32 and bf16 ``F.linear``;
   int8 per-channel and int4 g128 weight-only layers as the package builds them (``kernel="auto"``, the default:
   `workbench_kernels.weight_only_cpu` on the CPU) and on ``kernel="reference"``; PyTorch's packed CPU kernels
   ``aten._weight_int8pack_mm`` / ``aten._weight_int4pack_mm_for_cpu`` with bf16 activations (their fast path)
   on weights of the same shape; the package's layers also with bf16 activations (a bf16 model's layer).
   Interleaved rounds after a warm-up, one thread by default: the median, the
   fastest and slowest round (spread), the speedup over fp32 and bf16, and the roofline ceiling of each path
   against fp32 at small M: fp32 weight bytes / the path's weight bytes.
2. `gemv_table` (``--gemv``): decode-sized products (M = 1) of LLM layer shapes, the exact CPU kernel against
   ``kernel="cpu-int8"`` (int8-rounded activations on integer dot products) for int4 g32 / g128 and int8 g32,
   beside fp32 / bf16 and the read bandwidth measured in the same rounds.
3. `decode_tokens_per_s`: greedy generation of ``new_tokens`` tokens at batch 1 from a causal LM of the zoo (any
   name: ``wb.models.load(name)``) or a model given as is (`workbench.measurement.decode.greedy`): Hugging Face
   models run ``generate`` with their KV cache; the zoo's own TinyLM (no KV cache) runs its forward over the
   whole context for each new token. Paths:
   fp32, bf16 (every Linear cast), int8 weight-only, int4 g64 weight-only, W8A8 (``Dynamic()``), each with the
   default ``kernel="auto"`` (the kernels that ran are in the table), and the two weight-only formats on
   ``kernel="reference"`` (auto must never be slower than those). Interleaved rounds, medians and spread.

Both are importable and have smoke tests on tiny sizes (tests/kernels/test_weight_only_cpu.py).
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["decode_tokens_per_s", "gemv_table", "interleaved", "main", "read_bandwidth", "split_table",
           "weight_only_table"]


def interleaved(calls: dict, rounds: int, warmup: int = 1, min_ms: float = 0.0) -> dict[str, list[float]]:
    """Milliseconds of each call in each of ``rounds`` interleaved rounds (after ``warmup`` calls each), so slow
    drift of a shared machine hits every path alike. ``min_ms``: a round of a call shorter than this repeats it
    back to back until that long (the same count in every round) and records the mean - for calls of a few
    microseconds, where one call's timing is mostly timer and cache noise."""
    reps = {}
    for name, fn in calls.items():
        for _ in range(warmup):
            fn()
        t0 = time.perf_counter()
        fn()
        once = (time.perf_counter() - t0) * 1e3
        reps[name] = max(1, min(200, int(min_ms / max(once, 1e-4)))) if min_ms > 0 else 1
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            n = reps[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times[name].append((time.perf_counter() - t0) * 1e3 / n)
    return times


def _aten_int8(N: int, K: int):
    """``aten._weight_int8pack_mm`` on an int8 (N, K) weight with bf16 per-channel scales."""
    w = torch.randint(-128, 128, (N, K), dtype=torch.int8)
    s = torch.rand(N, dtype=torch.bfloat16) + 0.5
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, w, s)


def _aten_int4(N: int, K: int, group: int):
    """``aten._weight_int4pack_mm_for_cpu`` on int4 codes packed once by ``_convert_weight_to_int4pack_for_cpu``,
    bf16 (scale, zero) per group."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (N, K), dtype=torch.int32), 1)
    sz = torch.rand(K // group, N, 2, dtype=torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)


def weight_only_table(K: int = 4096, N: int = 4096, ms=(1, 16, 256), threads: int = 1, rounds: int = 7,
                      group: int = 128, aten: bool = True):
    """One row per (M, path): median / min / max ms over the rounds, speedups over fp32 and bf16 (medians), the
    weight bytes and the byte-ratio ceiling over fp32, and the kernel the package's layer recorded."""
    import pandas as pd

    import workbench as wb
    from workbench.measurement import num_threads

    Q = wb.quant
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(K, N, bias=False))
    w32, wbf = lin[0].weight.detach(), lin[0].weight.detach().bfloat16()
    layers = {"int8 WO auto (ours)": wb.apply(lin, {"0": Q.WeightOnly(8, None)}, progress=False),
              "int8 WO reference": wb.apply(lin, {"0": Q.WeightOnly(8, None, kernel="reference")}, progress=False),
              f"int4 g{group} WO auto (ours)": wb.apply(lin, {"0": Q.WeightOnly(4, group)}, progress=False),
              f"int4 g{group} WO reference": wb.apply(lin, {"0": Q.WeightOnly(4, group, kernel="reference")},
                                                      progress=False)}
    weight_bytes = {"fp32": 4 * N * K, "bf16": 2 * N * K, "aten int8 (bf16 x)": N * K + 2 * N,
                    f"aten int4 g{group} (bf16 x)": N * K // 2 + 4 * N * (K // group)}
    weight_bytes.update({p: wb.size_bytes(m) for p, m in layers.items()})
    kernels = {p: m[0].kernel for p, m in layers.items()}
    rows = []
    with num_threads(threads), torch.inference_mode():
        calls_of = {"fp32": lambda x: F.linear(x, w32), "bf16": lambda x: F.linear(x.bfloat16(), wbf)}
        calls_of.update({p: m for p, m in layers.items()})
        for p in ("int8 WO auto (ours)", f"int4 g{group} WO auto (ours)"):   # a bf16 model's layer: bf16 x
            calls_of[p.replace("(ours)", "(ours, bf16 x)")] = lambda x, m=layers[p]: m(x.bfloat16())
            weight_bytes[p.replace("(ours)", "(ours, bf16 x)")] = weight_bytes[p]
            kernels[p.replace("(ours)", "(ours, bf16 x)")] = kernels[p]
        if aten:
            int8, int4 = _aten_int8(N, K), _aten_int4(N, K, group)
            calls_of["aten int8 (bf16 x)"] = lambda x: int8(x.bfloat16())
            calls_of[f"aten int4 g{group} (bf16 x)"] = lambda x: int4(x.bfloat16())
        for M in ms:
            x = torch.randn(M, K)
            times = interleaved({p: functools.partial(fn, x) for p, fn in calls_of.items()}, rounds)
            med = {p: statistics.median(t) for p, t in times.items()}
            for p, t in times.items():
                rows.append({"K": K, "N": N, "M": M, "path": p, "kernel": kernels.get(p, "-"), "ms": med[p],
                             "ms_min": min(t), "ms_max": max(t), "vs_fp32": med["fp32"] / med[p],
                             "vs_bf16": med["bf16"] / med[p], "weight_bytes": weight_bytes[p],
                             "ceiling_vs_fp32": 4 * N * K / weight_bytes[p], "threads": threads, "rounds": rounds})
    return pd.DataFrame(rows)


GEMV_SHAPES = ((4096, 4096), (2048, 5632), (5632, 2048), (32000, 2048))   # (N, K): a 7 B layer; TinyLlama's FFN, head


def read_bandwidth(gib: float = 1.0):
    """A call that reads ``gib`` GiB (``torch.sum`` over an fp32 tensor: the read-bandwidth ceiling of a decode step
    on this machine, at the current thread count) and the bytes it reads."""
    big = torch.ones(int(gib * (1 << 28)))
    return (lambda: big.sum()), big.numel() * 4


def gemv_table(shapes=GEMV_SHAPES, formats=((4, 32), (4, 128), (8, 32)), threads: int = 1, rounds: int = 7,
               bandwidth_gib: float = 1.0):
    """Decode-sized products (M = 1) of each (N, K) weight: fp32 and bf16 ``F.linear``, and per integer format
    (bits, group) the package's layer on ``kernel="auto"`` (the exact CPU kernel) and ``kernel="cpu-int8"``
    (activations rounded to int8, `workbench_kernels.act_int8_cpu`), interleaved with a read of ``bandwidth_gib``
    GiB (`read_bandwidth`). One row per (shape, path): median / min / max ms, the weight's bytes, GB/s of them
    (bytes / median time), that as a share of the bandwidth measured in the same rounds, and the speedup over fp32.
    A weight smaller than the CPU's last-level cache is read from it after the first round (the GB/s of such rows
    can exceed the memory's)."""
    import pandas as pd

    import workbench as wb
    from workbench.measurement import num_threads

    rows = []
    with num_threads(threads), torch.inference_mode():
        read, read_bytes = read_bandwidth(bandwidth_gib)
        for N, K in shapes:
            torch.manual_seed(0)
            lin = nn.Sequential(nn.Linear(K, N, bias=False))
            w32, wbf = lin[0].weight.detach(), lin[0].weight.detach().bfloat16()
            x = torch.randn(1, K)
            calls = {"fp32": functools.partial(F.linear, x, w32),
                     "bf16": functools.partial(F.linear, x.bfloat16(), wbf)}
            nbytes = {"fp32": 4 * N * K, "bf16": 2 * N * K}
            for bits, group in formats:
                for kernel in ("auto", "cpu-int8"):
                    m = wb.apply(lin, {"0": wb.quant.WeightOnly(bits, group, kernel=kernel)}, progress=False)
                    name = f"int{bits} g{group} {m[0].kernel}"
                    calls[name], nbytes[name] = functools.partial(m, x), wb.size_bytes(m)
            calls["read bandwidth"] = read
            times = interleaved(calls, rounds)
            med = {p: statistics.median(t) for p, t in times.items()}
            gbs = read_bytes / med["read bandwidth"] / 1e6
            for p, t in times.items():
                if p == "read bandwidth":
                    continue
                rows.append({"N": N, "K": K, "path": p, "ms": med[p], "ms_min": min(t), "ms_max": max(t),
                             "weight_bytes": nbytes[p], "GB_s": nbytes[p] / med[p] / 1e6,
                             "bandwidth_GB_s": gbs, "share_of_bandwidth": nbytes[p] / med[p] / 1e6 / gbs,
                             "vs_fp32": med["fp32"] / med[p], "threads": threads, "rounds": rounds})
    return pd.DataFrame(rows)


def _layer_cases(shapes, formats, ms):
    """(N, K, format, M, x, packed weight, decoded fp32 weight) for every weight shape, format name (int8, int4
    g128 / g64 / g32, nf4 g64) and rows of x: random weights (seeded) encoded by the package's formats."""
    from workbench.quantization import formats as fm
    from workbench_kernels import weight_only_cpu as wk

    fmts = {"int8": fm.IntFormat(8, None), "int4 g128": fm.IntFormat(4, 128), "int4 g64": fm.IntFormat(4, 64),
            "int4 g32": fm.IntFormat(4, 32), "nf4 g64": fm.NF4Format(64)}
    gen = torch.Generator().manual_seed(0)
    for N, K in shapes:
        weight = torch.randn(N, K, generator=gen) / K ** 0.5
        for f in formats:
            t = fm.encode(weight, fmts[f])
            w, dense = wk.pack(t, fmts[f], K), fm.decode(t, fmts[f], K)
            for M in ms:
                yield N, K, f, M, torch.randn(M, K, generator=gen), w, dense


SPLIT_SHAPES = ((768, 192), (192, 768), (1536, 384), (384, 1536), (1024, 1024), (2048, 2048), (5632, 2048),
                (2048, 5632), (4096, 4096))


def split_table(shapes=SPLIT_SHAPES, ms=(8, 16, 32, 64, 128, 256), threads: int = 1, rounds: int = 7,
                formats: tuple[str, ...] = ("int8", "int4 g128", "int4 g64")):
    """The split path (fp32 x, AMX) against what runs without it (the decode path up to the weight's
    `prefill_rows`, the fp32 prefill path above) and fp32 ``F.linear`` on the decoded weight, side by side in
    interleaved rounds, per weight shape (N, K), format and rows M: the measurements behind `split_rows_for`."""
    import pandas as pd

    from workbench.measurement import num_threads
    from workbench_kernels import weight_only_cpu as wk

    if not wk.split_available():
        raise RuntimeError("split_table: the split path runs on CPUs with AMX bf16 tiles; this one has none "
                           "(cpublas::could_pack(bf16) is false), so there is nothing to compare")
    rows = []
    with num_threads(threads), torch.inference_mode():
        for N, K, f, M, x, w, dense in _layer_cases(shapes, formats, ms):
            calls = {"fp32": functools.partial(F.linear, x, dense),
                     "without split": functools.partial(wk.weight_only_linear_cpu, x, w, split_rows=0),
                     "split": functools.partial(wk.weight_only_linear_cpu, x, w, prefill_rows=0,
                                                split_rows=1 << 30)}
            times = interleaved(calls, rounds)
            med = {p: statistics.median(v) for p, v in times.items()}
            rows.append({"N": N, "K": K, "format": f, "M": M, "fp32_ms": med["fp32"],
                         "without_ms": med["without split"], "split_ms": med["split"],
                         "split_vs_without": med["without split"] / med["split"],
                         "split_vs_without_min": min(a / b for a, b in zip(times["without split"],
                                                                           times["split"])),
                         "split_vs_without_max": max(a / b for a, b in zip(times["without split"],
                                                                           times["split"])),
                         "split_vs_fp32": med["fp32"] / med["split"], "default_rows": w.split_rows,
                         "threads": threads, "rounds": rounds})
    return pd.DataFrame(rows)


BRGEMM_SHAPES = ((10, 128), (64, 64), (256, 64), (128, 256), (192, 192), (576, 192), (768, 192), (192, 768),
                 (512, 512), (1024, 512), (1536, 384), (1024, 1024))


def brgemm_table(shapes=BRGEMM_SHAPES, ms=(4, 8, 16, 32, 64, 128, 256, 512), threads: int = 1, rounds: int = 7,
                 formats: tuple[str, ...] = ("int8", "int4 g64", "int4 g32")):
    """The fp32 brgemm path (decoded fp32 blocks times oneDNN's fp32 brgemm) against the paths without it (the
    decode path up to the weight's `prefill_rows`, the fp32 prefill path - MKL's GEMM on decoded blocks - above;
    no split path) and fp32 ``F.linear`` on the decoded weight, side by side in interleaved rounds: the
    measurements behind `brgemm_rows_for`."""
    import pandas as pd

    from workbench.measurement import num_threads
    from workbench_kernels import weight_only_cpu as wk

    rows = []
    with num_threads(threads), torch.inference_mode():
        for N, K, f, M, x, w, dense in _layer_cases(shapes, formats, ms):
            calls = {"fp32": functools.partial(F.linear, x, dense),
                     "without": functools.partial(wk.weight_only_linear_cpu, x, w, split_rows=0,
                                                  brgemm_rows=0),
                     "brgemm": functools.partial(wk.weight_only_linear_cpu, x, w, split_rows=0,
                                                 prefill_rows=0, brgemm_rows=1 << 30)}
            times = interleaved(calls, rounds, min_ms=0.3)
            med = {p: statistics.median(v) for p, v in times.items()}
            ratios = [a / b for a, b in zip(times["without"], times["brgemm"])]
            rows.append({"N": N, "K": K, "format": f, "M": M, "fp32_ms": med["fp32"],
                         "without_ms": med["without"], "brgemm_ms": med["brgemm"],
                         "brgemm_vs_without": med["without"] / med["brgemm"],
                         "brgemm_vs_without_min": min(ratios), "brgemm_vs_without_max": max(ratios),
                         "brgemm_vs_fp32": med["fp32"] / med["brgemm"], "default_rows": w.brgemm_rows,
                         "prefill_rows": w.prefill_rows, "threads": threads, "rounds": rounds})
    return pd.DataFrame(rows)


def decode_tokens_per_s(model: nn.Module | str = "tiny-lm", new_tokens: int = 64, prompt_tokens: int = 8,
                        threads: int = 1, rounds: int = 3, paths: tuple[str, ...] | None = None):
    """Tokens per second of greedy batch-1 generation for each path (see the module docstring): median, min and
    max over interleaved rounds, the speedup over fp32 and bf16, the kernels that ran and whether the path
    generated the same tokens as fp32 (greedy decoding: a quantized model may legitimately differ)."""
    import pandas as pd

    import workbench as wb
    from workbench.measurement import num_threads
    from workbench.measurement.decode import greedy as _greedy
    from workbench.measurement.decode import vocab_size

    name = model if isinstance(model, str) else type(model).__name__
    base = wb.models.load(model) if isinstance(model, str) else model
    base = base.eval()
    Q = wb.quant
    # every Linear except one whose weight is tied to another layer (a Llama's lm_head shares the embedding's
    # table: the plan would refuse it alone) - that one stays fp32 on every path
    holders: dict[int, int] = {}
    for m in base.modules():
        for t in m.parameters(recurse=False):
            holders[id(t)] = holders.get(id(t), 0) + 1
    linears = [n for n, m in base.named_modules() if isinstance(m, nn.Linear) and holders[id(m.weight)] == 1]

    def plan(cfg):
        return wb.Plan({n: cfg for n in linears})

    variants = {"fp32": lambda: base,
                "bf16": lambda: wb.apply(base, plan(wb.precision.Cast(torch.bfloat16)), progress=False),
                "int8 WO": lambda: wb.apply(base, plan(Q.WeightOnly(8, None)), progress=False),
                "int4 g64 WO": lambda: wb.apply(base, plan(Q.WeightOnly(4, 64)), progress=False),
                "W8A8 dynamic": lambda: wb.apply(base, plan(Q.Dynamic()), progress=False),
                "int8 WO reference": lambda: wb.apply(base, plan(Q.WeightOnly(8, None, kernel="reference")),
                                                      progress=False),
                "int4 g64 WO reference": lambda: wb.apply(base, plan(Q.WeightOnly(4, 64, kernel="reference")),
                                                          progress=False)}
    variants = {p: v for p, v in variants.items() if paths is None or p in paths}
    models = {p: v() for p, v in variants.items()}
    torch.manual_seed(0)
    prompt = torch.randint(1, vocab_size(base), (1, prompt_tokens))
    rows = []
    with num_threads(threads), torch.inference_mode():
        out = {p: _greedy(m, prompt, new_tokens) for p, m in models.items()}
        times = interleaved({p: functools.partial(_greedy, m, prompt, new_tokens) for p, m in models.items()},
                            rounds, warmup=0)
    for p, m in models.items():
        assert out[p].shape[1] == prompt_tokens + new_tokens, (p, out[p].shape)
        t = times[p]
        tps = [new_tokens / (v * 1e-3) for v in t]
        kernels: dict[str, int] = {}
        for mod in m.modules():
            if hasattr(mod, "kernel") and isinstance(mod.kernel, str):
                key = f"{type(mod).__name__}:{mod.kernel}"
                kernels[key] = kernels.get(key, 0) + 1
        rows.append({"model": name, "path": p, "tokens_per_s": statistics.median(tps), "tokens_per_s_min": min(tps),
                     "tokens_per_s_max": max(tps), "same_tokens_as_fp32": bool(torch.equal(out[p], out["fp32"]))
                     if "fp32" in out else None, "kernels": ", ".join(f"{k} x{v}" for k, v in sorted(kernels.items())),
                     "new_tokens": new_tokens, "threads": threads, "rounds": rounds,
                     "kv_cache": hasattr(m, "generate") and hasattr(m, "config")})
    df = pd.DataFrame(rows)
    for ref in ("fp32", "bf16"):
        if ref in set(df["path"]):
            df[f"vs_{ref}"] = df["tokens_per_s"] / float(df.loc[df["path"] == ref, "tokens_per_s"].iloc[0])
    return df


def main(argv=None) -> None:
    from workbench.benchmarks.kernels import environment

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-lm", help="causal-LM zoo name for the decode benchmark")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--size", type=int, nargs=2, default=(4096, 4096), metavar=("K", "N"))
    p.add_argument("--ms", type=int, nargs="+", default=[1, 16, 256], help="rows of x for the layer table")
    p.add_argument("--skip-layer", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--split", action="store_true", help="only the split path's table (fp32 x, AMX)")
    p.add_argument("--gemv", action="store_true",
                   help="only the decode-sized table: exact vs int8-activation kernels against the read bandwidth")
    a = p.parse_args(argv)
    print(environment())
    def fmt(v):
        return f"{v:.3g}"

    if a.gemv:
        print(gemv_table(threads=a.threads, rounds=a.rounds).drop(columns=["threads", "rounds"])
              .to_string(index=False, float_format=fmt))
        return

    if a.split:
        print(split_table(threads=a.threads, rounds=a.rounds).drop(columns=["threads", "rounds"])
              .to_string(index=False, float_format=fmt))
        return
    if not a.skip_layer:
        df = weight_only_table(*a.size, ms=a.ms, threads=a.threads, rounds=a.rounds)
        print(df.drop(columns=["K", "N", "threads", "rounds"]).to_string(index=False, float_format=fmt))
    if not a.skip_decode:
        df = decode_tokens_per_s(a.model, threads=a.threads, rounds=max(3, a.rounds // 2))
        print(df.to_string(index=False, float_format=fmt))


if __name__ == "__main__":
    main()
