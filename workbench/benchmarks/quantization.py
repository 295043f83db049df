"""Quantization results on the zoo: ``python -m workbench.benchmarks.quantization [--models tiny-lm minilm] [--calib 64]
[--pipelines sequential original] [--group 64]``

For each model: fp32, then weight-only int4/int3 g64 with RTN, GPTQ, AWQ and HQQ on every Linear of the
transformer blocks (MiniLM also quantizes its word embeddings with RTN), then W8A8 dynamic with and
without SmoothQuant - each measured with `wb.measure` (quality on the task's evaluation data, real bytes),
plus the time `wb.apply` took. Calibrated plans run once per calibration ``pipeline`` asked for ("sequential":
block by block on the compressed blocks' outputs, the default; "original": every layer from the float model).
Prints a table and returns it as a DataFrame.
"""
from __future__ import annotations

import argparse
import time

import torch

import workbench as wb

Q = wb.quant
BLOCKS = {"tiny-lm": "h.*", "minilm": "encoder.*", "tiny-llama": "model.layers.*"}


def candidate_plans(model_name: str, bits_list=(4, 3), methods=("rtn", "gptq", "awq", "hqq"), group: int = 64):
    blocks = BLOCKS[model_name]
    for bits in bits_list:
        for method in methods:
            entries = {blocks: Q.WeightOnly(bits, group, symmetric=method != "hqq", method=method)}
            if model_name == "minilm":
                entries["embeddings.word_embeddings"] = Q.WeightOnly(bits, group)
            yield f"W{bits} g{group} {method}", wb.Plan(entries)
    yield "W8A8 dynamic", wb.Plan({blocks: Q.Dynamic()})
    yield "W8A8 dynamic + SmoothQuant 0.5", wb.Plan({blocks: Q.Dynamic(smooth_alpha=0.5)})


def bench_quantization(models=("tiny-lm", "minilm"), calib: int = 64, quick: bool = False, threads: int = 2,
                       bits_list=(4, 3), methods=("rtn", "gptq", "awq", "hqq"), pipelines=("sequential",),
                       group: int = 64):
    import pandas as pd

    rows = []
    for name in models:
        model = wb.models.load(name)
        task = wb.tasks.load(wb.models.spec(name).task)
        calibration = task.calibration(calib)
        base = wb.measure(model, task, quick=quick, threads=threads, progress=False)
        rows.append({"model": name, "plan": "fp32", "pipeline": "", task.primary.name: base.primary_value,
                     "size_bytes": base.size_bytes, "size_ratio": 1.0, "apply_s": 0.0})
        for label, plan in candidate_plans(name, bits_list, methods, group):
            calibrated = any(c is not None and wb.plans.handler_for(c).needs_calibration(c) for c in plan.values())
            for pipeline in pipelines if calibrated else ("",):
                t0 = time.perf_counter()
                with wb.measurement.num_threads(threads):
                    q = wb.apply(model, plan, calibration=calibration, progress=False, pipeline=pipeline or "original")
                took = time.perf_counter() - t0
                m = wb.measure(q, task, quick=quick, threads=threads, progress=False)
                rows.append({"model": name, "plan": label, "pipeline": pipeline, task.primary.name: m.primary_value,
                             "size_bytes": m.size_bytes, "size_ratio": m.size_bytes / base.size_bytes,
                             "apply_s": took})
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny-lm", "minilm"], choices=list(BLOCKS))
    p.add_argument("--calib", type=int, default=64)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bits", type=int, nargs="+", default=[4, 3])
    p.add_argument("--methods", nargs="+", default=["rtn", "gptq", "awq", "hqq"])
    p.add_argument("--pipelines", nargs="+", default=["sequential"], choices=["sequential", "original"])
    p.add_argument("--group", type=int, default=64, help="group size (one that does not divide a layer's inputs, "
                   "e.g. 64 for tiny-llama's 864-wide down_proj, leaves a short last group)")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    print(bench_quantization(a.models, a.calib, a.quick, a.threads, tuple(a.bits), tuple(a.methods),
                             tuple(a.pipelines), a.group).to_string(index=False))


if __name__ == "__main__":
    main()
