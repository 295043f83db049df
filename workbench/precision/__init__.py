"""Precision: per-layer casts (`Cast`) of weights and compute to fp16 / bf16, and mixed-precision training
(`AmpStep`, `fit_mixed`, `compare_precisions`), fp8 training recipes (`Fp8Recipe`, `fp8_training`: current vs
delayed scaling, e4m3 forward / e5m2 gradients, emulated) and an 8-bit AdamW (`AdamW8bit`)."""
from workbench.precision.cast import Cast, CastConv1d, CastConv2d, CastConv3d, CastEmbedding, CastLinear
from workbench.precision.fp8 import Fp8Linear, Fp8Recipe, fp8_restore, fp8_training
from workbench.precision.optim import AdamW8bit, state_bytes
from workbench.precision.training import AmpStep, checkpoint_blocks, compare_precisions, fit_mixed

__all__ = ["AdamW8bit", "state_bytes", "AmpStep", "checkpoint_blocks", "fit_mixed", "compare_precisions", "Cast",
           "CastLinear", "CastConv1d", "CastConv2d", "CastConv3d", "CastEmbedding", "Fp8Recipe", "Fp8Linear",
           "fp8_training", "fp8_restore"]
