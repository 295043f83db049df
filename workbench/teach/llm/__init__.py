"""Lab 60 (LLM decode on tiny-llama): bytes per token, activation outliers, W4A16 / NF4, KV-cache quantization.

The notebook ``notebooks/60_llm_decode.ipynb`` measures why batch-1 decoding is bound by the bytes it moves, and
what each low-bit format buys. What it needs beyond the package's public API lives here (`figures`, and the
exercises in `checks`; both re-exported here):

- `linear_shapes`, `weight_bytes`, `decode_bytes_table`: the bytes one decoded token reads (every Linear's
  weight, in a format; the tied embedding is read as the output head) and the KV cache at a context;
- `measure_decode`: `workbench.measurement.decode.tokens_per_second` for each variant of the model, with the
  roofline bound ``bandwidth / bytes`` beside it; `matvec_sweep`: one matrix-vector product at growing sizes,
  the effective GB/s that says when a weight read is memory-bound;
- `activation_errors`: per-tensor / per-token / per-channel int8 activations and the LLM.int8 split;
- `attention_inputs`, `kv_errors`, `kv_share_table`: real queries, keys and values of one layer, the attention
  output error of each `workbench.quantization.kvcache.KVCacheFormat`, and the cache's share of decode bytes;
- plotly figures; in `checks`, the exercise checks with their worked solutions (``_solution_*``), each expected
  value computed through the package's own implementation.
"""
from workbench.teach.llm.checks import (
           check_group_scales,
           check_int4_pack,
           check_kv_bytes,
           check_kv_quantizer,
           check_nf4,
           check_per_channel,
           check_per_token,
           check_roofline_bound,
           check_weight_bytes,
)
from workbench.teach.llm.figures import (
           activation_errors,
           attention_inputs,
           bytes_per_token,
           decode_bytes_table,
           decode_figure,
           kv_error_figure,
           kv_errors,
           kv_share_figure,
           kv_share_table,
           linear_shapes,
           matvec_figure,
           matvec_sweep,
           measure_decode,
           nf4_figure,
           outlier_figure,
           perplexity_with_kv,
           quick_task,
           weight_bytes,
)

__all__ = ["linear_shapes", "weight_bytes", "bytes_per_token", "decode_bytes_table", "nf4_figure", "kv_error_figure",
           "measure_decode", "decode_figure", "matvec_sweep", "matvec_figure", "outlier_figure", "activation_errors",
           "attention_inputs", "kv_errors", "kv_share_table", "kv_share_figure", "perplexity_with_kv", "quick_task",
           "check_weight_bytes", "check_roofline_bound", "check_per_token", "check_per_channel", "check_group_scales",
           "check_int4_pack", "check_nf4", "check_kv_quantizer", "check_kv_bytes"]
