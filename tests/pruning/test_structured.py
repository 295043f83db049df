"""Structured pruning: channels really removed, dependents fixed, clear errors, recovery by fine-tuning."""
import pytest
import torch
from torch import nn

import workbench as wb


@pytest.fixture(scope="module")
def digits():
    return wb.tasks.load("digits")


def test_zero_amount_is_identity(digits):
    model = wb.models.load("digits-cnn")
    x = digits.example_inputs(4)
    same = wb.prune.channels(model, {"conv*": 0.0, "fc1": 0.0}, example_inputs=x)
    with torch.no_grad():
        assert torch.equal(same(*x), model(*x))


def test_channels_removed_and_dependents_fixed(digits):
    model = wb.models.load("digits-cnn")
    x = digits.example_inputs(4)
    small = wb.prune.channels(model, {"conv3": 0.5, "conv1": 0.25, "fc1": 0.5}, example_inputs=x)
    assert small.conv1.out_channels == 24 and small.bn1.num_features == 24 and small.conv2.in_channels == 24
    assert small.conv3.out_channels == 32 and small.bn3.running_mean.shape == (32,)
    assert small.fc1.in_features == 32 * 2 * 2 and small.fc1.out_features == 64 and small.fc2.in_features == 64
    assert model.conv3.out_channels == 64  # the input model is untouched
    assert small(*x).shape == (4, 10)
    # the kept channels compute exactly what they computed before
    keep = torch.sort(torch.topk(model.conv1.weight.detach().abs().reshape(32, -1).sum(1), 24).indices).values
    with torch.no_grad():
        a = model.bn1(model.conv1(x[0].view(-1, 1, 8, 8)))[:, keep]
        b = small.bn1(small.conv1(x[0].view(-1, 1, 8, 8)))
    torch.testing.assert_close(a, b)


@pytest.mark.slow   # fine-tunes each pruned model: ~25 s each
@pytest.mark.parametrize("criterion", ["l1", "l2", "taylor"])
def test_fine_tune_recovers(digits, criterion):
    model = wb.models.load("digits-cnn")
    labels = digits.calibration_labels(256)
    calib = digits.calibration(256, batch_size=128)
    small = wb.prune.channels(model, {"conv*": 0.25, "fc1": 0.25}, criterion=criterion,
                              example_inputs=digits.example_inputs(2), calibration=calib,
                              labels=[labels[:128], labels[128:]])
    assert wb.size_bytes(small) < 0.6 * wb.size_bytes(model)
    wb.training.fit_classifier(small, digits, epochs=3, lr=1e-3, progress=False)
    assert digits.evaluate(small)["accuracy"] >= digits.evaluate(model)["accuracy"] - 0.01


def test_structured_errors(digits):
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.b(x + self.a(x))

    with pytest.raises(ValueError, match=r"cannot resolve the layers that depend on 'a'.*add"):
        wb.prune.channels(Residual(), {"a": 0.5})
    mlp = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="would remove all of its 4 channels"):
        wb.prune.channels(mlp, {"0": 0.9})
    with pytest.raises(ValueError, match=r"cannot resolve the layers that depend on '2'.*output"):
        wb.prune.channels(mlp, {"2": 0.5})
    with pytest.raises(ValueError, match="matches no nn.Linear / nn.Conv2d / Conv1D layer"):
        wb.prune.channels(mlp, {"fc": 0.5})
    with pytest.raises(ValueError, match=r"amount for '0' must be in \[0, 1\)"):
        wb.prune.channels(mlp, {"0": 1.0})
    with pytest.raises(ValueError, match="criterion must be"):
        wb.prune.channels(mlp, {"0": 0.5}, criterion="l3")
    with pytest.raises(ValueError, match="pass example_inputs"):
        wb.prune.channels(wb.models.load("digits-cnn"), {"conv3": 0.5})


def test_structured_benchmark_smoke():
    from workbench.benchmarks.pruning import bench_structured

    df = bench_structured(batch=4, threads=1, mlp=(32, 64), cnn_size=16)
    assert len(df) == 3 and (df["pruned_ms"] > 0).all()
    assert df.loc[0, "params_ratio"] < 0.6 and df.loc[1, "params_ratio"] == 1.0


def test_tiny_lm_ffn_neurons_with_explicit_consumers():
    model = wb.models.load("tiny-lm")
    task = wb.tasks.load("tiny-lm")
    consumers = wb.prune.transformer_ffn_consumers(model)
    assert consumers["h.0.mlp.c_fc"] == ["h.0.mlp.c_proj"] and len(consumers) == 4
    small = wb.prune.channels(model, {"h.*.mlp.c_fc": 0.5}, criterion="taylor", calibration=task.calibration(8),
                              consumers=consumers)
    assert small.h[0].mlp.c_fc.out_features == 384 and small.h[0].mlp.c_proj.in_features == 384
    base = task.evaluate(model, quick=True)["perplexity"]
    assert base < task.evaluate(small, quick=True)["perplexity"] < 3 * base
    with pytest.raises(ValueError, match="consumers= does not say which layers read the channels of 'h.0.attn.c_attn'"):
        wb.prune.channels(model, {"h.0.attn.c_attn": 0.5}, consumers=consumers)


@pytest.mark.slow
def test_minilm_heads_and_ffn_neurons(minilm, minilm_task, tmp_path):
    # one batch of 8 documents: head_importance runs the whole model once per (head, batch) - 72 heads here
    calib = minilm_task.calibration(8, batch_size=8)
    importance = wb.prune.head_importance(minilm, calib)
    assert len(importance) == 6 and all(v.shape == (12,) and (v >= 0).all() for v in importance.values())
    fewer = wb.prune.attention_heads(minilm, 2, calib, importance=importance)
    sa = fewer.encoder.layer[0].attention.self
    assert sa.query.out_features == sa.key.out_features == sa.value.out_features == 10 * 32
    assert fewer.encoder.layer[0].attention.output.dense.in_features == 320
    assert minilm.encoder.layer[0].attention.self.query.out_features == 384   # untouched
    fid_heads = minilm_task.fidelity(fewer, quick=True)
    again = wb.load(wb.save(fewer, tmp_path / "heads.safetensors"))
    x = minilm_task.example_inputs(2)
    with torch.no_grad():
        assert torch.equal(again(*x), fewer(*x))
    # the least important heads cost far less than the same number of the most important ones
    worst = wb.prune.attention_heads(minilm, 2, calib, importance={k: -v for k, v in importance.items()})
    assert fid_heads > minilm_task.fidelity(worst, quick=True) + 0.02
    assert fid_heads > 0.9
    consumers = wb.prune.transformer_ffn_consumers(minilm)
    fid = {c: minilm_task.fidelity(wb.prune.channels(minilm, {"encoder.layer.*.intermediate.dense": 0.5},
                                                     criterion=c, calibration=calib, consumers=consumers), quick=True)
           for c in ("l2", "taylor")}
    assert fid["taylor"] > fid["l2"] and fid["taylor"] > 0.6, fid
    with pytest.raises(ValueError, match="would remove every head"):
        wb.prune.attention_heads(minilm, 12, calib, importance=importance)


def test_structurally_pruned_models_save_and_load(tmp_path, digits):
    model = wb.models.load("digits-cnn")
    x = digits.example_inputs(4)
    small = wb.prune.channels(model, {"conv2": 0.5, "fc1": 0.25}, example_inputs=x)
    kept = wb.applied_plans(small)[-1]
    assert kept["conv2"] == wb.prune.Kept(out_channels=32) and kept["bn2"] == wb.prune.Kept(out_channels=32)
    assert kept["conv3"] == wb.prune.Kept(in_channels=32) and kept["fc2"] == wb.prune.Kept(in_channels=96)
    quantized = wb.apply(small, {"fc*": wb.quant.WeightOnly(8, None)})       # compose with later plans
    for m in (small, quantized):
        again = wb.load(wb.save(m, tmp_path / "s.safetensors"))
        with torch.no_grad():
            assert torch.equal(again(*x), m(*x))
    with pytest.raises(wb.ApplyError, match="Kept records what wb.prune.channels"):
        wb.apply(model, kept)


class _ResNetish(nn.Module):
    """stem -> two residual blocks (conv-bn-relu-conv-bn + identity) -> pooled linear head."""

    def __init__(self, c=16):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.stem_bn = nn.BatchNorm2d(c)
        self.b1c1, self.b1n1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.b1c2, self.b1n2 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.b2c1, self.b2n1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.b2c2, self.b2n2 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.head = nn.Linear(c * 4 * 4, 10)

    def forward(self, x):
        x = torch.relu(self.stem_bn(self.stem(x)))
        x = torch.relu(x + self.b1n2(self.b1c2(torch.relu(self.b1n1(self.b1c1(x))))))
        x = torch.relu(x + self.b2n2(self.b2c2(torch.relu(self.b2n1(self.b2c1(x))))))
        return self.head(torch.nn.functional.max_pool2d(x, 2).flatten(1))


def test_residual_groups_are_pruned_together():
    torch.manual_seed(0)
    model = _ResNetish().eval()
    dead = torch.arange(8)  # make 8 channels of the residual stream exactly zero everywhere
    with torch.no_grad():
        for conv, bn in (("stem", "stem_bn"), ("b1c2", "b1n2"), ("b2c2", "b2n2")):
            getattr(model, conv).weight[dead] = 0
            getattr(model, conv).bias[dead] = 0
            getattr(model, bn).running_mean[dead] = 0
            getattr(model, bn).bias[dead] = 0
    x = (torch.randn(2, 3, 8, 8),)
    small = wb.prune.channels(model, {"stem": 0.5}, example_inputs=x)
    for name in ("stem", "b1c2", "b2c2"):
        assert getattr(small, name).out_channels == 8
    for name in ("stem_bn", "b1n2", "b2n2"):
        assert getattr(small, name).num_features == 8
    assert small.b1c1.in_channels == small.b2c1.in_channels == 8 and small.b1c1.out_channels == 16
    assert small.head.in_features == 8 * 4 * 4
    with torch.no_grad():
        torch.testing.assert_close(small(*x), model(*x))   # only the all-zero channels went
    with pytest.raises(ValueError, match="must be pruned alike"):
        wb.prune.channels(model, {"stem": 0.5, "b1c2": 0.25}, example_inputs=x)
    inner = wb.prune.channels(model, {"b1c1": 0.5}, example_inputs=x)     # inside a block: no coupling
    assert inner.b1c1.out_channels == 8 and inner.b1n1.num_features == 8 and inner.b1c2.in_channels == 8
    assert inner.stem.out_channels == 16
