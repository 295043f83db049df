"""Write notebooks/01_explorer.ipynb from the cells below (run after editing them)."""
from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_writer import write

cells = [
    new_markdown_cell("""# The explorer: edit a model layer by layer and watch the measured trade-offs move

1. Run all cells. The workbench below measures the unchanged model first (the reference point).
2. Pick layers in the table (click, shift/ctrl-click, click a header to sort, or type a pattern such as
   `encoder.*.dense` and press *Select matching*), choose a technique - every technique of the registry, with
   its settings - and press **Set for selected**. The table shows each layer's bytes before and after.
3. Press **Apply & measure**: only the layers you changed are rebuilt, the model is measured on the task's quick
   subset, and a point joins the two charts (quality vs size, quality vs latency; the dotted line is the Pareto
   front). Click any point to bring its plan back; *Undo* / *Redo* walk your edits.
4. The *Sensitivity* tab measures what each candidate costs on each layer; *Roofline* compares every plan's
   measured speedup with the byte-ratio ceiling; *Size* shows the bytes per layer; *Plan JSON* exports the plan
   for `wb.apply` / `workbench measure --plan`.

The cells after the workbench apply one example edit from code (the same calls the buttons make), so this
notebook also runs headless as a report and a regression test."""),
    new_code_cell("""# Parameters (papermill replaces this cell's values when the notebook runs as a report)
model_name = "digits-cnn"        # any of wb.models.names()
task_name = "digits"             # any of wb.tasks.names()
pattern = "fc*"                  # the example edit: these layers ...
bits = 4                         # ... quantized to this many bits
group_size = 32                  # ... in groups of this size (None: one scale per output channel)
calibration = 32                 # calibration samples for GPTQ / AWQ
threads = 2                      # CPU threads for every measurement""", metadata={"tags": ["parameters"]}),
    new_code_cell("""import torch

import workbench as wb

torch.set_num_threads(threads)
model = wb.models.load(model_name)
task = wb.tasks.load(task_name)
app = wb.ui.Workbench(model, task, calibration=calibration, threads=threads)   # measures the reference first
app"""),
    new_markdown_cell("""## The example edit, from code

The same operations as the controls above: select by pattern, choose the technique, set, apply and measure."""),
    new_code_cell("""app.pattern.value = pattern
app.select_button.click()
app.choose(wb.quant.WeightOnly(bits=bits, group_size=group_size))   # fills the technique form, as clicks would
app.set_button.click()
app.apply_button.click()
app.wait()
app.session.layer_rows()"""),
    new_markdown_cell("""The trade-off charts as static figures (what a saved report shows; the live ones above need a kernel)."""),
    new_code_cell("""import plotly.graph_objects as go

go.Figure(app.size_chart).show()
go.Figure(app.latency_chart).show()"""),
    new_markdown_cell("""The values below are recorded in the notebook's outputs: the test suite and report regression checks read them."""),
    new_code_cell("""reference, edited = app.session.history[0].metrics, app.session.history[-1].metrics
wb.reports.record(
    model=model_name,
    primary_metric=reference.primary,
    reference_primary=reference.primary_value,
    edited_primary=edited.primary_value,
    size_ratio=edited.size_bytes / reference.size_bytes,
    points=len(app.size_chart.data[0].x),
    plan=app.session.plan.to_json(),
)"""),
]

write("01_explorer", cells)
