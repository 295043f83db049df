"""Quantization: numerics (`primitives`), bit-packing (`packing`) and calibration observers (`observers`).

The quantized modules, PTQ algorithms (RTN, GPTQ, AWQ, SmoothQuant, HQQ) and QAT are built on these;
see the quantization issue for what has landed.
"""
from workbench.quantization import observers, packing, primitives

__all__ = ["primitives", "packing", "observers"]
