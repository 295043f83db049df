"""Bit-packing of low-bit codes into uint8, under the workbench's name for it: defined once, in the kernels'
distribution (`workbench_kernels.packing`: the layout the kernels read)."""
from workbench_kernels.packing import *  # noqa: F403
from workbench_kernels.packing import __all__  # noqa: F401
