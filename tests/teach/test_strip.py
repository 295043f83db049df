"""workbench.teach.strip: a notebook saved from JupyterLab (outputs, counts, widget state) is stripped to its
sources; the rules it checks (one parameters cell, no definitions) are reported, not silently fixed."""
import json

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from workbench.teach import strip


def _saved_after_a_run(path, extra_code="x = 1"):
    params = new_code_cell("solutions = False", metadata={"tags": ["parameters"]})
    cell = new_code_cell(extra_code, execution_count=3, outputs=[new_output("stream", text="1\n")],
                         metadata={"execution": {"iopub.status.busy": "2026"}, "tags": ["keep"]})
    nb = new_notebook(cells=[new_markdown_cell("# lesson"), params, cell],
                      metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                                "widgets": {"application/vnd.jupyter.widget-state+json": {}}})
    params.execution_count = 2
    nbformat.write(nb, str(path))
    return nb


def test_strip_removes_outputs_counts_and_runtime_metadata_keeps_sources(tmp_path):
    path = tmp_path / "lesson.ipynb"
    before = _saved_after_a_run(path)
    found = strip.problems(path)
    assert any("has outputs" in line for line in found) and any("execution count" in line for line in found)
    assert any("'widgets'" in line for line in found)
    # a notebook stored without the kernel's language_info / kernelspec name opens "modified" in JupyterLab
    assert any("'language_info' is not the kernel's" in line for line in found)
    assert any("'kernelspec' is not the kernel's" in line for line in found)
    assert strip.main([str(tmp_path)]) == 0
    after = nbformat.read(str(path), as_version=4)
    assert [c.source for c in after.cells] == [c.source for c in before.cells]
    assert [c.id for c in after.cells] == [c.id for c in before.cells]
    code = [c for c in after.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    assert code[1].metadata == {"tags": ["keep"]} and "widgets" not in after.metadata
    assert after.metadata["kernelspec"]["name"] == "python3"
    assert {k: after.metadata[k] for k in ("kernelspec", "language_info")} == strip.kernel_metadata()
    assert strip.problems(path) == [] and strip.main(["--check", str(path)]) == 0
    text = path.read_text()
    assert strip.strip_file(path) is False and path.read_text() == text   # idempotent: a second strip changes nothing


def test_check_reports_definitions_and_parameter_cells_with_exit_1(tmp_path, capsys):
    path = tmp_path / "bad.ipynb"
    _saved_after_a_run(path, extra_code="def helper(x):\n    return x")
    assert strip.main(["--check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "bad.ipynb: cell 2 defines code (FunctionDef" in out
    nb = json.loads(path.read_text())
    nb["cells"][1]["metadata"]["tags"] = []
    path.write_text(json.dumps(nb))
    assert any("exactly one cell tagged 'parameters', found 0" in line for line in strip.problems(path))
    assert strip.main([str(path)]) == 1          # stripping cannot fix a definition: it still fails
    assert "defines code" in capsys.readouterr().err
    assert nbformat.read(str(path), as_version=4).cells[2].outputs == []
