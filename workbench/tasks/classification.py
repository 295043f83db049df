"""Image / signal classification tasks (digits, mnist1d): top-1 accuracy on the fixed test split.

Calibration samples are drawn (seeded) from the training split, so they never overlap the test data.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn

from workbench.tasks import data
from workbench.tasks.base import MetricSpec, Task, check_count, check_model, eval_mode, model_device

__all__ = ["ClassificationTask"]


class ClassificationTask(Task):
    metrics = (MetricSpec("accuracy", True, "top-1 accuracy on the test split (higher is better)"),)
    default_batch_size = 64
    quick_samples = 256

    def __init__(self, name: str, load: Callable[[], data.Split], input_desc: str):
        self.name = name
        self._load = load
        self.input_desc = input_desc

    @property
    def split(self) -> data.Split:
        return self._load()

    def evaluate(self, model: nn.Module, quick: bool = False) -> dict[str, float]:
        return self.evaluate_with_error(model, quick)[0]

    def evaluate_with_error(self, model: nn.Module, quick: bool = False) -> tuple[dict[str, float], dict[str, float]]:
        """Accuracy and its Wilson 95 % half-width (256 quick samples: about +-0.02 near 0.97)."""
        from workbench.measurement.sampling import wilson_halfwidth

        check_model(model)
        with eval_mode(model):
            correct, n = self._count(model, quick)
        return {"accuracy": correct / n}, {"accuracy": wilson_halfwidth(correct, n)}

    def _count(self, model: nn.Module, quick: bool) -> tuple[int, int]:
        s = self.split
        n = min(self.quick_samples, len(s.x_test)) if quick else len(s.x_test)
        x = torch.from_numpy(s.x_test[:n]).to(model_device(model))  # (n, features)
        y = s.y_test[:n]
        correct = 0
        with torch.inference_mode():
            for i in range(0, n, 512):
                xb = x[i:i + 512]
                logits = model(xb)  # (b, classes)
                if logits.ndim != 2 or logits.shape[0] != len(xb):
                    raise ValueError(f"task {self.name!r} expects (batch, classes) logits, got shape "
                                     f"{tuple(logits.shape)}")
                correct += int((logits.argmax(-1).cpu().numpy() == y[i:i + len(xb)]).sum())
        return correct, n

    def calibration(self, n: int, batch_size: int | None = None) -> list[tuple[torch.Tensor, ...]]:
        s = self.split
        check_count(n, len(s.x_train), f"{self.name} calibration")
        idx = np.random.default_rng(1).permutation(len(s.x_train))[:n]
        x = torch.from_numpy(s.x_train[idx])
        bs = batch_size or 128
        return [(x[i:i + bs],) for i in range(0, n, bs)]

    def calibration_labels(self, n: int) -> torch.Tensor:
        """Labels of the first ``n`` calibration samples (same order as ``calibration(n)``)."""
        s = self.split
        check_count(n, len(s.x_train), f"{self.name} calibration")
        idx = np.random.default_rng(1).permutation(len(s.x_train))[:n]
        return torch.from_numpy(s.y_train[idx])

    def example_inputs(self, batch_size: int | None = None) -> tuple[torch.Tensor, ...]:
        bs = batch_size or self.default_batch_size
        x = self.split.x_test
        reps = -(-bs // len(x))
        return (torch.from_numpy(np.concatenate([x] * reps)[:bs]),)
