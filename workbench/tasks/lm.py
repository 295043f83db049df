"""tiny-lm: character-level language modelling on gensim's lee_background.cor.

Quality is the perplexity (lower is better) of the held-out last 10 % of the text, scored on
non-overlapping windows of the model's block size. Calibration windows come from the first 90 %.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from workbench.tasks import data
from workbench.tasks.base import MetricSpec, Task, check_count, check_model, eval_mode, model_device

__all__ = ["CharLMTask", "perplexity", "window_losses"]


def _windows(ids: np.ndarray, block: int) -> torch.Tensor:
    n = (len(ids) - 1) // block
    return torch.from_numpy(ids[: n * block + 1])


def window_losses(model: nn.Module, ids: np.ndarray, block: int, max_windows: int | None = None,
                  batch_size: int = 32) -> np.ndarray:
    """Mean next-character cross-entropy of each non-overlapping window of ``block`` characters, (windows,)."""
    stream = _windows(ids, block)
    n = (len(stream) - 1) // block
    if max_windows is not None:
        n = min(n, max_windows)
    device = model_device(model)
    out = []
    with torch.inference_mode():
        for i in range(0, n, batch_size):
            rows = range(i, min(n, i + batch_size))
            x = torch.stack([stream[r * block:(r + 1) * block] for r in rows]).to(device)          # (B, T)
            y = torch.stack([stream[r * block + 1:(r + 1) * block + 1] for r in rows]).to(device)  # (B, T)
            logits = model(x).float()                                                            # (B, T, V)
            loss = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")                  # (B, T)
            out.append(loss.double().mean(1).cpu().numpy())
    return np.concatenate(out)


def perplexity(model: nn.Module, ids: np.ndarray, block: int, max_windows: int | None = None,
               batch_size: int = 32) -> float:
    """exp(mean next-character cross-entropy) over non-overlapping windows of ``block`` characters."""
    return math.exp(float(window_losses(model, ids, block, max_windows, batch_size).mean()))


class CharLMTask(Task):
    name = "tiny-lm"
    metrics = (MetricSpec("perplexity", False, "character-level perplexity of the held-out text (lower is better)"),)
    default_batch_size = 1
    quick_windows = 64

    def __init__(self, block_size: int = 128):
        self.block_size = block_size
        self.corpus = data.char_corpus()

    def evaluate(self, model: nn.Module, quick: bool = False) -> dict[str, float]:
        return self.evaluate_with_error(model, quick)[0]

    def evaluate_with_error(self, model: nn.Module, quick: bool = False) -> tuple[dict[str, float], dict[str, float]]:
        """Perplexity and its 95 % half-width from the spread of the windows' losses."""
        from workbench.measurement.sampling import perplexity_halfwidth

        check_model(model)
        with eval_mode(model):
            losses = window_losses(model, self.corpus.test, self.block_size,
                                   max_windows=self.quick_windows if quick else None)
        return {"perplexity": math.exp(float(losses.mean()))}, {"perplexity": perplexity_halfwidth(losses)}

    def calibration(self, n: int, batch_size: int | None = None) -> list[tuple[torch.Tensor, ...]]:
        train = self.corpus.train
        T = self.block_size
        check_count(n, (len(train) - 1) // T, "tiny-lm calibration")
        rng = np.random.default_rng(1)
        starts = np.sort(rng.choice((len(train) - 1) // T, size=n, replace=False)) * T
        x = torch.from_numpy(np.stack([train[s:s + T] for s in starts]))  # (n, T)
        bs = batch_size or 8
        return [(x[i:i + bs],) for i in range(0, n, bs)]

    def example_inputs(self, batch_size: int | None = None) -> tuple[torch.Tensor, ...]:
        bs = batch_size or self.default_batch_size
        T = self.block_size
        test = self.corpus.test
        return (torch.from_numpy(np.stack([test[i * T:(i + 1) * T] for i in range(bs)])),)
