"""Workshop support: exercise checks that tell a learner what was expected, what they gave, and a hint.

A lesson notebook asks for a value, then checks it; the learner's cell holds only their line and the check::

    answer = ...                                   # your code: the int8 scale of x
    F.check_int8_scale(answer, x)

Lesson modules (``wb.teach.formats``, ``wb.teach.ptq``, ...) compute the expected values themselves, so the
notebook never shows the answer, and hold the lesson's figures. Each check also knows a worked solution (a small
function in the lesson module, passed as ``check(..., solution=...)``): the feedback box offers it behind a
"Show solution" toggle once the learner has tried, and ``use_solutions(True)`` (the lessons' ``solutions``
parameter, used by the regression suite) makes an unattempted exercise run that solution - so papermill runs a
lesson end to end and the suite notices a worked solution that no longer passes its own check. Lesson modules
are imported on first use (``wb.teach.formats`` works without an import line for each lesson here).

`check` returns a `Feedback` (displayed as a coloured box in a notebook, as text elsewhere) and remembers the
latest result per exercise; `summary()` counts them, so a lesson records how many exercises passed and the
regression suite (run with ``solutions=True``) notices an exercise whose solution no longer passes.
An exercise left as ``...`` (or None) is "not attempted": a hint, never an error, so a notebook runs end to end.
"""
from __future__ import annotations

import importlib
import inspect
import math
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["Feedback", "check", "summary", "summary_table", "reset", "as_number", "use_solutions",
           "solution_source"]

_results: dict[str, "Feedback"] = {}
_use_solutions = False

_COLOURS = {"passed": ("#e6f4ea", "#137333", "✔"), "failed": ("#fce8e6", "#a50e0e", "✘"),
            "not attempted": ("#fef7e0", "#8a6d00", "…")}


@dataclass(frozen=True)
class Feedback:
    exercise: str
    status: str          # "passed", "failed" or "not attempted"
    message: str         # what was expected and what was found
    hint: str = ""
    solution: str = ""   # the worked solution's source, shown behind a toggle (not for a passed attempt)
    answer: Any = None   # what was checked: the learner's answer, or the solution's when it was filled in

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        text = f"[{self.status}] {self.exercise}: {self.message}"
        return text + (f"\n  hint: {self.hint}" if self.hint and not self.passed else "")

    @property
    def from_solution(self) -> bool:
        """True when the worked solution, not the learner, produced the answer (``use_solutions(True)``)."""
        return self.message.startswith("worked solution")

    def _repr_html_(self) -> str:
        import html

        bg, fg, mark = _COLOURS[self.status]
        hint = (f"<div style='margin-top:4px'><b>Hint:</b> {_inline_code(self.hint)}</div>"
                if self.hint and not self.passed else "")
        reveal = ""
        if self.solution and (not self.passed or self.from_solution):
            reveal = ("<details style='margin-top:4px'><summary style='cursor:pointer'>Show solution</summary>"
                      f"<pre style='color:#202124;background:#fff;padding:6px;margin:4px 0'>"
                      f"{html.escape(self.solution)}</pre></details>")
        return (f"<div style='background:{bg};color:{fg};border-left:4px solid {fg};padding:6px 10px;"
                f"margin:4px 0;font-family:sans-serif'><b>{mark} {html.escape(self.exercise)}</b> — "
                f"{_inline_code(self.message)}{hint}{reveal}</div>")

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))


def _inline_code(text: str) -> str:
    """``text`` as HTML, its Markdown-style `code` spans set as <code> (a banner is not Markdown: shown raw, the
    backticks would stay on screen)."""
    import html

    parts = html.escape(text).split("`")
    if len(parts) % 2 == 0:                                  # an unpaired backtick: keep it as typed
        return html.escape(text)
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


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


def use_solutions(on: bool = True) -> None:
    """Let every following check fill an unattempted exercise (``...``) with its worked solution - the lessons'
    ``solutions`` parameter, so papermill (and the regression suite) runs a lesson end to end."""
    global _use_solutions
    _use_solutions = bool(on)


def solution_source(solution: Callable[..., Any]) -> str:
    """The body of a worked-solution function, as a learner would type it in the exercise cell."""
    try:
        lines = inspect.getsource(solution).splitlines()
    except (OSError, TypeError):                                            # defined where no source is kept
        return ""
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("def ")) + 1
    while start < len(lines) and lines[start - 1].rstrip()[-1:] != ":":     # a signature over several lines
        start += 1
    body = textwrap.dedent("\n".join(lines[start:]))
    if body.startswith(('"""', "'''")):                                   # drop the docstring
        quote = body[:3]
        body = body[body.index(quote, 3) + 3:].lstrip("\n")
    lines = body.rstrip().splitlines()
    if lines and lines[-1].startswith("return "):                           # as the learner writes it
        value = lines[-1][len("return "):].strip()
        lines = lines[:-1] if value == "answer" else [*lines[:-1], f"answer = {value}"]
    return "\n".join(lines)


def check(exercise: str, answer: Any, expected: Any, *, hint: str = "", rtol: float = 1e-4,
          atol: float = 1e-6, mistakes: Sequence[tuple[Any, str]] = (),
          solution: Callable[[], Any] | None = None, measure: Callable[[Any], Any] | None = None) -> Feedback:
    """Compare a learner's ``answer`` with ``expected`` (tensors, arrays, numbers, strings, bools, dtypes,
    lists, dicts; floats within ``rtol`` / ``atol``) and return specific feedback. ``mistakes``: (value, hint)
    pairs of plausible wrong answers; a wrong answer equal to one of them gets that hint instead of ``hint``.
    ``solution``: a function of no arguments returning the worked answer (usually a ``functools.partial`` of a
    solution function in the lesson module); its source is offered behind a "Show solution" toggle after an
    attempt, and it answers an unattempted exercise after ``use_solutions(True)`` - checked like any answer.
    ``measure``: for an answer that is checked by what it does rather than by its value (a tensor and the gradient
    autograd finds through it, say), a function of the answer returning what is compared with ``expected`` and
    with the ``mistakes``; it is applied to the learner's answer and to the worked solution's alike."""
    source = solution_source(getattr(solution, "func", solution)) if solution is not None else ""
    filled = False
    if (answer is ... or answer is None) and _use_solutions and solution is not None:
        answer, filled = solution(), True
    if answer is ... or answer is None:
        fb = Feedback(exercise, "not attempted", "replace the `...` with your answer and run the cell again", hint,
                      source)
    else:
        found = answer if measure is None else measure(answer)
        diff = _compare(found, expected, rtol, atol)
        if diff is not None:
            hint = next((why for value, why in mistakes if _compare(found, value, rtol, atol) is None), hint)
        message = "correct" if diff is None else diff
        if filled:
            message = f"worked solution (solutions=True): {message}"
        fb = Feedback(exercise, "passed" if diff is None else "failed", message, hint, source, answer)
    _results[exercise] = fb
    return fb


def summary() -> dict[str, int]:
    """How many exercises were checked in this session, and how many passed / failed / were not attempted."""
    statuses = [fb.status for fb in _results.values()]
    return {"exercises": len(statuses), "passed": statuses.count("passed"), "failed": statuses.count("failed"),
            "not_attempted": statuses.count("not attempted")}


def summary_table():
    """The lesson's exercises as a table a learner reads at the end: one row per exercise, its status and what
    the check said (a pandas DataFrame, displayed as HTML in a notebook)."""
    import pandas as pd

    rows = [{"exercise": fb.exercise, "status": fb.status + (" (worked solution)" if fb.from_solution else ""),
             "feedback": fb.message.removeprefix("worked solution (solutions=True): ")} for fb in _results.values()]
    return pd.DataFrame(rows, columns=["exercise", "status", "feedback"])


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
