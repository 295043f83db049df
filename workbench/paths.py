"""Where the project's shipped data lives (``data/`` at the repository root).

``WORKBENCH_DATA`` overrides it, e.g. for an installation that keeps the weights elsewhere.
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["data_dir"]


def data_dir() -> Path:
    override = os.environ.get("WORKBENCH_DATA")
    path = Path(override) if override else Path(__file__).resolve().parent.parent / "data"
    if not path.is_dir():
        raise FileNotFoundError(
            f"the workbench data folder {path} does not exist; run from a source checkout "
            f"(pip install -e .) or point WORKBENCH_DATA at a copy of the repository's data/")
    return path
