"""Lessons are committed as notebooks without outputs: strip them after editing in JupyterLab, or check them.

The committed ``notebooks/*.ipynb`` are the lessons' source: a teacher opens one in JupyterLab, edits, runs and
saves it, then strips the outputs before committing (run from the repository root)::

    python -m workbench.teach.strip notebooks            # strip every notebook in the folder, in place
    python -m workbench.teach.strip --check notebooks    # list what breaks the rules; exit 1 if anything does

The rules (`problems`), which tests/test_notebooks.py also asserts for every committed notebook: no outputs and
no execution counts, exactly one cell tagged ``parameters``, and no ``def`` / ``class`` / ``lambda`` in code cells
(notebooks only call the package). Stripping fixes the first rule only; the others need an edit.

Stripping removes outputs, execution counts and the run-time metadata Jupyter and papermill add (cell
``execution`` / ``papermill`` / ``collapsed`` / ``scrolled`` keys, notebook ``widgets`` / ``papermill`` state), and
keeps the sources, cell ids and tags, so a stripped notebook diffs as its sources only.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
from pathlib import Path

__all__ = ["strip", "strip_file", "problems", "notebook_paths", "main", "kernel_metadata"]

# run-time metadata: what running or viewing a notebook writes, never what a teacher authors
CELL_KEYS = ("execution", "papermill", "collapsed", "scrolled", "ExecuteTime")
NOTEBOOK_KEYS = ("widgets", "papermill", "toc", "varInspector")


def kernel_metadata() -> dict:
    """The notebook metadata JupyterLab writes as the kernel connects (the kernelspec of ``python3`` and the
    kernel's ``language_info``): a notebook stored with anything else opens marked "modified" before anyone
    typed. Committed notebooks hold exactly this (`strip` writes it, `problems` checks it, Python's patch version
    aside)."""
    from ipykernel.ipkernel import IPythonKernel

    return {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
            "language_info": dict(sorted(IPythonKernel.language_info.items()))}


def _kernel_metadata_differs(metadata, ignore_version: bool) -> list[str]:
    """The keys of `kernel_metadata` that ``metadata`` holds otherwise (``language_info``'s version aside when
    ``ignore_version``: a machine with another Python patch release reads the same notebook)."""
    def norm(key, value):
        value = dict(value or {})
        if ignore_version and key == "language_info":
            value.pop("version", None)
        return value
    return [key for key, value in kernel_metadata().items() if norm(key, metadata.get(key)) != norm(key, value)]


def strip(nb) -> bool:
    """Strip an ``nbformat`` notebook in place and give it the kernel's metadata (`kernel_metadata`); True when
    anything changed."""
    changed = False
    for key in _kernel_metadata_differs(nb.metadata, ignore_version=False):
        nb.metadata[key] = kernel_metadata()[key]
        changed = True
    for cell in nb.cells:
        for key in CELL_KEYS:
            changed |= cell.metadata.pop(key, None) is not None
        if cell.cell_type != "code":
            continue
        if cell.get("outputs") or cell.get("execution_count") is not None:
            changed = True
        cell.outputs, cell.execution_count = [], None
    for key in NOTEBOOK_KEYS:
        changed |= nb.metadata.pop(key, None) is not None
    return changed


def _read(path: Path):
    import nbformat

    try:
        return nbformat.read(str(path), as_version=4)
    except Exception as e:   # nbformat raises several types (JSON, validation, version)
        raise ValueError(f"{path}: not a readable notebook ({type(e).__name__}: {e})") from e


def strip_file(path: str | os.PathLike) -> bool:
    """Strip the notebook file at ``path`` in place; True when it was rewritten."""
    import nbformat

    path = Path(path)
    nb = _read(path)
    if not strip(nb):
        return False
    nbformat.write(nb, str(path))
    return True


def problems(path: str | os.PathLike) -> list[str]:
    """What breaks the committed-notebook rules in the notebook at ``path`` (an empty list when none)."""
    path = Path(path)
    nb = _read(path)
    out = []
    params = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(params) != 1:
        out.append(f"{path.name}: expected exactly one cell tagged 'parameters', found {len(params)}")
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if cell.get("outputs"):
            out.append(f"{path.name}: cell {i} has outputs (strip: python -m workbench.teach.strip {path})")
        if cell.get("execution_count") is not None:
            out.append(f"{path.name}: cell {i} has an execution count (strip: python -m workbench.teach.strip "
                       f"{path})")
        try:
            tree = ast.parse(cell.source)
        except SyntaxError as e:
            out.append(f"{path.name}: cell {i} is not valid Python ({e.msg}, line {e.lineno})")
            continue
        defs = [n for n in ast.walk(tree)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))]
        if defs:
            kinds = sorted({type(n).__name__ for n in defs})
            out.append(f"{path.name}: cell {i} defines code ({', '.join(kinds)}, line {defs[0].lineno}); "
                       f"notebooks only call the package: move it into workbench/")
    for key in NOTEBOOK_KEYS:
        if key in nb.metadata:
            out.append(f"{path.name}: notebook metadata holds run-time state {key!r} (strip it)")
    for key in _kernel_metadata_differs(nb.metadata, ignore_version=True):
        out.append(f"{path.name}: notebook metadata {key!r} is not the kernel's: JupyterLab opens it marked "
                   f"modified (strip: python -m workbench.teach.strip {path})")
    return out


def notebook_paths(paths: list[str]) -> list[Path]:
    """Files as given; folders expanded to the ``*.ipynb`` directly inside them (sorted)."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(p.glob("*.ipynb"))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"no notebook or folder at {p}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.teach.strip", description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", default=["notebooks"],
                        help="notebooks or folders of notebooks (default: notebooks)")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; list every rule broken and exit 1 if any is")
    args = parser.parse_args(argv)
    try:
        paths = notebook_paths(args.paths)
    except FileNotFoundError as e:
        parser.error(str(e))
    if not paths:
        parser.error(f"no notebooks in {' '.join(args.paths)}")
    if args.check:
        found = [line for p in paths for line in problems(p)]
        print("\n".join(found) if found else f"{len(paths)} notebook(s) follow the rules")
        return 1 if found else 0
    rewritten = [p for p in paths if strip_file(p)]
    print(f"stripped {len(rewritten)} of {len(paths)} notebook(s)" +
          "".join(f"\n  {p}" for p in rewritten))
    left = [line for p in paths for line in problems(p)]
    if left:   # rules stripping cannot fix: say so, fail
        print("\n".join(left), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
