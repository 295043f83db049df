"""Precision: per-layer casts (`Cast`) of weights and compute to fp16 / bf16, and mixed-precision training
(`AmpStep`, `fit_mixed`, `compare_precisions`)."""
from workbench.precision.cast import Cast, CastConv1d, CastConv2d, CastConv3d, CastEmbedding, CastLinear
from workbench.precision.training import AmpStep, compare_precisions, fit_mixed

__all__ = ["AmpStep", "fit_mixed", "compare_precisions", "Cast", "CastLinear", "CastConv1d", "CastConv2d", "CastConv3d", "CastEmbedding"]
