"""AWQ (Lin et al. 2024): a per-input-channel scale searched on the layer's inputs (salient channels kept with more
precision), then a per-group clipping search (`workbench.quantization.awq`). nn.Linear and fused experts."""
from workbench.quantization.methods import Method, PTQMethod, register_method


@register_method
class AWQ(PTQMethod):
    name = Method.AWQ
    calibrated = True
    linear_only = True

    def takes_experts(self, config) -> bool:
        return True

    def experts(self, name, module, config, fmt, inputs):
        from workbench.quantization import experts
        from workbench.quantization.awq import awq_search

        def awq(label, w, xs):
            tensors, factors, _ = awq_search(w, xs, fmt, name=label)
            return {**tensors, experts.SMOOTH: factors.float()}
        return experts.calibrated_experts(name, module, fmt, inputs, awq, "AWQ", smooth=True)

    def calibration_cost(self, module, config, tokens):
        # inputs (tokens, K), reference and candidate outputs (tokens, N), 21 + 20 search steps
        N, K = module.weight.shape[0], module.weight[0].numel()
        return 4 * (2 * tokens * K + 2 * tokens * N + 3 * N * K), 2.0 * tokens * K * N * (1 + 21 + 20)

    def linear_tensors(self, name, module, config, fmt, inputs):
        from workbench.quantization.awq import awq_search

        tensors, smooth, _ = awq_search(module.weight.detach(), inputs, fmt, name=name)
        return tensors, smooth

    def smooth(self, config) -> bool:
        return True
