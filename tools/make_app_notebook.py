"""Write notebooks/app.ipynb - the dashboard `workbench app` serves with Voila (run after editing the cells)."""
from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_writer import write

cells = [
    new_markdown_cell("""# Compression workbench

Pick layers in the table (click, shift/ctrl-click; click a header to sort), choose a technique, *Set for selected*,
then **Apply & measure**: each plan becomes a measured point on the trade-off charts (click one to bring it back).
Served by `workbench app --model NAME --task TASK`."""),
    new_code_cell("""# Parameters (`workbench app` and papermill replace these values)
model_name = "digits-cnn"        # any of wb.models.names()
task_name = "digits"             # any of wb.tasks.names()
calibration = 32                 # calibration samples for GPTQ / AWQ
threads = 2                      # CPU threads for every measurement""", metadata={"tags": ["parameters"]}),
    new_code_cell("""import torch

import workbench as wb

torch.set_num_threads(threads)
app = wb.ui.Workbench(wb.models.load(model_name), wb.tasks.load(task_name), calibration=calibration,
                      threads=threads)   # measures the reference first
app"""),
    new_code_cell("""wb.reports.record_hidden(model=model_name, points=len(app.session.history),
                         reference_primary=app.session.history[0].quality)   # for the regression suite; shows nothing"""),
]

write("app", cells)
