"""The kernels depend only on the quantization primitives: every module of `workbench.kernels` that holds a
kernel or its PyTorch reference imports nothing of the package beyond `quantization.primitives` /
`quantization.packing` (pure functions) and the kernels' own helpers - never the quantized modules, the formats
or the package top level - so the modules can call the kernels without a cycle. The benchmarks, clients of the whole
package, live in `workbench.benchmarks`, not here. The activation quantizers exist once, in primitives."""
import ast
from pathlib import Path

import workbench.kernels as kernels_pkg

KERNELS = Path(kernels_pkg.__file__).parent
ALLOWED = {"workbench.quantization.primitives", "workbench.quantization.packing", "workbench.kernels._common",
           "workbench.kernels.w8a8_cpu", "workbench.kernels.isa",
           "workbench.kernels"}   # ops.py: the custom ops over its sibling kernels (from workbench.kernels import ...)


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.split(".")[0] == "workbench"}


def test_kernels_import_only_the_primitives():
    files = list(KERNELS.glob("*.py"))
    assert len(files) >= 8                                   # __init__, _common and the six kernels
    bad = {p.name: sorted(_imports(p) - ALLOWED) for p in files if _imports(p) - ALLOWED}
    assert not bad, f"kernel modules importing more than the primitives: {bad}"


def test_activation_quantizers_are_defined_once():
    root = KERNELS.parent
    defs = [(p.relative_to(root).as_posix(), node.name) for p in root.rglob("*.py")
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.FunctionDef) and node.name in ("quantize_per_tensor", "quantize_per_token")]
    # the Triton kernel's custom op shares the name; its reference is the primitive itself
    assert sorted(defs) == [("kernels/w8a8.py", "quantize_per_token"),
                            ("quantization/primitives.py", "quantize_per_tensor"),
                            ("quantization/primitives.py", "quantize_per_token")]
