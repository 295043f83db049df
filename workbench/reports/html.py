"""Standalone HTML for an executed notebook: one file that renders with no network at all.

`to_html(notebook, html)` prepares a copy of the notebook, then renders it with the ``workbench_report``
nbconvert template (next to this file):

- plotly figures become inline charts, plotly.js embedded once;
- maths in markdown (``$…$``, ``$$…$$``) is pre-rendered to MathML (browsers draw it natively), so no MathJax;
- the template drops require.js and the CDN widget manager and folds every code cell behind a "code" toggle;
- papermill's two parameter cells (the notebook's defaults and the injected values) become one table of the
  values the run used, with the defaults beside them;
- widget outputs (progress bars) are dropped: without a live kernel they would render as nothing.

`browser_url(path)` says where a browser reaches a report written by a kernel running under Jupyter or Voila
(`OutsideServerRoot` when it cannot: the file lies outside the server's folder).
"""
from __future__ import annotations

import ast
import html
import io
import json
import os
import re
import tokenize
from pathlib import Path
from typing import Any

__all__ = ["to_html", "parameter_rows", "browser_url", "OutsideServerRoot"]

TEMPLATES = Path(__file__).resolve().parent / "templates"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
# code spans and fences are kept as they are; the math patterns only look outside them
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)
_MATH = re.compile(r"\$\$(.+?)\$\$|(?<![\\$\w])\$(?!\s)([^$\n]+?)(?<!\s)\$(?![\w$])", re.DOTALL)


def _math_to_placeholders(text: str, store: list[str]) -> str:
    """Replace each formula by a placeholder token; its MathML goes in ``store`` (put back after rendering)."""
    from latex2mathml.converter import convert

    def formula(m: re.Match) -> str:
        block, inline = m.group(1), m.group(2)
        try:
            store.append(convert(block or inline, display="block" if block is not None else "inline"))
        except Exception as e:  # latex2mathml raises many types; the formula is named below
            raise ValueError(f"the formula {m.group(0)!r} cannot be rendered to MathML: {e}") from e
        return f"wbmath{len(store) - 1}x"

    pieces, last = [], 0
    for code in _CODE.finditer(text):
        pieces += [_MATH.sub(formula, text[last:code.start()]), code.group(0)]
        last = code.end()
    pieces.append(_MATH.sub(formula, text[last:]))
    return "".join(pieces)


def parameter_rows(nb) -> list[tuple[str, str, str, str]]:
    """(name, value used, default, comment) for each parameter of a papermill-executed notebook.

    The defaults and comments come from the cell tagged ``parameters``; the values used from the papermill
    metadata (what was injected), else the default.
    """
    injected = nb.metadata.get("papermill", {}).get("parameters", {}) or {}
    rows: dict[str, tuple[str, str, str, str]] = {}
    for cell in nb.cells:
        if cell.cell_type != "code" or "parameters" not in cell.metadata.get("tags", []):
            continue
        source = cell.source
        comments = {tok.start[0]: tok.string.lstrip("# ").strip()
                    for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                    if tok.type == tokenize.COMMENT}
        for node in ast.parse(source).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
                default = ast.get_source_segment(source, node.value) or ""
                used = repr(injected[name]) if name in injected else default
                rows[name] = (name, used, default, comments.get(node.end_lineno, ""))
    for name, value in injected.items():  # a parameter the notebook does not declare still ran
        rows.setdefault(name, (name, repr(value), "", "(not declared in the notebook)"))
    return list(rows.values())


def _parameters_cell(nb):
    import nbformat

    head = "<tr><th>parameter</th><th>value</th><th>default</th><th></th></tr>"
    body = "".join(
        f"<tr><td><code>{html.escape(n)}</code></td><td class='{'changed' if used != default else ''}'>"
        f"<code>{html.escape(used)}</code></td><td><code>{html.escape(default)}</code></td>"
        f"<td>{html.escape(note)}</td></tr>" for n, used, default, note in parameter_rows(nb))
    cell = nbformat.v4.new_markdown_cell(
        f"<div class='wb-parameters'><strong>Parameters of this run</strong>\n\n<table>{head}{body}</table></div>")
    cell.metadata["tags"] = ["parameters-table"]
    return cell


def _prepare(nb, formulas: list[str]) -> None:
    """Rewrite the notebook in place into what the report shows (see the module docstring)."""
    import plotly.io as pio

    cells, table_done, plotly_js = [], False, True  # plotly.js goes into the first chart; the others reuse it
    for cell in nb.cells:
        tags = cell.metadata.get("tags", [])
        if "injected-parameters" in tags:
            continue
        if "parameters" in tags:
            if not table_done:
                cells.append(_parameters_cell(nb))
                table_done = True
            continue
        if cell.cell_type == "markdown":
            cell.source = _math_to_placeholders(cell.source, formulas)
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "text/markdown" in data:
                data["text/markdown"] = _math_to_placeholders(data["text/markdown"], formulas)
            if PLOTLY_MIME in data:
                fig = pio.from_json(json.dumps(data.pop(PLOTLY_MIME)))
                data["text/html"] = pio.to_html(fig, include_plotlyjs=plotly_js, full_html=False,
                                                config={"responsive": True})
                plotly_js = False
        if cell.get("outputs"):
            cell.outputs = [o for o in cell.outputs if WIDGET_MIME not in o.get("data", {})]
        cells.append(cell)
    nb.cells = cells
    nb.metadata.pop("widgets", None)


def to_html(notebook_path: str | os.PathLike, html_path: str | os.PathLike) -> Path:
    """Render an executed notebook to one standalone HTML file that needs no network (see the module docstring)."""
    import nbformat
    from nbconvert import HTMLExporter

    notebook_path = Path(notebook_path)
    if not notebook_path.is_file():
        raise FileNotFoundError(f"notebook {notebook_path} does not exist")
    nb = nbformat.read(str(notebook_path), as_version=4)
    formulas: list[str] = []
    _prepare(nb, formulas)
    exporter = HTMLExporter(template_name="workbench_report", extra_template_basedirs=[str(TEMPLATES)])
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": notebook_path.stem}})
    # longest index first, so that wbmath1x is not replaced inside wbmath12x
    for i in sorted(range(len(formulas)), reverse=True):
        body = body.replace(f"wbmath{i}x", formulas[i])
    html_path = Path(html_path)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    html_path.write_text(body, encoding="utf-8")
    return html_path


def _jupyter_server() -> dict[str, Any] | None:
    """The Jupyter server that started this kernel (its runtime file names its root folder and base URL)."""
    try:
        from jupyter_server.serverapp import list_running_servers
    except ImportError:
        return None
    parent = os.getppid()
    return next((s for s in list_running_servers() if s.get("pid") == parent), None)


class OutsideServerRoot(ValueError):
    """A file the browser cannot reach: it lies outside the folder the Jupyter (or Voila) server serves.

    ``path`` is the file, ``root`` the server's folder; the message says where the file is and what to do.
    """

    def __init__(self, path: Path, root: Path, jupyter: bool = True):
        self.path, self.root = path, root
        where = "this Jupyter server's folder" if jupyter else "the folder this server serves"
        also = ", or start JupyterLab with `make lab` (its folder is the repository)" if jupyter else ""
        super().__init__(f"the report is outside {where} {root}, so no browser link can reach it: "
                         f"open {path} from a file manager{also}")


def served_folder() -> Path | None:
    """The folder the browser showing this kernel's outputs can fetch files from: the Voila app's
    (``WORKBENCH_FILES_ROOT``) or the Jupyter server's root; None with no server (a script, a test)."""
    root = os.environ.get("WORKBENCH_FILES_ROOT") if os.environ.get("WORKBENCH_FILES_URL") else None
    if not root:
        server = _jupyter_server()
        root = server.get("root_dir") if server is not None else None
    return Path(root).expanduser().resolve() if root else None


def browser_url(path: str | os.PathLike) -> str:
    """A URL under which the browser showing this kernel's outputs fetches ``path`` as a plain file.

    Under Voila started by ``workbench app``: ``/voila/files/…`` (the command allows .html files of its folder).
    Under a Jupyter server: ``<base_url>files/…``, which serves the page itself, so its scripts run — unlike
    JupyterLab's HTML viewer, which shows untrusted HTML without scripts. With no server at all (a script, a
    test): a ``file://`` URL. A file outside the server's folder raises `OutsideServerRoot`: a page served over
    http may not open ``file://`` links, so there is no link to give.
    """
    path = Path(path).resolve()
    root, prefix = os.environ.get("WORKBENCH_FILES_ROOT"), os.environ.get("WORKBENCH_FILES_URL")
    jupyter = False
    if not (root and prefix):
        server = _jupyter_server()
        if server is not None:
            root, prefix, jupyter = server.get("root_dir"), server.get("base_url", "/") + "files/", True
    if root and prefix:
        base = Path(root).expanduser().resolve()
        try:
            rel = path.relative_to(base)
        except ValueError:
            raise OutsideServerRoot(path, base, jupyter) from None
        from urllib.parse import quote

        return prefix + quote(rel.as_posix())
    return path.as_uri()
