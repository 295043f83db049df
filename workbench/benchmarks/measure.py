"""How long does `wb.measure` take?
``python -m workbench.benchmarks.measure [--model minilm] [--threads 2] [--repeats 3]``

The issue's budget on 2 CPU cores: a full `measure` of MiniLM in <= 20 s and ``quick=True`` in <= 5 s.
Prints a table of wall-clock seconds (median of ``repeats`` runs after one warm-up run that also fills
the per-process caches, e.g. MiniLM's fp32 reference embeddings) and returns it as a DataFrame.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import workbench as wb

BUDGET_S = {("minilm", False): 20.0, ("minilm", True): 5.0}


def bench_measure(model_name: str = "minilm", threads: int = 2, repeats: int = 3, quick_modes=(False, True)):
    import pandas as pd

    model = wb.models.load(model_name)
    task = wb.tasks.load(wb.models.spec(model_name).task)
    rows = []
    for quick in quick_modes:
        wb.measure(model, task, quick=quick, threads=threads)  # warm-up: imports, tokenizer, references
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            m = wb.measure(model, task, quick=quick, threads=threads)
            times.append(time.perf_counter() - t0)
        rows.append({"model": model_name, "quick": quick, "threads": threads, "repeats": repeats,
                     "median_s": statistics.median(times), "min_s": min(times),
                     "budget_s": BUDGET_S.get((model_name, quick)), "primary": m.primary_value,
                     "torch": torch.__version__, "cpu": platform.processor() or platform.machine()})
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="minilm")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    print(bench_measure(a.model, a.threads, a.repeats).to_string(index=False))


if __name__ == "__main__":
    main()
