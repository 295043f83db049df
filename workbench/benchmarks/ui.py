"""How long from "Apply & measure" to the new chart point? ``python -m workbench.benchmarks.ui [--threads 2]``

For each model, the workbench (widgets included, no browser) measures the reference, then one layer at a time
is changed (int8 weight-only) and "Apply & measure" clicked; the time until the charts hold the new point is
recorded (median over the changed layers). Targets on 2 CPU cores: <= 2 s for digits / mnist1d models, <= 5 s for
MiniLM, in quick mode.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import workbench as wb

CASES = (("digits-cnn", "digits"), ("mnist1d-cnn", "mnist1d"), ("minilm", "minilm"))


def bench_ui(cases=CASES, threads: int = 2, edits: int = 3):
    import pandas as pd

    rows = []
    for model_name, task_name in cases:
        model, task = wb.models.load(model_name), wb.tasks.load(task_name)
        t0 = time.perf_counter()
        app = wb.ui.Workbench(model, task, threads=threads, background=False)  # measures the reference
        first = time.perf_counter() - t0
        layers = [n for n in app.session.layer_names
                  if isinstance(model.get_submodule(n), torch.nn.Linear)][:edits]
        times = []
        for name in layers:
            app.layers.value = (name,)
            app.choose(wb.quant.WeightOnly(bits=8))  # int8 per channel, through the generated form
            app.set_button.click()
            t0 = time.perf_counter()
            app.apply_button.click()
            times.append(time.perf_counter() - t0)
            if "#b00020" in app.status.value:
                raise RuntimeError(app.status.value)
        rows.append({"model": model_name, "threads": threads, "reference_s": first,
                     "one_layer_median_s": statistics.median(times), "one_layer_max_s": max(times),
                     "points": len(app.size_chart.data[0].x)})
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    print(bench_ui(threads=args.threads).to_string(index=False))


if __name__ == "__main__":
    main()
