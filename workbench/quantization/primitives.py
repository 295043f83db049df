"""The quantization numerics (pure functions), under the workbench's name for them: they are defined once, in the
kernels' distribution (`workbench_kernels.numerics`, beside the kernels whose references compute them), and every
quantized module and algorithm here calls them through this module. See `workbench_kernels.numerics` for the math."""
from workbench_kernels.numerics import *  # noqa: F403
from workbench_kernels.numerics import __all__  # noqa: F401
