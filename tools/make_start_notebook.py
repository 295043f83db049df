"""Write notebooks/00_start_here.ipynb from the cells below (run after editing them)."""
from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_writer import write

cells = [
    new_markdown_cell("""# Start here: measure a model, compress some layers, measure again

This notebook is the whole workbench loop in six steps. Every number below is **measured** on this machine:
real quality on real data, real latency (median of timed runs), the real bytes the weights occupy, and the
peak memory of a forward pass.

1. load a model and its task from the zoo
2. measure the baseline
3. write a **plan**: which layers get which technique (here: store and run some layers in bfloat16)
4. `wb.apply` the plan to get a new model (the original is untouched)
5. measure the compressed model and compare
6. save it to a safetensors file and load it back, bit for bit

Run it as a report with `workbench report notebooks/00_start_here.ipynb -p model_name digits-cnn -p pattern 'fc*'`."""),
    new_code_cell("""# Parameters (papermill replaces this cell's values when the notebook runs as a report)
model_name = "minilm"                              # any of wb.models.names()
task_name = "minilm"                               # any of wb.tasks.names()
pattern = "encoder.layer.*.intermediate.dense"     # which layers to cast: a name, a glob or "re:<regex>"
dtype = "bfloat16"                                 # "bfloat16" or "float16"
quick = False                                      # True: primary metric on a subset, fewer timing runs
threads = 2                                        # CPU threads used for every measurement
out_file = "../reports/start_here.safetensors"      # where step 6 writes the compressed model""",
                  metadata={"tags": ["parameters"]}),
    new_code_cell("""import torch

import workbench as wb

print("models:", wb.models.names())
print("tasks: ", wb.tasks.names())"""),
    new_markdown_cell("""## 1. The model and its task

A task bundles evaluation data, a calibration split that never overlaps it, the quality metrics (the first is
the primary one, and each says whether higher is better) and example inputs for timing."""),
    new_code_cell("""model = wb.models.load(model_name)
task = wb.tasks.load(task_name)
print(task)
for spec in task.metrics:
    print(f"  {spec.name:11s} {'higher' if spec.higher_is_better else 'lower'} is better: {spec.description}")
layers = wb.layer_table(model)
layers.head(12)"""),
    new_markdown_cell("""## 2. Baseline

`wb.measure` evaluates quality, times the forward pass (warm-up, then the median and p90 of timed runs with a
fixed thread count), counts the bytes of every parameter and buffer as stored, and records the peak memory of
one forward pass."""),
    new_code_cell("""baseline = wb.measure(model, task, quick=quick, threads=threads)
print(baseline)"""),
    new_markdown_cell("""## 3. A plan

A plan maps layer-name patterns to technique configs. `plan.describe(model)` shows exactly which layer gets
which config - a pattern that matches nothing is an error, never a silent no-op."""),
    new_code_cell("""plan = wb.Plan({pattern: wb.precision.Cast(dtype)})
plan.describe(model)"""),
    new_markdown_cell("""## 4. Apply it

`wb.apply` returns a new model. It is transactional: if any layer fails, you get an error naming the layer and
no half-changed model. The original keeps its fp32 weights."""),
    new_code_cell("""small = wb.apply(model, plan)
print("original dtypes:  ", wb.measurement.bytes_by_dtype(model))
print("compressed dtypes:", wb.measurement.bytes_by_dtype(small))"""),
    new_markdown_cell("""## 5. Measure and compare"""),
    new_code_cell("""compressed = wb.measure(small, task, quick=quick, threads=threads)
labels = ["fp32 baseline", f"{dtype} on {pattern}"]
wb.compare(baseline, compressed, labels=labels)"""),
    new_code_cell("""wb.plots.comparison_bars([baseline, compressed], labels=labels)"""),
    new_code_cell("""wb.plots.tradeoff([baseline, compressed], labels=labels, x="size_bytes")"""),
    new_markdown_cell("""## 6. Save and load

`wb.save` writes a safetensors file (no pickle) with the plan in its metadata; `wb.load` rebuilds the compressed
structure from the plan on the base model and checks every tensor's shape and dtype before loading."""),
    new_code_cell("""wb.save(small, out_file)
again = wb.load(out_file, base=model)
inputs = task.example_inputs(4)
with torch.inference_mode():
    identical = torch.equal(small(*inputs), again(*inputs))
print("reloaded model gives bit-identical outputs:", identical)"""),
    new_markdown_cell("""The values below are recorded in the notebook's outputs: the test suite and the report regression checks
read them back."""),
    new_code_cell("""wb.reports.record(
    model=model_name,
    baseline_primary=baseline.primary_value,
    compressed_primary=compressed.primary_value,
    primary_metric=baseline.primary,
    baseline_size_bytes=baseline.size_bytes,
    compressed_size_bytes=compressed.size_bytes,
    size_ratio=compressed.size_bytes / baseline.size_bytes,
    speedup=baseline.latency_ms / compressed.latency_ms,
    reload_identical=identical,
)"""),
]

write("00_start_here", cells)
