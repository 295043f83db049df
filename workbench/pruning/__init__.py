"""Pruning (`wb.prune`): unstructured magnitude / random, N:M semi-structured, global thresholds, masks
kept for fine-tuning or made permanent (dense zeros or CSR storage). See `configs` for the plan configs."""
from workbench.pruning import masks
from workbench.pruning.configs import NM, Magnitude, Random, finalize, global_plan, sparsity_of
from workbench.pruning.modules import PrunedConv2d, PrunedLinear, SparseLinear

__all__ = ["masks", "Magnitude", "Random", "NM", "global_plan", "finalize", "sparsity_of", "PrunedLinear",
           "PrunedConv2d", "SparseLinear"]
