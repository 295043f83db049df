"""A lesson as a learner opens it in JupyterLab (Debian chromium driven by playwright): every exercise cell shows
only the learner's line and the check - no worked solution, no ``if solutions`` - and none of the lesson module's
worked-solution code is on the page. Nothing is run: this is what the learner sees before the first Run.

Needs ``/usr/bin/chromium`` and the ``playwright`` package (never ``playwright install``); without them the test
skips, except where ``WORKBENCH_E2E=required`` (CI), where it fails. The screenshot (the first exercise on screen)
goes to ``test-output/lesson_<notebook>.png`` at the repository root, next to the other browser tests' shots.
"""
import inspect
import json
from pathlib import Path

import pytest
from conftest import free_port
from test_browser import browser  # noqa: F401  (the shared chromium fixture, skip / fail rules included)

from workbench import teach

ROOT = Path(__file__).resolve().parents[2]
LESSON, MODULE = "20_pruning", "pruning"
INPUTS = "() => [...document.querySelectorAll('.jp-CodeCell .jp-InputArea .cm-content')].map(e => e.innerText)"


@pytest.fixture
def page(browser):  # noqa: F811  (the fixture imported above)
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.set_default_timeout(120_000)          # a loaded 2-core machine
    yield page
    page.close()


def _solution_lines() -> set[str]:
    module = getattr(teach, MODULE).checks                   # where the lesson's worked solutions live
    lines = set()
    for name, fn in inspect.getmembers(module, inspect.isfunction):
        if name.startswith("_solution_"):
            lines |= {line.split("#")[0].strip() for line in teach.solution_source(fn).splitlines()}
    return {line for line in lines if len(line) > 12}


def lab_settings(tmp_path, monkeypatch) -> None:
    """JupyterLab user settings for a test: every cell rendered (no windowing, so the page holds the whole
    notebook), no "Jupyter news?" pop-up."""
    settings = tmp_path / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    news = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    monkeypatch.setenv("JUPYTERLAB_SETTINGS_DIR", str(tmp_path / "settings"))


def test_lesson_cells_show_no_solutions_in_jupyterlab(page, serve, tmp_path, monkeypatch):
    lab_settings(tmp_path, monkeypatch)
    port, token = free_port(), "wb-lesson"
    serve(["jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--allow-root",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={ROOT}",
           f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}"],                # no tabs left open by others
          f"http://127.0.0.1:{port}/api/status?token={token}")
    page.goto(f"http://127.0.0.1:{port}/lab/tree/notebooks/{LESSON}.ipynb?token={token}")
    cells = json.loads((ROOT / "notebooks" / f"{LESSON}.ipynb").read_text())["cells"]
    code_cells = sum(c["cell_type"] == "code" for c in cells)
    page.wait_for_function(f"({INPUTS})().length >= {code_cells}")
    inputs = page.evaluate(INPUTS)
    exercises = [text for text in inputs if text.lstrip().startswith("# Exercise")]
    assert len(exercises) >= 3, inputs

    first = page.locator(".jp-CodeCell", has_text="# Exercise").first
    first.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    shots = ROOT / "test-output"
    shots.mkdir(exist_ok=True)
    page.screenshot(path=str(shots / f"lesson_{LESSON}.png"))

    for text in exercises:
        code = [line.strip() for line in text.replace("\u00a0", " ").splitlines()
                if line.strip() and not line.strip().startswith("#")]
        assert code[0] == "answer = ..." and len(code) >= 2 and ".check_" in code[1], text    # the line, the check
        assert not any(line.startswith(("answer", "if ", "for ")) for line in code[1:]), text      # nothing more
    page_text = "\n".join(inputs).replace("\u00a0", " ")
    assert "if solutions" not in page_text
    shown = [line for line in _solution_lines() if line in page_text]
    assert not shown, f"worked-solution code visible in the lesson: {shown}"
