"""The anywidget-based views of the workbench (plotly's ``FigureWidget``, the itables grid), served by URL
under Voila.

An anywidget ships its JavaScript module (``_esm``) inside each widget's state; the browser evaluates it once
per widget, and anywidget's front end gives every widget 2 s to do so. A dashboard page restores all of its
widgets at once - five plotly charts are five evaluations of plotly's 5 MB bundle, sent five times - so on a
busy 2-core machine some widgets miss that deadline ("[anywidget] Failed to initialize model") and stay blank
or never update. Given as an ``http(s)`` URL instead, the module is fetched once, cached and evaluated once by
the browser for every widget that names it.

`served(cls)` does that where it can: under ``workbench app`` (Voila, which tells the kernel the page's URL in
``VOILA_REQUEST_URL``; the command lets Voila serve ``.js`` files of its folder) it writes the class's module once
into the served folder, named by its content hash, and returns a subclass whose ``_esm`` is that file's URL.
Anywhere else (JupyterLab, where widgets are created one by one as cells run) it returns ``cls`` unchanged.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from urllib.parse import urljoin

__all__ = ["served", "figure_widget", "grid_widget"]

_SERVED: dict[tuple[type, str], type] = {}


def served(cls: type) -> type:
    """``cls`` (an anywidget class) with its JavaScript module served by URL under Voila; see the module
    docstring. Each class is written and subclassed once per page URL."""
    from workbench.reports.html import browser_url

    page, root = os.environ.get("VOILA_REQUEST_URL"), os.environ.get("WORKBENCH_FILES_ROOT")
    if not (page and root and os.environ.get("WORKBENCH_FILES_URL")):
        return cls
    key = (cls, page)
    if key not in _SERVED:
        source = str(cls._esm)       # anywidget keeps a file's text (FileContents); a URL stays a URL
        if source.startswith(("http://", "https://")):
            return cls
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        path = Path(root) / "_widgets" / f"{cls.__name__}-{digest}.js"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(source, encoding="utf-8")
            tmp.replace(path)        # atomic: a page never fetches half a module
        url = urljoin(page, browser_url(path))
        _SERVED[key] = type(cls.__name__, (cls,), {"_esm": url, "__module__": __name__,
                                                   "__doc__": cls.__doc__})
    return _SERVED[key]


def figure_widget(*args, **kwargs):
    """``plotly.graph_objects.FigureWidget(*args, **kwargs)``, its module served by URL under Voila."""
    import plotly.graph_objects as go

    return served(go.FigureWidget)(*args, **kwargs)


def grid_widget(*args, **kwargs):
    """``itables.widget.ITable(*args, **kwargs)``, its module served by URL under Voila."""
    from itables.widget import ITable

    return served(ITable)(*args, **kwargs)
