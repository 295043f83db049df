"""Mixture-of-experts decode on the CPU: ``python -m workbench.benchmarks.experts [--hidden 1024] [--threads 1]``

One experts module of a Mixtral-style model (transformers' ``MixtralExperts``: ``num_experts`` experts of
``hidden`` -> ``intermediate`` -> ``hidden``, top-2 routing), timed on decode-sized calls (``tokens`` rows, each
routed to 2 experts at random with a fixed seed), side by side in one process: the float module (the class's eager
per-expert loop, fp32), and the same experts as int4 (groups of 32) weight-only - on the reference path (decode each
routed expert's matrices, then the class's matmuls) and on the CPU kernel path (each routed expert's products on
`workbench_kernels.weight_only_cpu`, reading its packed codes), and as Dynamic W8A8 (int8 codes on the same kernel,
the activations rounded to int8 per token first). Rounds are interleaved after warm-up, one thread by
default; reports medians, their spread, the ratios to fp32, the bytes of the experts read per call (the routed
experts' matrices only) and the largest difference of the outputs to the reference path.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from workbench.measurement import num_threads


def _experts(hidden: int, intermediate: int, experts: int):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=intermediate, num_local_experts=experts,
                        num_experts_per_tok=2)
    cfg._experts_implementation = "eager"
    module = MixtralExperts(cfg).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, hidden ** -0.5)
    return module


def bench_experts(hidden: int = 1024, intermediate: int = 2048, experts: int = 8, tokens=(1, 4), threads: int = 1,
                  warmup: int = 3, rounds: int = 15):
    import pandas as pd

    import workbench as wb

    float_module = _experts(hidden, intermediate, experts)
    holder = torch.nn.Module()
    holder.experts = float_module
    quantized = wb.apply(holder, {"experts": wb.quant.WeightOnly(bits=4, group_size=32)}, progress=False).experts
    reference = copy.deepcopy(quantized).set_kernel("reference")
    w8a8 = wb.apply(holder, {"experts": wb.quant.Dynamic()}, progress=False).experts
    gen = torch.Generator().manual_seed(1)
    rows = []
    for t in tokens:
        x = torch.randn(t, hidden, generator=gen)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(t)])
        w = torch.softmax(torch.randn(t, 2, generator=gen), dim=-1)
        fns = {"fp32": float_module, "int4 reference": reference, "int4 cpu kernel": quantized,
               "w8a8 dynamic cpu kernel": w8a8}
        times = {n: [] for n in fns}
        with num_threads(threads), torch.inference_mode():
            for _ in range(warmup):
                for f in fns.values():
                    f(x, ids, w)
            for r in range(rounds):
                for n in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                    t0 = time.perf_counter()
                    fns[n](x, ids, w)
                    times[n].append(time.perf_counter() - t0)
            ref, out, base = reference(x, ids, w), quantized(x, ids, w), float_module(x, ids, w)
        routed = len(ids.unique())
        per_expert_fp32 = 3 * hidden * intermediate * 4
        med = {n: statistics.median(v) for n, v in times.items()}
        for n, v in times.items():
            rows.append({"tokens": t, "routed experts": routed, "path": n, "threads": threads,
                         "median_ms": round(med[n] * 1e3, 3),
                         "spread_ms": f"{min(v) * 1e3:.3f}-{max(v) * 1e3:.3f}",
                         "speedup_vs_fp32": round(med["fp32"] / med[n], 2),
                         "weight_MB_read": round(routed * per_expert_fp32 / {"fp32": 1, "w8a8 dynamic cpu kernel": 4}
                                                 .get(n, 8) / 1e6, 2),
                         "max_abs_diff_to_reference": (out - ref).abs().max().item() if n == "int4 cpu kernel"
                         else (base - ref).abs().max().item() if n == "fp32"
                         else 0.0 if n == "int4 reference" else float("nan")})   # (W8A8: other numbers)
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args(argv)
    print(bench_experts(a.hidden, a.intermediate, a.experts, a.tokens, a.threads, rounds=a.rounds)
          .to_string(index=False))


if __name__ == "__main__":
    main()
