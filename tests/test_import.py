"""Importing workbench is fast and has no side effects."""
import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_has_no_side_effects():
    out = _run("""
        import sys, torch
        threads = torch.get_num_threads()
        dtype = torch.get_default_dtype()
        import workbench
        assert torch.get_num_threads() == threads
        assert torch.get_default_dtype() == dtype
        assert not torch.cuda.is_initialized()
        heavy = [m for m in ("transformers", "plotly", "pandas", "papermill", "sklearn", "gensim", "triton")
                 if m in sys.modules]
        print(",".join(heavy) or "none")
    """)
    assert out == "none", f"importing workbench imported heavy modules: {out}"


def test_public_api_names():
    import workbench as wb

    for name in ["models", "tasks", "measure", "Metrics", "Plan", "apply", "save", "load", "precision"]:
        assert hasattr(wb, name), name
    assert callable(wb.precision.Cast)


def test_lesson_modules_load_on_first_use():
    """`wb.teach.<lesson>` imports the lesson module when first used, not when workbench is imported; an unknown
    name is an AttributeError that names it."""
    out = _run("""
        import sys
        import workbench as wb
        lessons = ("formats", "distillation", "precision", "pruning")
        print([n for n in lessons if f"workbench.teach.{n}" in sys.modules])
        print([getattr(wb.teach, n).__name__ for n in lessons])
        try:
            wb.teach.no_such_lesson
        except AttributeError as e:
            print(e)
    """)
    assert out.splitlines() == [
        "[]",
        "['workbench.teach.formats', 'workbench.teach.distillation', 'workbench.teach.precision', "
        "'workbench.teach.pruning']",
        "workbench.teach has no lesson module 'no_such_lesson'",
    ]
