"""HQQ (Badri & Shaji 2023): real-valued zero points optimised half-quadratically against the weight alone
(`workbench.quantization.hqq`; data-free; nn.Linear; ``symmetric=False``)."""
from workbench.quantization.methods import Method, PTQMethod, register_method


@register_method
class HQQ(PTQMethod):
    name = Method.HQQ
    linear_only = True
    float_zero = True

    def check(self, config) -> None:
        if config.symmetric:
            raise ValueError("method='hqq' optimises zero points: pass symmetric=False")

    def linear_tensors(self, name, module, config, fmt, inputs):
        from workbench.quantization.hqq import hqq_quantize

        return hqq_quantize(module.weight.detach(), fmt), None
