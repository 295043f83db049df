"""Fit a compressed model to an export format: each layer the format cannot hold as it is, re-quantized (round to
nearest) into the nearest grid the format holds, with a report of what changed - measured, never estimated.

    from workbench.export.fit import fit

    fitted, report = fit(small, "gguf", task)          # NF4, int3, group-64 layers -> the Q4_0 / Q8_0 grids
    wb.export(fitted, "tiny-llama-q4", format="gguf")
    wb.export(small, "tiny-llama-q4", format="gguf", requantize=task)   # the same, in one call (one warning)

1. The format says, layer by layer, what it needs (`ExportFormat.nearest`): None where it holds the layer as it
   is, the config of the nearest grid it holds (GGUF: ``WeightOnly(bits=4 or 8, group_size=32)``; compressed-tensors:
   integer codes with the same bits and group where it can; ONNX: 2/4/8 bits, a power-of-two group >= 16), or a
   ValueError naming the layer where nothing it holds is near (a pruned, low-rank or cast layer): `fit` refuses then,
   before anything is copied.
2. In a deep copy of the model (the model passed in is only read), each such layer is rebuilt from its **effective
   float weight** - what the layer computes with: the dequantized weight, AWQ's smoothing divided out, GPTQ's
   act-order permutation undone (the layer's ``effective_weight()``) - put in a float layer of the same kind and
   quantized by the config's own handler through `transform_layer`, the step `wb.apply` runs. Layers that share
   their stored tensors (tied embeddings) keep sharing them.
3. The copy records its plans with an exact-name entry per re-quantized layer (ahead of the pattern that chose its
   old config, in the plan that compressed it), so `wb.save` / `wb.load` and the exporters' provenance describe
   exactly the fitted model.

The report is a DataFrame, one row per re-quantized layer: ``layer``, ``from`` (the config its plan gave it),
``to`` (the config it was re-quantized into), ``weight_change`` (``||W' - W|| / ||W||`` of the effective weights).
With a ``task``, the task's primary metric is measured with `wb.measure` on the model and on the fitted model, and
``report.attrs["quality"]`` holds a `QualityChange` (before, after, the change and its 95 % sampling error, and
`wb.measurement.quality_change`'s reading of it).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from workbench.plans import Plan, applied_plans, record_plan, share_tied, swap_layers, transform_layer
from workbench.plans.registry import Config
from workbench.quantization import formats as fm
from workbench.quantization.modules import (
    W8A8Conv1d,
    W8A8Conv2d,
    W8A8ConvTranspose2d,
    W8A8Linear,
    WeightOnlyConv1d,
    WeightOnlyConv2d,
    WeightOnlyConvTranspose2d,
    WeightOnlyEmbedding,
    WeightOnlyLinear,
)

if TYPE_CHECKING:
    import pandas as pd

    from workbench.export import ExportFormat
    from workbench.tasks.base import Task

__all__ = ["fit", "nearest_configs", "float_layer", "Grid", "GRIDS", "weight_grid", "holds_as_is", "QualityChange",
           "RequantizedWarning", "summary", "COLUMNS", "FLOAT_LAYERS"]

COLUMNS = ["layer", "from", "to", "weight_change"]


class RequantizedWarning(UserWarning):
    """`wb.export(..., requantize=...)` re-quantized layers the format could not hold as they were."""


# --- what a layer stores, in the terms every format's `nearest` speaks -------------------------------------------

@dataclass(frozen=True)
class Grid:
    """The grid a quantized layer's weight sits on: bits per value, values per scale along the input (None: per output
    channel), and whether the grid is symmetric (no stored zero point)."""

    bits: int
    group_size: int | None
    symmetric: bool


# weight format class -> its grid (a new format is a new row)
GRIDS: dict[type[fm.WeightFormat], Callable[[Any], Grid]] = {
    fm.IntFormat: lambda f: Grid(f.bits, f.group_size, f.symmetric),        # HQQ: asymmetric, real-valued zero points
    fm.NF4Format: lambda f: Grid(4, f.group_size, True),
    fm.FP8Format: lambda f: Grid(8, None, True),                            # one scale per row
    fm.MXFP4Format: lambda f: Grid(4, f.group_size, True),                  # E2M1 codes: not integer codes
    fm.NVFP4Format: lambda f: Grid(4, f.group_size, True),
    fm.MXFP8Format: lambda f: Grid(8, f.group_size, True),
}


def weight_grid(module: nn.Module) -> Grid:
    """The `Grid` of a quantized layer: its weight format's, or int8 per channel for a W8A8 layer."""
    fmt = getattr(module, "fmt", None)
    if isinstance(fmt, fm.WeightFormat):
        return GRIDS[type(fmt)](fmt)
    return Grid(8, None, True)   # W8A8: int8 per output channel, symmetric


def holds_as_is(encode: Callable[[str, nn.Module], object], name: str, module: nn.Module) -> bool:
    """Whether a format's own layer encoder takes ``module`` as it is: the encoder is the one place that decides what
    the format holds, so `nearest` asks it rather than repeating its rules (its refusal is a ValueError)."""
    try:
        encode(name, module)
    except ValueError:
        return False
    return True


# --- the float layer a compressed layer computes as ----------------------------------------------------------------

def _linear(module: Any, w: torch.Tensor) -> nn.Module:
    return nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device=w.device,
                     dtype=w.dtype)


def _embedding(module: Any, w: torch.Tensor) -> nn.Module:
    return nn.Embedding(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx,
                        device=w.device, dtype=w.dtype)


def _conv(module: Any, w: torch.Tensor) -> nn.Module:
    a = module.conv_args
    if a["input_padding"] is not None:
        raise ValueError(f"pads its input itself ({a['input_padding']}), which a plain float convolution does not: "
                         f"re-quantize it with a plan of its own")
    common: dict[str, Any] = dict(stride=a["stride"], padding=a["padding"], dilation=a["dilation"], groups=a["groups"],
                  bias=module.bias is not None, device=w.device, dtype=w.dtype)
    if module.transposed:
        return nn.ConvTranspose2d(module.in_channels, module.out_channels, a["kernel_size"],
                                  output_padding=a["output_padding"], **common)
    cls = nn.Conv1d if len(a["kernel_size"]) == 1 else nn.Conv2d
    return cls(module.in_channels, module.out_channels, a["kernel_size"], **common)


# compressed layer class -> (it, its effective weight) -> an empty float layer of the same computation
FLOAT_LAYERS: dict[type[nn.Module], Callable[[Any, torch.Tensor], nn.Module]] = {
    WeightOnlyLinear: _linear, W8A8Linear: _linear, WeightOnlyEmbedding: _embedding,
    **{t: _conv for t in (WeightOnlyConv1d, WeightOnlyConv2d, WeightOnlyConvTranspose2d, W8A8Conv1d, W8A8Conv2d,
                          W8A8ConvTranspose2d)}}


def float_layer(name: str, module: Any) -> nn.Module:
    """A float layer computing what the compressed layer ``module`` computes: its effective weight (dequantized,
    smoothing divided out, permutation undone) and its bias, in a plain nn.Linear / nn.Embedding / convolution."""
    make = FLOAT_LAYERS.get(type(module))
    if make is None:
        raise ValueError(f"{name!r} is a {type(module).__name__}, which fit cannot rebuild as a float layer")
    with torch.no_grad():
        w = module.effective_weight().detach()                          # the float layer's shape, as computed with
        try:
            layer: Any = make(module, w)
        except ValueError as e:
            raise ValueError(f"{name!r} {e}") from None
        layer.weight.copy_(w)
        bias = getattr(module, "bias", None)
        if bias is not None:
            layer.bias.copy_(bias.detach())
    return layer.requires_grad_(False)


# --- fit -------------------------------------------------------------------------------------------------------------

def nearest_configs(model: nn.Module, format: str | ExportFormat) -> dict[str, Config]:
    """Layer name -> the config of the nearest grid ``format`` holds, for each layer it cannot hold as it is; raises the
    format's ValueError naming a layer nothing in the format is near."""
    from workbench.export import _format

    fmt = _format(format)
    out: dict[str, Config] = {}
    for name, module in model.named_modules():
        config = fmt.nearest(name, module)
        if config is not None:
            out[name] = config
    return out


@dataclass(frozen=True)
class QualityChange:
    """The task's primary metric on the model and on the fitted model (both `wb.measure`, same settings)."""

    metric: str
    before: float
    after: float
    error: float | None    # 95 % half-width of the difference (None: the task states no sampling error)
    verdict: str           # `wb.measurement.quality_change`: "within sampling error (...)", "worse by ...", ...
    quick: bool

    @property
    def change(self) -> float:
        return self.after - self.before

    def __str__(self) -> str:
        return f"{self.metric} {self.before:.4g} -> {self.after:.4g}: {self.verdict}"


def fit(model: nn.Module, format: str | ExportFormat, task: Task | str | None = None, *, quick: bool = True,
        progress: bool = True) -> tuple[nn.Module, pd.DataFrame]:
    """``(fitted, report)``: a copy of ``model`` whose every layer ``format`` (a name in `FORMATS` or an
    `ExportFormat`) could not hold as it was is re-quantized, round to nearest from its effective float weight, into
    the nearest grid the format holds (see the module docstring); ``model`` is never modified.

    ``report``: one row per re-quantized layer (`COLUMNS`: layer, from, to, weight_change). With ``task`` (a
    `wb.tasks.Task` or its name), its primary metric is measured with `wb.measure` (``quick``) before and after, into
    ``report.attrs["quality"]`` (a `QualityChange`; None when no task was given or nothing was re-quantized).
    Raises ValueError naming the layer where nothing the format holds is near (pruned, low-rank, cast layers).
    """
    import pandas as pd
    from tqdm.auto import tqdm

    from workbench.export import _format

    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module to fit, got {type(model).__name__}")
    fmt = _format(format)
    configs = nearest_configs(model, fmt)
    plans = applied_plans(model)
    fitted = copy.deepcopy(model)
    groups = _shared_groups(fitted, configs)
    new: dict[str, nn.Module] = {}
    rows = []
    for name, config in tqdm(configs.items(), desc=f"fit to {fmt.name}", disable=not progress or len(configs) < 2,
                             leave=False):
        old = fitted.get_submodule(name)
        layer: Any = float_layer(name, old)
        built: Any = transform_layer(name, layer, config).module
        new[name] = built
        with torch.no_grad():
            w, w2 = layer.weight.float(), built.effective_weight().float()
            change = float((w2 - w).norm() / w.norm().clamp_min(torch.finfo(torch.float32).tiny))
        rows.append({"layer": name, "from": _planned(plans, name) or str(getattr(old, "fmt", type(old).__name__)),
                     "to": config, "weight_change": change})
    for group in groups:
        share_tied(group, new)
    swap_layers(fitted, new)
    if configs:
        record_plan(fitted, _refitted_plans(model, plans, configs))
    report = pd.DataFrame(rows, columns=COLUMNS)
    report.attrs["format"] = fmt.name
    report.attrs["quality"] = None
    if task is not None and configs:
        report.attrs["quality"] = _quality(model, fitted, task, quick, progress)
    return fitted, report


def _shared_groups(model: nn.Module, configs: dict[str, Config]) -> list[tuple[str, ...]]:
    """Groups of layers to re-quantize that share their stored weight (tied embeddings), each group in module order;
    a layer sharing it with one that stays as it is cannot be re-quantized alone (the weight would be stored twice)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        stored = module._buffers.get("qweight", module._buffers.get("qweight_t"))
        if stored is not None:
            owners.setdefault(id(stored), []).append(name)
    groups = []
    for names in owners.values():
        chosen = [n for n in names if n in configs]
        if len(names) > 1 and chosen:
            if len(chosen) < len(names) or len({configs[n] for n in names}) > 1:
                raise ValueError(f"{chosen[0]!r} shares its stored weight with {[n for n in names if n != chosen[0]]}, "
                                 f"which the format does not re-quantize into the same grid; fit cannot re-quantize "
                                 f"one copy alone")
            groups.append(tuple(names))
    return groups


def _planned(plans, name: str) -> Config | None:
    """The config the recorded plans gave layer ``name`` (the first plan whose first matching entry has one)."""
    for plan in plans:
        hit = plan.match(name)
        if hit is not None and hit[1] is not None:
            return hit[1]
    return None


def _refitted_plans(model: nn.Module, plans, configs: dict[str, Config]) -> tuple:
    """The plans with an exact entry per re-quantized layer, first in the plan that compressed it; a pattern left
    with no layer of its own is dropped (on `wb.load` it would select nothing, which is an error). A layer no
    plan compressed gets a plan of its own, last."""
    owner: dict[str, int | None] = {}
    for name in configs:
        owner[name] = next((i for i, p in enumerate(plans) if (hit := p.match(name)) is not None and hit[1]), None)
    compressed = [n for n, m in model.named_modules() if type(m).__module__.partition(".")[0] == "workbench"]
    out = []
    for i, plan in enumerate(plans):
        mine = [(n, c) for n, c in configs.items() if owner[n] == i]
        if not mine:
            out.append(plan)
            continue
        deciding: dict[str, set[str]] = {}
        for n in compressed:
            hit = plan.match(n)
            if hit is not None and hit[1] is not None and _planned(plans[:i], n) is None:
                deciding.setdefault(hit[0], set()).add(n)
        kept = [(p, c) for p, c in plan.items()
                if p not in configs and not (c is not None and deciding.get(p) and deciding[p] <= set(configs))]
        out.append(Plan([*mine, *kept], stages=plan.stages))
    rest = [(n, c) for n, c in configs.items() if owner[n] is None]
    if rest:
        out.append(Plan(rest))
    return tuple(out)


def _quality(model: nn.Module, fitted: nn.Module, task, quick: bool, progress: bool) -> QualityChange:
    from workbench.measurement import measure, quality_change
    from workbench.measurement.sampling import combined_halfwidth

    before = measure(model, task, quick=quick, progress=progress)
    after = measure(fitted, task, quick=quick, progress=progress)
    name = before.primary
    error = combined_halfwidth(after.quality_error.get(name), before.quality_error.get(name))
    return QualityChange(name, before.primary_value, after.primary_value, error, quality_change(after, before), quick)


def summary(report: pd.DataFrame, limit: int = 4) -> str:
    """One sentence: what `fit` re-quantized (the first ``limit`` layers, with their weight change) and, where
    measured, the change in the task's metric."""
    fmt = report.attrs.get("format", "the format")
    shown = "; ".join(f"{r.layer}: {_short(r[1])} -> {_short(r[2])} (weight change {r.weight_change:.2%})"
                      for r in report.head(limit).itertuples(index=False))
    more = f"; and {len(report) - limit} more" if len(report) > limit else ""
    quality = report.attrs.get("quality")
    measured = (f". Measured on the task: {quality}" if quality is not None else
                ". Pass requantize=task to measure the change in the task's metric")
    worst = float(report["weight_change"].max()) if len(report) else math.nan
    return (f"re-quantized {len(report)} layer(s) {fmt} cannot hold as they are into the nearest grid it holds "
            f"(round to nearest from the effective weight; largest weight change {worst:.2%}): {shown}{more}"
            f"{measured}")


def _short(config) -> str:
    from workbench.plans.words import describe

    return describe(config) if isinstance(config, Config) else str(config)
