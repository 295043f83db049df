"""Precision: per-layer casts (`Cast`) of weights and compute to fp16 / bf16."""
from workbench.precision.cast import Cast, CastConv1d, CastConv2d, CastConv3d, CastEmbedding, CastLinear

__all__ = ["Cast", "CastLinear", "CastConv1d", "CastConv2d", "CastConv3d", "CastEmbedding"]
