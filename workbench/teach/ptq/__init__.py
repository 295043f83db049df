"""Lesson 12 (post-training quantization algorithms): step-throughs, figures and exercise checks.

The notebook ``notebooks/12_ptq_algorithms.ipynb`` compares RTN, GPTQ, AWQ and SmoothQuant on real models.
It cannot define functions, so what it needs beyond the package's public API lives here (`figures`, and the
exercises in `checks`; both re-exported here):

- `layer_inputs`: the inputs a layer sees on calibration data, as one ``(tokens, K)`` matrix;
- `gptq_trace`: `workbench.quantization.gptq.gptq_quantize` itself, watched column by column through its
  ``observer`` hook, recording the layer-output error after every few columns and the weights as the error
  feedback moves them;
- `awq_grid`: the loss of AWQ's scale search at every alpha of its grid (as `awq.awq_search` computes it);
- `smoothing_view`: per-channel ranges of activations and weights before and after SmoothQuant;
- figures (plotly ``go.Figure``) for each; in `checks`, the block the GPTQ exercise works on (`gptq_block`) and
  checks for the exercises, which compute the expected value themselves so the notebook never shows the answer.

Every layer-output error here is relative: ``||X (W - W_hat)^T||^2 / ||X W^T||^2`` over calibration tokens X.
"""
from workbench.teach.ptq.checks import (
           GPTQBlock,
           check_awq_alpha,
           check_best_method,
           check_gptq_block,
           check_smoothing,
           gptq_block,
           gptq_block_reference,
)
from workbench.teach.ptq.figures import (
           GPTQTrace,
           awq_grid,
           awq_loss_figure,
           awq_scales_figure,
           gptq_error_figure,
           gptq_trace,
           gptq_update_figure,
           layer_errors,
           layer_errors_figure,
           layer_inputs,
           measure_plans,
           method_table,
           ptq_plans,
           relative_output_error,
           results_figure,
           smoothing_figure,
           smoothing_view,
)

__all__ = ["layer_inputs", "relative_output_error", "GPTQTrace", "gptq_trace", "gptq_error_figure",
           "gptq_update_figure", "awq_grid", "awq_scales_figure", "awq_loss_figure", "smoothing_view",
           "smoothing_figure", "layer_errors", "layer_errors_figure", "ptq_plans", "measure_plans", "GPTQBlock",
           "gptq_block", "gptq_block_reference", "results_figure", "method_table", "check_gptq_block",
           "check_awq_alpha", "check_smoothing", "check_best_method"]
