"""Sensitivity, search and sweep at full size: ``python -m workbench.benchmarks.analysis [--threads 2] [--out DIR]``

1. `wb.sensitivity` over every encoder Linear of MiniLM (36 layers) x 3 candidates (int8 per channel,
   int4 g64, 50 % magnitude sparsity) on the quick fidelity subset: cold (empty cache) and again from the
   cache. Targets on 2 cores: <= 120 s cold, <= 2 s cached.
2. `wb.search` at 35 % of the fp32 bytes of those layers, and at the size of uniform int4; each plan is
   applied and measured on the full fidelity set (predicted vs measured).
3. `wb.sweep` of the uniform plans and the searched ones: one table, Pareto marks, saved as CSV.
Returns the timings and the sweep table; prints both.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import workbench as wb


def candidates() -> dict:
    return {"int8": wb.quant.WeightOnly(bits=8, group_size=None),
            "int4 g64": wb.quant.WeightOnly(bits=4, group_size=64),
            "50% sparse": wb.prune.Magnitude(0.5)}


def bench_analysis(model_name: str = "minilm", task_name: str | None = None, layers: str | None = "encoder.*",
                   threads: int = 2, budget_fraction: float = 0.35, out: str | Path | None = None,
                   quick_verify: bool = False, compare_replay: bool = False):
    import pandas as pd

    model, task = wb.models.load(model_name), wb.tasks.load(task_name or model_name)
    cands = candidates()
    with tempfile.TemporaryDirectory() as cache, wb.measurement.latency.num_threads(threads):
        task.evaluate(model, quick=True)  # reference embeddings are computed once per process: not timed
        t0 = time.perf_counter()
        table = wb.sensitivity(model, task, cands, layers, cache=cache, progress=False)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        cached = wb.sensitivity(model, task, cands, layers, cache=cache, progress=False)
        warm = time.perf_counter() - t0
        no_replay = float("nan")
        if compare_replay:  # the same cold run without prefix replay: slower, identical values
            t0 = time.perf_counter()
            full = wb.sensitivity(model, task, cands, layers, cache=False, replay=False, progress=False)
            no_replay = time.perf_counter() - t0
            assert full["value"].equals(table["value"])
    assert cached["value"].equals(table["value"])
    uniform = wb.analysis.uniform_plans(table)
    int4_bytes = int(table[table.candidate == "int4 g64"]["size_after"].sum())
    plans, reports = {}, {}
    with wb.measurement.latency.num_threads(threads):
        for label, budget in ((f"searched @{budget_fraction:.0%}", wb.Budget.size_fraction(budget_fraction)),
                              ("searched @int4 size", wb.Budget.size(int4_bytes))):
            plan, report = wb.search(model, task, cands, budget, table=table, quick=quick_verify,
                                     verify="quick" if quick_verify else "full", progress=False)
            plans[label], reports[label] = plan, report
        df = wb.sweep(model, task, {**uniform, **plans}, quick=quick_verify, threads=threads, progress=False,
                      path=Path(out) / "analysis_sweep.csv" if out else None)
    # Plans change only the searched layers, so their bytes are the model's minus the untouched rest.
    fp32_layers = int(table.groupby("layer")["size_before"].first().sum())
    rest = int(df.loc[df["label"] == "reference", "size_bytes"].iloc[0]) - fp32_layers
    df["layers_bytes"] = df["size_bytes"] - rest
    df["layers_fraction"] = df["layers_bytes"] / fp32_layers
    timings = pd.DataFrame([{"model": model_name, "layers": table["layer"].nunique(), "candidates": len(cands),
                             "threads": threads, "cold_s": cold, "cached_s": warm, "cold_without_replay_s": no_replay,
                             "replay": table.attrs["replay"]}])
    predicted = pd.DataFrame([{"plan": label, "budget_bytes": r.limit, "predicted": r.predicted_quality,
                               "measured_quick" if quick_verify else "measured": r.measured_quality,
                               "bytes": r.measured_cost, "choices": r.choices["option"].value_counts().to_dict()}
                              for label, r in reports.items()])
    return timings, predicted, df


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget", type=float, default=0.35)
    p.add_argument("--out", default="reports")
    p.add_argument("--compare-replay", action="store_true", help="also time a cold run without prefix replay")
    args = p.parse_args(argv)
    import pandas as pd

    pd.set_option("display.width", 200)
    timings, predicted, df = bench_analysis(threads=args.threads, budget_fraction=args.budget, out=args.out,
                                        compare_replay=args.compare_replay)
    print(timings.to_string(index=False))
    print(predicted.to_string(index=False))
    primary = df.attrs["primary"]
    cols = ["label", primary, "wordsim353", "simlex999", "size_bytes", "layers_fraction", "latency_ms", "pareto_size"]
    print(df[[c for c in cols if c in df.columns]].to_string(index=False))


if __name__ == "__main__":
    main()
