"""Lesson 11, quantization basics: granularity (per-tensor / per-channel / per-group), symmetric vs asymmetric,
observers and clipping, and how much calibration data a range needs - measured on real weights and activations.

Affine quantization with ``b`` bits, scale ``s`` and zero point ``z`` (`workbench.quantization.primitives`)::

    q = clamp(round(x / s) + z, qmin, qmax)        x_hat = (q - z) * s

Every number here comes from the package's primitives (`fake_quantize`, `choose_qparams`, `quantize`,
`dequantize`), its storage formats (`formats.encode`: the bytes really stored) and its observers
(`observers.MinMax`, `Percentile`, `MSE`, `Histogram`). This package adds the lesson's tables and figures
(`figures`) and the exercise checks (`checks`: ``check_*``, which compute their expected values themselves), all
re-exported here.
"""
from workbench.teach.basics.checks import (
           check_asymmetric_quantizer,
           check_best_clipping,
           check_codes_used,
           check_group_quantizer,
)
from workbench.teach.basics.figures import (
           OBSERVER_KEYS,
           OBSERVER_LABELS,
           bytes_per_weight,
           calibration_figure,
           calibration_table,
           clip_mse,
           clipping_curve,
           clipping_figure,
           fit_observer,
           granularity_figure,
           granularity_table,
           layer_inputs,
           mse,
           observer_table,
           symmetry_figure,
           symmetry_table,
)

__all__ = ["layer_inputs", "mse", "bytes_per_weight", "granularity_table", "granularity_figure", "symmetry_table",
           "symmetry_figure", "clip_mse", "clipping_curve", "fit_observer", "observer_table", "clipping_figure",
           "calibration_table", "calibration_figure", "OBSERVER_LABELS", "OBSERVER_KEYS", "check_group_quantizer",
           "check_asymmetric_quantizer", "check_best_clipping", "check_codes_used"]
