"""Lab 41, fp8 training recipes: what e4m3 and e5m2 hold, why every tensor needs a scale, current vs delayed
scaling, and what fp8 numerics do to a real training run (`wb.precision.fp8_training`, emulated on this CPU).

In `figures`: the format table, real tensors of a training step (inputs, weights, output gradients of each
Linear), the per-step amax trace of a training run, the recipe comparison (accuracy, saturated values) and the lab's
figures. In `checks`: the exercise checks (``check_*``), which compute their expected values through the package
and know a worked solution each (``_solution_*``, shown behind "Show solution", run by the regression suite).
Both are re-exported here.
"""
from workbench.teach.fp8.checks import (
           check_better_gradient_format,
           check_current_scale,
           check_delayed_scale,
           check_headroom,
           check_relative_error,
           check_round_trip,
           check_saturating_steps,
           check_saved_bytes,
           check_zero_fraction,
)
from workbench.teach.fp8.figures import (
           FP8,
           amax_figure,
           amax_trace,
           format_table,
           recipe_figure,
           saturating_steps,
           step_tensors,
           train_recipes,
           zero_fraction,
)

__all__ = ["FP8", "format_table", "step_tensors", "zero_fraction", "amax_trace", "saturating_steps", "train_recipes",
           "amax_figure", "recipe_figure", "check_round_trip", "check_current_scale", "check_zero_fraction",
           "check_delayed_scale", "check_saturating_steps", "check_relative_error", "check_headroom",
           "check_better_gradient_format", "check_saved_bytes"]
