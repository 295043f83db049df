"""The package's import structure, read from its source with `ast` (`make lint` runs this file): no module imports
a private name (``_x``) or a private module from another sub-package of ``workbench`` or from the kernels'
distribution (``workbench_kernels``, one room) - what one room shares with another is public there - and no cycle
among the imports a module runs when it is imported (module-level imports; an import inside a function, made on
first use, is not one; neither is a ``TYPE_CHECKING`` block). A failure names each offending import or the modules
of each cycle."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"workbench": ROOT, "workbench_kernels": ROOT / "kernels"}   # import name -> the folder holding it


def _modules() -> dict[str, Path]:
    out = {}
    for name, base in PACKAGES.items():
        for path in sorted((base / name).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _room(module: str) -> str:   # workbench.<sub-package> (or the top-level module itself); the kernels: one room
    return "workbench_kernels" if module.split(".")[0] == "workbench_kernels" else ".".join(module.split(".")[:2])


def _ours(name: str | None) -> bool:
    return (name or "").split(".")[0] in PACKAGES


def _resolve(name: str) -> str:   # the deepest module of a dotted name
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(tree: ast.Module, import_time: bool):
    """(ImportFrom / Import node, target module, imported name or None) of the workbench imports: all of them, or
    where ``import_time`` those that run when the module is imported."""
    if import_time:
        nodes: list[ast.stmt] = []
        pending = list(tree.body)
        while pending:
            stmt = pending.pop()
            if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
                pending += stmt.orelse
            elif isinstance(stmt, (ast.If, ast.Try)):
                pending += stmt.body + stmt.orelse + getattr(stmt, "finalbody", [])
                pending += [s for h in getattr(stmt, "handlers", []) for s in h.body]
            else:
                nodes.append(stmt)
    else:
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _ours(node.module):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                yield node, full if full in MODULES else _resolve(node.module), alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name):
                    yield node, _resolve(alias.name), None


def test_no_private_name_is_imported_across_sub_packages():
    found = []
    for module, path in MODULES.items():
        for node, target, name in _imports(ast.parse(path.read_text()), import_time=False):
            depth = 1 if _room(target) == "workbench_kernels" else 2   # the parts below the room
            private = [p for p in ((name or "").split(".") + target.split(".")[depth:]) if p.startswith("_")
                       and not p.startswith("__")]
            if private and _room(module) != _room(target):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name or target} from {target}")
    assert not found, "private names imported from another sub-package:\n" + "\n".join(found)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_time_cycles():
    graph = {module: set() for module in MODULES}
    for module, path in MODULES.items():
        for _, target, _ in _imports(ast.parse(path.read_text()), import_time=True):
            # (a module's own packages are imported before it, whatever it imports: not an edge of a cycle)
            if target and target != module and not module.startswith(target + "."):
                graph[module].add(target)
    cycles = _cycles(graph)
    assert not cycles, "modules that import each other when imported:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_see_a_private_import_and_a_cycle():
    tree = ast.parse("from workbench.plans.plan import _x\nimport workbench_kernels.ops\n"
                     "def f():\n    from workbench.models import load\n")
    assert [(t, n) for _, t, n in _imports(tree, import_time=True)] == [("workbench_kernels.ops", None),
                                                                       ("workbench.plans.plan", "_x")]
    assert len(list(_imports(tree, import_time=False))) == 3
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
