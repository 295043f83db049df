"""Technique forms generated from the registered config types, and configs described in words.

`TechniqueForm(cls)` builds one labelled input per dataclass field of a registered config class from its type
(int, float, bool, str, an enum, a torch dtype, or ``X | None``), filled with the field's default;
`TechniqueForm.config()` constructs the config, so its own ``__post_init__`` validation speaks for a bad
value (the field is named in the error). `technique_forms()` makes one form per entry of
`registry.registered_configs()`: a technique registered tomorrow appears in the workbench with no UI code.

A field with a few allowed values states them in its dataclass field metadata, with the constant its
``__post_init__`` validates against (one source of truth)::

    kernel: str = field(default="auto", metadata={"choices": KERNELS})

`field_choices` reads them; the form shows such a field - and every enum field - as a dropdown of exactly those
values (plus "none" for ``X | None``), a bool as a checkbox, and the rest as number or text boxes. A control's
label is the field's name in words; its tooltip is what the class says of the field (`field_docs`): the comment
on the field's line (and its indented continuation lines), or else the clause after ``name``: in the class
docstring; none where the class says nothing of it.

`describe(config)` is the label the layer table shows: the class name with its identifying fields in words,
e.g. ``WeightOnly · 4 bits · group 32 · rtn`` - integer, enum and dtype fields always, the others when they
differ from their default.
"""
from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import io
import re
import textwrap
import tokenize
import typing
from typing import Any

import torch

from workbench.plans.registry import Config, registered_configs
from workbench.plans.words import describe, in_words, optional_of

__all__ = ["TechniqueForm", "technique_forms", "describe", "field_choices", "field_docs"]

# dtypes a config field of type torch.dtype can hold when it states no choices (the config validates which it takes)
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8")


class _NoneChoice:
    """The "none" entry of an ``X | None`` dropdown (ipywidgets reads a value of None as "nothing selected")."""

    def __repr__(self) -> str:
        return "none"


NONE = _NoneChoice()


def field_choices(f: dataclasses.Field) -> tuple | None:
    """The values a config field allows, as its ``metadata["choices"]`` states them (None: not stated)."""
    choices = f.metadata.get("choices")
    return None if choices is None else tuple(choices)


class TechniqueForm:
    """Inputs for every field of one config class (see the module docstring)."""

    def __init__(self, cls: type):
        import ipywidgets as W

        if not (dataclasses.is_dataclass(cls) and issubclass(cls, Config)):
            raise TypeError(f"{cls!r} is not a registered config dataclass")
        self.cls = cls
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        self.widgets: dict[str, Any] = {}
        self._parse: dict[str, Any] = {}   # widget value -> field value (None: the same)
        self._show: dict[str, Any] = {}    # field value -> widget value (None: the same)
        # a gap after each control, so a checkbox label and the next field's label never run together
        style, layout = {"description_width": "initial"}, W.Layout(width="auto", margin="2px 22px 2px 0")
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            kind, optional = optional_of(hints[f.name])
            default = None if f.default is dataclasses.MISSING else f.default
            label = f.name.replace("_", " ")
            choices = field_choices(f)
            if choices is None and isinstance(kind, type) and issubclass(kind, enum.Enum):
                choices = tuple(kind)
            if choices is None and kind is torch.dtype:
                choices = tuple(getattr(torch, n) for n in DTYPES if hasattr(torch, n))
            if choices is not None:
                w, parse, show = _dropdown(W, choices, default, optional, label)
            elif kind is bool and not optional:
                w = W.Checkbox(value=bool(default), description=label, indent=False)
                parse = show = None
            elif kind in (int, float) and not optional:
                w = (W.IntText if kind is int else W.FloatText)(value=default if default is not None else 0,
                                                                 description=label)
                parse = show = None
            else:  # str, X | None, anything else: typed as text ("" or "none" stands for None)
                w = W.Text(value="" if default is None else in_words(default), description=label,
                           placeholder="none" if optional else "")
                parse = _text_parser(cls, f.name, kind, optional)
                show = _text_shown
            w.style, w.layout = style, layout
            if f.name in docs:
                w.tooltip = docs[f.name]
            self.widgets[f.name] = w
            self._parse[f.name] = parse
            self._show[f.name] = show
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
            show = self._show[name]
            w.value = show(value) if show is not None else value


def _dropdown(W, choices: tuple, default: Any, optional: bool, label: str):
    """(a Dropdown of ``choices``, parse, show). Its values are the choices themselves - a dtype by its name
    ("float16"), an enum by its member - and `NONE` for None."""
    def shown(value):
        if value is None:
            return NONE
        return in_words(value) if isinstance(value, torch.dtype) else value

    by_name = {in_words(c): c for c in choices if isinstance(c, torch.dtype)}
    options = [(in_words(c), shown(c)) for c in choices] + ([("none", NONE)] if optional else [])
    value = shown(default) if default is not None or optional else options[0][1]
    if value not in [v for _, v in options]:   # a default outside the choices: say so, not a blank box
        raise ValueError(f"{label!r}: default {default!r} is not one of its choices {choices}")
    w = W.Dropdown(options=options, value=value, description=label)

    def parse(v):
        if v is NONE or v is None:
            return None
        return by_name.get(v, v) if isinstance(v, str) else v
    return w, parse, shown


def _text_shown(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, tuple):
        return ", ".join(in_words(v) for v in value)
    return in_words(value)


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
        if typing.get_origin(kind) is tuple and all(a is int for a in typing.get_args(kind)):
            try:   # "2, 4", "2:4" or "(2, 4)"
                return tuple(int(p) for p in re.split(r"[\s,:()\[\]]+", text) if p)
            except ValueError:
                raise ValueError(f"{cls.__name__}.{field} takes integers such as 2, 4"
                                 f"{' or none' if optional else ''}, got {text!r}") from None
        return text
    return parse


def _clause(text: str, start: int) -> str:
    """The clause of ``text`` from ``start`` to a ";" or a full stop outside parentheses, or to the ")" closing a
    parenthesis it is in."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "(":
            depth += 1
        elif ch == ")":
            if depth == 0:
                return text[start:i].strip()
            depth -= 1
        elif depth == 0 and (ch == ";" or (ch == "." and text[i + 1:i + 2] in ("", " "))):
            return text[start:i].strip()
    return text[start:].strip()


def field_docs(cls: type) -> dict[str, str]:
    """What a config class says of each of its fields (see the module docstring), for the tooltips: ``{}`` where
    its source cannot be read."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        docs.update(_class_field_docs(klass))
    return docs


@functools.cache
def _class_field_docs(klass: type) -> dict[str, str]:
    text = " ".join((klass.__doc__ or "").split())
    docs = {m.group(1): _clause(text, m.end())   # "``damp``: fraction of ... ." in the class docstring
            for m in re.finditer(r"``(\w+)``:", text)}
    try:
        source = textwrap.dedent(inspect.getsource(klass))
        tree = ast.parse(source)
        comments = {}   # line -> (the comment's text, whether the line holds nothing else)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = (tok.string[1:], not tok.line[:tok.start[1]].strip())
    except (OSError, TypeError, SyntaxError, tokenize.TokenError):
        return docs
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        end = node.end_lineno or node.lineno
        said = [comments[n][0] for n in range(node.lineno, end + 1) if n in comments and not comments[n][1]]
        n = end + 1   # continuation lines: comments alone on their line, indented past the "#"
        while said and n in comments and comments[n][1] and comments[n][0].startswith("  "):
            said.append(comments[n][0])
            n += 1
        if said:
            docs[node.target.id] = " ".join(" ".join(said).split())
    return docs


def technique_forms() -> dict[type, TechniqueForm]:
    """One form per registered config class, in registration order."""
    return {cls: TechniqueForm(cls) for cls in registered_configs()}
