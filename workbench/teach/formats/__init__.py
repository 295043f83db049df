"""Lesson 10, number formats: what int4 / int8 / fp8 (e4m3, e5m2) / fp16 / bf16 can represent, and what that
costs real tensors.

A float format with ``e`` exponent bits and ``m`` mantissa bits stores a sign ``s``, a biased exponent ``E``
and a mantissa ``M``; with ``bias = 2^(e-1) - 1``::

    normal    (E > 0):  (-1)^s * 2^(E - bias) * (1 + M / 2^m)
    subnormal (E = 0):  (-1)^s * 2^(1 - bias) * (M / 2^m)

so its **range** comes from ``e`` and its **precision** (the relative step, about ``2^-m``) from ``m``.
An integer format is a uniform grid that needs a scale: ``x ~ q * scale``.

Here: the format table (`FORMATS`, `format_table`), every representable value (`grid`), the bit fields of a
number (`bit_layout`), round trips through a format (`cast`: no scale; `quantize_dequantize`: a per-tensor
scale, through `workbench.quantization.primitives`), error tables, the lesson's figures and a helper that records a
layer's inputs (`layer_inputs`) are in `figures`; the exercise checks (``check_*``), which compute their expected
values, are in `checks`. Both are re-exported here.
"""
from workbench.teach.formats.checks import (
           check_e4m3_decode,
           check_fp16_exp_limit,
           check_int8_round_trip,
           check_loses_small_values,
           differs_only_at_ties,
)
from workbench.teach.formats.figures import (
           FORMATS,
           Format,
           bit_layout,
           cast,
           error_bars_figure,
           error_table,
           flushed_fraction,
           format_of,
           format_table,
           grid,
           grid_figure,
           layer_inputs,
           magnitude_error_figure,
           quantize_dequantize,
           spacing_figure,
)

__all__ = ["Format", "FORMATS", "format_of", "format_table", "grid", "bit_layout", "cast", "quantize_dequantize",
           "error_table", "flushed_fraction", "layer_inputs", "spacing_figure", "grid_figure", "magnitude_error_figure",
           "error_bars_figure", "differs_only_at_ties", "check_int8_round_trip", "check_e4m3_decode",
           "check_loses_small_values", "check_fp16_exp_limit"]
