"""Lesson 50 (kernels and the roofline): figures (`figures`) and exercise checks (`checks`), re-exported here.

A kernel's time is bounded below by the larger of the time to move its bytes and the time to do its FLOPs:

    t >= max(bytes / bandwidth, flops / peak)          arithmetic intensity I = flops / bytes

so its achievable throughput is ``min(peak, bandwidth * I)`` (the roofline). A low-bit weight cuts the bytes;
at small batch (decode) a Linear is memory-bound and its speedup ceiling is the byte ratio, e.g.
``16 / (bits + scale bits / group)`` over a bf16 weight; at large batch it is compute-bound and only faster
arithmetic (int8 dot products, fewer FLOPs) helps.
"""
from workbench.teach.kernels.checks import check_bound, check_int4_linear, check_int4_pack, int4_layer, intensity
from workbench.teach.kernels.figures import byte_ratio_ceiling, roofline_chart, speedup_chart

__all__ = ["byte_ratio_ceiling", "intensity", "roofline_chart", "speedup_chart", "int4_layer", "check_int4_pack",
           "check_int4_linear", "check_bound"]
