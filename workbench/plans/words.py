"""Configs in words: `describe(config)` is the one-line label the layer table, `Plan.describe`, reports and the
workbench's status line show - the class name with its identifying fields, e.g. ``WeightOnly · 4 bits · group 32 ·
rtn``: the first field, integer, enum and dtype fields always, the others when they differ from their default."""
from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any

import torch

from workbench.plans.registry import Config

__all__ = ["describe"]

_UNITS = {"bits": "bits", "group_size": "group", "sparsity": "sparse"}
_NONE = {"group_size": "per channel"}   # what None means for a field, where it has one meaning everywhere
_UNSAID = {"act_bits"}   # optional fields whose None is the plain case (activations as they come): said only when set


def optional_of(hint: Any) -> tuple[Any, bool]:
    """(X, True) for ``X | None`` / ``Optional[X]``, else (hint, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0], True
    return hint, False


def in_words(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def describe(config: Config | None) -> str:
    """A readable one-line label of a config (see the module docstring); ``"none"`` for no config."""
    if config is None:
        return "none"
    hints = typing.get_type_hints(type(config))
    parts = []
    for i, f in enumerate(x for x in dataclasses.fields(typing.cast(Any, config)) if x.init):
        value = getattr(config, f.name)
        kind, _ = optional_of(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
        identifying = i == 0 or kind is int or kind is torch.dtype or (
            isinstance(kind, type) and issubclass(kind, enum.Enum))
        if (not identifying or f.name in _UNSAID) and value == default:
            continue
        if value is None:
            parts.append(_NONE.get(f.name, f"no {f.name.replace('_', ' ')}"))
        elif f.name == "sparsity":
            parts.append(f"{value:.0%} sparse")
        elif f.name == "act_bits":
            parts.append(f"activations {value} bits")
        elif f.name in _UNITS and not isinstance(value, bool):
            unit = _UNITS[f.name]
            parts.append(f"{in_words(value)} {unit}" if f.name != "group_size" else f"{unit} {in_words(value)}")
        elif isinstance(value, bool):
            parts.append(f.name.replace("_", " ") if value else f"not {f.name.replace('_', ' ')}")
        elif kind in (int, float):
            parts.append(f"{f.name.replace('_', ' ')} {in_words(value)}")
        else:
            parts.append(in_words(value))
    return " · ".join([type(config).__name__, *parts])
