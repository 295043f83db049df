"""Model-level stages: a registered config whose `StageHandler` changes the whole model before the per-layer entries,
in order, inside `wb.apply`'s transaction, rebuilt by `wb.load` and round-tripped through the plan's JSON. A stage
defined here, outside the package (an output-preserving rescaling of two Linears around a ReLU), shows that a new
stage is one class and one handler."""
import json
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.plans import FoldBatchNorm, Plan, StageHandler
from workbench.plans.registry import Config, register_config, registered_configs, registered_stages

INT8 = wb.quant.WeightOnly(bits=8, group_size=None)


class _Rescale(StageHandler):
    """fc1's rows and bias times ``factor``, fc2's columns divided by it: ReLU is positively homogeneous, so the
    model computes the same function (a toy of what rotations and smoothing do across layers)."""

    calls: list = []

    def apply(self, model, config, calibration):
        self.calls.append(("apply", len(calibration)))
        if config.fail:
            raise RuntimeError("boom")
        with torch.no_grad():
            model.fc1.weight.mul_(config.factor)
            model.fc1.bias.mul_(config.factor)
            model.fc2.weight.div_(config.factor)

    def skeleton(self, model, config):
        self.calls.append(("skeleton", 0))   # values only: the structure is unchanged


@register_config(_Rescale(), kind="tests.Rescale")
@dataclass(frozen=True)
class Rescale(Config):
    factor: float = 4.0
    fail: bool = False


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_stages_run_first_in_order_round_trip_and_reload(tmp_path):
    model = MLP().eval()
    x = torch.randn(5, 16)
    plan = Plan({"fc*": INT8}, stages=[Rescale(4.0), Rescale(0.5)])
    assert Plan.from_json(plan.to_json()) == plan and plan.stages == (Rescale(4.0), Rescale(0.5))
    assert json.loads(plan.to_json())["stages"] == [{"kind": "tests.Rescale", "factor": 4.0, "fail": False},
                                                    {"kind": "tests.Rescale", "factor": 0.5, "fail": False}]
    _Rescale.calls.clear()
    small = wb.apply(model, plan, progress=False)
    assert _Rescale.calls == [("apply", 0), ("apply", 0)]
    # the layers were quantized after the stages: fc1's stored weight is the rescaled one (x 2), not the original
    torch.testing.assert_close(small.fc1.effective_weight(), model.fc1.weight * 2, rtol=0.02, atol=0.02)
    assert torch.equal(model.fc1.weight, MLP().fc1.weight)   # the user's model is untouched
    with torch.inference_mode():
        y = small(x)
        torch.testing.assert_close(y, model(x), rtol=0.05, atol=0.05)
    wb.save(small, tmp_path / "s.safetensors")
    _Rescale.calls.clear()
    again = wb.load(tmp_path / "s.safetensors", base=model)
    assert _Rescale.calls == [("skeleton", 0), ("skeleton", 0)]
    with torch.inference_mode():
        assert torch.equal(again(x), y)
    assert wb.applied_plans(again)[0] == plan


def test_a_failing_stage_or_a_failing_layer_leaves_the_model_as_it_was():
    model = MLP().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"stage Rescale\(factor=4.0, fail=True\) failed: RuntimeError: boom"):
        wb.apply(model, Plan({"fc*": INT8}, stages=[Rescale(fail=True)]), progress=False)
    bad = wb.quant.WeightOnly(bits=4, group_size=7, kernel="triton")   # refused when the layer is built
    with pytest.raises((wb.ApplyError, ValueError)):
        wb.apply(model, Plan({"fc1": INT8, "fc2": bad}, stages=[Rescale()]), progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="changes the model before its layers are compressed.*inplace=False"):
        wb.apply(model, Plan({"fc*": INT8}, stages=[Rescale()]), inplace=True)


def test_stages_and_layer_techniques_are_not_confused():
    with pytest.raises(TypeError, match="Rescale is a model-level stage.*stages=\\[Rescale"):
        Plan({"fc1": Rescale()})
    with pytest.raises(TypeError, match="WeightOnly is a per-layer technique, not a model-level stage"):
        Plan({}, stages=[INT8])
    with pytest.raises(TypeError, match="a list of stage configs"):
        Plan({}, stages=Rescale())
    assert Rescale in registered_stages() and FoldBatchNorm in registered_stages()
    assert Rescale not in registered_configs()   # (the UI's technique list is per-layer techniques)


def test_the_old_fold_batchnorm_spelling_is_the_fold_stage():
    old = {"format": "workbench.plan", "version": 1, "fold_batchnorm": True,
           "entries": [{"pattern": "*", "config": None}]}
    plan = Plan.from_dict(old)
    assert plan.stages == (FoldBatchNorm(),) and plan.fold_batchnorm
    assert plan == Plan({"*": None}, fold_batchnorm=True) == Plan({"*": None}, stages=[FoldBatchNorm()])
    both = Plan({"*": None}, fold_batchnorm=True, stages=[Rescale()])
    assert both.stages == (FoldBatchNorm(), Rescale())
    with pytest.raises(ValueError, match="plan stage 0: unknown config kind 'nope'"):
        Plan.from_dict({**old, "stages": [{"kind": "nope"}]})


def test_the_session_and_qat_refuse_plans_with_stages(digits_mlp, digits_task):
    from workbench.ui.session import Session

    plan = Plan({"fc1": INT8}, stages=[FoldBatchNorm()])
    with pytest.raises(ValueError, match="model-level stages.*use wb.apply"):
        Session(digits_mlp, digits_task).load_plan(plan)
    with pytest.raises(ValueError, match="qat.prepare takes per-layer entries"):
        wb.qat.prepare(digits_mlp, plan)
