"""The workbench's layer list: an itables grid widget (DataTables in the page, synced with Python).

Column headers; click a header to sort; click, shift-click and ctrl-click rows to select several. `value` is
the tuple of selected layer names (settable, like a `SelectMultiple`), whatever order the rows are sorted in:
the grid reports selected rows by their position in the table the session gave, not on screen.
"""
from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

__all__ = ["LayerTable", "COLUMNS"]

COLUMNS = ["layer", "type", "shape", "params", "technique", "bytes before", "bytes after", "state", "loss"]


class LayerTable:
    """See the module docstring. ``rows``: `Session.layer_rows()` (one row per editable layer)."""

    def __init__(self, rows: pd.DataFrame, height_px: int = 360):
        from workbench.ui.widgets import grid_widget

        self.names: list[str] = list(rows["layer"])
        self.widget = grid_widget(self._frame(rows), select={"style": "os"}, paging=False, showIndex=False,
                             classes="display compact nowrap", scrollY=f"{height_px}px", scrollCollapse=True,
                             scrollX=True, style="width:100%;margin:0")
        self.widget.add_class("wb-layers")

    @staticmethod
    def _frame(rows: pd.DataFrame) -> pd.DataFrame:
        out = rows.rename(columns={"bytes_before": "bytes before", "bytes_after": "bytes after"})
        out["loss"] = [f"{v:+.4f}" if pd.notna(v) else "" for v in out["loss"]]   # NaN: no sensitivity measured yet
        return out[COLUMNS]

    def update(self, rows: pd.DataFrame) -> None:
        """Show new rows (same layers, new techniques / bytes); the selection is kept."""
        if list(rows["layer"]) != self.names:
            raise ValueError("the layer table's layers changed; build a new LayerTable")
        selected = list(self.widget.selected_rows)
        self.widget.update(self._frame(rows), selected_rows=selected)

    @property
    def value(self) -> tuple[str, ...]:
        """The selected layers, in the model's order."""
        rows = sorted(set(self.widget.selected_rows))
        return tuple(self.names[i] for i in rows if 0 <= i < len(self.names))

    @value.setter
    def value(self, names: Sequence[str]) -> None:
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise ValueError(f"not layers of this table: {', '.join(map(repr, unknown))}")
        wanted = set(names)
        self.widget.selected_rows = [i for i, n in enumerate(self.names) if n in wanted]
