"""An on-disk cache of measured results, keyed by what determines them.

A key is a hash of a JSON description: the model's *fingerprint* (a hash of its class, every parameter
and buffer - names, dtypes, shapes and bytes - and the plans applied to it), the task, the options and
the candidate config. Entries are JSON lines appended as results arrive, so an interrupted run keeps
what it measured and a rerun only measures what is missing. Nothing is ever unpickled.

The cache lives under ``$WORKBENCH_CACHE`` (default ``~/.cache/workbench``).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["fingerprint", "ResultCache", "cache_dir", "key_of"]


def cache_dir() -> Path:
    return Path(os.environ.get("WORKBENCH_CACHE") or Path.home() / ".cache" / "workbench")


def fingerprint(model: nn.Module) -> str:
    """A hash of the model's structure and values (changes when any weight changes)."""
    from workbench.plans.apply import applied_plans

    h = hashlib.blake2b(digest_size=16)
    h.update(f"{type(model).__module__}.{type(model).__qualname__}".encode())
    for name, t in model.state_dict(keep_vars=False).items():
        t = t.detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    for plan in applied_plans(model):
        h.update(plan.to_json().encode())
    for name, module in model.named_modules():  # structure: a swapped module type changes the hash
        h.update(f"{name}:{type(module).__qualname__};".encode())
    return h.hexdigest()


def key_of(description: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()[:32]


class ResultCache:
    """JSON-lines store ``key -> row`` in one file; later lines win."""

    def __init__(self, path: Path | None):
        self.path = path
        self._rows: dict[str, dict] = {}
        if path is not None and path.exists():
            with open(path, encoding="utf-8") as f:
                for line in f:
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        entry = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut short by an interrupted write: measured again
                    if isinstance(entry, dict) and "key" in entry and "row" in entry:
                        self._rows[entry["key"]] = entry["row"]

    def get(self, key: str) -> dict | None:
        return self._rows.get(key)

    def put(self, key: str, row: dict) -> None:
        self._rows[key] = row
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, "row": row}, default=str) + "\n")

