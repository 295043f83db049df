"""`CausalLM`: held-out perplexity of a causal language model on the user's own text (``wb.tasks.CausalLM``).

    task = wb.tasks.CausalLM(texts, tokenizer)           # a Hugging Face tokenizer, or any callable text -> ids

The texts are tokenised one by one and concatenated into one stream of token ids. The last
``eval_fraction`` of the stream is held out: perplexity = exp(mean next-token cross-entropy) over
non-overlapping windows of ``block_size`` tokens of it (lower is better). Calibration windows come from the
rest (seeded choice), so the two never overlap. The model is called as ``model(ids)`` with ``ids`` of shape
(B, T) and must return (B, T, vocab) logits: a tensor, a tuple or a ``ModelOutput`` with ``logits``.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from workbench.tasks import inputs as I
from workbench.tasks.base import MetricSpec, Task, check_count, check_model, eval_mode, model_device

__all__ = ["CausalLM", "tokenize"]


def tokenize(texts: str | Sequence[str], tokenizer: Callable[[str], Any]) -> np.ndarray:
    """One int64 stream of token ids: each text through ``tokenizer`` (a Hugging Face tokenizer returning
    ``input_ids``, or a callable returning a list / array / tensor of ids), concatenated."""
    if isinstance(texts, str):
        texts = [texts]
    texts = list(texts)
    if not texts or not any(isinstance(t, str) and t for t in texts):
        raise ValueError("CausalLM needs a non-empty list of texts")
    if not callable(tokenizer):
        raise TypeError(f"tokenizer must be callable (text -> ids), got {type(tokenizer).__name__}")
    parts = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"text {i} is a {type(text).__name__}, not a str")
        ids = tokenizer(text)
        if isinstance(ids, Mapping):
            if "input_ids" not in ids:
                raise TypeError(f"the tokenizer returned keys {list(ids)}, without 'input_ids'")
            ids = ids["input_ids"]
        arr = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"the tokenizer must return integer token ids, got {arr.dtype} for text {i}")
        parts.append(arr.reshape(-1).astype(np.int64))
    return np.concatenate(parts)


class CausalLM(Task):
    """See the module docstring."""

    metrics = (MetricSpec("perplexity", False, "perplexity of the held-out text (lower is better)"),)
    default_batch_size = 1
    quick_windows = 16

    def __init__(self, texts: str | Sequence[str], tokenizer: Callable[[str], Any], *, block_size: int = 128,
                 eval_fraction: float = 0.1, name: str = "causal-lm", seed: int = 0):
        if not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"block_size must be an int >= 2, got {block_size!r}")
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
        self.name, self.block_size, self.seed = name, block_size, seed
        ids = tokenize(texts, tokenizer)
        cut = int(len(ids) * (1 - eval_fraction))
        self.train_ids, self.test_ids = ids[:cut], ids[cut:]
        self.eval_windows = (len(self.test_ids) - 1) // block_size
        if self.eval_windows < 1:
            raise ValueError(f"task {name!r}: the held-out {eval_fraction:.0%} of the text is {len(self.test_ids)} "
                             f"tokens, fewer than one window of {block_size} + 1; pass more text or a smaller "
                             f"block_size")

    def windows(self, ids: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (len(starts), T)."""
        T = self.block_size
        x = np.stack([ids[s:s + T] for s in starts])
        y = np.stack([ids[s + 1:s + T + 1] for s in starts])
        return torch.from_numpy(x), torch.from_numpy(y)

    def evaluate(self, model: nn.Module, quick: bool = False, batch_size: int = 8) -> dict[str, float]:
        return self.evaluate_with_error(model, quick, batch_size)[0]

    def evaluate_with_error(self, model: nn.Module, quick: bool = False,
                            batch_size: int = 8) -> tuple[dict[str, float], dict[str, float]]:
        """Perplexity and its 95 % half-width from the spread of the windows' mean losses."""
        from workbench.measurement.sampling import perplexity_halfwidth

        losses = self.window_losses(model, quick, batch_size)
        return {"perplexity": math.exp(float(losses.mean()))}, {"perplexity": perplexity_halfwidth(losses)}

    def window_losses(self, model: nn.Module, quick: bool = False, batch_size: int = 8) -> np.ndarray:
        """Each evaluation window's mean next-token loss (nats; the perplexity is exp of their mean): two models'
        arrays pair window by window, so their difference has a far smaller error than either perplexity."""
        check_model(model)
        n = min(self.eval_windows, self.quick_windows) if quick else self.eval_windows
        starts = np.arange(n) * self.block_size
        device = model_device(model)
        losses = []
        with eval_mode(model), torch.inference_mode():
            for i in range(0, n, batch_size):
                x, y = self.windows(self.test_ids, starts[i:i + batch_size])              # (B, T) each
                logits = self._logits(model(x.to(device)), tuple(x.shape))               # (B, T, V)
                if int(y.max()) >= logits.shape[-1]:
                    raise ValueError(f"task {self.name!r}: token id {int(y.max())} is outside the model's "
                                     f"vocabulary of {logits.shape[-1]}")
                loss = F.cross_entropy(logits.transpose(1, 2), y.to(device), reduction="none")  # (B, T)
                losses.append(loss.double().mean(1).cpu().numpy())
        return np.concatenate(losses)

    def _logits(self, out: Any, shape: tuple[int, int]) -> torch.Tensor:
        logits = I.output_tensor(out, f"task {self.name!r}", prefer=("logits",))
        if logits.ndim != 3 or tuple(logits.shape[:2]) != shape:
            raise ValueError(f"task {self.name!r} expects (batch, tokens, vocab) logits for inputs of shape "
                             f"{shape}, got {tuple(logits.shape)}")
        return logits.float()

    def calibration(self, n: int, batch_size: int | None = None) -> list[tuple[torch.Tensor, ...]]:
        T = self.block_size
        available = (len(self.train_ids) - 1) // T
        check_count(n, available, f"{self.name} calibration windows of {T} tokens")
        rng = np.random.default_rng(self.seed)
        starts = np.sort(rng.choice(available, size=n, replace=False)) * T
        x, _ = self.windows(self.train_ids, starts)                                     # (n, T)
        bs = batch_size or 8
        return [(x[i:i + bs],) for i in range(0, n, bs)]

    def example_inputs(self, batch_size: int | None = None) -> tuple[torch.Tensor, ...]:
        bs = batch_size or self.default_batch_size
        starts = (np.arange(bs) % self.eval_windows) * self.block_size
        return (self.windows(self.test_ids, starts)[0],)

    def check_fit(self, model: nn.Module) -> None:
        (x,) = self.example_inputs(2)
        with eval_mode(model), torch.inference_mode():
            logits = self._logits(model(x.to(model_device(model))), tuple(x.shape))
        top = int(max(self.train_ids.max(initial=0), self.test_ids.max()))
        if top >= logits.shape[-1]:
            raise ValueError(f"token id {top} is outside the model's vocabulary of {logits.shape[-1]}")
