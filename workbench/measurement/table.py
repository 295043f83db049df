"""Tables of measurements that read as a person reads them: `MetricsTable`, what `wb.compare`, `wb.layer_table`
and `wb.sweep` return.

A `MetricsTable` is a pandas DataFrame (every value stays the number it was, for code and tests); only its
display in a notebook or an HTML report is formatted, by the field each value belongs to - ``*_bytes`` (and
``bytes``) in B / KiB / MiB / GiB, ``*_ms`` in ms, speedups and ratios as ``1.23x``, other numbers to 4
significant figures, missing values as "-" - whether the fields are its columns or, transposed (``.T``, one
column per model), its rows; a few rows of many fields (`wb.compare`'s) show transposed, one column per model, so
nothing runs off the page. `styled(df)` gives that formatted view (a pandas ``Styler``) of any DataFrame with
such field names.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable

import pandas as pd

__all__ = ["MetricsTable", "styled", "format_value", "plain_number"]


def plain_number(value: float, digits: int = 4) -> str:
    """A number people read at a glance: about ``digits`` significant digits in plain notation (1,380, 0.9727,
    12.35), never 1.38e+03; scientific only outside [0.001, 1e6)."""
    if value == 0:
        return "0"
    if not math.isfinite(value) or not 1e-3 <= abs(value) < 1e6:
        return f"{value:.{digits - 1}g}"
    return f"{value:,.{max(0, digits - 1 - math.floor(math.log10(abs(value))))}f}"


def _bytes(v: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= size:
            return f"{plain_number(v / size, 4)} {unit}"
    return f"{int(v):,} B"


def _formatter(field: Any) -> Callable[[float], str]:
    name = str(field)
    if name in ("speedup", "speedup_low", "speedup_high") or name.endswith("_ratio"):
        return lambda v: f"{plain_number(v, 3)}x"
    if name.endswith("_bytes") or name == "bytes" or name.startswith("bytes_"):
        return _bytes
    if name.endswith("_ms"):
        return lambda v: f"{plain_number(v, 4)} ms"
    return lambda v: f"{v:,}" if isinstance(v, numbers.Integral) else plain_number(float(v), 4)


def format_value(field: Any, value: Any) -> str:
    """``value`` of column / row ``field`` as `MetricsTable` shows it."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    return _formatter(field)(value)


def _fields_are_columns(df: pd.DataFrame) -> bool:
    known = ("latency_ms", "size_bytes", "speedup", "model", "threads", "layer", "bytes", "label")
    return sum(c in df.columns for c in known) >= sum(i in df.index for i in known)


def styled(df: pd.DataFrame):
    """A pandas ``Styler`` of ``df`` with each value formatted by its field (see the module docstring)."""
    frame = pd.DataFrame(df)
    by_column = _fields_are_columns(frame)
    text = frame.copy().astype(object)
    for i, row in enumerate(frame.index):
        for j, col in enumerate(frame.columns):
            text.iat[i, j] = format_value(col if by_column else row, frame.iat[i, j])
    # (a Styler of the formatted text: labels need not be unique, as Styler.format's subsets would need)
    return text.style.set_table_styles([{"selector": "td", "props": [("text-align", "right")]}])


class MetricsTable(pd.DataFrame):
    """A DataFrame of measurements whose notebook display is formatted (`styled`); its values are unchanged."""

    @property
    def _constructor(self):
        return MetricsTable

    def _repr_html_(self) -> str | None:
        # a few models x many fields (wb.compare: ~20 columns) would run off the page: one column per model
        frame = pd.DataFrame(self)
        wide = _fields_are_columns(frame) and len(frame.columns) > 12 and len(frame.index) <= 8
        return styled(frame.T if wide else frame).to_html()
