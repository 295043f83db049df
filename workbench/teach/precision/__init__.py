"""Lesson 40, mixed precision: autocast, loss scaling, and what fp16 / bf16 cost and buy on a real model.

Three 16- and 32-bit float formats (sign, exponent bits e, mantissa bits m)::

    fp32  e=8 m=23   largest 3.4e38   smallest normal 2^-126  smallest subnormal 2^-149
    bf16  e=8 m=7    largest 3.4e38   smallest normal 2^-126  smallest subnormal 2^-133
    fp16  e=5 m=10   largest 65504    smallest normal 2^-14   smallest subnormal 2^-24 (5.96e-8)

bf16 keeps fp32's range with fewer mantissa bits; fp16 keeps more mantissa bits but a narrow range, so small
gradients **underflow** to zero. Loss scaling multiplies the loss by S before the backward pass (every gradient
is then S times larger, lifted out of the underflow zone), divides the gradients by S in fp32 before the
optimizer step, and - dynamically, as `torch.amp.GradScaler` does - halves S and skips the step when a
gradient overflows to inf, doubles it after a run of good steps.

In `figures`: the format table, an `Autocast` inference wrapper, which dtype each layer computes in under
autocast, real gradient magnitudes and how much of them fp16 loses at a given scale, a GradScaler trace and the
lesson's figures. In `checks`: the exercise checks (``check_*``), which compute their expected values themselves.
Both are re-exported here.
"""
from workbench.teach.precision.checks import (
           HALFWAY,
           bf16_bits_variants,
           check_bf16_round,
           check_grad_scaler,
           check_underflow_fractions,
           grad_scaler_trace,
           gradient_peaks,
)
from workbench.teach.precision.figures import (
           DTYPES,
           Autocast,
           autocast_gradients,
           autocast_table,
           autocast_underflow,
           format_table,
           gradient_histogram,
           gradient_magnitudes,
           overflow_fraction,
           scale_table,
           scale_trace,
           scale_trace_figure,
           smallest_subnormal,
           underflow_fraction,
)

__all__ = ["DTYPES", "smallest_subnormal", "format_table", "Autocast", "autocast_table", "gradient_magnitudes",
           "autocast_gradients", "autocast_underflow", "underflow_fraction", "overflow_fraction", "scale_table",
           "scale_trace", "gradient_histogram", "scale_trace_figure", "HALFWAY", "bf16_bits_variants", "gradient_peaks",
           "grad_scaler_trace", "check_bf16_round", "check_underflow_fractions", "check_grad_scaler"]
