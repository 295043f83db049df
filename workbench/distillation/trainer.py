"""`fit`: train a student against a teacher, with progress, early stopping and nothing lost.

    history = wb.distill.fit(student, teacher, task, epochs=10, alpha=0.7, temperature=4.0)

Classification tasks (digits, mnist1d): the logit loss `kd_loss` on the training split, minus a held-out
validation slice (10 %, seeded) that drives early stopping (``patience`` epochs without improvement; the best
weights are restored). The test split is never seen. ``alpha=0`` trains on hard labels only - the baseline
with the same budget. Sentence encoders (minilm): `fit_embeddings` distils embeddings on the calibration text;
it also distils without labels on any task's calibration batches (e.g. `wb.tasks.Fidelity`), keyword inputs and
Hugging Face outputs included. A `wb.tasks.Classification` with a labelled calibration split trains with `fit`.

A NaN/Inf loss stops training with a message and restores the last good weights. The history is a DataFrame
(epoch, train loss, validation metric). Works for any student whose output matches the teacher's: a fresh
model, a pruned or QAT-prepared copy of the teacher, or a user model pair. ``workers=N`` on `fit` and
`fit_embeddings` trains with N data-parallel processes on the same global batch (`workbench.distributed`); the
trained student comes back into the caller's model.
"""
from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from workbench import distributed
from workbench.distillation.losses import check_kd_args, embedding_loss, kd_loss
from workbench.measurement.latency import threads_option
from workbench.training import one_cycle, optimizer_step, train_epoch

__all__ = ["fit", "fit_embeddings"]


def _state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Taps:
    """Forward hooks recording chosen layers' outputs (for feature distillation)."""

    def __init__(self, model: nn.Module, names):
        self.out: dict[str, torch.Tensor] = {}
        self.handles = []
        for name in names:
            try:
                module = model.get_submodule(name)
            except AttributeError:
                raise ValueError(f"feature distillation: {type(model).__name__} has no layer {name!r}") from None
            self.handles.append(module.register_forward_hook(
                lambda mod, args, out, name=name: self.out.__setitem__(name, out)))

    def close(self):
        for h in self.handles:
            h.remove()


class _Trained(nn.Module):
    """The student with the learned projections of feature distillation, so that DDP averages both."""

    def __init__(self, student: nn.Module, extras: nn.Module):
        super().__init__()
        self.student, self.extras = student, extras

    def forward(self, *args, **kwargs):
        return self.student(*args, **kwargs)


def _flat_features(t: torch.Tensor) -> torch.Tensor:
    """(B, C, ...) conv maps -> (B, ..., C) so a Projection acts on channels; (B, ..., C) stays."""
    return t.movedim(1, -1) if t.ndim > 2 and t.shape[1] != t.shape[-1] else t


@threads_option
def fit(student: nn.Module, teacher: nn.Module, task, *, epochs: int = 10, lr: float = 1e-3, alpha: float = 0.5,
        temperature: float = 4.0, batch_size: int = 64, patience: int | None = 3, seed: int = 0,
        weight_decay: float = 1e-4, features: dict[str, str] | None = None, beta: float = 1.0,
        progress: bool = True, workers: int = 1, strategy: str = "ddp"):
    """See the module docstring. ``features``: ``{student layer: teacher layer}`` whose outputs are matched with
    an MSE (weight ``beta``), through a learned `Projection` where the channel widths differ. ``workers``:
    data-parallel processes sharing each global batch of ``batch_size``, replicating the student (``strategy=
    "ddp"``) or sharding it (``"fsdp"``)."""
    import pandas as pd

    from workbench.distillation.losses import Projection, feature_loss

    check_kd_args(alpha, temperature)
    distributed.check_strategy(strategy)
    if distributed.check_workers(workers) > 1 and not distributed.is_worker():
        return distributed.launch(fit, student, (teacher, task), dict(
            epochs=epochs, lr=lr, alpha=alpha, temperature=temperature, batch_size=batch_size, patience=patience,
            seed=seed, weight_decay=weight_decay, features=features, beta=beta, progress=progress), workers,
            strategy=strategy)
    split = getattr(task, "split", task)          # a classification task, or a tasks.data.Split
    if not hasattr(split, "x_train"):
        raise TypeError(f"fit needs a classification task (digits, mnist1d) or a Split; for sentence encoders "
                        f"use fit_embeddings; got {task!r:.80}")
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be a positive int, got {epochs!r}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(split.x_train))
    n_val = max(1, len(order) // 10)
    val_idx, train_idx = order[:n_val], order[n_val:]
    x = torch.from_numpy(split.x_train[train_idx])
    y = torch.from_numpy(split.y_train[train_idx])
    xv = torch.from_numpy(split.x_train[val_idx])
    yv = torch.from_numpy(split.y_train[val_idx])
    teacher.eval()
    with torch.no_grad():
        t_logits = teacher(x)                                  # (N, classes), computed once
        probe = student.eval()(x[:2])
    if probe.shape[1:] != t_logits.shape[1:]:
        raise ValueError(f"the student outputs shape {tuple(probe.shape[1:])} per sample but the teacher outputs "
                         f"{tuple(t_logits.shape[1:])}; they must match")
    projections = nn.ModuleDict()
    proj_for: dict[str, nn.Module | None] = {}
    s_taps = t_taps = None
    if features:
        s_taps, t_taps = _Taps(student, features), _Taps(teacher, features.values())
        with torch.no_grad():
            student(x[:2])
            teacher(x[:2])
        for s_name, t_name in features.items():
            ds, dt = _flat_features(s_taps.out[s_name]).shape[-1], _flat_features(t_taps.out[t_name]).shape[-1]
            if ds != dt:    # initialised from ``seed``: the same in every worker and every run
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed + len(projections))
                    projections[s_name.replace(".", "_")] = Projection(ds, dt)
            proj_for[s_name] = projections[s_name.replace(".", "_")] if ds != dt else None

    if len(projections) and distributed.strategy_here() == "fsdp":
        # the student was sharded (and has run) on its own: each projection is sharded as its own group
        for proj in projections.values():
            distributed.shard_model(proj)
        net, where = distributed.prepare(student)
    else:
        net, where = distributed.prepare(_Trained(student, projections) if len(projections) else student)

    def batch_loss(idx):
        loss = kd_loss(net(x[idx]), t_logits[idx], y[idx], alpha, temperature)
        if features:
            with torch.no_grad():
                teacher(x[idx])
            for s_name, t_name in features.items():
                loss = loss + beta * feature_loss(_flat_features(s_taps.out[s_name]),
                                                  _flat_features(t_taps.out[t_name]), proj_for[s_name])
        return loss

    g = torch.Generator().manual_seed(seed)
    params = [p for p in student.parameters() if p.requires_grad] + list(projections.parameters())
    opt, sched = one_cycle(params, lr=lr, weight_decay=weight_decay,
                           total_steps=epochs * math.ceil(len(x) / batch_size))
    best = (-1.0, _state(student), 0)
    rows, stale = [], 0
    try:
        for epoch in tqdm(range(1, epochs + 1), desc="distill", disable=not progress or where[0] > 0, leave=False):
            good = _state(student)  # the weights at the end of the previous epoch: restored on a NaN loss
            try:
                train_loss = train_epoch(student, opt, sched, len(x), batch_size, g, batch_loss, where)
            except FloatingPointError as e:
                student.load_state_dict(good)
                warnings.warn(f"distillation stopped at epoch {epoch}: {e}; the last good weights were kept",
                              RuntimeWarning, stacklevel=2)
                break
            student.eval()
            with torch.no_grad():
                val = float((student(xv).argmax(-1) == yv).float().mean())
            rows.append({"epoch": epoch, "train_loss": train_loss, "val_accuracy": val})
            if val > best[0]:
                best, stale = (val, _state(student), epoch), 0
            else:
                stale += 1
                if patience is not None and stale >= patience:
                    break
    finally:
        student.eval()
        for taps in (s_taps, t_taps):
            if taps is not None:
                taps.close()
    if rows:  # best validation epoch (the NaN case with no finished epoch keeps the restored weights)
        student.load_state_dict(best[1])
    history = pd.DataFrame(rows, columns=["epoch", "train_loss", "val_accuracy"])
    history.attrs["best_epoch"] = best[2]
    return history


@threads_option
def fit_embeddings(student: nn.Module, teacher: nn.Module, task, *, epochs: int = 3, lr: float = 5e-5,
                   n: int = 150, batch_size: int = 8, kind: str = "cosine", progress: bool = True, workers: int = 1,
                   strategy: str = "ddp"):
    """Distil a sentence encoder on ``n`` calibration documents of ``task`` (embedding loss); returns the history.
    ``workers``: data-parallel processes (DDP), each taking its share of every calibration batch."""
    import pandas as pd

    from workbench.tasks.inputs import call, output_tensor

    def embed(model, b):  # a tensor, a tuple or a Hugging Face ModelOutput (its logits / last_hidden_state)
        return output_tensor(call(model, b), "fit_embeddings")

    distributed.check_strategy(strategy)
    if distributed.check_workers(workers) > 1 and not distributed.is_worker():
        distributed.check_batch_size(batch_size, workers)
        return distributed.launch(fit_embeddings, student, (teacher, task), dict(
            epochs=epochs, lr=lr, n=n, batch_size=batch_size, kind=kind, progress=progress), workers,
            strategy=strategy)
    batches = task.calibration(n, batch_size=batch_size)
    teacher.eval()
    with torch.no_grad():
        targets = [embed(teacher, b) for b in batches]
    net, where = distributed.prepare(student)   # (before the optimizer: FSDP replaces the parameters)
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=lr)
    rows = []
    good = _state(student)
    try:
        for epoch in tqdm(range(1, epochs + 1), desc="distill embeddings", disable=not progress or where[0] > 0,
                          leave=False):
            student.train()
            total = 0.0
            for b, t in zip(batches, targets, strict=True):
                part, weight = distributed.shard_batch(b, where)
                t_part = t[where[0]::where[1]]
                loss = embedding_loss(embed(net, part), t_part, kind)
                try:
                    total += optimizer_step(loss, opt, weight=weight, where=where)
                except FloatingPointError as e:
                    student.load_state_dict(good)
                    warnings.warn(f"distillation stopped at epoch {epoch}: {e}; the last good weights were kept",
                                  RuntimeWarning, stacklevel=2)
                    return pd.DataFrame(rows, columns=["epoch", "train_loss"])
            good = _state(student)
            rows.append({"epoch": epoch, "train_loss": total / len(batches)})
    finally:
        student.eval()
    return pd.DataFrame(rows, columns=["epoch", "train_loss"])


def drop_layers(model: nn.Module, blocks: str, keep: list[int]) -> nn.Module:
    """A copy of ``model`` whose ``nn.ModuleList`` at attribute path ``blocks`` (e.g. "encoder.layer" for MiniLM,
    "h" for tiny-lm) keeps only the layers ``keep`` (in that order) - a student initialisation."""
    target = copy.deepcopy(model)
    layers = target.get_submodule(blocks)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{blocks!r} is a {type(layers).__name__}, not an nn.ModuleList of layers")
    if not keep or any(not isinstance(i, int) or not 0 <= i < len(layers) for i in keep):
        raise ValueError(f"keep must list layer indices in [0, {len(layers)}), got {keep!r}")
    new = nn.ModuleList(layers[i] for i in keep)
    for j, layer in enumerate(new):  # transformers layers know their index (caches); keep it consistent
        for m in layer.modules():
            if hasattr(m, "layer_idx"):
                m.layer_idx = j
    target.set_submodule(blocks, new)
    config = getattr(target, "config", None)
    if config is not None and hasattr(config, "num_hidden_layers"):
        config.num_hidden_layers = len(keep)
    return target


__all__ += ["drop_layers"]
