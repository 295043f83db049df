"""Lesson 20, pruning: which weights a mask removes, what it costs in accuracy, and what it buys in speed.

Three ways to choose the weights ``W`` (out x in) to drop, all at the same 50 % sparsity (= fraction of zeros):

- **unstructured magnitude**: drop the smallest ``|w|`` anywhere - the zeros land scattered over the matrix,
  which dense kernels still multiply, so nothing gets faster;
- **structured**: drop whole output rows (neurons / channels) with the smallest L1 norm ``sum_j |w_ij|`` - the
  layer (and the input of the next one) really becomes smaller, so dense kernels run faster;
- **N:M semi-structured** (2:4): in every group of M = 4 consecutive inputs keep the N = 2 largest - a pattern
  sparse tensor cores on recent GPUs run at up to 2x. For a convolution (out, in, kh, kw) the groups run along
  the input channels at each kernel position (the GEMM's reduction dimension, as NVIDIA's ASP prunes), never
  over the flattened (in, kh, kw), which would mix kernel positions in a group.

In `figures`: the masks of a real layer (`lesson_masks`, `row_mask`) and the figures (`mask_heatmaps`,
`channel_norms`, `sparsity_curves`); in `checks`: the exercise checks (``check_*``), which compute their expected
values themselves. Both are re-exported here.
"""
from workbench.teach.pruning.checks import check_global_mask, check_nm_mask, check_structured_pair
from workbench.teach.pruning.figures import (
           channel_norms,
           lesson_masks,
           mask_heatmaps,
           mask_sparsity,
           nm_grouping,
           row_mask,
           sparsity_curves,
)

__all__ = ["row_mask", "lesson_masks", "mask_sparsity", "mask_heatmaps", "channel_norms", "sparsity_curves",
           "nm_grouping", "check_global_mask", "check_nm_mask", "check_structured_pair"]
