"""Estimate the peak memory and time of a calibration *before* running it: `wb.apply(..., estimate=True)` calls
`estimate_calibration` (also ``wb.analysis.estimate_calibration``), which belongs to the core because `apply`
needs it; `workbench.analysis.estimate` adds the training estimate and re-exports these.

`estimate_calibration(model, plan, calibration)`:
  one calibration batch is recorded exactly as `wb.apply` records it: the peak of that, the distinct
  input storages it keeps and its time are measured; then each distinct (layer type, shape,
  config) is calibrated once on that batch's inputs, peak and time measured. These are scaled to the
  whole calibration set: recorded inputs by the number of tokens, per-layer work by the token-dependent
  part of the technique's cost model (the handler's ``calibration_cost``: bytes and arithmetic, turned
  into seconds with this machine's measured matmul throughput).
  With ``pipeline="original"``: peak = model copy (unless in place) + max(one-batch capture peak + the other
  batches' inputs, all recorded inputs + the largest layer's work). With ``pipeline="sequential"`` (`wb.apply`'s
  default) only one block is held at a time: peak = model copy + max(the peak of one batch run up to the
  last block, the hidden states of every batch at a block boundary + the largest block's kept statistics -
  accumulators such as GPTQ's Hessians, one per input that layers share, or the recorded inputs of layers
  without one - + the largest layer's work); in place, what the blocks replace is spilled to disk
  (`workbench.plans.spill`) and not counted.
  time = forward time x batches + the sum of per-layer times.

It returns an `Estimate` that prints as a short sentence, says whether it fits in the memory available now,
and keeps its parts (``parts``) for inspection. Tests compare the estimates against measured runs.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from workbench.measurement.footprint import peak_allocated_during, size_bytes

__all__ = ["Estimate", "estimate_calibration", "available_memory", "matmul_flops_per_s"]


def available_memory(device: torch.device | str = "cpu") -> int:
    """Bytes that can be allocated now: free GPU memory, or the OS's available RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


@functools.lru_cache(maxsize=8)
def matmul_flops_per_s(threads: int, device: str = "cpu", n: int = 512) -> float:
    """Measured fp32 matmul throughput (the median of 5 timed (n x n) @ (n x n) products)."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    times = []
    for i in range(7):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    times.sort()
    return 2.0 * n ** 3 / times[len(times) // 2]


@dataclass(frozen=True)
class Estimate:
    """An estimate of ``what``: peak bytes and seconds, with their parts."""

    what: str
    peak_bytes: int
    seconds: float
    available_bytes: int
    parts: dict[str, float | int | str] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.available_bytes

    def __str__(self) -> str:
        verdict = "fits in" if self.fits else "EXCEEDS"
        return (f"{self.what}: estimated peak {self.peak_bytes / 2**20:,.1f} MiB ({verdict} the "
                f"{self.available_bytes / 2**30:,.1f} GiB available now), about {_duration(self.seconds)}")

    def to_frame(self):
        import pandas as pd

        return pd.Series({"peak_bytes": self.peak_bytes, "seconds": self.seconds,
                          "available_bytes": self.available_bytes, **self.parts}, name=self.what).to_frame()


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _tokens(t: torch.Tensor) -> int:
    """Rows a layer sees in this input: every dimension but the last (features)."""
    return max(1, t.numel() // max(1, t.shape[-1])) if t.ndim else 1


def estimate_calibration(model: nn.Module, plan, calibration: Iterable[Any], *, inplace: bool = False,
                         pipeline="sequential") -> Estimate:
    """Peak memory and time of ``wb.apply(model, plan, calibration, pipeline=pipeline)`` (see the module
    docstring)."""
    from workbench.plans.apply import _as_plan, normalize_calibration  # (apply imports this module lazily)
    from workbench.plans.layers import capture_inputs, transform_layer
    from workbench.plans.registry import handler_for
    from workbench.tasks.base import model_device

    plan = _as_plan(plan)
    assignments = plan.resolve(model)
    needing = [a for a in assignments if handler_for(a.config).needs_calibration(a.config)]
    device = model_device(model)
    batches = normalize_calibration(calibration, model) if calibration is not None else []
    copy_bytes = 0 if inplace else size_bytes(model)
    if not needing or not batches:
        return Estimate("calibration", copy_bytes, 0.0, available_memory(device),
                        {"model copy bytes": copy_bytes, "calibrated layers": len(needing)})

    # One batch recorded exactly as `wb.apply` records it: the peak of that (the forward pass plus what
    # it keeps), the distinct input storages it keeps, and its time are measured.
    names = [a.name for a in needing]
    records: dict[str, list] = {}

    def capture():
        records.update(capture_inputs(model, names, batches[:1], progress=False))

    capture_peak = peak_allocated_during(capture)
    t0 = time.perf_counter()
    capture_inputs(model, names, batches[:1], progress=False)
    forward_s = time.perf_counter() - t0
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for batch_list in records.values() for batch in batch_list for t in batch}
    first = {n: b[0] for n, b in records.items() if b}
    def lead(b):  # the first input of a batch: positional, or the first keyword input
        return next(iter(b.values())) if isinstance(b, dict) else b[0]

    scale = sum(lead(b).numel() for b in batches) / max(1, lead(batches[0]).numel())
    per_batch = sum(seen.values())
    recorded = int(per_batch * scale)

    # Each distinct (layer type, weight shape, config) is calibrated once on the first batch's inputs
    # (peak and time measured); the token-dependent part of the handler's cost model scales it up.
    rate = matmul_flops_per_s(torch.get_num_threads(), str(device) if device.type == "cuda" else "cpu")
    samples: dict[tuple, tuple[int, float]] = {}
    work_bytes, algorithm_s = 0, 0.0
    for a in needing:
        module = model.get_submodule(a.name)
        handler = handler_for(a.config)
        weight = getattr(module, "weight", None)
        key = (type(module), tuple(weight.shape) if isinstance(weight, torch.Tensor) else None, a.config)
        inputs = [first[a.name]] if a.name in first else None
        if key not in samples:
            peak_1 = peak_allocated_during(functools.partial(transform_layer, a.name, module, a.config, inputs))
            t0 = time.perf_counter()
            transform_layer(a.name, module, a.config, inputs)
            samples[key] = (peak_1, time.perf_counter() - t0)
        peak_1, t_1 = samples[key]
        rows_1 = _tokens(first[a.name][0]) if a.name in first and first[a.name] else 0
        cost_1 = handler.calibration_cost(module, a.config, rows_1)
        if cost_1 is not None:
            b1, f1 = cost_1
            cost_T = handler.calibration_cost(module, a.config, int(rows_1 * scale))
            assert cost_T is not None   # a handler with a cost model has it for any number of rows
            bT, fT = cost_T
            layer_bytes, layer_s = peak_1 + max(0, bT - b1), t_1 + max(0.0, fT - f1) / rate
        else:  # no cost model: assume both grow in proportion to the calibration tokens
            layer_bytes, layer_s = int(peak_1 * scale), t_1 * scale
        work_bytes = max(work_bytes, int(layer_bytes))
        algorithm_s += layer_s
    peak = copy_bytes + max(capture_peak + recorded - per_batch, recorded + work_bytes)
    blocks, chain_peak = _sequential_blocks(model, needing, batches, pipeline)
    if blocks is not None:
        hidden, kept = _block_bytes(model, needing, blocks, batches, records, scale)
        capture_peak = chain_peak   # its one full pass checks the chain on one batch, stopping after the last block
        peak = copy_bytes + max(capture_peak, hidden + kept + work_bytes)
        recorded = hidden + kept
    parts = {"model copy bytes": copy_bytes, "pipeline": "sequential" if blocks is not None else "original",
             "recorded inputs bytes": recorded, "one-batch capture peak bytes": capture_peak,
             "largest layer work bytes": work_bytes, "calibrated layers": len(needing), "batches": len(batches),
             "layers timed": len(samples), "forward s": forward_s * len(batches), "algorithm s": algorithm_s}
    return Estimate("calibration", peak, forward_s * len(batches) + algorithm_s, available_memory(device), parts)


def _sequential_blocks(model: nn.Module, needing, batches, pipeline):
    """(the block list `wb.apply` would calibrate block by block, the peak of checking that they run as a chain on
    one batch); (None, 0) when the original pipeline runs."""
    from workbench.plans.sequential import Pipeline, find_blocks, runs_as_chain

    if Pipeline.of(pipeline) is not Pipeline.SEQUENTIAL:
        return None, 0
    blocks = find_blocks(model, [a.name for a in needing])
    if blocks is None:
        return None, 0
    why: list = []
    peak = peak_allocated_during(lambda: why.append(runs_as_chain(model, blocks, batches[0], [])))
    return (blocks, peak) if why[0] is None else (None, 0)


def _block_bytes(model: nn.Module, needing, blocks, batches, records, scale: float) -> tuple[int, int]:
    """(hidden states of every batch at a block boundary, the largest block's kept statistics), from one batch
    scaled by ``scale`` (the calibration set's size over the first batch's)."""
    from workbench.plans.apply import _statistics
    from workbench.plans.sequential import capture_block_inputs

    first = capture_block_inputs(model, blocks.names[0], batches[:1], progress=False)[0]
    hidden = int(first.hidden.untyped_storage().nbytes() * scale)
    per_block: dict[str, int] = {}
    shared: list[tuple] = []   # (block, input storage, accumulator) of the layers counted so far
    for a in needing:
        block = blocks.block_of(a.name)
        stats = _statistics(a.name, model.get_submodule(a.name), a.config)
        if isinstance(stats, list):   # no accumulator: the layer's inputs are kept, one batch's worth scaled
            size = int(sum(t.untyped_storage().nbytes() for b in records.get(a.name, []) for t in b) * scale)
        else:
            planned = stats.nbytes   # (an accumulator that allocates at its first batch), else its tensors now
            size = int(planned) if planned is not None else sum(
                t.nbytes for t in vars(stats).values() if isinstance(t, torch.Tensor))
            seen = records.get(a.name)
            if seen and seen[0]:   # layers reading one input share one accumulator where it allows
                ptr = seen[0][0].untyped_storage().data_ptr()
                if any(b == block and p == ptr and other.shares_with(stats) for b, p, other in shared):
                    size = 0
                shared.append((block, ptr, stats))
        per_block[block or ""] = per_block.get(block or "", 0) + size
    return hidden, max(per_block.values(), default=0)
