"""Pruning (`wb.prune`): unstructured magnitude / random, N:M semi-structured, one-shot calibrated Wanda and
SparseGPT (`oneshot`), global thresholds, masks
kept for fine-tuning or made permanent (dense zeros, CSR or 2:4 storage) - see `configs`; pruned layers are drop-ins
(`modules`) - and structured pruning that physically removes channels and fixes their dependents (`channels`, see
`structured`; fused projections and mixture-of-experts experts per expert included) or removes attention heads
(`attention_heads`, see `heads`) or whole experts of a mixture of experts by routing share (`experts`, see `moe`);
`reestimate_batchnorm` refreshes BatchNorm statistics after pruning."""
from workbench.pruning import masks
from workbench.pruning.batchnorm import reestimate_batchnorm
from workbench.pruning.configs import NM, Magnitude, Random, SparseGPT, Wanda, finalize, global_plan, sparsity_of
from workbench.pruning.heads import KeptHeads, attention_heads, head_importance
from workbench.pruning.modules import (
    PrunedConv1d,
    PrunedConv2d,
    PrunedEmbedding,
    PrunedLinear,
    SemiStructuredLinear,
    SparseLinear,
    pruned_class,
)
from workbench.pruning.moe import KeptExperts, KeptRouter, experts
from workbench.pruning.schedules import gradual_prune, polynomial_sparsity, sweep
from workbench.pruning.structured import Kept, channel_importance, channels, transformer_ffn_consumers

__all__ = ["masks", "reestimate_batchnorm", "Kept", "KeptHeads", "channels", "channel_importance", "attention_heads",
           "head_importance", "transformer_ffn_consumers", "polynomial_sparsity", "gradual_prune", "sweep", "Magnitude",
           "Random", "NM", "Wanda", "SparseGPT", "global_plan", "finalize", "sparsity_of", "PrunedLinear",
           "PrunedConv2d", "PrunedConv1d", "PrunedEmbedding", "pruned_class", "SparseLinear", "SemiStructuredLinear",
           "experts", "KeptExperts", "KeptRouter"]
