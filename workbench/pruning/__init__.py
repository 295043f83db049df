"""Pruning (`wb.prune`): unstructured magnitude / random, N:M semi-structured, global thresholds, masks
kept for fine-tuning or made permanent (dense zeros or CSR storage) - see `configs` - and structured pruning
that physically removes channels and fixes their dependents (`channels`, see `structured`)."""
from workbench.pruning import masks
from workbench.pruning.schedules import gradual_prune, polynomial_sparsity, sweep
from workbench.pruning.structured import (
    Kept, attention_heads, channel_importance, channels, head_importance, transformer_ffn_consumers,
)
from workbench.pruning.configs import NM, Magnitude, Random, finalize, global_plan, sparsity_of
from workbench.pruning.modules import PrunedConv2d, PrunedLinear, SemiStructuredLinear, SparseLinear

__all__ = ["masks", "Kept", "channels", "channel_importance", "attention_heads", "head_importance",
           "transformer_ffn_consumers", "polynomial_sparsity", "gradual_prune", "sweep", "Magnitude", "Random", "NM", "global_plan", "finalize", "sparsity_of", "PrunedLinear",
           "PrunedConv2d", "SparseLinear", "SemiStructuredLinear"]
