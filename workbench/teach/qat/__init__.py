"""Lesson 13 (quantization-aware training): the straight-through estimator, training curves, LSQ's scales.

The notebook ``notebooks/13_qat.ipynb`` cannot define functions; what it needs beyond the package's public API
lives here (`figures`, and the exercises in `checks`; both re-exported here), computed with the package's own
pieces (`workbench.quantization.qat.fake_quantize_ste`, `wb.qat.prepare` / `convert`, `wb.training`):

- `ste_curve` / `ste_figure`: fake quantization of a range of values and the gradient the STE gives it;
- `train_with_curve`: exactly `wb.training.fit_classifier` (same optimizer, schedule, batches and seed; a test
  checks the weights are identical), also recording the loss of every step and the test accuracy every few
  steps, for the plot only (nothing is chosen by it: the number of epochs is fixed in advance);
- `ptq_baselines`, `code_usage`: the strong PTQ baselines (asymmetric grid, GPTQ) and why a symmetric 2-bit
  grid is nearly ternary;
- `ptq_vs_qat`: PTQ (round-to-nearest) against QAT with and without learned scales, per bit width;
- `lsq_scales`, `zero_gradient_fraction`: what learning the scales changed in a layer;
- in `checks`: checks for the exercises, computing the expected values themselves (`ste_reference`,
  `lsq_step_gradient`).
"""
from workbench.teach.qat.checks import (
           check_code_usage,
           check_lsq_step_gradient,
           check_ste_fake_quantize,
           lsq_step_gradient,
           ste_reference,
)
from workbench.teach.qat.figures import (
           Curve,
           bits_figure,
           code_usage,
           curves_figure,
           fake_quantize,
           lsq_scales,
           lsq_scales_figure,
           ptq_baselines,
           ptq_vs_qat,
           qat_plan,
           ste_curve,
           ste_figure,
           ste_gradient,
           train_with_curve,
           zero_gradient_fraction,
)

__all__ = ["fake_quantize", "ste_gradient", "ste_curve", "ste_figure", "Curve", "train_with_curve", "curves_figure",
           "qat_plan", "ptq_baselines", "code_usage", "ptq_vs_qat", "bits_figure", "lsq_scales", "lsq_scales_figure",
           "zero_gradient_fraction", "ste_reference", "lsq_step_gradient", "check_ste_fake_quantize",
           "check_lsq_step_gradient", "check_code_usage"]
