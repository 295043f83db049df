"""Write notebooks/02_plan_report.ipynb - the report of one plan against its reference (the workbench's
"Report" button runs it; run this script after editing the cells)."""
from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_writer import write

cells = [
    new_markdown_cell("""# Plan report: one compression plan against the unchanged model

Every number is measured on this machine: the task's quality metrics on the full evaluation set (unless `quick`),
latency (median of timed runs at a fixed thread count), the bytes the weights occupy and peak memory.
The workbench's *Report* button runs this notebook with its current plan; so does
`workbench report notebooks/02_plan_report.ipynb -p model_name digits-cnn -p plan_json "$(cat plan.json)"`."""),
    new_code_cell("""# Parameters (papermill replaces these values)
model_name = "digits-cnn"        # any of wb.models.names()
task_name = "digits"             # any of wb.tasks.names()
plan_json = '{"format": "workbench.plan", "version": 1, "entries": [{"pattern": "fc*", "config": {"kind": "quant.WeightOnly", "bits": 4, "group_size": 32, "symmetric": true, "method": "rtn", "damp": 0.01, "act_order": false}}]}'
calibration = 64                 # calibration samples, for plans that need them (GPTQ, AWQ, static W8A8)
quick = False                    # True: the primary metric on the quick subset, fewer timing runs
threads = 2                      # CPU threads for every measurement""", metadata={"tags": ["parameters"]}),
    new_code_cell("""import workbench as wb

model = wb.models.load(model_name)
task = wb.tasks.load(task_name)
plan = wb.Plan.from_json(plan_json)
plan.describe(model)"""),
    new_markdown_cell("## Apply and measure"),
    new_code_cell("""compressed = wb.apply(model, plan, calibration=task.calibration(calibration))
reference = wb.measure(model, task, quick=quick, threads=threads)
result = wb.measure(compressed, task, quick=quick, threads=threads)
wb.compare(reference, result, labels=["reference", "plan"]).T"""),
    new_code_cell("""wb.plots.comparison_bars([reference, result], labels=["reference", "plan"]).show()
wb.plots.size_breakdown(compressed, top=30).show()"""),
    new_markdown_cell("The values below are recorded in the notebook's outputs (tests and regression checks read them)."),
    new_code_cell("""wb.reports.record(
    model=model_name,
    primary_metric=reference.primary,
    reference_primary=reference.primary_value,
    plan_primary=result.primary_value,
    size_ratio=result.size_bytes / reference.size_bytes,
    speedup=reference.latency_ms / result.latency_ms,
    layers=len(plan.resolve(model)),
)"""),
]

write("02_plan_report", cells)
