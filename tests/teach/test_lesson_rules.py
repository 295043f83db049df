"""The exercise convention, checked on the committed lessons: an exercise cell holds only the learner's line and
the check; the worked solutions live in the lessons' ``checks`` modules (none of their code appears in a notebook);
each lesson turns solutions on once, after its parameters, and ends with a visible summary before the record."""
import ast
import inspect
from pathlib import Path

import nbformat
import pytest

from workbench import teach

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
LESSONS = {"10_number_formats": "formats", "11_quantization_basics": "basics", "12_ptq_algorithms": "ptq",
           "13_qat": "qat", "20_pruning": "pruning", "30_distillation": "distillation",
           "40_mixed_precision": "precision", "41_fp8_recipes": "fp8", "50_kernels": "kernels",
           "14_integer_only": "integer", "15_sensitivity_bits": "sensitivity", "21_pruning_beyond": "gradual",
           "60_llm_decode": "llm", "31_lm_distillation": "lm_distillation"}


def _code_cells(stem):
    nb = nbformat.read(str(NOTEBOOKS / f"{stem}.ipynb"), as_version=4)
    return [c for c in nb.cells if c.cell_type == "code"]


def _solution_lines(module):
    """The statements of every worked solution in ``module``, as the learner would type them."""
    lines = set()
    for name, fn in inspect.getmembers(module, inspect.isfunction):
        if name.startswith("_solution_") and fn.__module__ == module.__name__:
            for line in teach.solution_source(fn).splitlines():
                code = line.split("#")[0].strip()
                if len(code) > 12 and code != "answer = ...":
                    lines.add(code)
    return lines


@pytest.mark.parametrize("stem", sorted(LESSONS))
def test_exercise_cells_hold_only_the_learners_line_and_the_check(stem):
    cells = _code_cells(stem)
    source = "\n".join(c.source for c in cells)
    assert "if solutions" not in source and "_solution_" not in source
    exercises = [c.source for c in cells if c.source.lstrip().startswith("# Exercise")]
    assert len(exercises) >= 3, f"{stem}: {len(exercises)} exercise cells"
    for cell in exercises:
        statements = ast.parse(cell).body
        assert len(statements) == 2, f"{stem}: an exercise cell holds more than its line and its check:\n{cell}"
        line, call = statements
        assert isinstance(line, ast.Assign) and ast.unparse(line) == "answer = ...", cell
        assert isinstance(call, ast.Expr) and ".check_" in ast.unparse(call.value), cell


@pytest.mark.parametrize("stem", sorted(LESSONS))
def test_no_worked_solution_code_in_the_notebook(stem):
    module = getattr(teach, LESSONS[stem]).checks            # the lesson's exercises: worked solutions and checks
    solution = _solution_lines(module)
    assert solution, f"{module.__name__} has no worked solutions"
    source = "\n".join(c.source for c in _code_cells(stem))
    shown = [line for line in solution if line in source]
    assert not shown, f"{stem} shows worked-solution code: {shown}"


@pytest.mark.parametrize("stem", sorted(LESSONS))
def test_solutions_switched_once_after_the_parameters_and_a_summary_ends_the_lesson(stem):
    cells = _code_cells(stem)
    params = [i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    calls = [i for i, c in enumerate(cells) if "wb.teach.use_solutions(solutions)" in c.source]
    assert calls == [params[0] + 1], f"{stem}: use_solutions in code cells {calls}"
    assert "wb.teach.summary_table()" in cells[-2].source and "key numbers" in cells[-2].source
    assert "wb.reports.record(" in cells[-1].source and "exercises_passed" in cells[-1].source


def _assigned(tree) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


@pytest.mark.parametrize("stem", sorted(LESSONS))
def test_every_worked_solution_runs_with_the_notebooks_names(stem):
    """The solution behind "Show solution" pastes into the exercise cell: every name it reads is one the notebook
    defines (or a builtin), so a learner can run it as shown."""
    import builtins

    defined = set(dir(builtins)) | _assigned(ast.parse("\n".join(c.source for c in _code_cells(stem))))
    module = getattr(teach, LESSONS[stem]).checks
    for name, fn in inspect.getmembers(module, inspect.isfunction):
        if name.startswith("_solution_") and fn.__module__ == module.__name__:
            tree = ast.parse(teach.solution_source(fn))
            read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            missing = read - _assigned(tree) - defined
            assert not missing, f"{stem}: {name} reads {sorted(missing)}, which the notebook never defines"
