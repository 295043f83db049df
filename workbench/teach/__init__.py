"""Workshop support: exercise checks that tell a learner what was expected, what they gave, and a hint.

A lesson notebook asks for a value, then checks it::

    answer = ...                                   # your code: the int8 scale of x
    answer = x.abs().max() / 127 if solutions else answer
    wb.teach.check("int8 scale", answer, expected=..., hint="max |x| maps to the largest code")

Lesson modules (``wb.teach.formats``, ``wb.teach.ptq``, ...) compute the expected values themselves, so the
notebook never shows the answer, and hold the lesson's figures. They are imported on first use
(``wb.teach.formats`` works without an import line for each lesson here).

`check` returns a `Feedback` (displayed as a coloured box in a notebook, as text elsewhere) and remembers the
latest result per exercise; `summary()` counts them, so a lesson records how many exercises passed and the
regression suite (run with ``solutions=True``) notices an exercise whose solution no longer passes.
An exercise left as ``...`` (or None) is "not attempted": a hint, never an error, so a notebook runs end to end.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["Feedback", "check", "summary", "reset", "as_number"]

_results: dict[str, "Feedback"] = {}

_COLOURS = {"passed": ("#e6f4ea", "#137333", "✔"), "failed": ("#fce8e6", "#a50e0e", "✘"),
            "not attempted": ("#fef7e0", "#8a6d00", "…")}


@dataclass(frozen=True)
class Feedback:
    exercise: str
    status: str          # "passed", "failed" or "not attempted"
    message: str         # what was expected and what was found
    hint: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        text = f"[{self.status}] {self.exercise}: {self.message}"
        return text + (f"\n  hint: {self.hint}" if self.hint and not self.passed else "")

    def _repr_html_(self) -> str:
        import html

        bg, fg, mark = _COLOURS[self.status]
        hint = (f"<div style='margin-top:4px'><b>Hint:</b> {html.escape(self.hint)}</div>"
                if self.hint and not self.passed else "")
        return (f"<div style='background:{bg};color:{fg};border-left:4px solid {fg};padding:6px 10px;"
                f"margin:4px 0;font-family:sans-serif'><b>{mark} {html.escape(self.exercise)}</b> — "
                f"{html.escape(self.message)}{hint}</div>")

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))


def as_number(answer: Any) -> float | None:
    """``answer`` (a number, a 0-d tensor or array) as a float, or None when it is not a number."""
    try:
        return float(answer.item() if hasattr(answer, "item") else answer)
    except (TypeError, ValueError, RuntimeError):
        return None


def _describe(x: Any) -> str:
    import torch

    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).replace('torch.', '')} tensor of shape {tuple(x.shape)}"
    if isinstance(x, (list, tuple, dict)):
        return f"a {type(x).__name__} of {len(x)}"
    return f"{type(x).__name__} {x!r}"


def _compare(answer: Any, expected: Any, rtol: float, atol: float) -> str | None:
    """None when ``answer`` matches ``expected``; otherwise what differs, in words."""
    import numpy as np
    import torch

    if isinstance(expected, torch.dtype):
        return None if answer == expected else f"expected {expected}, found {answer!r}"
    if isinstance(expected, (torch.Tensor, np.ndarray)) or (
            isinstance(expected, (list, tuple)) and expected and all(isinstance(v, (int, float)) for v in expected)):
        exp = torch.as_tensor(expected).double()
        try:
            got = torch.as_tensor(answer.detach().cpu() if isinstance(answer, torch.Tensor) else answer).double()
        except (TypeError, ValueError, RuntimeError):
            return f"expected {_describe(expected)}, found {_describe(answer)}"
        if got.shape != exp.shape:
            return f"expected shape {tuple(exp.shape)}, found shape {tuple(got.shape)}"
        close = torch.isclose(got, exp, rtol=rtol, atol=atol, equal_nan=True)
        if bool(close.all()):
            return None
        bad = (~close).nonzero()[0].tolist() if exp.ndim else []
        where = tuple(bad) if exp.ndim else ()
        return (f"{int((~close).sum())} of {exp.numel()} values differ; e.g. at index {where}: expected "
                f"{exp[where].item():.6g}, found {got[where].item():.6g}")
    if isinstance(expected, bool) or isinstance(expected, str):
        same = (answer.strip().lower() == expected.strip().lower()) if isinstance(answer, str) and \
            isinstance(expected, str) else answer is expected or answer == expected
        return None if same else f"expected {expected!r}, found {answer!r}"
    if isinstance(expected, (int, float)):
        value = as_number(answer)
        if value is None:
            return f"expected a number close to {expected:.6g}, found {_describe(answer)}"
        if math.isclose(value, float(expected), rel_tol=rtol, abs_tol=atol):
            return None
        return f"expected {expected:.6g}, found {value:.6g}"
    if isinstance(expected, dict):
        if not isinstance(answer, dict):
            return f"expected a dict with keys {sorted(expected)}, found {_describe(answer)}"
        if set(answer) != set(expected):
            return f"expected keys {sorted(expected)}, found {sorted(answer)}"
        for k in expected:
            diff = _compare(answer[k], expected[k], rtol, atol)
            if diff:
                return f"[{k!r}] {diff}"
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(answer, (list, tuple)) or len(answer) != len(expected):
            return f"expected {_describe(expected)}, found {_describe(answer)}"
        for i, (a, e) in enumerate(zip(answer, expected, strict=True)):
            diff = _compare(a, e, rtol, atol)
            if diff:
                return f"item {i}: {diff}"
        return None
    return None if answer == expected else f"expected {expected!r}, found {answer!r}"


def check(exercise: str, answer: Any, expected: Any, *, hint: str = "", rtol: float = 1e-4,
          atol: float = 1e-6, mistakes: Sequence[tuple[Any, str]] = ()) -> Feedback:
    """Compare a learner's ``answer`` with ``expected`` (tensors, arrays, numbers, strings, bools, dtypes,
    lists, dicts; floats within ``rtol`` / ``atol``) and return specific feedback. ``mistakes``: (value, hint)
    pairs of plausible wrong answers; a wrong answer equal to one of them gets that hint instead of ``hint``."""
    if answer is ... or answer is None:
        fb = Feedback(exercise, "not attempted", "replace the `...` with your answer and run the cell again", hint)
    else:
        diff = _compare(answer, expected, rtol, atol)
        if diff is not None:
            hint = next((why for value, why in mistakes if _compare(answer, value, rtol, atol) is None), hint)
        fb = Feedback(exercise, "passed" if diff is None else "failed", "correct" if diff is None else diff, hint)
    _results[exercise] = fb
    return fb


def summary() -> dict[str, int]:
    """How many exercises were checked in this session, and how many passed / failed / were not attempted."""
    statuses = [fb.status for fb in _results.values()]
    return {"exercises": len(statuses), "passed": statuses.count("passed"), "failed": statuses.count("failed"),
            "not_attempted": statuses.count("not attempted")}


def reset() -> None:
    _results.clear()


def __getattr__(name: str):
    """Lesson modules load on first use: ``wb.teach.formats`` imports ``workbench.teach.formats``."""
    if name.startswith("_"):
        raise AttributeError(name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"{__name__}.{name}":
            raise AttributeError(f"workbench.teach has no lesson module {name!r}") from None
        raise
