"""Worked solutions live in the lesson modules, not in the learner's cell: `wb.teach.check(..., solution=...)`."""
import functools

import pytest
import torch

from workbench import teach


def _worked(x, bits):
    """A worked solution as a lesson module writes it."""
    qmax = 2 ** (bits - 1) - 1
    return x.abs().max() / qmax


def _wrong(x):
    return x.abs().max() / 128



def test_solution_source_is_the_body_as_the_learner_writes_it():
    assert teach.solution_source(_worked) == "qmax = 2 ** (bits - 1) - 1\nanswer = x.abs().max() / qmax"


def test_unattempted_stays_unattempted_without_solutions_and_offers_the_solution_after_an_attempt():
    x = torch.tensor([0.5, -2.0, 1.0])
    solution = functools.partial(_worked, x, 8)
    fb = teach.check("scale", ..., 2.0 / 127, solution=solution)
    assert fb.status == "not attempted" and "Show solution" in fb._repr_html_()
    wrong = teach.check("scale", 2.0 / 128, 2.0 / 127, solution=solution)
    assert wrong.status == "failed" and "answer = x.abs().max() / qmax" in wrong._repr_html_()
    right = teach.check("scale", 2.0 / 127, 2.0 / 127, solution=solution)
    assert right.passed and "Show solution" not in right._repr_html_()


def test_use_solutions_fills_only_unattempted_exercises_and_checks_the_worked_answer():
    x = torch.tensor([0.5, -2.0, 1.0])
    teach.use_solutions(True)
    fb = teach.check("scale", ..., 2.0 / 127, solution=functools.partial(_worked, x, 8))
    assert fb.passed and fb.from_solution and fb.answer == pytest.approx(2.0 / 127)
    mine = teach.check("scale", 1.0, 2.0 / 127, solution=functools.partial(_worked, x, 8))
    assert mine.status == "failed" and not mine.from_solution        # the learner's answer is never replaced
    broken = teach.check("broken", ..., 2.0 / 127, solution=functools.partial(_wrong, x))
    assert broken.status == "failed"                                 # a stale worked solution is caught
    table = teach.summary_table()
    assert list(table["exercise"]) == ["scale", "broken"]
    assert list(table["status"]) == ["failed", "failed (worked solution)"]


def _worked_doubler(x):
    return lambda t: t * 2


def test_measure_checks_what_an_answer_does_for_the_learner_and_the_worked_solution_alike():
    x = torch.tensor([1.0, 2.0])
    solution = functools.partial(_worked_doubler, x)

    def measure(f):
        return f(x)                      # an answer that is a function is checked by its output

    fb = teach.check("doubler", lambda t: t + t, torch.tensor([2.0, 4.0]), measure=measure, solution=solution)
    assert fb.passed and callable(fb.answer)                          # the feedback keeps the answer itself
    wrong = teach.check("doubler", lambda t: t + 1, torch.tensor([2.0, 4.0]), measure=measure, solution=solution,
                        mistakes=[(torch.tensor([2.0, 3.0]), "that adds one")])
    assert wrong.status == "failed" and wrong.hint == "that adds one" and "expected 4, found 3" in wrong.message
    teach.use_solutions(True)
    worked = teach.check("doubler", ..., torch.tensor([2.0, 4.0]), measure=measure, solution=solution)
    assert worked.passed and worked.from_solution                     # the worked solution is measured too
