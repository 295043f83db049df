"""Candidate configs for sensitivity and search: normalisation and short, readable labels.

Candidates are given as a list of configs (labelled automatically: the class name and the fields that
differ from their defaults, e.g. ``WeightOnly(bits=8, group_size=None)``) or as a mapping
``label -> config`` when the user wants their own names.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Mapping, Sequence

import torch

from workbench.plans.registry import Config, config_to_dict, handler_for

__all__ = ["label", "normalize"]


def _short(value) -> str:
    if isinstance(value, enum.Enum):
        return repr(value.value)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return repr(value)


def label(config: Config) -> str:
    """``ClassName(field=value, ...)`` listing only the fields that differ from their defaults."""
    parts = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        if value != default:
            parts.append(f"{f.name}={_short(value)}")
    return f"{type(config).__name__}({', '.join(parts)})"


def normalize(candidates: Sequence[Config] | Mapping[str, Config],
              what: str = "candidates") -> list[tuple[str, Config]]:
    """``[(label, config), ...]`` with unique labels; an empty list or a non-config is an error."""
    if isinstance(candidates, Config):
        raise TypeError(f"{what} must be a list of configs (or a mapping label -> config), got a single "
                        f"{type(candidates).__name__}; wrap it in a list")
    if isinstance(candidates, Mapping):
        items = list(candidates.items())
    elif isinstance(candidates, (list, tuple)):
        items = [(None, c) for c in candidates]
    else:
        raise TypeError(f"{what} must be a list of configs or a mapping label -> config, got "
                        f"{type(candidates).__name__}")
    if not items:
        raise ValueError(f"{what} is empty: give at least one config, e.g. [wb.quant.WeightOnly(bits=8)]")
    out: list[tuple[str, Config]] = []
    seen: dict[str, Config] = {}
    for i, (name, config) in enumerate(items):
        if not isinstance(config, Config):
            raise TypeError(f"{what}[{name if name is not None else i}] is a {type(config).__name__}, not a "
                            f"technique config")
        handler_for(config)
        name = label(config) if name is None else name
        if not isinstance(name, str) or not name:
            raise ValueError(f"{what}: labels must be non-empty strings, got {name!r}")
        if name in seen:
            if config_to_dict(seen[name]) == config_to_dict(config):
                raise ValueError(f"{what}: {name} is listed twice")
            raise ValueError(f"{what}: two configs share the label {name!r}; pass a mapping label -> config")
        seen[name] = config
        out.append((name, config))
    return out
