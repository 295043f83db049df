"""`Workbench`: the interactive per-layer editor (ipywidgets + plotly FigureWidgets).

    wb.ui.Workbench(model, task)        # displays itself in a notebook cell

Pick layers in the layer table (click, shift/ctrl-click, sort by any column, or a name pattern), choose a
technique - the list is every config type in the technique registry, its form generated from the config's
fields (`workbench.ui.forms`) - and "Set for selected", then "Apply & measure": only the changed layers are rebuilt,
the model is measured on the task's
quick subset and a point joins the trade-off charts (quality vs size and vs latency, Pareto front dashed,
every plan tried kept; click a point to bring its plan back). Undo / redo walk the edits. Tabs hold the
sensitivity heatmap (computed from the UI), the roofline view of every plan tried, the size breakdown of
the current model, and the plan as JSON (export / import).

Every callback reports failures in the status line (naming the layer and the cause); a failed apply leaves
the model as it was. Work runs in a background thread (``background=True``) so Cancel stays clickable.
"""
from __future__ import annotations

import html
import threading
from typing import Mapping, Sequence

import torch

from workbench.plans.registry import Config
from workbench.plots.style import TEMPLATE
from workbench.ui.session import Cancelled, Session

__all__ = ["Workbench"]

# the charts share the width of a 1280-1920 px page: two side by side at 1280, growing with the window
_STYLE = ("<style>.wb-chart{flex:1 1 560px;min-width:520px}.wb-help{color:#555;font-size:12px;margin:2px 0 6px}"
          ".wb-layers table.dataTable td,.wb-layers table.dataTable th{font-size:12px}</style>")


def _default_candidates() -> dict[str, Config]:
    from workbench import prune, quant

    return {"int8": quant.WeightOnly(bits=8, group_size=None), "int4 g64": quant.WeightOnly(bits=4, group_size=64),
            "50% sparse": prune.Magnitude(0.5)}


class Workbench:
    """See the module docstring. ``candidates``: the configs the sensitivity tab compares (default:
    int8, int4 g64, 50 % sparse); ``quick``/``calibration``/``threads``/``pipeline`` go to the `Session`;
    ``reference``: measure the unchanged model first (the charts' first point)."""

    def __init__(self, model, task, candidates: Sequence[Config] | Mapping[str, Config] | None = None, *,
                 quick: bool = True, calibration: int = 32, threads: int | None = None, background: bool = True,
                 reference: bool = True, pipeline: str = "sequential"):
        import ipywidgets as W

        self.session = Session(model, task, quick=quick, calibration=calibration, threads=threads, pipeline=pipeline)
        self.candidates = _named(candidates if candidates is not None else _default_candidates())
        self.background = background
        self._cancel = threading.Event()
        self._worker: threading.Thread | None = None

        from workbench.ui.forms import technique_forms
        from workbench.ui.layer_table import LayerTable

        self.status = W.HTML()
        self.layers = LayerTable(self.session.layer_rows())
        self.pattern = W.Text(placeholder="pattern, e.g. encoder.*.dense or re:.*fc[12]",
                              layout=W.Layout(width="340px"))
        self.select_button = W.Button(description="Select matching")
        self.forms = technique_forms()   # config type -> its generated form, for every registered technique
        self.technique = W.Dropdown(options=[("none (undo the technique)", None)]
                                    + [(f.label, cls) for cls, f in self.forms.items()], description="technique",
                                    style={"description_width": "initial"})
        from workbench import quant

        self.technique.value = quant.WeightOnly   # the common first choice
        self.technique_help = W.HTML()
        self.form_box = W.Box()
        self.set_button = W.Button(description="Set for selected", button_style="info")
        self.samples = W.BoundedIntText(value=calibration, min=1, max=100_000, description="calibration samples",
                                        style={"description_width": "initial"})
        self.estimate_box = W.HTML()
        self.progress = W.FloatProgress(value=0.0, min=0.0, max=1.0, description="", layout=W.Layout(width="300px"))
        self.progress_label = W.Label()
        self.apply_button = W.Button(description="Apply & measure", button_style="primary",
                                     layout=W.Layout(width="auto", min_width="180px"))   # "(N changed)" fits
        self.cancel_button = W.Button(description="Cancel", disabled=True, button_style="warning")
        self.undo_button = W.Button(description="Undo", icon="undo")
        self.redo_button = W.Button(description="Redo", icon="repeat")
        self.sens_button = W.Button(description="Run sensitivity (selected layers, or all)",
                                    layout=W.Layout(width="auto"))
        # the candidates the sensitivity compares: ticked ones run; the technique set above can be added
        self.sens_checks = W.HBox(layout=W.Layout(flex_flow="row wrap"))
        self.add_candidate_button = W.Button(description="Add the technique above as a candidate",
                                             layout=W.Layout(width="auto"))
        self._show_candidates()
        self.plan_text = W.Textarea(placeholder="Export current plan writes the plan here as JSON (copy it, or "
                                                "save it for `workbench report -p plan ...`); paste a plan here and "
                                                "press Import plan to load it", layout=W.Layout(width="100%",
                                                                                               height="150px"))
        self.export_button = W.Button(description="Export current plan")
        self.import_button = W.Button(description="Import plan")
        self.report_button = W.Button(description="Report", tooltip="run notebooks/90_report.ipynb with "
                                      "the current plan (papermill) and link the HTML")
        self.report_link = W.HTML()
        from workbench.export import FORMATS

        self.export_format = W.Dropdown(options=sorted(FORMATS), value="compressed-tensors", description="format",
                                        layout=W.Layout(width="260px"))
        self.export_folder = W.Text(placeholder="reports/exports/<model>-<format> (or a new folder)",
                                    description="to", layout=W.Layout(width="480px"))
        self.export_model_button = W.Button(description="Export model", icon="download", tooltip=(
            "write the model as last applied with wb.export: compressed-tensors (vLLM, transformers), gguf "
            "(llama.cpp, Ollama) or onnx (ONNX Runtime)"))
        self.export_link = W.HTML()

        if reference:  # the first point, measured before the charts are built (see _tradeoff_figure)
            self.session.apply_and_measure()
        self.size_chart, self.latency_chart = self._tradeoff_figure("size"), self._tradeoff_figure("latency")
        self.heatmap = self._empty_figure("run the sensitivity analysis to fill this")
        self.roofline_chart = self._empty_figure("apply a plan to compare it with the reference")
        self.size_figure = self._empty_figure("")

        self.select_button.on_click(self._guard(self._on_select))
        self.set_button.on_click(self._guard(self._on_set))
        self.apply_button.on_click(self._guard(self._on_apply))
        self.cancel_button.on_click(self._guard(lambda _: self._cancel.set()))
        self.undo_button.on_click(self._guard(lambda _: self.session.undo() and self._refresh()))
        self.redo_button.on_click(self._guard(lambda _: self.session.redo() and self._refresh()))
        self.sens_button.on_click(self._guard(self._on_sensitivity))
        self.add_candidate_button.on_click(self._guard(self._on_add_candidate))
        self.export_button.on_click(self._guard(lambda _: setattr(self.plan_text, "value",
                                                                  self.session.plan.to_json(indent=2))))
        self.import_button.on_click(self._guard(self._on_import))
        self.report_button.on_click(self._guard(self._on_report))
        self.export_model_button.on_click(self._guard(self._on_export_model))
        self.samples.observe(self._guard(self._on_samples), names="value")
        self.technique.observe(lambda _: self._show_controls(), names="value")

        controls = W.VBox([W.HBox([self.pattern, self.select_button]),
                           W.HBox([self.technique, self.technique_help]), self.form_box,
                           W.HBox([self.set_button, self.undo_button, self.redo_button])])
        calibration_box = W.VBox([W.HTML("<b>Calibration</b> (GPTQ / AWQ / static W8A8)"),
                                  W.HBox([self.samples]), self.estimate_box])
        run = W.HBox([self.apply_button, self.cancel_button, self.progress, self.progress_label])
        self.size_chart.add_class("wb-chart")
        self.latency_chart.add_class("wb-chart")
        self.tabs = W.Tab(children=[W.HBox([self.size_chart, self.latency_chart],
                                           layout=W.Layout(flex_flow="row wrap", width="100%")),
                                    W.VBox([W.HTML("<b>Candidates</b> <span class='wb-help'>(each is applied "
                                                   "to one layer at a time; the quality it loses is the cell)"
                                                   "</span>"),
                                            self.sens_checks, W.HBox([self.add_candidate_button, self.sens_button]),
                                            self.heatmap]), self.roofline_chart, self.size_figure,
                                    W.VBox([W.HBox([self.export_button, self.import_button, self.report_button]),
                                            self.report_link, self.plan_text,
                                            W.HTML("<b>Export the model</b> <span class='wb-help'>(the plan as last "
                                                   "applied, for the runtime you deploy with)</span>"),
                                            W.HBox([self.export_format, self.export_folder,
                                                    self.export_model_button]), self.export_link])])
        for i, title in enumerate(["Trade-offs", "Sensitivity", "Roofline", "Size", "Plan & export"]):
            self.tabs.set_title(i, title)
        self.widget = W.VBox([W.HTML(_STYLE), W.HTML(self._title()), self.layers.widget, controls, calibration_box, run,
                              self.status, self.tabs])
        self._show_controls()
        self._refresh()

    # --- display -------------------------------------------------------------------------------
    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def _title(self) -> str:
        s = self.session
        return (f"<h3>{html.escape(type(s.original).__name__)} on {html.escape(s.task.name)}</h3>"
                f"<div>{len(s.layer_names)} editable layers; quality = {html.escape(s.task.primary.name)} "
                f"({'higher' if s.task.primary.higher_is_better else 'lower'} is better), measured on the "
                f"{'quick subset' if s.quick else 'full evaluation set'}.</div>")

    def _say(self, message: str, error: bool = False, tone: str = "ok", notes: Sequence[str] = ()) -> None:
        """The status line: ``tone`` "ok" (green: done as asked), "info" (grey: under way, a plain fact), "warn"
        (amber: done, with a cost the user should read, e.g. slower) or "error" (red); ``notes`` below it, smaller."""
        color = _TONES["error" if error else tone]
        extra = "".join(f"<div class='wb-help' style='white-space:pre-wrap'>{html.escape(n)}</div>" for n in notes)
        self.status.value = (f"<div class='wb-status wb-status-{'error' if error else tone}' style='color:{color};"
                             f"white-space:pre-wrap'>{html.escape(message)}</div>{extra}")

    def _guard(self, fn):
        """Run a callback; any failure is shown in the status line instead of vanishing into a log."""
        def run(*args):
            try:
                return fn(*args)
            except Exception as e:
                self._say(f"{type(e).__name__}: {e}", error=True)
        return run

    @staticmethod
    def _empty_figure(message: str):
        import plotly.graph_objects as go

        from workbench.ui.widgets import figure_widget

        # no axes until there is data: empty axes with -1..6 ticks read as a broken chart
        return figure_widget(layout=go.Layout(template=TEMPLATE, height=380, xaxis=dict(visible=False),
                                              yaxis=dict(visible=False),
                                              annotations=[dict(text=message, showarrow=False, x=0.5, y=0.5,
                                                                xref="paper", yref="paper",
                                                                font=dict(size=15, color="#666"))]))

    def _series(self, kind: str) -> dict[str, list]:
        """The trade-off chart's data: every plan tried, the Pareto front, the latest point."""
        import pandas as pd

        from workbench.analysis.sweep import pareto

        h = self.session.history
        if not h:
            return {"x": [], "y": [], "text": [], "fx": [], "fy": [], "lx": [], "ly": [], "hi": [], "lo": [],
                    "ye": [], "xrange": None, "yrange": None}
        df = pd.DataFrame({"x": [e.metrics.size_bytes / 2**20 if kind == "size" else _speedup(e) for e in h],
                           "y": [e.quality for e in h]})
        if kind == "size":
            front = df[pareto(df, "x", "y", y_higher_is_better=self.session.task.primary.higher_is_better)]
        else:   # speedup: higher is better, so the front is taken on the negated axis
            flipped = df.assign(x=-df["x"])
            front = df[pareto(flipped, "x", "y", y_higher_is_better=self.session.task.primary.higher_is_better)]
        front = front.sort_values("x")
        hi = [e.speedup.high - e.speedup.ratio if kind != "size" and e.speedup is not None else 0.0 for e in h]
        lo = [e.speedup.ratio - e.speedup.low if kind != "size" and e.speedup is not None else 0.0 for e in h]
        # the quality's sampling error (95 % half-width) where the task states one: a vertical bar per point
        ye = [_finite_or_zero(e.metrics.primary_error) for e in h]
        primary = self.session.task.primary.name
        # hover: the plan in words, one line per technique (a long single line would be clipped)
        text = [f"plan {i}: " + e.label.replace("; ", "<br>") +
                (f"<br>speedup: {e.speedup.verdict}" if e.speedup is not None else "") +
                (f"<br>{primary} ± {err:.2g} (sampling error, 95 %)" if err else "")
                for i, (e, err) in enumerate(zip(h, ye))]
        xs = [*df["x"], *(df["x"] + pd.Series(hi)), *(df["x"] - pd.Series(lo))]
        if kind != "size":   # one wide interval must not squeeze every point into a corner: ends past twice the
            #                   points' own span are cut at the axis edge (the hover gives the whole interval)
            xs = _clip_to_points(xs, list(df["x"]))
        ys = [*df["y"], *(df["y"] + pd.Series(ye)), *(df["y"] - pd.Series(ye))]
        return {"x": list(df["x"]), "y": list(df["y"]), "hi": hi, "lo": lo, "ye": ye, "text": text,
                "fx": list(front["x"]), "fy": list(front["y"]), "lx": [df["x"].iloc[-1]], "ly": [df["y"].iloc[-1]],
                "xrange": _fit(xs, floor=0.0), "yrange": _fit(ys)}

    def _tradeoff_figure(self, kind: str):
        import plotly.graph_objects as go

        from workbench.ui.widgets import figure_widget

        task = self.session.task
        better = "higher" if task.primary.higher_is_better else "lower"
        x_title = ("size (MiB, lower is better)" if kind == "size"
                   else "speedup over the unchanged model (×, 95% interval; higher is better)")
        x_hover = "size %{x:.4g} MiB" if kind == "size" else "speedup %{x:.3g}×"
        d = self._series(kind)
        # Data and layout go into the constructor: a dashboard (Voila) renders the widget's initial state,
        # and changes made before its page connects would not reach it.
        fig = figure_widget(
            data=[go.Scatter(x=d["x"], y=d["y"], mode="markers", name="plans tried", text=d["text"],
                             marker=dict(size=10),
                             error_x=dict(type="data", symmetric=False, array=d["hi"], arrayminus=d["lo"],
                                          visible=kind != "size"),
                             error_y=dict(type="data", array=d["ye"], visible=any(d["ye"]), color="gray"),
                             hovertemplate=f"%{{text}}<br>{x_hover}<br>{task.primary.name} %{{y:.4f}}"
                                           "<extra>click to restore</extra>"),
                  go.Scatter(x=d["fx"], y=d["fy"], mode="lines", name="Pareto front (best trade-offs)",
                             line=dict(dash="dot", color="black"), hoverinfo="skip"),
                  go.Scatter(x=d["lx"], y=d["ly"], mode="markers", name="current plan",
                             marker=dict(size=18, symbol="star", color="rgba(0,0,0,0)",
                                         line=dict(color="red", width=2)), hoverinfo="skip")],
            layout=go.Layout(template=TEMPLATE, height=400, autosize=True, xaxis_title=x_title,
                             xaxis_range=d["xrange"], yaxis_range=d["yrange"],
                             yaxis_title=f"{task.primary.name} ({better} is better)",
                             hoverlabel=dict(align="left"), margin=dict(l=70, r=20, t=50, b=40),
                             title=f"{task.primary.name} vs {'size' if kind == 'size' else 'speedup'}",
                             legend=dict(orientation="h", y=-0.22)))
        fig.data[0].on_click(self._guard(self._on_point_click))
        return fig

    def _show_controls(self) -> None:
        cls = self.technique.value
        form = self.forms.get(cls)
        self.form_box.children = [form.box] if form is not None else []
        self.technique_help.value = (f"<div class='wb-help'>{html.escape(form.help)}</div>" if form is not None
                                     else "<div class='wb-help'>the selected layers go back to the original</div>")

    def choose(self, config: Config | None) -> None:
        """Show ``config`` in the technique form (its type chosen, its fields filled): what a person would click."""
        if config is not None and type(config) not in self.forms:
            raise TypeError(f"{type(config).__name__} is not a registered technique config")
        self.technique.value = None if config is None else type(config)
        if config is not None:
            self.forms[type(config)].show(config)

    # --- state -> widgets ----------------------------------------------------------------------
    def _refresh(self) -> None:
        s = self.session
        self.layers.update(s.layer_rows())
        self.undo_button.disabled, self.redo_button.disabled = not s.can_undo, not s.can_redo
        pending = s.changed
        self.apply_button.description = f"Apply & measure ({len(pending)} changed)" if pending else "Apply & measure"
        self._update_charts()

    def _update_charts(self) -> None:
        if not self.session.history:
            return
        for fig, kind in ((self.size_chart, "size"), (self.latency_chart, "latency")):
            d = self._series(kind)
            with fig.batch_update():
                fig.data[0].x, fig.data[0].y, fig.data[0].text = d["x"], d["y"], d["text"]
                fig.data[0].error_x.array, fig.data[0].error_x.arrayminus = d["hi"], d["lo"]
                fig.data[0].error_y.array, fig.data[0].error_y.visible = d["ye"], any(d["ye"])
                fig.data[1].x, fig.data[1].y = d["fx"], d["fy"]
                fig.data[2].x, fig.data[2].y = d["lx"], d["ly"]
                fig.layout.xaxis.range, fig.layout.yaxis.range = d["xrange"], d["yrange"]

    def _update_views(self) -> None:
        from workbench.plots import roofline, size_breakdown

        h = self.session.history
        if len(h) >= 2:
            import pandas as pd

            df = pd.DataFrame([{"label": f"{i}: {e.label}", "latency_ms": e.metrics.latency_ms,
                                "size_bytes": e.metrics.size_bytes, "threads": e.metrics.threads,
                                "device": e.metrics.device,
                                **(e.speedup.to_dict() if e.speedup is not None else {})} for i, e in enumerate(h)])
            self._replace(self.roofline_chart, roofline(df, title="measured speedup of each plan over the unchanged "
                                                        "model, beside its byte-ratio ceiling"))
        self._replace(self.size_figure, size_breakdown(self.session.work, top=30))

    @staticmethod
    def _replace(target, fig) -> None:
        with target.batch_update():
            target.data = []
            for trace in fig.data:
                target.add_trace(trace)
            target.layout = fig.layout

    # --- callbacks -----------------------------------------------------------------------------
    def _config(self) -> Config | None:
        """The config the technique form describes (None: back to the original layer)."""
        cls = self.technique.value
        return None if cls is None else self.forms[cls].config()

    def _on_select(self, _=None) -> None:
        hits = self.session.select(self.pattern.value.strip())
        self.layers.value = tuple(hits)
        self._say(f"selected {_count(len(hits), 'layer')}: {', '.join(hits[:6])}{' ...' if len(hits) > 6 else ''}")

    def _on_set(self, _=None) -> None:
        layers = list(self.layers.value)
        if not layers:
            raise ValueError("select one or more layers first (click, shift-click, or a pattern)")
        config = self._config()
        self.session.set(layers, config)
        self._refresh()
        self._show_estimate()
        from workbench.ui.forms import describe

        what = "the original layer (no technique)" if config is None else describe(config)
        pending = len(self.session.changed)
        self._say(f"{_count(len(layers), 'layer')} set to {what}; "
                  + (f"{_count(pending, 'layer')} to apply: press Apply & measure" if pending else "nothing to apply"))

    def _on_samples(self, change) -> None:
        self.session.calibration = int(change["new"])
        self._show_estimate()

    def _show_estimate(self) -> None:
        est = self.session.estimate()
        self.estimate_box.value = "" if est is None else (
            f"<span style='color:{'#1b5e20' if est.fits else '#b00020'}'>{html.escape(str(est))}</span>")

    def _on_import(self, _=None) -> None:
        self.session.load_plan(self.plan_text.value)
        self._refresh()
        self._say(f"plan imported: {_count(len(self.session.assigned), 'layer')} assigned; press Apply & measure")

    def report(self, out_dir: str | None = None, quick: bool | None = None, name: str | None = None):
        """Run the plan-report notebook with the current plan into ``out_dir`` (default: the reports folder
        `wb.reports.reports_dir()`, shared with ``workbench report``); returns (executed notebook, HTML) paths.

        The files (.ipynb, .html and the plan as .plan.json) are named ``plan_report_<model>-<plan hash>-<time>``
        (`wb.reports.report_stem`): one plan's reports share the hash, and a rerun never overwrites a report;
        ``name`` replaces that stem."""
        from pathlib import Path

        from workbench import models
        from workbench.reports import report_stem, run_notebook

        model = models.source_of(self.session.original)
        if model is None:
            raise ValueError("Report reloads the model by its zoo name, and this model is not from wb.models; "
                             "export the plan and use wb.sweep / wb.measure on your model instead")
        notebook = Path(__file__).resolve().parents[2] / "notebooks" / "90_report.ipynb"
        out_dir = report_folder() if out_dir is None else Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = name or report_stem(f"plan_report_{model}", self.session.plan.to_json(), out_dir)
        plan_file = out_dir / f"{stem}.plan.json"
        self.session.plan.save(plan_file)
        params = {"model_name": model, "task_name": self.session.task.name, "plan": str(plan_file.resolve()),
                  "calibration": self.session.calibration, "quick": self.session.quick if quick is None else quick,
                  "threads": self.session.threads or torch.get_num_threads()}
        return run_notebook(notebook, params, out_dir=out_dir, name=stem)

    def _on_report(self, _=None) -> None:
        if not self.session.assigned:
            raise ValueError("the plan is empty: set a technique on some layers first")
        self._say("running the report notebook ...", tone="info")

        def run():
            from workbench.reports import OutsideServerRoot, browser_url

            nb, page = self.report()
            note = (f"<span style='color:#666'>({html.escape(str(page))}; executed notebook: "
                    f"{html.escape(nb.name)})</span>")
            try:
                url = browser_url(page)
            except OutsideServerRoot as e:   # a file:// link from an http page opens nothing: say where it is
                self.report_link.value = (f"<span class='wb-report-outside'>report written, no link: "
                                          f"{html.escape(str(e))}</span>")
            else:
                # served as a plain file (not JupyterLab's untrusted HTML viewer), so its charts draw at once
                self.report_link.value = (f"<a href='{html.escape(url)}' target='_blank' rel='noopener' "
                                          f"style='color:#0b57d0;text-decoration:underline'>open the report</a> "
                                          f"{note}")
            self._say(f"report written to {page}")

        if self.background:
            threading.Thread(target=self._guard(run), daemon=True).start()
        else:
            run()

    def export_model(self, folder: str | None = None, format: str | None = None):
        """Write the current model with `wb.export` (see `Session.export`) into ``folder`` (default: a new folder
        ``<model>-<format>`` under ``reports/exports``); returns its path."""
        from pathlib import Path

        from workbench import models
        from workbench.reports import reports_dir

        format = format or self.export_format.value
        if not folder:
            stem = models.source_of(self.session.original) or type(self.session.original).__name__
            base = reports_dir() / "exports" / f"{stem}-{format}"
            target, i = base, 1
            while target.exists() and (not target.is_dir() or any(target.iterdir())):
                i += 1
                target = base.with_name(f"{base.name}-{i}")
            folder = str(target)
        return self.session.export(Path(folder).expanduser(), format)

    def _on_export_model(self, _=None) -> None:
        self._say(f"exporting as {self.export_format.value} ...", tone="info")
        path = self.export_model(self.export_folder.value.strip() or None)
        files = sorted(p.name for p in path.iterdir())
        self.export_link.value = (f"<span>written: <code>{html.escape(str(path))}</code> "
                                  f"<span style='color:#666'>({html.escape(', '.join(files[:6]))}"
                                  f"{' ...' if len(files) > 6 else ''})</span></span>")
        self._say(f"exported the model ({self.export_format.value}) to {path}")

    def _on_point_click(self, trace, points, state) -> None:
        if not points.point_inds:
            return
        i = points.point_inds[0]
        self.session.restore(i)
        self._refresh()
        self._say(f"restored plan {i} ({self.session.history[i].label}); click Apply & measure to rebuild it")

    def _on_sensitivity(self, _=None) -> None:
        from workbench.analysis.sensitivity import sensitivity
        from workbench.plots import sensitivity_heatmap

        layers = list(self.layers.value) or None
        chosen = {c.description: self.candidates[c.description] for c in self.sens_checks.children if c.value}
        if not chosen:
            raise ValueError("tick at least one candidate for the sensitivity analysis")
        self._say("measuring sensitivity ...", tone="info")
        table = sensitivity(self.session.original, self.session.task, chosen, layers,
                            calibration=self.session.calibration, progress=False)
        self.session.sensitivity = table
        self._replace(self.heatmap, sensitivity_heatmap(table))
        self._refresh()
        self._say(_sensitivity_summary(table), tone="ok" if (table["status"] == "ok").all() else "warn")

    def _show_candidates(self) -> None:
        import ipywidgets as W

        ticked = {c.description: c.value for c in self.sens_checks.children}
        self.sens_checks.children = [W.Checkbox(value=ticked.get(name, True), description=name, indent=False,
                                                layout=W.Layout(width="auto", margin="0 18px 0 0"))
                                     for name in self.candidates]

    def _on_add_candidate(self, _=None) -> None:
        from workbench.ui.forms import describe

        config = self._config()
        if config is None:
            raise ValueError("choose a technique above first: 'none' is the unchanged layer, not a candidate")
        name = describe(config)
        self.candidates[name] = config
        self._show_candidates()
        self._say(f"candidate added: {name} ({_count(len(self.candidates), 'candidate')})", tone="info")

    def _on_apply(self, _=None) -> None:
        if self._worker is not None and self._worker.is_alive():
            raise RuntimeError("an apply is already running")
        if not self.session.changed and self.session.history:
            self._say("nothing changed since the last measurement")
            return
        self._cancel.clear()
        if self.background:
            self._worker = threading.Thread(target=self._guard(self._apply_now), daemon=True)
            self._worker.start()
        else:
            self._guard(self._apply_now)()

    def _apply_now(self) -> None:
        def progress(message: str, fraction: float) -> None:
            self.progress.value = fraction
            self.progress_label.value = message

        self.apply_button.disabled, self.cancel_button.disabled = True, False
        try:
            entry = self.session.apply_and_measure(progress=progress, cancel=self._cancel)
        except Cancelled as e:
            self.progress.value, self.progress_label.value = 0.0, "cancelled"
            self._say(str(e))
            return
        except Exception:
            self.progress.value, self.progress_label.value = 0.0, "failed"
            raise
        finally:
            self.apply_button.disabled, self.cancel_button.disabled = False, True
        self._refresh()
        self._update_views()
        # quality +- its sampling error, size, speed verdict; why it is slower (or no smaller) below, in amber
        slower = entry.speedup is not None and (entry.speedup.slower or not entry.speedup.reliable)
        self._say(entry.headline, tone="warn" if slower or entry.notes else "ok", notes=entry.notes)

    def wait(self, timeout: float | None = None) -> None:
        """Block until a background apply finishes (for scripts and tests)."""
        if self._worker is not None:
            self._worker.join(timeout)


def _finite_or_zero(value: float | None) -> float:
    """A sampling error for an error bar: 0 (no bar) where the task states none or it is not finite."""
    import math

    return float(value) if value is not None and math.isfinite(value) else 0.0


def _fit(values: list[float], floor: float | None = None) -> list[float] | None:
    """An axis range around the data with a small margin (plotly's autorange pads a single point to +-50%);
    ``floor``: a bound the range does not cross unless the data do (sizes and speedups are positive)."""
    import math

    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not finite:
        return None
    lo, hi = min(finite), max(finite)
    pad = (hi - lo) * 0.08 if hi > lo else max(abs(hi) * 0.02, 1e-3)
    low = lo - pad if floor is None or lo - pad >= floor or lo < floor else floor
    return [low, hi + pad]


def _clip_to_points(values: list[float], points: list[float], reach: float = 2.0) -> list[float]:
    """``values`` (points and their interval ends) limited to the points' span widened ``reach`` times on each
    side (at least 0.25 around 1, the unchanged model): an axis range for ratios that one noisy interval cannot
    stretch to 15x while every point sits near 1."""
    import math

    finite = [p for p in points if isinstance(p, (int, float)) and math.isfinite(p)]
    if not finite:
        return values
    lo, hi = min(*finite, 1.0), max(*finite, 1.0)
    span = max(hi - lo, 0.25)
    low, high = max(lo - reach * span, 0.0), hi + reach * span
    return [min(max(v, low), high) if isinstance(v, (int, float)) and math.isfinite(v) else v for v in values]


_TONES = {"ok": "#1b5e20", "info": "#444444", "warn": "#8a4b00", "error": "#b00020"}


def _named(candidates) -> dict:
    """Sensitivity candidates as an ordered name -> config dict (a sequence is named by `describe`)."""
    from workbench.ui.forms import describe

    if isinstance(candidates, Mapping):
        return dict(candidates)
    return {describe(c): c for c in candidates}


def _sensitivity_summary(table) -> str:
    """The sensitivity analysis in a sentence: what was measured, what did not run, how it was computed."""
    layers, cands = table["layer"].nunique(), table["candidate"].nunique()
    bad = int((table["status"] != "ok").sum())
    replay = str(table.attrs.get("replay", ""))
    how = ("the layers before each changed one replayed from a recording (same numbers, faster)"
           if replay.startswith("on") else "each candidate measured on the whole model"
           + (f" (no replay: {replay.split(':', 1)[1].strip()})" if ":" in replay else ""))
    return (f"sensitivity measured: {_count(layers, 'layer')} x {_count(cands, 'candidate')}"
            + (f"; {bad} did not run (grey cells: hover for why)" if bad else "") + f"; {how}")


def report_folder():
    """Where the Report button writes: `wb.reports.reports_dir()`, unless the browser's server (JupyterLab started
    in another folder than the repository, a Voila app) cannot serve it - then ``reports/`` in the folder it
    serves, so the report's link opens wherever JupyterLab was started."""
    from workbench.reports import reports_dir, served_folder

    folder, served = reports_dir().resolve(), served_folder()
    if served is None or folder.is_relative_to(served):
        return folder
    return served / "reports"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _speedup(entry) -> float:
    return entry.speedup.ratio if entry.speedup is not None else float("nan")
