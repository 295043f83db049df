"""How long does an honest comparison take?
``python -m workbench.benchmarks.honest [--models ...] [--threads 2] [--repeats 3]``

One point of a trade-off chart costs a side-by-side speedup (`wb.speedup`: paired alternating rounds with a 95 %
interval) and, in the workbench, a whole ``wb.measure(point, task, baseline=original, quick=True)``. The issue's
budget on 2 CPU cores: <= 2 s per point on the small zoo models, <= 5 s on MiniLM.

For each model this times both calls on a compressed copy (int8 weight-only on every layer that takes it) and on
an unchanged deep copy, in interleaved rounds after one warm-up round (which also fills per-process caches such as
MiniLM's reference embeddings), and reports the median and spread of the wall-clock seconds, the rounds the
speedup needed and its interval - the unchanged copy's interval must contain 1.0, or the speed was bought with
honesty.
"""
from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch

import workbench as wb

SMALL = ("digits-mlp", "digits-cnn", "mnist1d-cnn", "tiny-lm")
BUDGET_S = {**{name: 2.0 for name in SMALL}, "minilm": 5.0}


def _point(model):
    return wb.apply(model, wb.Plan({"*": wb.quant.WeightOnly(bits=8, group_size=None)}))


def bench_honest(models=(*SMALL, "minilm"), threads: int = 2, repeats: int = 3):
    """A DataFrame: one row per model x point (int8 / unchanged) x call (speedup / measure)."""
    import pandas as pd

    rows = []
    for name in models:
        model = wb.models.load(name)
        task = wb.tasks.load(wb.models.spec(name).task)
        points = {"int8 weight-only": _point(model), "unchanged copy": copy.deepcopy(model)}
        calls = {
            "wb.speedup": lambda m, model=model, task=task: wb.speedup(m, model, task, threads=threads),
            "wb.measure(quick, baseline)": lambda m, model=model, task=task: wb.measure(
                m, task, quick=True, threads=threads, baseline=model, progress=False).speedup,
        }
        for point in points.values():   # warm-up round
            for call in calls.values():
                call(point)
        times = {(p, c): [] for p in points for c in calls}
        results = {}
        for _ in range(repeats):        # interleaved: every round runs every (point, call) once
            for p, point in points.items():
                for c, call in calls.items():
                    t0 = time.perf_counter()
                    results[p, c] = call(point)
                    times[p, c].append(time.perf_counter() - t0)
        for (p, c), ts in times.items():
            s = results[p, c]
            rows.append({"model": name, "point": p, "call": c, "median_s": statistics.median(ts),
                         "min_s": min(ts), "max_s": max(ts), "budget_s": BUDGET_S.get(name),
                         "rounds": s.rounds, "ratio": s.ratio, "low": s.low, "high": s.high,
                         "verdict": s.verdict, "threads": threads, "repeats": repeats,
                         "torch": torch.__version__, "cpu": platform.processor() or platform.machine()})
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=[*SMALL, "minilm"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    with wb.measurement.latency.num_threads(a.threads):
        df = bench_honest(a.models, a.threads, a.repeats)
    cols = ["model", "point", "call", "median_s", "min_s", "max_s", "budget_s", "rounds", "ratio", "low", "high"]
    print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))


if __name__ == "__main__":
    main()
