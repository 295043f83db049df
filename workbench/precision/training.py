"""Mixed-precision training: autocast with fp16 + dynamic loss scaling, or bf16 without, fp32 master weights.

`AmpStep` does one optimisation step in the chosen precision. The parameters (and so the optimizer's
"master" weights) stay fp32; autocast runs the matmuls and convolutions in fp16 / bf16. fp16 uses
``torch.amp.GradScaler`` with its standard dynamics - initial scale 2^16, doubled after 2000 consecutive good
steps, halved on a step whose gradients contain Inf/NaN, which is then skipped - and `AmpStep` counts the
skipped steps. bf16 has fp32's range and needs no scaling.

`fit_mixed` trains a classifier that way and `compare_precisions` measures fp32 vs bf16 vs fp16+scaling on the
same seed: median step time, peak memory of a training step, final accuracy and skipped steps (a DataFrame).
"""
from __future__ import annotations

import copy
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from workbench.measurement.latency import threads_option
from workbench.training import epoch_batches, one_cycle

__all__ = ["PRECISIONS", "AmpStep", "fit_mixed", "compare_precisions"]

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class AmpStep:
    """``step(loss_fn) -> loss``: forward + backward + optimizer step in ``precision`` ("fp32", "bf16", "fp16")."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision: str = "fp32",
                 init_scale: float = 2.0 ** 16, growth_interval: int = 2000):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
        if any(p.dtype != torch.float32 for p in model.parameters() if p.requires_grad):
            raise ValueError("mixed precision keeps fp32 master weights: the model's trainable parameters must be fp32")
        self.model, self.optimizer, self.precision = model, optimizer, precision
        self.device = next(model.parameters()).device.type
        self.scaler = torch.amp.GradScaler(self.device, init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5,
                                           growth_interval=growth_interval) if precision == "fp16" else None
        self.steps = 0
        self.skipped = 0

    @property
    def scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def __call__(self, loss_fn) -> torch.Tensor:
        dtype = PRECISIONS[self.precision]
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = loss_fn()
        self.steps += 1
        if self.scaler is None:
            if not torch.isfinite(loss):
                self.skipped += 1
                return loss.detach()
            loss.backward()
            self.optimizer.step()
            return loss.detach()
        before = self.scale
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)     # skipped when the unscaled gradients hold Inf/NaN
        self.scaler.update()
        if self.scale < before:
            self.skipped += 1
        return loss.detach()


def _train_step_peak(model: nn.Module, step: AmpStep, x: torch.Tensor, y: torch.Tensor) -> int:
    from workbench.measurement.footprint import peak_allocated_during

    return peak_allocated_during(lambda: step(lambda: F.cross_entropy(model(x), y)))


@threads_option
def fit_mixed(model: nn.Module, task, *, precision: str = "fp32", epochs: int = 5, lr: float = 3e-3,
              batch_size: int = 64, seed: int = 0, progress: bool = True) -> dict:
    """Train ``model`` in ``precision``; returns step times, peak step memory, skipped steps and accuracy."""
    from workbench.measurement.footprint import size_bytes

    split = getattr(task, "split", None)
    if split is None:
        raise TypeError(f"fit_mixed needs a classification task (digits, mnist1d), got {task!r}")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    from workbench.tasks.base import model_device

    device = model_device(model)   # the task's arrays live on the CPU; the model may be on a GPU
    x = torch.as_tensor(split.x_train).to(device)
    y = torch.as_tensor(split.y_train).to(device)
    opt, sched = one_cycle(model.parameters(), lr=lr, weight_decay=1e-4,
                           total_steps=epochs * math.ceil(len(x) / batch_size))
    step = AmpStep(model, opt, precision)   # the update: autocast forward, scaled backward, skipped on Inf/NaN
    times = []
    model.train()
    peak = None
    try:
        for _ in tqdm(range(epochs), desc=f"train {precision}", disable=not progress, leave=False):
            for idx, _, _ in epoch_batches(len(x), batch_size, g):
                if peak is None and len(idx) == batch_size:
                    peak = size_bytes(model) + _train_step_peak(model, step, x[idx], y[idx])
                else:
                    t0 = time.perf_counter()
                    step(lambda idx=idx: F.cross_entropy(model(x[idx]), y[idx]))
                    times.append((time.perf_counter() - t0) * 1e3)
                sched.step()
    finally:
        model.eval()
    return {"precision": precision, "step_ms": statistics.median(times), "peak_step_memory_bytes": peak,
            "skipped_steps": step.skipped, "steps": step.steps, "final_scale": step.scale,
            "accuracy": task.evaluate(model)["accuracy"]}


def compare_precisions(model: nn.Module, task, *, precisions=("fp32", "bf16", "fp16"), epochs: int = 5,
                       lr: float = 3e-3, seed: int = 0, threads: int | None = None, progress: bool = True):
    """The same fresh copy of ``model`` trained in each precision on the same seed, as a DataFrame."""
    import pandas as pd

    from workbench.measurement.latency import num_threads

    rows = []
    with num_threads(threads) as used:
        for p in precisions:
            rows.append({**fit_mixed(copy.deepcopy(model), task, precision=p, epochs=epochs, lr=lr, seed=seed,
                                     progress=progress), "threads": used})
    return pd.DataFrame(rows)


class _Checkpointed(nn.Module):
    """Runs ``block`` under activation checkpointing while training: its activations are recomputed in the
    backward pass instead of kept, trading compute for memory."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args):
        if self.training and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self.block, *args, use_reentrant=False)
        return self.block(*args)


def checkpoint_blocks(model: nn.Module, blocks: str) -> nn.Module:
    """A copy of ``model`` whose ``nn.ModuleList`` at ``blocks`` (e.g. "h" for tiny-lm, "encoder.layer" for
    MiniLM) runs each block with gradient checkpointing during training. Parameter names gain ``.block``."""
    target = copy.deepcopy(model)
    layers = target.get_submodule(blocks)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{blocks!r} is a {type(layers).__name__}, not an nn.ModuleList of blocks")
    target.set_submodule(blocks, nn.ModuleList(_Checkpointed(b) for b in layers))
    return target


__all__ += ["checkpoint_blocks"]
