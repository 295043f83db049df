"""Shared by the tools/make_*_notebook.py scripts: write a list of cells as notebooks/NAME.ipynb."""
from pathlib import Path

import nbformat
from nbformat.v4 import new_notebook


def write(name: str, cells: list) -> Path:
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
    })
    out = Path(__file__).resolve().parent.parent / "notebooks" / f"{name}.ipynb"
    nbformat.write(nb, str(out))
    print(f"wrote {out}")
    return out
