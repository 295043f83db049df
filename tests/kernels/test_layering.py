"""The layering of the kernels' distribution (kernels/, import name `workbench_kernels`): nothing in it imports the
workbench - its modules import torch, Triton, the standard library and each other - so the workbench's modules call
the kernels without a cycle and the kernels can be used, tested and released alone. The quantization numerics live
there once (`numerics`, `packing`); `workbench.quantization.primitives` / `.packing` only re-export them. The
activation quantizers exist once, in `numerics`."""
import ast
from pathlib import Path

import workbench_kernels as kernels_pkg
from workbench.quantization import packing, primitives

KERNELS = Path(kernels_pkg.__file__).parent


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_the_kernels_import_nothing_of_the_workbench():
    files = sorted(KERNELS.glob("*.py"))
    assert {"__init__.py", "_common.py", "numerics.py", "packing.py", "int4_weight_only.py",
            "weight_only_cpu.py"} <= {p.name for p in files}
    bad = {p.name: sorted(m for m in _imports(p) if m.split(".")[0] == "workbench") for p in files}
    assert not {k: v for k, v in bad.items() if v}, f"kernel modules importing the workbench: {bad}"
    assert KERNELS.parent.name == "kernels" and (KERNELS.parent / "pyproject.toml").is_file()


def test_the_workbench_names_of_the_numerics_are_the_kernels_own_functions():
    from workbench_kernels import numerics
    from workbench_kernels import packing as kpacking

    assert primitives.__all__ == numerics.__all__ and packing.__all__ == kpacking.__all__
    assert all(getattr(primitives, n) is getattr(numerics, n) for n in numerics.__all__)
    assert all(getattr(packing, n) is getattr(kpacking, n) for n in kpacking.__all__)


def test_activation_quantizers_are_defined_once():
    repo = KERNELS.parents[1]
    defs = [(p.relative_to(repo).as_posix(), node.name)
            for root in (KERNELS, repo / "workbench") for p in root.rglob("*.py")
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.FunctionDef) and node.name in ("quantize_per_tensor", "quantize_per_token")]
    # the Triton kernel's custom op shares the name; its reference is the numerics' function itself
    assert sorted(defs) == [("kernels/workbench_kernels/numerics.py", "quantize_per_tensor"),
                            ("kernels/workbench_kernels/numerics.py", "quantize_per_token"),
                            ("kernels/workbench_kernels/w8a8.py", "quantize_per_token")]


def test_the_kernels_folder_does_not_pose_as_hugging_faces_kernels_package():
    """From the repository root (on sys.path in `python -m` and notebooks started there) the folder kernels/ is at
    most an empty namespace package: transformers' probe for the `kernels` hub package answers as it would without
    it (whether that package is really installed)."""
    import importlib.metadata
    import subprocess
    import sys

    repo = KERNELS.parents[1]
    assert not (repo / "kernels" / "__init__.py").exists()
    try:
        installed = bool(importlib.metadata.version("kernels"))
    except importlib.metadata.PackageNotFoundError:
        installed = False
    probe = "from transformers.utils.import_utils import is_kernels_available as a; print(a())"
    out = subprocess.run([sys.executable, "-c", probe], cwd=repo, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(installed)
