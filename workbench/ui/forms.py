"""Technique forms generated from the registered config types, and configs described in words.

`TechniqueForm(cls)` builds one input per dataclass field of a registered config class from its type
(int, float, bool, str, an enum, a torch dtype, or ``X | None``), filled with the field's default;
`TechniqueForm.config()` constructs the config, so its own ``__post_init__`` validation speaks for a bad
value (the field is named in the error). `technique_forms()` makes one form per entry of
`registry.registered_configs()`: a technique registered tomorrow appears in the workbench with no UI code.

`describe(config)` is the label the layer table shows: the class name with its identifying fields in words,
e.g. ``WeightOnly · 4 bits · group 32 · rtn`` - integer, enum and dtype fields always, the others when they
differ from their default.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from typing import Any

import torch

from workbench.plans.registry import Config, registered_configs
from workbench.plans.words import describe, in_words, optional_of

__all__ = ["TechniqueForm", "technique_forms", "describe"]

# dtypes a config field of type torch.dtype can hold (the config validates which it accepts)
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8")
class TechniqueForm:
    """Inputs for every field of one config class (see the module docstring)."""

    def __init__(self, cls: type):
        import ipywidgets as W

        if not (dataclasses.is_dataclass(cls) and issubclass(cls, Config)):
            raise TypeError(f"{cls!r} is not a registered config dataclass")
        self.cls = cls
        hints = typing.get_type_hints(cls)
        self.widgets: dict[str, Any] = {}
        self._parse: dict[str, Any] = {}
        style, layout = {"description_width": "initial"}, W.Layout(width="auto")
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            kind, optional = optional_of(hints[f.name])
            default = None if f.default is dataclasses.MISSING else f.default
            label = f.name.replace("_", " ")
            if isinstance(kind, type) and issubclass(kind, enum.Enum):
                w = W.Dropdown(options=[(str(m.value), m) for m in kind], value=default, description=label)
                parse = None
            elif kind is torch.dtype:
                names = [n for n in DTYPES if hasattr(torch, n)]
                w = W.Dropdown(options=names, value=in_words(default) if default is not None else names[0],
                               description=label)
                parse = functools.partial(getattr, torch)
            elif kind is bool and not optional:
                w = W.Checkbox(value=bool(default), description=label, indent=False)
                parse = None
            elif kind in (int, float) and not optional:
                w = (W.IntText if kind is int else W.FloatText)(value=default if default is not None else 0,
                                                                 description=label)
                parse = None
            else:  # str, X | None, anything else: typed as text ("" or "none" stands for None)
                w = W.Text(value="" if default is None else in_words(default), description=label,
                           placeholder="none" if optional else "")
                parse = _text_parser(cls, f.name, kind, optional)
            w.style, w.layout = style, layout
            self.widgets[f.name] = w
            self._parse[f.name] = parse
        doc = (cls.__doc__ or "").strip().splitlines()
        self.help = doc[0].replace("``", "") if doc else cls.__name__
        self.label = f"{cls.__name__} ({cls.kind.split('.')[0]})"   # e.g. "WeightOnly (quant)"
        self.box = W.HBox(list(self.widgets.values()), layout=W.Layout(flex_flow="row wrap"))

    def __getitem__(self, field: str):
        return self.widgets[field]

    def config(self) -> Config:
        """The config the inputs describe; a bad value raises the config's own error, naming the field."""
        kwargs = {}
        for name, w in self.widgets.items():
            parse = self._parse[name]
            kwargs[name] = parse(w.value) if parse is not None else w.value
        return self.cls(**kwargs)

    def show(self, config: Config) -> None:
        """Fill the inputs from ``config`` (of this form's class)."""
        if type(config) is not self.cls:
            raise TypeError(f"this form edits {self.cls.__name__}, not {type(config).__name__}")
        for name, w in self.widgets.items():
            value = getattr(config, name)
            if self._parse[name] is not None:
                value = "" if value is None else in_words(value)
            w.value = value


def _text_parser(cls: type, field: str, kind: Any, optional: bool):
    def parse(text: str):
        text = text.strip()
        if optional and text.lower() in ("", "none"):
            return None
        if kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                raise ValueError(f"{cls.__name__}.{field} takes {'an integer' if kind is int else 'a number'}"
                                 f"{' or none' if optional else ''}, got {text!r}") from None
        return text
    return parse


def technique_forms() -> dict[type, TechniqueForm]:
    """One form per registered config class, in registration order."""
    return {cls: TechniqueForm(cls) for cls in registered_configs()}
