"""Write notebooks/90_report.ipynb - the report template: one plan (a JSON file) against the unchanged model.

`workbench report notebooks/90_report.ipynb -p model_name digits-cnn -p plan my_plan.json` renders it to
standalone HTML; the workbench's *Report* button runs it with the current plan. Run this script after editing
the cells."""
from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_writer import write

cells = [
    new_markdown_cell("""# Compression report: a plan against the unchanged model

Every number here is measured on this machine: the task's quality metrics on the full evaluation set (unless
`quick`), latency (median of timed runs at a fixed thread count), the bytes the weights really occupy and peak
memory. Render it with
`workbench report notebooks/90_report.ipynb -p model_name digits-cnn -p task_name digits -p plan my_plan.json`
(a plan file is what `wb.Plan.save` or the workbench's *Plan JSON* tab writes)."""),
    new_code_cell("""# Parameters (papermill replaces these values)
model_name = "digits-cnn"                      # any of wb.models.names()
task_name = "digits"                           # any of wb.tasks.names()
plan = "../data/plans/digits-cnn-mixed.json"   # the plan's JSON file (relative to notebooks/; `workbench report`: to where it runs)
calibration = 64                               # calibration samples, for plans that need them (GPTQ, AWQ, static W8A8)
quick = False                                  # True: the primary metric on the quick subset, fewer timing runs
sensitivity = True                             # per-layer sensitivity of the plan's layers to the plan's configs
threads = 2                                    # CPU threads for every measurement""",
                  metadata={"tags": ["parameters"]}),
    new_code_cell("""import workbench as wb

model = wb.models.load(model_name)
task = wb.tasks.load(task_name)
the_plan = wb.Plan.read(plan)
assignments = the_plan.resolve(model)
the_plan.describe(model)"""),
    new_markdown_cell("## Baseline against the plan"),
    new_markdown_cell("""The speedup is measured side by side with the unchanged model (paired rounds, 95 % interval); a plan
that runs slower says why (`slowdown_reason`). `quality_change` reads the primary metric with its sampling
error: a difference inside it is not a loss."""),
    new_code_cell("""compressed = wb.apply(model, the_plan, calibration=task.calibration(calibration))
reference = wb.measure(model, task, quick=quick, threads=threads)
result = wb.measure(compressed, task, quick=quick, threads=threads, baseline=model)
print(f"speed: {result.speedup}")
print(wb.measurement.slowdown_note(result) or "not slower than the unchanged model")
print(f"{task.primary.name}: {wb.measurement.quality_change(result, reference)}")
wb.compare(reference, result, labels=["reference", "plan"]).T"""),
    new_code_cell("""wb.plots.comparison_bars([reference, result], labels=["reference", "plan"]).show()"""),
    new_markdown_cell("""## Per layer

What each layer holds before and after: its type, the bytes of its tensors and their dtypes (quantized layers
keep packed integer codes plus scales)."""),
    new_code_cell("""layers = wb.layer_table(model).merge(wb.layer_table(compressed), on="layer", how="outer",
                                     suffixes=("_reference", "_plan"))
layers["bytes_ratio"] = layers["bytes_plan"] / layers["bytes_reference"]
layers"""),
    new_code_cell("""wb.plots.size_breakdown(compressed, top=30).show()"""),
    new_markdown_cell("""## Sensitivity and trade-off

Each of the plan's configurations applied to one layer at a time (quality loss on the quick subset), then each
configuration applied uniformly to all of the plan's layers, measured beside the plan: where the plan sits on
the size / quality and latency / quality trade-off."""),
    new_code_cell("""configs = list(dict.fromkeys(a.config for a in assignments))
table = wb.sensitivity(model, task, configs, layers=[a.name for a in assignments], calibration=calibration,
                       threads=threads) if sensitivity else None
wb.plots.sensitivity_heatmap(table).show() if sensitivity else None"""),
    new_code_cell("""alternatives = {"plan": the_plan, **(wb.analysis.uniform_plans(table) if sensitivity else {})}
trade = wb.sweep(model, task, alternatives, quick=quick, calibration=calibration, threads=threads)
wb.plots.frontier(trade, x="size_bytes").show()
wb.plots.frontier(trade, x="latency_ms").show()
trade[["label", task.primary.name, "size_bytes", "latency_ms", "pareto_size", "pareto_latency"]]"""),
    new_markdown_cell("The values below are recorded in the notebook's outputs (the regression suite reads them)."),
    new_code_cell("""wb.reports.record(
    model=model_name,
    primary_metric=reference.primary,
    reference_primary=reference.primary_value,
    plan_primary=result.primary_value,
    size_ratio=result.size_bytes / reference.size_bytes,
    speedup=result.speedup.ratio,
    layers=len(assignments),
    plan_on_size_front=bool(trade.loc[trade["label"] == "plan", "pareto_size"].iloc[0]),
)"""),
]

write("90_report", cells)
