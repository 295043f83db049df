"""The interactive workbench: `Workbench` (ipywidgets) over a widget-free `Session`.

    import workbench as wb
    wb.ui.Workbench(wb.models.load("digits-cnn"), "digits")
"""
from workbench.ui.session import Entry, Session

__all__ = ["Workbench", "Session", "Entry"]


def __getattr__(name):
    if name == "Workbench":  # ipywidgets and plotly are imported only when the UI is used
        from workbench.ui.app import Workbench

        return Workbench
    raise AttributeError(f"module 'workbench.ui' has no attribute {name!r}")
