"""Analysis and search across techniques: per-layer sensitivity, budgeted mixed-technique search,
sweeps with Pareto fronts, scale-out executors and calibration cost estimates.

    table = wb.sensitivity(model, task, [wb.quant.WeightOnly(bits=8, group_size=None),
                                         wb.quant.WeightOnly(bits=4, group_size=64)])
    plan, report = wb.search(model, task, candidates, budget=wb.Budget.size_fraction(0.35), table=table)
    df = wb.sweep(model, task, {"int8": plan8, "int4": plan4, "searched": plan})
    df[wb.pareto(df, "size_bytes", "fidelity")]
    print(wb.analysis.estimate_calibration(model, gptq_plan, task.calibration(128)))
"""
from workbench.analysis.candidates import label
from workbench.analysis.estimate import Estimate, estimate_calibration, estimate_training
from workbench.analysis.executors import Executor, InProcess, ProcessPool, Ray
from workbench.analysis.search import Budget, SearchReport, search, solve, uniform_plans
from workbench.analysis.sensitivity import layer_latencies, sensitivity
from workbench.analysis.sweep import load_results, pareto, plan_of, save_results, sweep

__all__ = ["sensitivity", "layer_latencies", "search", "solve", "Budget", "SearchReport", "uniform_plans", "sweep",
           "pareto", "save_results", "load_results", "plan_of", "label", "Estimate", "estimate_calibration",
           "estimate_training", "Executor", "InProcess", "ProcessPool",
           "Ray"]
