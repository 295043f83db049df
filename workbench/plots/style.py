"""One look for every figure of the package - the lessons', the workbench's, the reports' and the analysis plots':
each passes ``template=TEMPLATE`` to ``update_layout``, so restyling them all is a change here (or registering
another plotly template under this name)."""
from __future__ import annotations

__all__ = ["TEMPLATE"]

TEMPLATE = "plotly_white"
