"""User objects named as ``package.module:factory`` entry points (the CLI's and notebooks' ``--model`` /
``--task`` / ``model_name`` / ``task_name`` values): the factory is imported and called with no arguments."""
from __future__ import annotations

import importlib
import re
from typing import Any

__all__ = ["is_entry_point", "resolve"]

_PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_entry_point(text: object) -> bool:
    """True for ``package.module:factory`` (a Windows path such as ``C:\\models`` is not one)."""
    return isinstance(text, str) and bool(_PATTERN.match(text))


def resolve(spec: str, what: str) -> Any:
    """Import ``package.module`` and return ``factory()``; errors name the entry point and what failed."""
    if not is_entry_point(spec):
        raise ValueError(f"{what} {spec!r} is not a 'package.module:factory' entry point")
    module_name, attr = spec.split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import {module_name!r}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{what} {spec!r}: {attr!r} is a {type(obj).__name__}, not a factory function")
    return obj()
