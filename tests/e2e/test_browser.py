"""End to end in a real browser (Debian chromium driven by playwright): JupyterLab opens the explorer notebook,
Run All, a layer's bit-width is changed in the UI, Apply & measure - the chart gains a point and the size drops.

Needs ``/usr/bin/chromium`` and the ``playwright`` package (never ``playwright install``: the system chromium
is used). Without chromium the tests skip, except where ``WORKBENCH_E2E=required`` (CI's ``.ci/run`` sets it),
where they fail. Screenshots go to ``test-output/`` at the repository root, the explorer's under JupyterLab (each
tab, the Report link, the opened report) to ``reports/screens/``.
"""
import os
import re
import shutil
from pathlib import Path

import pytest
from conftest import free_port
from test_lab import make_lab_arguments

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
TIMEOUT_MS = 300_000   # the shared 2-core machines can be loaded many times over

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


HEADERS = ("() => [...document.querySelectorAll('.wb-layers th')].filter(e => e.offsetHeight > 0)"
           ".map(e => e.textContent.trim())")
# cells of the layer table whose text does not fit their box (cut or overflowing)
CUT = """() => [...document.querySelectorAll('.wb-layers td, .wb-layers th')].filter(e => e.offsetHeight > 0
            && e.scrollWidth > e.clientWidth + 1).map(e => e.textContent.trim())"""
AXES = """() => [...document.querySelectorAll('.js-plotly-plot')].slice(0, 2).map(g => ({
            x: g._fullData[0].x, y: g._fullData[0].y, ex: g._fullData[0].error_x, ey: g._fullData[0].error_y,
            xr: g._fullLayout.xaxis.range, yr: g._fullLayout.yaxis.range}))"""


def _field(page, kind: str, label: str):
    """The input of the ipywidgets control ``kind`` (e.g. 'widget-text') whose label is exactly ``label``."""
    return page.locator(f".{kind}", has=page.locator("label", has_text=re.compile(f"^{label}$"))).locator(
        "input, select").first


def _speedup_bounds(points: list[float]) -> tuple[float, float]:
    """Where the speedup chart cuts interval ends at its axis edge (what the workbench states: beyond twice the
    points' own span - at least 0.25 around 1, the unchanged model - on each side), so that one noisy interval
    cannot squeeze every point into a corner."""
    lo, hi = min(*points, 1.0), max(*points, 1.0)
    span = max(hi - lo, 0.25)
    return max(lo - 2 * span, 0.0), hi + 2 * span


def _check_axes(page) -> None:
    """Each trade-off chart's axes hold its data (error bars included; on the speedup chart an interval end past
    `_speedup_bounds` may be cut at the axis edge, which then reaches that bound) and are not padded far beyond it."""
    for i, chart in enumerate(page.evaluate(AXES)):   # the size chart, then the speedup chart
        plus = (chart["ex"] or {}).get("array") or [0] * len(chart["x"])
        minus = (chart["ex"] or {}).get("arrayminus") or [0] * len(chart["x"])
        xs = [*chart["x"], *(x + e for x, e in zip(chart["x"], plus)), *(x - e for x, e in zip(chart["x"], minus))]
        if i == 1:
            low, high = _speedup_bounds(chart["x"])
            lo, hi = chart["xr"]
            assert (lo <= low or min(xs) >= low) and (hi >= high or max(xs) <= high), (lo, hi, low, high, xs)
            xs = [min(max(v, low), high) for v in xs]
        ey = (chart["ey"] or {}).get("array") or [0] * len(chart["y"])   # the quality's sampling error
        ys = [*chart["y"], *(y + e for y, e in zip(chart["y"], ey)), *(y - e for y, e in zip(chart["y"], ey))]
        for values, (lo, hi) in ((xs, chart["xr"]), (ys, chart["yr"])):
            assert lo <= min(values) and hi >= max(values), (lo, hi, values)
            assert hi - lo <= 1.3 * (max(values) - min(values)) + 0.05 * abs(max(values)), (lo, hi, values)


def _edit_and_apply(page, shots: Path, name: str, points: int) -> None:
    try:
        page.wait_for_function(f"({SIZES})().length >= {points}")  # what the notebook measured
    except Exception:
        shots.mkdir(exist_ok=True)   # what the page showed instead, for the reviewer
        page.screenshot(path=str(shots / f"{name}_timeout.png"), full_page=True)
        raise
    page.wait_for_selector(".wb-layers tbody tr")
    before = _sizes(page)
    assert page.evaluate(HEADERS)[:8] == ["layer", "type", "shape", "params", "technique", "bytes before",
                                          "bytes after", "state"]
    assert page.evaluate(CUT) == [], "text cut in the layer table"
    page.locator(".wb-layers tbody tr", has_text="conv1").first.click()   # conv1: not touched by the example edit
    _field(page, "widget-dropdown", "technique").select_option(label="WeightOnly (quant)")
    _field(page, "widget-text", "bits").fill("2")
    _field(page, "widget-text", "bits").press("Tab")
    _field(page, "widget-text", "group size").fill("")                  # none: per channel (conv1 has 9 inputs)
    _field(page, "widget-text", "group size").press("Tab")
    page.get_by_role("button", name="Set for selected").click()
    page.get_by_role("button", name=re.compile(r"Apply & measure \(1 changed\)")).click()
    shots.mkdir(exist_ok=True)
    # the new point, or an error in the status line (red): either ends the wait, an error fails with its text
    page.wait_for_function(f"({SIZES})().length > {len(before)} || !!document.querySelector(\"div[style*='#b00020']\")")
    page.wait_for_timeout(800)
    page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
    errors = page.locator("div[style*='#b00020']")
    assert errors.count() == 0, errors.first.inner_text()
    after = _sizes(page)
    assert len(after) == len(before) + 1, (before, after)
    assert after[-1] < before[-1], f"the measured size did not drop: {before} -> {after}"
    points = page.locator(".js-plotly-plot").first.locator(".scatterlayer .trace").first.locator("path.point")
    assert points.count() == len(after)                            # drawn, not only in the data
    row = page.locator(".wb-layers tbody tr", has_text="conv1").first.inner_text()
    assert "WeightOnly · 2 bits · per channel · rtn" in row and "applied" in row, row
    assert page.evaluate(CUT) == [], "text cut in the layer table"
    _check_axes(page)
    # the numbers on the screen agree: the speedup chart's new point is the ratio the status line states
    speedups = page.evaluate("() => document.querySelectorAll('.js-plotly-plot')[1].data[0].x")
    status = page.locator(".wb-status").first.inner_text()
    assert f"{speedups[-1]:.2f}x" in status, (speedups[-1], status)


TABS = ["Trade-offs", "Sensitivity", "Roofline", "Size", "Plan & export"]


def test_explorer_in_jupyterlab(browser, serve, monkeypatch, tmp_path):
    """JupyterLab as `make lab` starts it: its URL opens the start notebook; the explorer is run, edited and
    applied, each of its tabs shown, and its Report link opens the report, served by that server (not file://,
    which a page served over http may not open). Screenshots in reports/screens/."""
    for name in ("WORKBENCH_REPORTS", "WORKBENCH_FILES_ROOT", "WORKBENCH_FILES_URL"):
        monkeypatch.delenv(name, raising=False)                   # the reports go to reports/, as for a person
    monkeypatch.setenv("JUPYTERLAB_WORKSPACES_DIR", str(tmp_path / "workspaces"))   # a first start: no tabs restored
    screens = ROOT / "reports" / "screens"
    screens.mkdir(parents=True, exist_ok=True)
    port, token = free_port(), "wb-e2e"
    args = make_lab_arguments()
    assert f"--ServerApp.root_dir={ROOT}" in args, args           # the repository is the server's folder
    serve(["jupyterlab", *args, f"--port={port}", f"--IdentityProvider.token={token}"],
          f"http://127.0.0.1:{port}/api/status?token={token}")
    base = f"http://127.0.0.1:{port}"
    page = browser.new_page(viewport={"width": 1440, "height": 1100})
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"{base}/?token={token}")                           # what the printed URL leads to
    page.wait_for_function("() => [...document.querySelectorAll('#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current')]"
                           ".some(t => t.textContent.trim() === '00_start_here.ipynb')")
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell")
    page.screenshot(path=str(screens / "lab_start_notebook.png"))

    page.goto(f"{base}/lab/tree/notebooks/01_explorer.ipynb?token={token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell")
    page.wait_for_timeout(3000)  # let the kernel start before Run All
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    _edit_and_apply(page, ROOT / "test-output", "explorer_lab", points=2)  # reference + the example edit

    news = page.locator(".Toastify__toast").get_by_role("button", name="No", exact=True)   # "Jupyter news?"
    if news.count():
        news.first.click()                                         # it would cover the explorer in the screenshots
    _click_tabs(page, screens, "explorer_lab")

    def listed(stem: str) -> None:                                 # in Lab's file browser too
        names = page.evaluate("async url => (await (await fetch(url)).json()).content.map(f => f.name)",
                              f"{base}/api/contents/reports?token={token}")
        assert f"{stem}.html" in names, names

    _open_report(page, screens, "explorer_lab", rf"{re.escape(base)}/files/reports/", ROOT / "reports", listed)


def _click_tabs(page, screens: Path, name: str) -> None:
    """Each tab of the workbench shown in turn (a screenshot of each)."""
    tabs = page.locator(".widget-tab").first
    for title in TABS:
        tab = tabs.locator(".lm-TabBar-tab", has_text=title).first
        tab.scroll_into_view_if_needed()
        tab.click()
        page.wait_for_timeout(800)
        assert "lm-mod-current" in (tab.get_attribute("class") or ""), title
        page.screenshot(path=str(screens / f"{name}_tab_{re.sub(r'[^a-z]+', '_', title.lower())}.png"))


def _open_report(page, screens: Path, name: str, prefix: str, folder: Path, listed=None) -> None:
    """Report (on the Plan & export tab, shown last): its link is served under ``prefix`` (not file://), fetching
    it returns the report, clicking it opens the report with its charts drawn and its speed panel showing the
    ratio its verdict prints. The report's files (in ``folder``) are removed afterwards; the screenshots stay."""
    page.get_by_role("button", name="Report", exact=True).click()
    link = page.get_by_role("link", name="open the report")
    failed = page.locator("div[style*='#b00020'], .wb-report-outside")
    page.wait_for_function("() => [...document.querySelectorAll('a')].some(a => a.textContent === 'open the report')"
                           " || !!document.querySelector(\"div[style*='#b00020'], .wb-report-outside\")",
                           timeout=2 * TIMEOUT_MS)                   # the report notebook runs: minutes
    assert failed.count() == 0, failed.first.inner_text()
    link.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    page.screenshot(path=str(screens / f"{name}_report_link.png"))
    href = link.evaluate("a => a.href")
    stem = re.fullmatch(rf"{prefix}(plan_report_digits-cnn-[0-9a-f]{{8}}-\d{{8}}-\d{{6}}(?:-\d+)?)\.html", href)
    assert stem, f"the Report link is {href}, not the report under this server"
    fetched = page.evaluate("async url => { const r = await fetch(url); return [r.status, await r.text()]; }", href)
    assert fetched[0] == 200 and f"<title>{stem[1]}</title>" in fetched[1], fetched[0]   # as the page fetches it
    if listed is not None:
        listed(stem[1])

    with page.context.expect_page() as opened:
        link.click()
    report = opened.value
    report.set_default_timeout(TIMEOUT_MS)
    report.set_viewport_size({"width": 1440, "height": 1100})
    report.wait_for_selector(".js-plotly-plot .main-svg")          # its scripts run: served, not sandboxed
    report.wait_for_timeout(1000)
    report.screenshot(path=str(screens / f"{name}_report_opened.png"), full_page=True)
    assert report.url == href and report.title() == stem[1]
    assert report.locator("h1").first.inner_text().startswith("Compression report")
    # one regime on the report: its comparison chart's speed panel shows the speedup its verdict prints
    panel = report.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].filter(g =>
        (g.layout.annotations || []).some(a => String(a.text).startsWith('speedup over')))
        .map(g => g.data[1].y[1])""")
    text = report.evaluate("() => document.body.textContent")
    printed = next((line for line in text.splitlines() if line.strip().startswith("speed: ")), "")
    assert panel and f"{panel[0]:.2f}x" in printed, (panel, printed)
    report.close()
    for suffix in (".ipynb", ".html", ".plan.json"):                # 5 MB each run: the screenshots stay
        (folder / f"{stem[1]}{suffix}").unlink(missing_ok=True)


def test_workbench_app_in_voila(browser, serve, tmp_path):
    port = free_port()
    serve(["workbench.cli", "app", "--model", "digits-cnn", "--task", "digits", f"--port={port}",
           "--out", str(tmp_path)], f"http://127.0.0.1:{port}/voila/static/favicon.ico")
    page = browser.new_page(viewport={"width": 1440, "height": 1100})
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    outside: list[str] = []                                        # the dashboard works offline: no CDN, no font server
    page.on("request", lambda r: None if r.url.startswith((f"http://127.0.0.1:{port}/", "data:", "blob:"))
            else outside.append(r.url))
    page.goto(f"http://127.0.0.1:{port}/", wait_until="commit")
    loading = page.locator("#loading_text")                        # a loading indicator while the kernel works
    loading.wait_for(state="visible", timeout=30_000)
    assert loading.inner_text().startswith("Running")                # Voila's spinner, shown at once
    page.wait_for_selector(".wb-layers tbody tr")
    _edit_and_apply(page, ROOT / "test-output", "workbench_app_voila", points=1)  # the reference
    screens = ROOT / "reports" / "screens"
    screens.mkdir(parents=True, exist_ok=True)
    _click_tabs(page, screens, "workbench_app_voila")
    _open_report(page, screens, "workbench_app_voila", rf"http://127\.0\.0\.1:{port}/voila/files/", tmp_path)
    text = page.locator("body").inner_text()
    assert "reference_primary" not in text and "points =" not in text   # no raw metrics dump
    # every anywidget (charts, layer grid) initialised: their modules come by URL, once (workbench.ui.widgets)
    assert not [e for e in errors if "anywidget" in e], errors
    assert outside == [], f"the dashboard asked outside this machine for {outside}"


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
