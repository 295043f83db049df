"""Lab 14, integer-only inference (Jacob et al. 2018): the digits CNN of the zoo run with int8 codes, int32
accumulators and fixed-point multipliers only, compared with the float fake-quant model it implements.

The integer arithmetic is the package's (`workbench.quantization.integer`: `quantize_multiplier`,
`rounding_right_shift`, `quantize_bias`, `zero_point_offset`, `IntegerLinear`, `integer_conv2d`); BatchNorm
folding is `workbench.models.fuse`. `figures` wires them into the digits CNN (`convert`, `integer_forward`),
builds the float fake-quant reference of the same model (`fake_quant_forward`), the lab's tables and figures;
`checks` holds the exercise checks (``check_*``) with their worked solutions (``_solution_*``). Both are
re-exported here.

Quantization points (static, min-max calibrated, asymmetric int8): the input pixels, the output of each
conv + ReLU (before max-pooling: max-pooling commutes with a monotone quantizer, so it runs on the codes), the
output of fc1 + ReLU and the logits. Weights: symmetric int8 per output channel.
"""
from workbench.teach.integer.checks import (
           LinearExercise,
           check_accumulator,
           check_fold_bn,
           check_int32_bias,
           check_integer_linear,
           check_multiplier,
           check_offset,
           check_quantize_multiplier,
           check_requantize_relu,
           check_rounding_shift,
           linear_exercise,
)
from workbench.teach.integer.figures import (
           LAYERS,
           IntegerCNN,
           accumulator,
           accuracy_figure,
           accuracy_table,
           asymmetric_weights,
           convert,
           fake_quant_forward,
           float_stages,
           fold,
           folding_figure,
           folding_table,
           integer_forward,
           integer_layer,
           layer_input,
           layer_lsb_table,
           logits,
           lsb_figure,
           multiplier_figure,
           multiplier_table,
)

__all__ = ["LAYERS", "IntegerCNN", "fold", "float_stages", "convert", "integer_forward", "fake_quant_forward",
           "layer_lsb_table", "accuracy_table", "multiplier_table", "folding_table", "lsb_figure", "accuracy_figure",
           "multiplier_figure", "folding_figure", "layer_input", "accumulator", "asymmetric_weights", "linear_exercise",
           "LinearExercise", "logits", "integer_layer", "check_accumulator", "check_offset", "check_int32_bias",
           "check_multiplier", "check_quantize_multiplier", "check_rounding_shift", "check_requantize_relu",
           "check_fold_bn", "check_integer_linear"]
