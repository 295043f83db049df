"""Quantization: numerics (`primitives`), bit-packing (`packing`), calibration observers (`observers`),
weight storage formats (`formats`), integer-only arithmetic (`integer`), modules that store low-bit data
(`modules`; fused mixture-of-experts projections: `experts`), GPTQ (`gptq`) and the plan configs (`configs`),
available as ``wb.quant``:

    wb.Plan({"encoder.*": wb.quant.WeightOnly(bits=4, group_size=64, method="gptq"),
             "embeddings.word_embeddings": wb.quant.WeightOnly(bits=4, group_size=64)})
"""
from workbench.quantization import formats, integer, observers, packing, primitives
from workbench.quantization.configs import FP8, MXFP4, MXFP8, NF4, NVFP4, Dynamic, Method, Static, WeightOnly
from workbench.quantization.experts import WeightOnlyExperts
from workbench.quantization.modules import (
           W8A8Conv2d,
           W8A8Linear,
           WeightOnlyConv2d,
           WeightOnlyEmbedding,
           WeightOnlyLinear,
)
from workbench.quantization.rotation import Rotate

__all__ = ["primitives", "integer", "packing", "observers", "formats", "WeightOnly", "NF4", "FP8", "MXFP4", "MXFP8",
           "NVFP4", "Dynamic", "Static", "Rotate",
           "Method", "WeightOnlyLinear", "WeightOnlyExperts", "WeightOnlyEmbedding", "WeightOnlyConv2d", "W8A8Linear",
           "W8A8Conv2d"]
