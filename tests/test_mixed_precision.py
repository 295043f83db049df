"""Mixed-precision training: GradScaler semantics, skipped-step counting, the measured comparison."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.precision import AmpStep


def _setup(precision, **kw):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, AmpStep(model, opt, precision, **kw), torch.randn(8, 4)


def test_fp16_overflow_step_is_skipped_and_the_scale_halves():
    model, step, x = _setup("fp16")
    assert step.scale == 2.0 ** 16
    before = model.weight.detach().clone()
    step(lambda: model(x).sum() * torch.tensor(float("inf")))          # forced overflow
    assert step.skipped == 1 and step.scale == 2.0 ** 15
    assert torch.equal(model.weight, before)                            # the step was skipped
    step(lambda: model(x).float().pow(2).mean())
    assert step.skipped == 1 and step.scale == 2.0 ** 15 and not torch.equal(model.weight, before)
    assert model.weight.dtype == torch.float32                          # fp32 master weights


def test_scale_grows_after_growth_interval_good_steps():
    model, step, x = _setup("fp16", growth_interval=3)
    for _ in range(3):
        step(lambda: model(x).float().pow(2).mean())   # the loss in fp32, as cross_entropy is under autocast
    assert step.scale == 2.0 ** 17 and step.skipped == 0 and step.steps == 3


def test_bf16_needs_no_scaling_and_counts_bad_steps():
    model, step, x = _setup("bf16")
    seen = {}

    def loss():
        out = model(x)
        seen["dtype"] = out.dtype
        return out.float().pow(2).mean()

    step(loss)
    assert seen["dtype"] == torch.bfloat16 and step.scale == 1.0
    step(lambda: model(x).sum() * float("nan"))
    assert step.skipped == 1


def test_bad_precision_and_weights():
    with pytest.raises(ValueError, match="precision must be one of"):
        _setup("fp8")
    half = nn.Linear(4, 2).half()
    with pytest.raises(ValueError, match="trainable parameters must be fp32"):
        AmpStep(half, torch.optim.SGD(half.parameters(), lr=0.1), "fp16")


def test_compare_precisions_table():
    from workbench.models.architectures import DigitsMLP

    df = wb.precision.compare_precisions(DigitsMLP(), wb.tasks.load("digits"), epochs=2,
                                         threads=1, progress=False)
    assert list(df["precision"]) == ["fp32", "bf16", "fp16"]
    assert (df["step_ms"] > 0).all() and (df["peak_step_memory_bytes"] > 0).all()
    assert (df["accuracy"] > 0.8).all() and (df["threads"] == 1).all()
    assert (df["accuracy"] - df.loc[0, "accuracy"]).abs().max() < 0.03   # same seed, same budget: alike
    assert df.loc[df["precision"] == "fp16", "final_scale"].item() >= 2.0 ** 15
