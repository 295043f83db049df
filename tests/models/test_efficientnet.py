"""EfficientNet-Lite0 (real ImageNet weights) in the zoo and the imagenet-photos task on bundled real photos.

The model: pretrained weights read without unpickling objects, eval mode, 49 same-padding convolutions (an
nn.Conv2d subclass). The task: calibration and evaluation photos disjoint, views deterministic, fp32 top-1 classes
sensible, fp32 against itself exactly agreement 1 and KL 0; `wb.sensitivity` and the UI `Session` take the task.
Compression with ``"*"``: every convolution and the classifier are compressed (counted, none passed over), the
metrics register the change, and W8A8 keeps the fp32 top-1 classes. Measured on the full split with every conv
compressed (each same-padding conv re-expressed as ZeroPad2d + nn.Conv2d, which ``"*"`` already takes): static
W8A8 agreement 1.00, KL 0.014; int8 weight-only per channel 1.00, KL 0.011; int4 weight-only per channel 0.12,
KL 3.7; 50 % magnitude pruning 0.00, KL 6.8 (no BatchNorm folding, no fine-tuning) - the last two are measured
here, not floored.
"""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.models.efficientnet import weights_path
from workbench.tasks import images

pytestmark = pytest.mark.slow   # a 4.65M-parameter CNN on 224x224 photos: seconds per evaluation on 2 cores


@pytest.fixture(scope="module")
def model():
    return wb.models.load("efficientnet-lite0")


@pytest.fixture(scope="module")
def task():
    return wb.tasks.load("imagenet-photos")


def _convs(m: nn.Module) -> list[str]:
    return [n for n, x in m.named_modules() if isinstance(x, nn.Conv2d)]


def test_zoo_model_is_pretrained_and_in_eval_mode(model):
    assert wb.models.spec("efficientnet-lite0").task == "imagenet-photos"
    assert wb.models.source_of(model) == "efficientnet-lite0"
    assert not model.training
    assert sum(p.numel() for p in model.parameters()) == 4_652_008
    convs = [model.get_submodule(n) for n in _convs(model)]
    assert len(convs) == 49 and all(type(c) is not nn.Conv2d for c in convs)   # all a Conv2d subclass
    assert isinstance(model._fc, nn.Linear) and model._fc.weight.shape == (1000, 1280)
    # the weights are the file's, read as plain tensors (weights_only: no arbitrary objects unpickled)
    state = torch.load(weights_path(), map_location="cpu", weights_only=True)
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_photos_are_disjoint_deterministic_and_normalised(task):
    assert not set(images.CALIBRATION_PHOTOS) & set(images.EVALUATION_PHOTOS)
    calib = torch.cat([b[0] for b in task.calibration(40, batch_size=16)])
    evaluation = torch.cat([images.views(p) for p in images.EVALUATION_PHOTOS])
    assert calib.shape == (40, 3, 224, 224) and evaluation.shape == (50, 3, 224, 224)
    calib_rows = {x.numpy().tobytes() for x in calib}
    assert len(calib_rows) == 40 and not calib_rows & {x.numpy().tobytes() for x in evaluation}
    assert torch.equal(calib, torch.cat([b[0] for b in task.calibration(40, batch_size=16)]))
    v = images.views("chelsea")
    assert torch.equal(v[1], v[0].flip(-1))                            # each crop is followed by its mirror
    assert -1.0 <= float(evaluation.min()) and float(evaluation.max()) <= 1.0   # (x - 127) / 128
    with pytest.raises(ValueError, match="asked for 41 samples, but the split has only 40"):
        task.calibration(41)
    assert task.example_inputs(3)[0].shape == (3, 3, 224, 224)


def test_fp32_top1_classes_of_the_photos_are_sensible(model, task):
    top1 = task.predictions(model)
    for photo, cls in top1.items():
        assert cls in images.EXPECTED[photo], f"{photo}: class {cls}, expected one of {images.EXPECTED[photo]}"


def test_fp32_against_itself(model, task):
    m = wb.measure(model, task)
    assert m.quality["agreement"] == 1.0
    assert m.quality["kl"] == pytest.approx(0.0, abs=1e-6)
    assert m.primary == "agreement" and not m.higher_is_better["kl"]


@pytest.mark.parametrize("config, min_agreement, max_kl", [
    pytest.param(wb.quant.Static(), 0.9, 0.1, id="static-w8a8"),
    pytest.param(wb.quant.WeightOnly(bits=4, group_size=None), 0.0, float("inf"), id="int4-weight-only"),
    pytest.param(wb.prune.Magnitude(0.5), 0.0, float("inf"), id="magnitude-50"),
])
def test_compressing_every_layer(model, task, config, min_agreement, max_kl):
    small = wb.apply(model, wb.Plan({"*": config}), calibration=task.calibration(16), progress=False)
    # every convolution (a Conv2d subclass) and the classifier are compressed: none passed over
    untouched = [n for n in [*_convs(model), "_fc"]
                 if type(small.get_submodule(n)) is type(model.get_submodule(n))
                 and all(torch.equal(a, b) for a, b in zip(model.get_submodule(n).state_dict().values(),
                                                          small.get_submodule(n).state_dict().values()))]
    assert not untouched, f"{len(untouched)} of 50 layers not compressed: {untouched[:5]}"
    q = task.evaluate(small, quick=True)
    assert 0.0 <= q["agreement"] <= 1.0 and 0.0 < q["kl"] < float("inf")
    assert q["agreement"] >= min_agreement and q["kl"] <= max_kl, q


def test_sensitivity_and_session_take_the_task(model, task):
    table = wb.sensitivity(model, task, [wb.precision.Cast(torch.bfloat16)], ["_fc"], calibration=None,
                           cache=False, progress=False)
    assert len(table) == 1 and table["layer"].tolist() == ["_fc"]
    assert 0.0 <= float(table["loss"].iloc[0]) < 0.05           # bf16 classifier: agreement barely moves
    session = wb.ui.Session(model, task)
    assert "_fc" in session.layer_names and session.task.primary.name == "agreement"
