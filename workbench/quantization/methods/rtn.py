"""Round to nearest: each weight to its nearest code on the group's grid (data-free; every layer type)."""
from workbench.quantization.methods import Method, PTQMethod, register_method


@register_method
class RTN(PTQMethod):
    name = Method.RTN

    def takes_experts(self, config) -> bool:
        return True
