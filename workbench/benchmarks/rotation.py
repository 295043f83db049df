"""Rotations before quantization, measured: ``python -m workbench.benchmarks.rotation [--model tiny-llama]
[--calibration 32] [--quick]``

For each quantization scheme (weights, weights and activations, the KV cache) the model is quantized as it is, after
`wb.quant.Rotate()` (the residual stream and the heads' values, fused into the weights) and after
``Rotate(online=True)`` (also ``down_proj``'s input at run time), and evaluated on the task's held-out windows; in
both rotated rows a quantized KV cache is also rotated per head (``KVCacheFormat(rotate=True)``). Perplexities are
reported with the change the rotation makes to the same scheme as a ratio and its 95 % interval from the windows'
paired losses (the same windows for both, so the interval is that of the difference, not of either perplexity): an
interval holding 1.0 is no measurable change. The inputs of the layers reading the residual stream, ``o_proj`` and
``down_proj`` are summarised by their kurtosis (3 for a Gaussian; large when a few channels hold outliers), before and
after.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import warnings
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from torch import nn

import workbench as wb
from workbench.measurement.sampling import mean_halfwidth
from workbench.quantization import kvcache
from workbench.quantization.rotation import kurtosis

__all__ = ["SCHEMES", "bench_rotation", "input_kurtosis", "main"]

L = "model.layers.*"
# label -> (plan entries of the decoder layers, KV-cache bits or None)
SCHEMES: dict[str, tuple[dict, int | None]] = {
    "fp32": ({}, None),
    "W4 per channel, RTN": ({L: wb.quant.WeightOnly(bits=4, group_size=None)}, None),
    "W3 per channel, RTN": ({L: wb.quant.WeightOnly(bits=3, group_size=None)}, None),
    "W4 g32, GPTQ": ({L: wb.quant.WeightOnly(bits=4, group_size=32, method="gptq")}, None),
    "W8A8 (Dynamic)": ({L: wb.quant.Dynamic()}, None),
    "W4A8 per channel, RTN": ({L: wb.quant.WeightOnly(bits=4, group_size=None, act_bits=8)}, None),
    "W4A4 per channel, RTN": ({L: wb.quant.WeightOnly(bits=4, group_size=None, act_bits=4)}, None),
    "W4A4 per channel, GPTQ": ({L: wb.quant.WeightOnly(bits=4, group_size=None, act_bits=4, method="gptq")}, None),
    "KV4 per token": ({}, 4),
    "KV3 per token": ({}, 3),
    "W4A4 GPTQ + KV4": ({L: wb.quant.WeightOnly(bits=4, group_size=None, act_bits=4, method="gptq")}, 4),
}
ROTATIONS = {"none": None, "Rotate()": wb.quant.Rotate(), "Rotate(online=True)": wb.quant.Rotate(online=True)}
LAYERS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")


def input_kurtosis(model: nn.Module, batch: torch.Tensor, layers: Sequence[str] = LAYERS) -> dict[str, float]:
    """The mean over decoder layers of the kurtosis of each named Linear's input (after any online rotation)."""
    seen: dict[str, list[float]] = {k: [] for k in layers}
    handles = []
    for name, module in model.named_modules():
        for key in layers:
            if name.endswith(key) and ".layers." in name:
                handles.append(module.register_forward_pre_hook(
                    lambda mod, args, _k=key: seen[_k].append(kurtosis(args[0]).item())))
    try:
        with torch.inference_mode():
            model(batch)
    finally:
        for h in handles:
            h.remove()
    return {k: float(np.mean(v)) for k, v in seen.items() if v}


def _losses(task, model: nn.Module, kv_bits: int | None, rotated_kv: bool, quick: bool) -> np.ndarray:
    if kv_bits is None:
        return task.window_losses(model, quick)
    with kvcache.quantized_kv_cache(model, kvcache.KVCacheFormat(bits=kv_bits, rotate=rotated_kv)):
        return task.window_losses(model, quick)


def bench_rotation(model_name: str = "tiny-llama", calibration: int = 32, quick: bool = False,
                   schemes: Sequence[str] | None = None, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(perplexities: one row per scheme and rotation with the paired ratio to the unrotated scheme, kurtosis: one
    row per rotation)."""
    model = wb.models.load(model_name).eval()
    task = wb.tasks.load(model_name)
    cal = task.calibration(calibration)
    rows, kurt = [], []
    rotated = {}
    for label, stage in ROTATIONS.items():
        rotated[label] = model if stage is None else wb.apply(
            model, wb.Plan({}, stages=[dataclasses.replace(stage, seed=seed)]), progress=False)
        kurt.append({"rotation": label, **input_kurtosis(rotated[label], cal[0][0])})
    for scheme in schemes or list(SCHEMES):
        entries, kv_bits = SCHEMES[scheme]
        base = None
        for label, m in rotated.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                q = wb.apply(m, entries, calibration=cal, progress=False) if entries else m
            losses = _losses(task, q, kv_bits, rotated_kv=label != "none", quick=quick)
            row = {"scheme": scheme, "rotation": label, "perplexity": math.exp(losses.mean())}
            if base is None:
                base = losses
                row.update(ratio=1.0, ratio_low=float("nan"), ratio_high=float("nan"))
            else:
                d = losses - base
                h = mean_halfwidth(d)
                row.update(ratio=math.exp(d.mean()), ratio_low=math.exp(d.mean() - h),
                           ratio_high=math.exp(d.mean() + h))
            rows.append(row)
    return pd.DataFrame(rows), pd.DataFrame(kurt)


def markdown(ppl: pd.DataFrame, kurt: pd.DataFrame) -> str:
    """The two tables as markdown: per scheme, the perplexity per rotation and the paired ratio with its interval."""
    out = ["| scheme | " + " | ".join(ROTATIONS) + " |", "|---|" + "---|" * len(ROTATIONS)]
    for scheme, g in ppl.groupby("scheme", sort=False):
        cells = []
        for _, r in g.iterrows():
            if r.rotation == "none":
                cells.append(f"{r.perplexity:.2f}")
            else:
                cells.append(f"{r.perplexity:.2f} ({r.ratio:.3f}x, {r.ratio_low:.3f}-{r.ratio_high:.3f})")
        out.append(f"| {scheme} | " + " | ".join(cells) + " |")
    out += ["", "| input kurtosis | " + " | ".join(c for c in kurt.columns if c != "rotation") + " |",
            "|---|" + "---|" * (len(kurt.columns) - 1)]
    for _, r in kurt.iterrows():
        out.append(f"| {r.rotation} | " + " | ".join(f"{r[c]:.1f}" for c in kurt.columns if c != "rotation") + " |")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--calibration", type=int, default=32, help="calibration windows (GPTQ)")
    p.add_argument("--quick", action="store_true", help="the task's quick evaluation (fewer windows)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schemes", nargs="*", choices=list(SCHEMES), default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    print(f"# {args.model}: perplexity as quantized, with the paired ratio to the same scheme unrotated (95 %)")
    print(markdown(*bench_rotation(args.model, args.calibration, args.quick, args.schemes, args.seed)))


if __name__ == "__main__":
    main()
