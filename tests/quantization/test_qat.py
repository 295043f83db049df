"""QAT: straight-through fake quantization, LSQ, convert to real modules, and recovery of PTQ's loss."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.quantization import W8A8Linear, WeightOnlyConv2d, WeightOnlyLinear
from workbench.quantization.qat import QATConv2d, QATLinear, fake_quantize_ste

Q = wb.quant


def test_ste_gradients():
    x = torch.tensor([[-3.0, -0.4, 0.2, 0.9, 5.0]], requires_grad=True)
    scale = torch.tensor([[0.5]], requires_grad=True)
    y = fake_quantize_ste(x, scale, torch.zeros(1, 1), -2, 1)       # grid {-1, -0.5, 0, 0.5}
    assert y.tolist() == [[-1.0, -0.5, 0.0, 0.5, 0.5]]
    y.sum().backward()
    assert x.grad.tolist() == [[0.0, 1.0, 1.0, 0.0, 0.0]]           # identity inside the grid, zero where clamped
    assert scale.grad is not None and scale.grad.item() != 0        # LSQ: the scale learns too


def test_prepare_and_convert_structure(tmp_path):
    model = wb.models.load("digits-cnn")
    plan = wb.Plan({"conv*": Q.WeightOnly(4, None), "fc1": Q.WeightOnly(4, 32), "fc2": Q.Dynamic()})
    qm = wb.qat.prepare(model, plan, learnable_scales=True)
    assert isinstance(qm.conv1, QATConv2d) and isinstance(qm.fc1, QATLinear) and qm.fc2.act_quant
    assert type(model.conv1) is nn.Conv2d                            # the input model is untouched
    assert {n for n, _ in qm.named_parameters() if n.endswith("weight_scale")} == {
        "conv1.weight_scale", "conv2.weight_scale", "conv3.weight_scale", "fc1.weight_scale"}
    real = wb.qat.convert(qm)
    assert isinstance(real.conv1, WeightOnlyConv2d) and isinstance(real.fc1, WeightOnlyLinear)
    assert isinstance(real.fc2, W8A8Linear)
    x = wb.tasks.load("digits").example_inputs(32)[0]
    with torch.no_grad():
        torch.testing.assert_close(real(x), qm.eval()(x), rtol=1e-4, atol=1e-4)  # fake == real numerics
        again = wb.load(wb.save(real, tmp_path / "qat.safetensors"))
        assert torch.equal(again(x), real(x))


def test_bad_qat_configs():
    model = wb.models.load("digits-mlp")
    with pytest.raises(ValueError, match="QAT trains the weights; use method='rtn'"):
        wb.qat.prepare(model, {"fc1": Q.WeightOnly(4, 64, method="gptq")})
    with pytest.raises(TypeError, match="QAT supports WeightOnly and Dynamic configs, got NF4"):
        wb.qat.prepare(model, {"fc1": Q.NF4(64)})
    with pytest.raises(ValueError, match="convert expects a model returned by wb.qat.prepare"):
        wb.qat.convert(model)


@pytest.mark.slow   # QAT training: 8-16 s each
@pytest.mark.parametrize("learnable_scales", [False, True], ids=["ste", "lsq"])
def test_qat_recovers_most_of_what_ptq_loses(learnable_scales):
    """digits-cnn with 2-bit per-channel weights everywhere: RTN loses ~26 points; 3 epochs of QAT win back >= 70 %."""
    model = wb.models.load("digits-cnn")
    task = wb.tasks.load("digits")
    plan = wb.Plan({"conv*": Q.WeightOnly(2, None), "fc*": Q.WeightOnly(2, None)})
    fp32 = task.evaluate(model)["accuracy"]
    ptq = task.evaluate(wb.apply(model, plan))["accuracy"]
    assert fp32 - ptq > 0.1
    qm = wb.qat.prepare(model, plan, learnable_scales=learnable_scales)
    wb.training.fit_classifier(qm, task, epochs=3, lr=1e-3, progress=False)
    qat = task.evaluate(wb.qat.convert(qm))["accuracy"]
    assert (qat - ptq) / (fp32 - ptq) >= 0.7, (fp32, ptq, qat)
