"""A small, honest training loop for the classification tasks (zoo training, QAT, fine-tuning).

``fit_classifier(model, task, epochs=..., lr=...)`` trains with AdamW and a one-cycle schedule on the task's
training split (the calibration data comes from the same split; the test split is never touched), shows a
tqdm progress bar, can be interrupted (Ctrl-C / the notebook's stop button: the model keeps the weights of
the last finished step and is left in eval mode), and returns the per-epoch mean loss. ``workers=N`` trains
with N data-parallel processes on the same global batch (`workbench.distributed`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from workbench.measurement.latency import threads_option

__all__ = ["fit_classifier", "train_epoch", "epoch_batches", "optimizer_step", "one_cycle"]


def one_cycle(params, *, lr: float, weight_decay: float, total_steps: int, optimizer_cls=torch.optim.AdamW):
    """The optimizer and its one-cycle learning-rate schedule, as every trainer here uses them."""
    opt = optimizer_cls(params, lr=lr, weight_decay=weight_decay)
    return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total_steps)


def optimizer_step(loss: torch.Tensor, opt, sched=None, *, weight: float = 1.0, where: tuple[int, int] = (0, 1),
                   clip: float | None = None, params=None) -> float:
    """One update from a batch's loss - the step every trainer here takes. The loss reported is the global
    batch's (``weight``: this worker's share, `distributed.shard`; one all-reduce inside a data-parallel worker)
    and is checked first: a NaN/Inf raises ``FloatingPointError`` before anything changes. Then zero the
    gradients, backward (weighted inside a worker, so DDP's average is the global batch's gradient), clip the
    gradient norm of ``params`` to ``clip`` if given, step the optimizer and the schedule."""
    from workbench.distributed import global_mean

    reported = global_mean(loss.detach() * weight, where)
    if not torch.isfinite(reported):
        raise FloatingPointError(f"the loss became {reported.item()}; try a smaller lr")
    opt.zero_grad(set_to_none=True)
    (loss * weight if where[1] > 1 else loss).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    if sched is not None:
        sched.step()
    return reported.item()


def train_epoch(model: nn.Module, opt, sched, n: int, batch_size: int, generator: torch.Generator,
                batch_loss, where: tuple[int, int] = (0, 1)) -> float:
    """One pass over ``n`` samples in a random order: ``batch_loss(idx)`` gives each batch's loss. Returns the
    mean loss; raises ``FloatingPointError`` (before any update) when a loss is NaN/Inf.

    ``where = (rank, world)`` inside a data-parallel worker: each global batch of ``batch_size`` is shared
    between the workers (`distributed.shard`) and the loss reported is the global batch's."""
    model.train()
    total = 0.0
    for idx, weight, size in epoch_batches(n, batch_size, generator, where):
        total += optimizer_step(batch_loss(idx), opt, sched, weight=weight, where=where) * size
    return total / n


def epoch_batches(n: int, batch_size: int, generator: torch.Generator, where: tuple[int, int] = (0, 1)):
    """The batches of one epoch over ``n`` samples in a random order (``randperm`` from ``generator``), as
    ``(idx, weight, global_size)``: this worker's indices of each global batch (`distributed.shard`), its weight
    in the global mean and the global batch's size. Every trainer here walks its epochs with it."""
    from workbench.distributed import shard

    perm = torch.randperm(n, generator=generator)
    for i in range(0, n, batch_size):
        idx, weight = shard(perm[i:i + batch_size], where)
        if len(idx) == 0:       # a short last batch leaves this worker nothing: it joins with zero weight
            idx, weight = perm[i:i + 1], 0.0
        yield idx, weight, len(perm[i:i + batch_size])


@threads_option
def fit_classifier(model: nn.Module, task, *, epochs: int, lr: float, batch_size: int = 64,
                   weight_decay: float = 1e-4, seed: int = 0, progress: bool = True,
                   optimizer_cls=torch.optim.AdamW, return_optimizer: bool = False, workers: int = 1,
                   strategy: str = "ddp"):
    """Train ``model`` on ``task``'s training split (a classification task, or a `tasks.data.Split`).

    ``optimizer_cls``: any AdamW-like class taking ``(params, lr=, weight_decay=)``, e.g.
    ``wb.precision.AdamW8bit``. ``return_optimizer``: return ``(history, optimizer)`` to inspect its state.
    ``workers``: data-parallel processes (same global ``batch_size``), replicating the model (``strategy="ddp"``)
    or sharding it (``"fsdp"``, `workbench.distributed`); the trained weights come back into ``model``."""
    from workbench import distributed
    from workbench.tasks.base import check_model, model_device

    check_model(model)
    distributed.check_strategy(strategy)
    if distributed.check_workers(workers) > 1 and not distributed.is_worker():
        if return_optimizer:
            raise ValueError("return_optimizer=True needs workers=1: the optimizer lives in the worker processes")
        return distributed.launch(fit_classifier, model, (task,), dict(
            epochs=epochs, lr=lr, batch_size=batch_size, weight_decay=weight_decay, seed=seed, progress=progress,
            optimizer_cls=optimizer_cls), workers, strategy=strategy)
    split = getattr(task, "split", task)
    if not hasattr(split, "x_train"):
        raise TypeError(f"fit_classifier needs a classification task (digits, mnist1d) or a Split, got {task!r}")
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be a positive int, got {epochs!r}")
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr!r}")
    device = model_device(model)
    g = torch.Generator().manual_seed(seed)
    x = torch.from_numpy(split.x_train).to(device)
    y = torch.from_numpy(split.y_train).to(device)
    net, where = distributed.prepare(model)   # (before the optimizer: FSDP replaces the parameters)
    opt, sched = one_cycle([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay,
                           total_steps=epochs * math.ceil(len(x) / batch_size), optimizer_cls=optimizer_cls)
    history: list[float] = []
    try:
        for _ in tqdm(range(epochs), desc="epochs", disable=not progress or where[0] > 0, leave=False):
            history.append(train_epoch(model, opt, sched, len(x), batch_size, g,
                                       lambda idx: F.cross_entropy(net(x[idx]), y[idx]), where))
    finally:
        model.eval()
    return (history, opt) if return_optimizer else history
