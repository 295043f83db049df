"""Notebooks open unmodified in JupyterLab (Debian chromium driven by playwright): once the kernel is up and idle,
no notebook tab carries the "modified" mark (JupyterLab writes the kernel's ``language_info`` and the kernelspec's
name into a notebook's metadata as it connects: a notebook stored with less reads as changed before anyone typed).

Needs ``/usr/bin/chromium`` and the ``playwright`` package; without them the test skips, except where
``WORKBENCH_E2E=required`` (CI), where it fails. Nothing is run in the notebooks.
"""
from pathlib import Path

from conftest import free_port
from test_browser import browser  # noqa: F401  (the shared chromium fixture, skip / fail rules included)
from test_lesson_browser import lab_settings, page  # noqa: F401  (a 1440 px page; Lab's settings for tests)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ["00_start_here", "01_explorer", "02_your_model", "20_pruning", "90_report"]
DIRTY = "() => [...document.querySelectorAll('.lm-TabBar-tab.jp-mod-dirty')].map(e => e.textContent.trim())"
IDLE = "() => !!document.querySelector('.jp-Notebook-ExecutionIndicator[data-status=\"idle\"]')"


def test_notebooks_open_unmodified(page, serve, tmp_path, monkeypatch):  # noqa: F811  (the fixture imported above)
    lab_settings(tmp_path, monkeypatch)
    port, token = free_port(), "wb-clean"
    serve(["jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--allow-root",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={ROOT}",
           f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}"],
          f"http://127.0.0.1:{port}/api/status?token={token}")
    dirty = {}
    for name in NOTEBOOKS:
        page.goto(f"http://127.0.0.1:{port}/lab/tree/notebooks/{name}.ipynb?reset&token={token}")
        page.wait_for_selector(".jp-Notebook .jp-Cell")
        page.wait_for_function(IDLE)                      # the kernel connected: its metadata has been merged
        page.wait_for_timeout(1500)
        dirty[name] = page.evaluate(DIRTY)
    shots = ROOT / "test-output"
    shots.mkdir(exist_ok=True)
    page.screenshot(path=str(shots / "notebook_opened.png"))
    assert not any(dirty.values()), f"notebooks marked modified on opening: {dirty}"
