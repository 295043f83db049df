"""End to end in a real browser (Debian chromium driven by playwright): JupyterLab opens the explorer notebook,
Run All, a layer's bit-width is changed in the UI, Apply & measure - the chart gains a point and the size drops.

Needs ``/usr/bin/chromium`` and the ``playwright`` package (never ``playwright install``: the system chromium
is used). Without chromium the tests skip, except where ``WORKBENCH_E2E=required`` (CI's ``.ci/run`` sets it),
where they fail. Screenshots go to ``test-output/`` at the repository root.
"""
import os
import re
import shutil
from pathlib import Path

import pytest

from conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
TIMEOUT_MS = 180_000

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright import sync_api
    except ImportError:
        sync_api = None
    missing = ("the playwright package (pip install -e .[dev])" if sync_api is None else
               f"Debian's chromium at {CHROMIUM} (apt-get install -y chromium)" if not Path(CHROMIUM).exists() else "")
    if missing:
        if os.environ.get("WORKBENCH_E2E") == "required":
            pytest.fail(f"the end-to-end tests need {missing}")
        pytest.skip(f"the end-to-end tests need {missing}")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


SIZES = "() => { const g = document.querySelector('.js-plotly-plot'); return g && g.data ? g.data[0].x : []; }"


def _sizes(page) -> list[float]:
    """The x values (MiB) of the live size chart's 'plans tried' trace, read from plotly.js."""
    return list(page.evaluate(SIZES))


def _edit_and_apply(page, shots: Path, name: str, points: int) -> None:
    page.wait_for_function(f"({SIZES})().length >= {points}")      # what the notebook measured
    before = _sizes(page)
    page.locator(".wb-layers select").select_option(index=[0])   # conv1: not touched by the example edit
    page.locator(".widget-dropdown", has=page.locator("label", has_text="technique")).locator("select") \
        .select_option(label="quantize")
    page.locator(".widget-dropdown", has=page.locator("label", has_text="bits")).locator("select") \
        .select_option(label="2")
    page.locator(".widget-dropdown", has=page.locator("label", has_text="group size")).locator("select") \
        .select_option(label="per channel")                       # conv1 has 9 inputs per channel
    page.get_by_role("button", name="Set for selected").click()
    page.get_by_role("button", name=re.compile(r"Apply & measure \(1 changed\)")).click()
    page.wait_for_function(f"({SIZES})().length > {len(before)}")
    page.wait_for_timeout(500)
    shots.mkdir(exist_ok=True)
    page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
    after = _sizes(page)
    assert len(after) == len(before) + 1, (before, after)
    assert after[-1] < before[-1], f"the measured size did not drop: {before} -> {after}"
    points = page.locator(".js-plotly-plot").first.locator(".scatterlayer .trace").first.locator("path.point")
    assert points.count() == len(after)                            # drawn, not only in the data


def test_explorer_in_jupyterlab(browser, serve):
    port, token = free_port(), "wb-e2e"
    serve(["jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--allow-root",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={ROOT}"],
          f"http://127.0.0.1:{port}/api/status?token={token}")
    page = browser.new_page(viewport={"width": 1500, "height": 1100})
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"http://127.0.0.1:{port}/lab/tree/notebooks/01_explorer.ipynb?token={token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell")
    page.wait_for_timeout(3000)  # let the kernel start before Run All
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    _edit_and_apply(page, ROOT / "test-output", "explorer_lab", points=2)  # reference + the example edit


def test_workbench_app_in_voila(browser, serve, tmp_path):
    port = free_port()
    serve(["workbench.cli", "app", "--model", "digits-cnn", "--task", "digits", f"--port={port}",
           "--out", str(tmp_path)], f"http://127.0.0.1:{port}/voila/static/favicon.ico")
    page = browser.new_page(viewport={"width": 1500, "height": 1100})
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"http://127.0.0.1:{port}/")
    page.wait_for_selector(".wb-layers select")
    _edit_and_apply(page, ROOT / "test-output", "workbench_app_voila", points=1)  # the reference


def test_report_opens_offline(browser, tmp_path):
    """A report run through papermill opens from disk with every request outside the file refused: the charts
    draw, the maths is typeset, the code is folded and the parameters are one table."""
    import nbformat

    from workbench.reports import run_notebook

    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    params = nbformat.v4.new_code_cell("points = 3   # how many points the chart draws\ntitle = 'default'")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# Offline report\nThe error $\\hat w - w$ and\n\n"
                                              "$$p_i = \\frac{e^{z_i}}{\\sum_j e^{z_j}}$$"), params,
                nbformat.v4.new_code_cell("import plotly.graph_objects as go\n"
                                          "go.Figure(go.Scatter(x=list(range(points)), y=[v * v for v in "
                                          "range(points)], mode='markers'), layout_title_text=title).show()")]
    nbformat.write(nb, str(tmp_path / "offline.ipynb"))
    _, html_path = run_notebook(tmp_path / "offline.ipynb", {"points": 5, "title": "five squares"}, out_dir=tmp_path)

    page = browser.new_page(viewport={"width": 1440, "height": 900})
    remote: list[str] = []

    def refuse_network(route):
        if route.request.url.startswith(("file:", "data:", "blob:")):
            route.continue_()
        else:
            remote.append(route.request.url)
            route.abort()

    page.route("**/*", refuse_network)
    page.goto(html_path.as_uri())
    page.wait_for_selector(".js-plotly-plot .main-svg")
    page.wait_for_timeout(500)
    (ROOT / "test-output").mkdir(exist_ok=True)
    page.screenshot(path=str(ROOT / "test-output" / "report_offline.png"), full_page=True)
    assert remote == [], f"the report asked the network for {remote}"
    assert page.locator(".js-plotly-plot .scatterlayer path.point").count() == 5     # drawn, not only in the data
    assert page.locator(".js-plotly-plot .gtitle").text_content() == "five squares"
    maths = page.locator("math")
    assert maths.count() == 2 and all(maths.nth(i).bounding_box()["width"] > 20 for i in range(2))
    assert not page.get_by_text("import plotly").is_visible()                        # code folded by default
    page.locator("details.wb-code summary").first.click()
    assert page.get_by_text("import plotly").is_visible()
    header = page.locator(".wb-parameters th").all_inner_texts()
    assert header[:3] == ["parameter", "value", "default"]
    rows = page.locator(".wb-parameters tr").all_inner_texts()
    assert len(rows) == 3 and "five squares" in rows[2] and "'default'" in rows[2]   # one table, both parameters
    assert page.get_by_text("# Parameters").count() == 0                              # no injected-parameters cell
