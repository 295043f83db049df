"""Spill: what an in-place `apply` replaced, kept on disk instead of in memory, so that the rollback promise
("a failed apply leaves the model exactly as it was") does not cost a second copy of the model.

The sequential pipeline swaps compressed layers in block by block. With ``inplace=True`` the layers it took
out are needed only if a later block fails (or the user presses Ctrl-C); `Spill.stash` writes their tensors
to a safetensors file in a temporary directory and leaves the modules holding meta tensors of the same
shapes, so their memory is released while the run goes on. `Spill.restore` reads them back (never
unpickling) before the modules are swapped back; `Spill.close` deletes the directory.

A tensor that is shared with anything outside the stashed modules (tied weights, a tensor held twice in the
model) is left in memory: replacing it would break the sharing on restore.
"""
from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch import nn

__all__ = ["Spill"]


def _slots(module: nn.Module):
    """Every (owner module, "_parameters" | "_buffers", key, tensor) held in ``module``'s tree."""
    for owner in module.modules():
        for kind in ("_parameters", "_buffers"):
            for key, t in getattr(owner, kind).items():
                if t is not None:
                    yield owner, kind, key, t


class Spill:
    """Tensors of replaced modules on disk; see the module docstring. ``model``: the model being compressed
    in place (tensors it holds more than once are never spilled)."""

    def __init__(self, model: nn.Module):
        counts = Counter(id(t) for m in model.modules() for kind in ("_parameters", "_buffers")
                         for t in getattr(m, kind).values() if t is not None)
        self._shared = {i for i, c in counts.items() if c > 1}
        self._dir: Path | None = None
        self._files: list[tuple[Path, list[tuple[nn.Module, str, str, str, bool, torch.device]]]] = []
        self.bytes = 0

    def stash(self, modules: dict[str, nn.Module]) -> int:
        """Move the tensors of ``modules`` (which the model no longer holds) to disk; returns the bytes freed."""
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        places: list[tuple[nn.Module, str, str, str, bool, torch.device]] = []
        names: dict[int, str] = {}
        for name, module in modules.items():
            for owner, kind, key, t in _slots(module):
                if id(t) in self._shared or t.device.type == "meta":
                    continue
                file_key = names.setdefault(id(t), f"{len(names)}")
                tensors.setdefault(file_key, t.detach().contiguous())
                places.append((owner, kind, key, file_key, isinstance(t, nn.Parameter) and t.requires_grad,
                               t.device))
        if not tensors:
            return 0
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="workbench-spill-"))
        path = self._dir / f"{len(self._files)}.safetensors"
        save_file(tensors, str(path))
        freed = sum(t.numel() * t.element_size() for t in tensors.values())
        metas: dict[str, torch.Tensor] = {}
        for owner, kind, key, file_key, grad, _ in places:
            held = getattr(owner, kind)[key]
            meta = metas.setdefault(file_key, torch.empty_like(held, device="meta"))
            getattr(owner, kind)[key] = nn.Parameter(meta, requires_grad=grad) if kind == "_parameters" else meta
        self._files.append((path, places))
        self.bytes += freed
        return freed

    def restore(self) -> None:
        """Put every spilled tensor back where it was (tensors that were one object are one object again)."""
        from safetensors import safe_open

        from workbench.plans.io import aligned

        while self._files:
            path, places = self._files.pop()
            with safe_open(str(path), "pt") as f:
                loaded: dict[str, torch.Tensor] = {}
                params: dict[str, nn.Parameter] = {}
                for owner, kind, key, file_key, grad, device in places:   # (back on the device it came from)
                    t = loaded.setdefault(file_key, aligned(f.get_tensor(file_key)).to(device))
                    if kind == "_parameters":
                        getattr(owner, kind)[key] = params.setdefault(file_key, nn.Parameter(t, requires_grad=grad))
                    else:
                        getattr(owner, kind)[key] = t
            path.unlink()

    def close(self) -> None:
        """Delete the spill files (after a successful run, or after `restore`)."""
        self._files.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
