"""Dynamic int8 LSTM / GRU speed:
``python -m workbench.benchmarks.recurrent [--threads 1] [--batches 8 32] [--hidden 512]``

Side by side in one process, for each recurrent type and batch size: fp32 ``nn.LSTM`` / ``nn.GRU``, the
workbench's `DynamicQuantLSTM` / `DynamicQuantGRU` (kernel "cpu" unless told) and torch.ao's
``quantize_dynamic`` (fbgemm). After warm-up, rounds are interleaved (each round times every variant once, in a
rotating order) so drifts of a shared machine hit all of them alike; reports medians with the spread
(min - max), the speed ratios and each int8 model's cosine similarity to fp32. The int8 GEMM of the "cpu"
kernel is oneDNN's s8 x s8 (``torch._int_mm``): fast on CPUs with AVX-512 VNNI, a slow generic loop on AVX2-only
CPUs - the ``cpu_flags`` column says which this machine has.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from workbench.measurement import num_threads
from workbench.quantization.recurrent import DynamicQuantGRU, DynamicQuantLSTM

KINDS = {"LSTM": (nn.LSTM, DynamicQuantLSTM), "GRU": (nn.GRU, DynamicQuantGRU)}


def _cpu_flags() -> str:
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        return "unknown"
    return "+".join(f for f in ("avx2", "avx512f", "avx512_vnni", "amx_int8") if f in flags)


def _time_interleaved(fns: dict, x: torch.Tensor, warmup: int, rounds: int) -> dict[str, list[float]]:
    names = list(fns)
    with torch.inference_mode():
        for _ in range(warmup):
            for n in names:
                fns[n](x)
        times = {n: [] for n in names}
        for r in range(rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                fns[n](x)
                times[n].append(time.perf_counter() - t0)
    return times


def bench_recurrent(kinds=("LSTM", "GRU"), batches=(8, 32), seq: int = 64, hidden: int = 512, layers: int = 2,
                    threads: int = 1, warmup: int = 2, rounds: int = 7, kernel: str = "cpu"):
    import pandas as pd

    rows = []
    for kind in kinds:
        F_cls, Q_cls = KINDS[kind]
        torch.manual_seed(0)
        fp32 = F_cls(hidden, hidden, layers).eval()
        ours = Q_cls.from_float(fp32, kernel=kernel)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")                       # torch.ao.quantization is deprecated
            ao = torch.ao.quantization.quantize_dynamic(nn.Sequential(fp32), {F_cls}, dtype=torch.qint8)
        for batch in batches:
            x = torch.randn(seq, batch, hidden)
            with num_threads(threads):
                t = _time_interleaved({"fp32": fp32, "ours": ours, "torch_ao": ao}, x, warmup, rounds)
                with torch.inference_mode():
                    y, yo, ya = fp32(x)[0], ours(x)[0], ao(x)[0]
            med = {n: statistics.median(v) for n, v in t.items()}
            row = {"kind": kind, "seq": seq, "batch": batch, "hidden": hidden, "layers": layers, "threads": threads,
                   "kernel": ours.kernel, "cpu_flags": _cpu_flags(), "rounds": rounds}
            for n, v in t.items():
                row[f"{n}_ms"] = med[n] * 1e3
                row[f"{n}_spread_ms"] = f"{min(v) * 1e3:.2f}-{max(v) * 1e3:.2f}"
            row["speedup_vs_fp32"] = med["fp32"] / med["ours"]
            row["speedup_vs_torch_ao"] = med["torch_ao"] / med["ours"]
            row["torch_ao_vs_fp32"] = med["fp32"] / med["torch_ao"]
            row["cos_ours"] = F.cosine_similarity(yo.flatten(), y.flatten(), dim=0).item()
            row["cos_torch_ao"] = F.cosine_similarity(ya.flatten(), y.flatten(), dim=0).item()
            row["state_bytes_ratio"] = (sum(v.numel() * v.element_size() for v in ours.state_dict().values())
                                        / sum(v.numel() * v.element_size() for v in fp32.state_dict().values()))
            rows.append(row)
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", nargs="+", default=["LSTM", "GRU"], choices=list(KINDS))
    p.add_argument("--batches", nargs="+", type=int, default=[8, 32])
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--kernel", default="cpu", choices=["cpu", "reference"])
    a = p.parse_args(argv)
    df = bench_recurrent(a.kinds, a.batches, a.seq, a.hidden, a.layers, a.threads, rounds=a.rounds, kernel=a.kernel)
    print(df.to_string(index=False))


if __name__ == "__main__":
    main()
