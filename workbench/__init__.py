"""workbench: measured model compression - quantization, pruning, distillation, low-rank, mixed precision.

    import workbench as wb
    model = wb.models.load("minilm")
    task = wb.tasks.load("minilm")
    base = wb.measure(model, task)
    plan = wb.Plan({"encoder.layer.*.intermediate.dense": wb.precision.Cast(torch.bfloat16)})
    small = wb.apply(model, plan)            # a new model; `model` is untouched
    wb.measure(small, task).to_dict()
    wb.save(small, "out.safetensors"); again = wb.load("out.safetensors", base=model)
    wb.export(small, "out-folder", format="compressed-tensors")   # a checkpoint vLLM and transformers read

Importing the package has no side effects: no CUDA initialisation, no global torch settings changed,
no models or data loaded.
"""
from workbench import analysis, lowrank, measurement, models, plots, precision, reports, tasks, teach, training, ui
from workbench import distillation as distill
from workbench import pruning as prune
from workbench import quantization as quant
from workbench.analysis import Budget, pareto, search, sensitivity, sweep
from workbench.export import export
from workbench.measurement import Metrics, Speedup, compare, layer_table, measure, size_bytes, speedup
from workbench.plans import ApplyError, Plan, applied_plans, applied_report, apply
from workbench.plans.io import empty_weights, load, save
from workbench.quantization import qat

__version__ = "0.1.0"

__all__ = ["models", "tasks", "precision", "quant", "qat", "prune", "lowrank", "distill", "training", "measurement",
           "plots", "reports", "measure", "Metrics", "compare", "speedup", "Speedup", "layer_table", "size_bytes",
           "Plan", "apply", "applied_plans", "applied_report", "ApplyError", "save", "load", "empty_weights",
           "analysis", "sensitivity", "search", "Budget", "sweep", "pareto", "ui", "teach", "export", "__version__"]
