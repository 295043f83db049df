"""Triton GPU kernels for low-bit inference, each paired with a pure-PyTorch reference of the same math.

Nothing lives here yet: the kernels issue adds one file per kernel (int8 / int4 weight-only GEMMs, W8A8,
fused fake-quantization, fp8). Importing this package must stay free of side effects (no CUDA init).
"""
