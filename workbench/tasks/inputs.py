"""Model inputs and outputs in the forms users have them: the shared helpers of the generic tasks.

A *batch* is what one model call takes: a tuple of tensors (called ``model(*batch)``) or a dict of named
tensors, Hugging Face keyword inputs (called ``model(**batch)``). Every tensor of a batch has the batch
size as its leading dimension. User data arrives as a tensor, a numpy array, a tuple / list of them, a dict,
or an iterable of such batches (a ``DataLoader`` or a list); `collect` turns any of these into a list of
batches. Note the difference: a *tuple* is one batch of several inputs, a *list* is a sequence of batches.

A model *output* is a tensor, a tuple (its first element is used) or a mapping such as a Hugging Face
``ModelOutput``; `output_tensor` picks ``logits`` (else ``last_hidden_state``) from a mapping.
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping, Union

import numpy as np
import torch
from torch import nn

__all__ = ["Batch", "as_tensor", "as_batch", "collect", "batch_size", "split_batch", "take", "to_device",
           "call", "describe", "output_tensor", "sample_digests", "read_inputs", "LABEL_KEYS"]

Batch = Union[tuple, dict]

LABEL_KEYS = ("labels", "label")  # keys of a dict batch that hold labels, not model inputs


def as_tensor(x: Any, what: str) -> torch.Tensor:
    """A tensor from a tensor, a numpy array or a (nested) list of numbers; anything else is an error."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, np.ndarray):
        if x.dtype == object:
            raise TypeError(f"{what}: a numpy array of Python objects cannot be a model input")
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, (list, tuple)) and x and all(isinstance(v, (int, float, list, tuple)) for v in x):
        return torch.as_tensor(x)
    raise TypeError(f"{what}: expected a tensor or a numpy array, got {type(x).__name__}")


def as_batch(x: Any, what: str) -> Batch:
    """One batch: a tensor / array -> ``(tensor,)``; a tuple or list -> a tuple of tensors; a mapping -> a dict."""
    if isinstance(x, Mapping):
        if not x:
            raise ValueError(f"{what}: the input dict is empty")
        batch: Batch = {str(k): as_tensor(v, f"{what}[{k!r}]") for k, v in x.items()}
    elif isinstance(x, (tuple, list)):
        if not x:
            raise ValueError(f"{what}: the input tuple is empty")
        batch = tuple(as_tensor(v, f"{what}[{i}]") for i, v in enumerate(x))
    else:
        batch = (as_tensor(x, what),)
    batch_size(batch, what)  # every tensor must share the leading dimension
    return batch


def _tensors(batch: Batch) -> list[torch.Tensor]:
    return list(batch.values()) if isinstance(batch, dict) else list(batch)


def batch_size(batch: Batch, what: str = "batch") -> int:
    """The shared leading dimension of the batch's tensors (an error if they disagree or are scalars)."""
    sizes = set()
    for t in _tensors(batch):
        if t.ndim == 0:
            raise ValueError(f"{what}: a scalar tensor has no batch dimension")
        sizes.add(t.shape[0])
    if len(sizes) != 1:
        raise ValueError(f"{what}: the tensors have different lengths {sorted(sizes)} ({describe(batch)})")
    return sizes.pop()


def split_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Samples ``start:stop`` of a batch."""
    if isinstance(batch, dict):
        return {k: v[start:stop] for k, v in batch.items()}
    return tuple(t[start:stop] for t in batch)


def collect(data: Any, what: str, chunk: int = 256) -> list[Batch]:
    """A list of batches from a single batch (split into ``chunk``-sample pieces) or an iterable of batches
    (a ``DataLoader``: kept as it batches them). Empty data is an error."""
    if isinstance(data, (torch.Tensor, np.ndarray, Mapping, tuple)):
        whole = as_batch(data, what)
        n = batch_size(whole, what)
        if n == 0:
            raise ValueError(f"{what}: no samples")
        return [split_batch(whole, i, min(n, i + chunk)) for i in range(0, n, chunk)]
    if isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
        raise TypeError(f"{what}: expected a tensor, an array, a tuple, a dict or a DataLoader, "
                        f"got {type(data).__name__}")
    batches = [as_batch(b, f"{what} batch {i}") for i, b in enumerate(data)]
    batches = [b for b in batches if batch_size(b) > 0]
    if not batches:
        raise ValueError(f"{what}: no samples (the data loader yielded nothing)")
    return batches


def take(batches: list[Batch], n: int, batch_size_: int | None = None) -> list[Batch]:
    """The first ``n`` samples of ``batches``, in batches of at most ``batch_size_`` (default: as stored)."""
    out: list[Batch] = []
    left = n
    for b in batches:
        if left <= 0:
            break
        size = min(batch_size(b), left)
        step = batch_size_ or size
        out += [split_batch(b, i, min(size, i + step)) for i in range(0, size, step)]
        left -= size
    return out


def to_device(batch: Batch, device: torch.device, float_dtype: torch.dtype | None = None) -> Batch:
    """The batch on ``device``; floating tensors cast to ``float_dtype`` when given."""
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=float_dtype if float_dtype is not None and t.is_floating_point() else None)
    return {k: move(v) for k, v in batch.items()} if isinstance(batch, dict) else tuple(move(t) for t in batch)


def call(model: nn.Module, batch: Batch) -> Any:
    """``model(**batch)`` for keyword inputs, ``model(*batch)`` for positional ones."""
    return model(**batch) if isinstance(batch, dict) else model(*batch)


def describe(batch: Batch) -> str:
    """e.g. ``input_ids (2, 16) int64, attention_mask (2, 16) int64`` or ``(2, 64) float32``."""
    def one(t: torch.Tensor) -> str:
        return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
    if isinstance(batch, dict):
        return ", ".join(f"{k} {one(v)}" for k, v in batch.items())
    return ", ".join(one(t) for t in batch)


def output_tensor(out: Any, what: str, prefer: tuple[str, ...] = ("logits", "last_hidden_state")) -> torch.Tensor:
    """The tensor a task scores: the output itself, the first element of a tuple, or the first of ``prefer``
    found in a mapping (a Hugging Face ``ModelOutput`` is one)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        for key in prefer:
            if out.get(key) is not None:
                return out[key]
        raise TypeError(f"{what}: the model returned {type(out).__name__} with keys {list(out.keys())}, "
                        f"none of {list(prefer)}")
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"{what}: the model returned {type(out).__name__}, not a tensor, a tuple of tensors "
                    f"or a ModelOutput")


def sample_digests(batches: list[Batch]) -> list[bytes]:
    """One digest per sample (its tensors' bytes, in key order), to find samples shared by two splits."""
    out = []
    for b in batches:
        items = sorted(b.items()) if isinstance(b, dict) else list(enumerate(b))
        arrays = [t.detach().cpu().contiguous() for _, t in items]
        for i in range(batch_size(b)):
            h = hashlib.blake2b(digest_size=16)
            for t in arrays:
                h.update(t[i].reshape(-1).view(torch.uint8).numpy().tobytes() if t[i].numel() else b"")
            out.append(h.digest())
    return out


def read_inputs(path: str) -> Batch:
    """Model inputs saved in a file, read without unpickling: ``.safetensors``, ``.npz`` or ``.npy``. One array
    -> one positional input; arrays named ``0``, ``1``, ... -> positional inputs in that order; other names ->
    keyword inputs (e.g. ``input_ids`` and ``attention_mask``)."""
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"inputs file {p} does not exist")
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        arrays: dict[str, Any] = load_file(str(p))
    elif p.suffix in (".npz", ".npy"):
        try:
            loaded = np.load(p, allow_pickle=False)
        except ValueError as e:
            raise ValueError(f"inputs file {p} could not be read without unpickling: {e}") from None
        arrays = {"0": loaded} if isinstance(loaded, np.ndarray) else {k: loaded[k] for k in loaded.files}
    else:
        raise ValueError(f"inputs file {p}: expected .safetensors, .npz or .npy, got {p.suffix or 'no suffix'!r}")
    if not arrays:
        raise ValueError(f"inputs file {p} holds no arrays")
    if len(arrays) == 1:
        return as_batch(next(iter(arrays.values())), str(p))
    if all(k.isdigit() for k in arrays):
        return as_batch([arrays[k] for k in sorted(arrays, key=int)], str(p))
    return as_batch(arrays, str(p))
