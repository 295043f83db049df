"""Real bytes and peak memory of a model.

- `size_bytes`: bytes of every parameter and buffer *as stored*: each distinct storage counted once
  (tied or shared weights are not double-counted), with its own element size, so a packed int4
  tensor (two values per uint8) costs half a byte per value plus its scales. A `FileModel` (a module that runs a
  file in another runtime: `workbench.export.runtimes`) holds no tensors; it counts its file's bytes on disk.
- `peak_memory`: CUDA: ``torch.cuda.max_memory_allocated`` around one forward pass (weights included).
  CPU: the resident parameter/buffer bytes plus the peak of the tensor allocations made during one
  forward pass, replayed from the PyTorch profiler's allocator events (``profile_memory=True``). What another
  runtime allocates (ONNX Runtime's arena, llama.cpp's KV cache) is outside PyTorch's allocator: for a model holding
  a `FileModel` the method says so.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from workbench.tasks.inputs import call  # model(*inputs), or model(**inputs) for keyword inputs

__all__ = ["FileModel", "size_bytes", "bytes_by_dtype", "layer_table", "peak_memory", "peak_allocated_during",
           "PeakMemory"]


class FileModel(nn.Module):
    """Base of modules whose forward runs a file in another runtime (`workbench.export.runtimes`): no PyTorch tensor
    holds their weights, so their size is the file's (``path``) bytes on disk, listed by `bytes_by_dtype` under
    ``"<file_format> file"``."""

    file_format: ClassVar[str]
    path: Path

    def file_bytes(self) -> int:
        return self.path.stat().st_size


def _files(model: nn.Module) -> list[FileModel]:
    return [m for m in model.modules() if isinstance(m, FileModel)]


def _storages(model: nn.Module):
    seen = set()
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "meta":
            raise ValueError("the model has tensors on the meta device (no real bytes to count)")
        st = t.untyped_storage()
        key = (t.device, st.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        yield t, st.nbytes()


def size_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers as stored (each storage once), plus the files of `FileModel` modules."""
    return sum(n for _, n in _storages(model)) + sum(f.file_bytes() for f in _files(model))


def bytes_by_dtype(model: nn.Module) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for t, n in _storages(model):
        out[str(t.dtype).removeprefix("torch.")] += n
    for f in _files(model):
        out[f"{f.file_format} file"] += f.file_bytes()
    return dict(out)


def layer_table(model: nn.Module):
    """One row per leaf module that owns tensors: name, type, parameters, bytes, dtypes (a DataFrame)."""

    rows = []
    for name, module in model.named_modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if not tensors:
            continue
        params = sum(p.numel() for p in module.parameters(recurse=False))
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        weight = getattr(module, "weight", None)
        rows.append({
            "layer": name or "<root>",
            "type": type(module).__name__,
            "shape": tuple(weight.shape) if isinstance(weight, torch.Tensor) else None,
            "params": params,
            "bytes": nbytes,
            "dtypes": ",".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors})),
        })
    from workbench.measurement.table import MetricsTable

    return MetricsTable(rows, columns=["layer", "type", "shape", "params", "bytes", "dtypes"])


@dataclass(frozen=True)
class PeakMemory:
    bytes: int
    method: str


@contextlib.contextmanager
def _fd2_silenced():
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_allocated_during(fn) -> int:
    """Peak bytes of CPU tensors allocated and alive at once while ``fn()`` runs, replayed from the PyTorch
    profiler's allocator events (allocations and frees in time order)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    # libkineto prints "profiler_start/stop" lines straight to file descriptor 2 on every use; keep
    # them out of notebooks and terminals (Python exceptions still propagate normally).
    with _fd2_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []

    def walk(node):
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    events.sort()
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def _cpu_transient_peak(model: nn.Module, inputs: tuple) -> int:
    """Peak bytes of CPU tensors allocated and alive at once during ``model(*inputs)`` (or ``**inputs``)."""
    with torch.inference_mode():
        return peak_allocated_during(lambda: call(model, inputs))


def peak_memory(model: nn.Module, inputs: tuple) -> PeakMemory:
    """Peak memory of one forward pass of ``model(*inputs)`` (or ``**inputs``; see the module docstring)."""
    from workbench.tasks.base import model_device

    device = model_device(model)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        with torch.inference_mode():
            call(model, inputs)
        torch.cuda.synchronize(device)
        return PeakMemory(torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated")
    method = "weights + peak live CPU tensor bytes of one forward (torch profiler allocator events)"
    runtimes = sorted({f.file_format for f in _files(model)})
    if runtimes:
        method += f"; the {' / '.join(runtimes)} file's bytes as weights, its runtime's own allocations not seen"
    return PeakMemory(size_bytes(model) + _cpu_transient_peak(model, inputs), method)
