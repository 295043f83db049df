"""Does structured pruning make models faster? ``python -m workbench.benchmarks.pruning [--threads 1] [--batch 64]``

Side by side in one process, one thread by default, median latency of timed runs:
- a wide MLP 1024 -> 4096 -> 1024 with 50 % of its hidden neurons removed;
- a VGG-style CNN on 32x32 inputs (conv 3-64-128-256, BatchNorm, pooling, Linear) with 50 % of the channels of
  every conv but the last removed (and its BatchNorms and consumers fixed);
- the same MLP with 50 % *unstructured* magnitude sparsity, which saves no time (dense kernels).
Returns a DataFrame with the speedups.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import workbench as wb


def wide_mlp(width: int = 1024, hidden: int = 4096) -> nn.Module:
    return nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width)).eval()


def vgg_cnn(classes: int = 10, size: int = 32) -> nn.Module:
    def block(i, o):
        return [nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(*block(3, 64), *block(64, 128), *block(128, 256), nn.Flatten(),
                         nn.Linear(256 * (size // 8) ** 2, classes)).eval()


def bench_structured(batch: int = 64, threads: int = 1, amount: float = 0.5, mlp=(1024, 4096), cnn_size: int = 32):
    import pandas as pd

    torch.manual_seed(0)
    rows = []
    mlp_model = wide_mlp(*mlp)
    x = (torch.randn(batch, mlp[0]),)
    cases = [("MLP %d-%d-%d" % (mlp[0], mlp[1], mlp[0]), mlp_model, wb.prune.channels(mlp_model, {"0": amount}), x),
             ("MLP, unstructured magnitude", mlp_model,
              wb.prune.finalize(wb.apply(mlp_model, {"*": wb.prune.Magnitude(amount)}, progress=False)), x)]
    cnn = vgg_cnn(size=cnn_size)
    xi = (torch.randn(batch, 3, cnn_size, cnn_size),)
    cases.append(("VGG-style CNN %dx%d" % (cnn_size, cnn_size), cnn,
                  wb.prune.channels(cnn, {"0": amount, "4": amount}, example_inputs=xi), xi))
    for label, dense, pruned, inputs in cases:
        lat = {}
        for _ in range(2):  # alternate, so drifting machine load hits both alike
            for key, model in (("dense", dense), ("pruned", pruned)):
                t = wb.measurement.time_forward(model, inputs, warmup=2, min_runs=10, max_runs=30, budget_s=2.0,
                                                threads=threads)
                lat.setdefault(key, []).append(t.median_ms)
        d, p = min(lat["dense"]), min(lat["pruned"])
        rows.append({"model": label, "batch": batch, "threads": threads, "dense_ms": d, "pruned_ms": p,
                     "speedup": d / p, "params_ratio": wb.size_bytes(pruned) / wb.size_bytes(dense)})
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args(argv)
    print(bench_structured(a.batch, a.threads).to_string(index=False))


if __name__ == "__main__":
    main()
