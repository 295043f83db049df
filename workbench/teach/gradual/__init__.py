"""Lab 21 (pruning beyond one shot): the gradual schedule, Wanda and SparseGPT on tiny-llama, and 2:4 hardware.

The notebook ``notebooks/21_pruning_beyond.ipynb`` compares Zhu & Gupta's gradual pruning with one-shot pruning
at the same final sparsity and fine-tuning budget, then calibrated one-shot LLM pruning (`workbench.pruning.oneshot`)
against magnitude at 50 % and 2:4, and measures what 2:4 storage costs and buys on this CPU. In `figures`:

- `schedule_figure`: the cubic schedule (`workbench.pruning.polynomial_sparsity`) against a linear one;
- `gradual_vs_oneshot` / `gradual_figure`: `workbench.pruning.gradual_prune` against prune-once-then-fine-tune;
- `llm_pruning`, `layer_errors`: the package's plans on tiny-llama (perplexity) and on one layer (output error);
- `bytes_24`, `time_24`: what 2:4 storage costs in bytes, and dense vs 2:4 storage timed side by side on this CPU.

In `checks`: `obs_example`, a corner of a real layer for SparseGPT's update, and the exercise checks with their
worked solutions (``_solution_*``). Both are re-exported here.
"""
from workbench.teach.gradual.checks import (
           OBSExample,
           check_24_bytes,
           check_24_ceiling,
           check_best_pruner,
           check_magnitude_mask,
           check_nm_mask,
           check_obs_saliency,
           check_obs_update,
           check_schedule,
           check_wanda_mask,
           check_wanda_scores,
           obs_example,
)
from workbench.teach.gradual.figures import (
           bytes_24,
           gradual_figure,
           gradual_vs_oneshot,
           layer_errors,
           llm_figure,
           llm_pruning,
           schedule_figure,
           time_24,
)

__all__ = ["schedule_figure", "gradual_vs_oneshot", "gradual_figure", "llm_pruning", "llm_figure", "layer_errors",
           "OBSExample", "obs_example", "time_24", "bytes_24", "check_schedule", "check_magnitude_mask",
           "check_wanda_scores", "check_wanda_mask", "check_nm_mask", "check_obs_update", "check_obs_saliency",
           "check_24_bytes", "check_24_ceiling", "check_best_pruner"]
