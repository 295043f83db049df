"""Measurement: quality, latency, real bytes and peak memory of a model on a task."""
from workbench.measurement import decode, sampling
from workbench.measurement.footprint import bytes_by_dtype, layer_table, peak_memory, size_bytes
from workbench.measurement.latency import num_threads, threads_option, time_forward
from workbench.measurement.metrics import Metrics, compare, measure, quality_change, slowdown_note, slowdown_reasons
from workbench.measurement.speedup import Speedup, speedup

__all__ = ["Metrics", "measure", "compare", "size_bytes", "bytes_by_dtype", "layer_table", "peak_memory",
           "time_forward", "num_threads", "threads_option", "Speedup", "speedup", "slowdown_reasons",
           "slowdown_note", "quality_change", "sampling", "decode"]
