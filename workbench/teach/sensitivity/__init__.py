"""Lab 15, sensitivity and mixed bit-widths: a per-layer scan, bits assigned under a byte budget (greedy and
exact), the searched plans measured against uniform ones, predicted vs measured quality, a Pareto front.

Every measurement is the package's: `wb.sensitivity` (one layer changed at a time, the task's metric),
`wb.analysis.solve` (the exact multiple-choice knapsack), `wb.search` (knapsack plans and uniform plans that fit,
all measured, the best measured one returned), `wb.pareto`; plans are applied with `wb.apply` and scored with
the task's own evaluation. This package adds the lab's tables and figures (`figures`) and the exercise checks
(``check_*``) with their worked solutions (``_solution_*``, in `checks`), all re-exported here; a plan here is
``{layer: option}``, option one of the candidate labels or ``"keep"`` (the layer unchanged).
"""
from workbench.teach.sensitivity.checks import (
           check_best_verified,
           check_greedy,
           check_knapsack,
           check_layer_bytes,
           check_measured,
           check_pareto,
           check_plan_bytes,
           check_predicted,
           check_scan,
)
from workbench.teach.sensitivity.figures import (
           KEEP,
           allocation_table,
           budget_plans,
           candidates,
           evaluate,
           layer_table,
           loss_figure,
           measure_plan,
           options,
           pareto_figure,
           plan_bytes,
           predicted,
           to_plan,
)

__all__ = ["KEEP", "candidates", "layer_table", "evaluate", "options", "plan_bytes", "predicted", "to_plan",
           "measure_plan", "loss_figure", "budget_plans", "allocation_table", "pareto_figure", "check_scan",
           "check_layer_bytes", "check_plan_bytes", "check_predicted", "check_measured", "check_greedy",
           "check_knapsack", "check_best_verified", "check_pareto"]
