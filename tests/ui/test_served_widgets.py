"""`workbench.ui.widgets.served`: under `workbench app` (Voila) the anywidget modules go by URL, written once."""
import plotly.graph_objects as go
import pytest
from itables.widget import ITable

from workbench.ui import widgets


@pytest.fixture
def voila(monkeypatch, tmp_path):
    monkeypatch.setenv("VOILA_REQUEST_URL", "http://127.0.0.1:8866/")
    monkeypatch.setenv("WORKBENCH_FILES_ROOT", str(tmp_path))
    monkeypatch.setenv("WORKBENCH_FILES_URL", "/voila/files/")
    monkeypatch.setattr(widgets, "_SERVED", {})
    return tmp_path


def test_outside_voila_the_class_is_unchanged(monkeypatch):
    monkeypatch.delenv("VOILA_REQUEST_URL", raising=False)
    assert widgets.served(go.FigureWidget) is go.FigureWidget
    fig = widgets.figure_widget()
    assert isinstance(fig, go.FigureWidget) and not fig._esm.startswith("http")  # inline, as shipped


@pytest.mark.parametrize("cls", [go.FigureWidget, ITable], ids=["plotly", "itables"])
def test_under_voila_the_module_is_served_once_by_url(voila, cls):
    served = widgets.served(cls)
    assert issubclass(served, cls) and served is not cls and widgets.served(cls) is served
    url = served._esm
    assert url.startswith("http://127.0.0.1:8866/voila/files/_widgets/") and url.endswith(".js")
    written = voila / "_widgets" / url.rsplit("/", 1)[1]
    assert written.read_text(encoding="utf-8") == str(cls._esm)     # the module itself, byte for byte
    assert len(url) < 200 < len(str(cls._esm))                      # the widget state carries a URL, not 0.6-5 MB


def test_served_figure_keeps_data_and_layout(voila):
    fig = widgets.figure_widget(data=[go.Scatter(x=[1, 2], y=[3, 4])], layout=go.Layout(title="t"))
    assert isinstance(fig, go.FigureWidget) and list(fig.data[0].x) == [1, 2] and fig.layout.title.text == "t"
    assert fig._esm.startswith("http://")
