"""GPTQ (Frantar et al. 2023): columns quantized in turn, each one's error fed back into the columns not yet quantized
through the inverse Hessian of the layer's inputs (`workbench.quantization.gptq`); optional act-order. nn.Linear and
fused experts (per expert, without act-order)."""
from workbench.quantization.methods import Method, PTQMethod, register_method


@register_method
class GPTQ(PTQMethod):
    name = Method.GPTQ
    calibrated = True
    linear_only = True

    def takes_experts(self, config) -> bool:
        return not config.act_order

    def experts(self, name, module, config, fmt, inputs):
        from workbench.quantization import experts
        from workbench.quantization.gptq import gptq_quantize

        return experts.calibrated_experts(
            name, module, fmt, inputs,
            lambda label, w, xs: gptq_quantize(w, xs, fmt, damp=config.damp, name=label), "GPTQ")

    def accumulator(self, name, module, config):
        from workbench.quantization.gptq import HessianAccumulator

        return HessianAccumulator(module.weight[0].numel(), name)

    def calibration_cost(self, module, config, tokens):
        # fp32 Hessian and its inverse factor, fp32 weight copy, codes
        N, K = module.weight.shape[0], module.weight[0].numel()
        return 2 * 4 * K * K + 5 * N * K, 2.0 * tokens * K * K + 2.0 * K ** 3 + 2.0 * N * K * K

    def linear_tensors(self, name, module, config, fmt, inputs):
        from workbench.quantization.gptq import gptq_quantize

        return gptq_quantize(module.weight.detach(), inputs, fmt, damp=config.damp, act_order=config.act_order,
                             static_groups=config.static_groups, name=name), None

    def permuted(self, config) -> bool:
        return config.act_order and not config.static_groups and config.group_size is not None
