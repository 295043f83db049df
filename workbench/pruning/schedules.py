"""Gradual pruning and sparsity sweeps for the classification tasks.

- `polynomial_sparsity(step, final, steps, initial=0)`: Zhu & Gupta (2017)'s schedule
  s_t = s_f + (s_i - s_f) (1 - t / n)^3, which prunes fast while many weights are redundant and slowly at the end.
- `gradual_prune(model, task, patterns, final_sparsity, steps, epochs_per_step, lr)`: prune to s_1, fine-tune,
  prune to s_2, ... (masks only grow); each fine-tune restarts the learning-rate schedule from ``lr``
  (learning-rate rewinding, Renda et al. 2020). Returns the pruned model (masks kept) and a history DataFrame.
- `sweep(model, task, patterns, sparsities, finetune_epochs)`: accuracy and size at each sparsity, with and
  without a short fine-tune, as one DataFrame ready to plot.
"""
from __future__ import annotations

import copy

from torch import nn
from tqdm.auto import tqdm

from workbench.plans.apply import apply
from workbench.plans.plan import Plan
from workbench.pruning.configs import Magnitude, Random, finalize
from workbench.pruning.masks import check_sparsity

__all__ = ["polynomial_sparsity", "gradual_prune", "sweep"]


def polynomial_sparsity(step: int, final: float, steps: int, initial: float = 0.0) -> float:
    """Sparsity after pruning step ``step`` of ``steps`` (1-based; step ``steps`` reaches ``final``)."""
    check_sparsity(final, "final sparsity")
    check_sparsity(initial, "initial sparsity")
    if not 1 <= step <= steps:
        raise ValueError(f"step must be in [1, {steps}], got {step}")
    return final + (initial - final) * (1 - step / steps) ** 3


def _patterns(patterns) -> list[str]:
    return [patterns] if isinstance(patterns, str) else list(patterns)


def gradual_prune(model: nn.Module, task, patterns, final_sparsity: float, steps: int = 4,
                  epochs_per_step: int = 1, lr: float = 1e-3, progress: bool = True):
    import pandas as pd

    from workbench.training import fit_classifier

    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    current = model
    rows = []
    for step in tqdm(range(1, steps + 1), desc="gradual pruning", disable=not progress, leave=False):
        s = polynomial_sparsity(step, final_sparsity, steps)
        current = apply(current, Plan({p: Magnitude(s) for p in _patterns(patterns)}), progress=False)
        pruned_acc = task.evaluate(current)[task.primary.name]
        fit_classifier(current, task, epochs=epochs_per_step, lr=lr, progress=False)
        rows.append({"step": step, "sparsity": s, f"{task.primary.name}_after_prune": pruned_acc,
                     f"{task.primary.name}_after_finetune": task.evaluate(current)[task.primary.name]})
    return current, pd.DataFrame(rows)


def sweep(model: nn.Module, task, patterns, sparsities=(0.0, 0.25, 0.5, 0.7, 0.8, 0.9, 0.95),
          finetune_epochs: int = 0, lr: float = 1e-3, method: str = "magnitude", progress: bool = True):
    """One row per (sparsity, fine-tuned or not): the primary metric, the non-zero weights left, and the bytes of
    dense storage (unchanged by unstructured sparsity: use CSR storage or structured pruning to save bytes)."""
    import pandas as pd

    from workbench.measurement import size_bytes
    from workbench.training import fit_classifier

    configs = {"magnitude": lambda s: Magnitude(s), "random": lambda s: Random(s)}
    if method not in configs:
        raise ValueError(f"sweep method must be one of {sorted(configs)}, got {method!r}")
    rows = []
    for s in tqdm(list(sparsities), desc="sparsity sweep", disable=not progress, leave=False):
        pruned = apply(model, Plan({p: configs[method](s) for p in _patterns(patterns)}), progress=False)
        variants = [(False, pruned)]
        if finetune_epochs:
            tuned = copy.deepcopy(pruned)
            fit_classifier(tuned, task, epochs=finetune_epochs, lr=lr, progress=False)
            variants.append((True, tuned))
        for finetuned, m in variants:
            final = finalize(m, "dense")
            nonzero = sum(int((mod.weight != 0).sum()) for _, mod in final.named_modules()
                          if isinstance(mod, (nn.Linear, nn.Conv2d)))
            rows.append({"sparsity": s, "finetuned": finetuned, task.primary.name: task.evaluate(m)[task.primary.name],
                         "nonzero_weights": nonzero, "dense_bytes": size_bytes(final)})
    return pd.DataFrame(rows)
