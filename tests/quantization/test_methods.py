"""The PTQ methods of `WeightOnly` are registered classes, one per file (`workbench.quantization.methods`): every
`Method` has one, the handler asks it (calibration, the layers it takes, its statistics and cost), and the registry
refuses what would make two methods answer for one name."""
import pytest
from torch import nn

import workbench as wb
from workbench.quantization.methods import Method, PTQMethod, method_for, register_method, registered_methods
from workbench.quantization.methods.gptq import GPTQ


def test_every_method_has_its_class_and_the_handler_asks_it():
    assert set(registered_methods()) == set(Method)
    for m in Method:
        cls = type(method_for(wb.quant.WeightOnly(bits=4, group_size=32, method=m.value,
                                                  symmetric=m is not Method.HQQ)))
        assert cls.name is m and cls.__module__ == f"workbench.quantization.methods.{m.value}"
    from workbench.plans.registry import handler_for

    layer = nn.Linear(64, 32)
    for method, calibrated, statistics in (("rtn", False, None), ("gptq", True, "HessianAccumulator"),
                                           ("awq", True, None), ("hqq", False, None)):
        config = wb.quant.WeightOnly(bits=4, group_size=32, method=method, symmetric=method != "hqq")
        handler = handler_for(config)
        assert handler.needs_calibration(config) is calibrated
        found = handler.accumulator("fc", layer, config)
        assert (type(found).__name__ if found is not None else None) == statistics
        assert handler.supports(nn.Embedding(10, 64), config) is (method == "rtn")   # the others: nn.Linear only
    with pytest.raises(ValueError, match="symmetric=False"):
        wb.quant.WeightOnly(method="hqq")


def test_the_registry_refuses_a_second_class_for_a_name_and_a_name_that_is_not_a_method():
    with pytest.raises(ValueError, match="already registered by GPTQ"):
        @register_method
        class Other(PTQMethod):
            name = Method.GPTQ
    with pytest.raises(TypeError, match="must be a Method"):
        @register_method
        class Nameless(PTQMethod):
            name = "mine"
    assert type(method_for(wb.quant.WeightOnly(method="gptq"))) is GPTQ
    assert method_for(wb.quant.WeightOnly()).linear_tensors("fc", nn.Linear(32, 8), None, None, None) == (None, None)
