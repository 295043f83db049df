"""Channel pruning of Hugging Face ResNet's residual streams (`workbench.pruning.streams`) on tiny random models with
trained-looking BatchNorms: every writer of a stream (the blocks' last convolutions, the shortcut projection, the
embedder) cut alike, every reader (the next blocks' first convolutions and projections, the classifier) fixed;
bottleneck and basic blocks; save -> load identical; partial selections refused naming the missing layers.

The reference: make the removed stream channels dead in a copy of the original - zero weight and bias in every
writer's BatchNorm. A writer's channel is then 0, the block's output ``relu(0 + shortcut)`` is ``relu(0) = 0`` where
the shortcut is a (dead) projection, and an identity shortcut carries the 0 on, so the whole stream channel is 0
and its readers get nothing from it: the pruned model must give the dead copy's logits."""
import pytest
import torch
from gallery import _randomise_bn  # (tests/ is on sys.path through its conftest)
from torch import nn

import workbench as wb

T = pytest.importorskip("transformers")

PIXELS = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
S0, S1 = "resnet.encoder.stages.0.layers", "resnet.encoder.stages.1.layers"
EMBEDDER = "resnet.embedder.embedder"


def _resnet(layer_type="bottleneck", head=True):
    torch.manual_seed(0)
    if layer_type == "bottleneck":   # every stage's first block has a projection shortcut
        cfg = T.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[32, 64], depths=[1, 2],
                             layer_type="bottleneck", num_labels=5)
    else:                            # stage 0's blocks keep the embedder's 16 channels: identity shortcuts
        cfg = T.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[2, 1],
                             layer_type="basic", num_labels=5)
    model = T.ResNetForImageClassification(cfg) if head else T.ResNetModel(cfg)
    _randomise_bn(model, torch.Generator().manual_seed(3))
    return model.eval()


def _logits(model):
    with torch.inference_mode():
        return model(PIXELS).logits


def _kept(model, producers, keep):
    """The channels the l1 criterion keeps: the largest summed norms over the stream's writers."""
    score = sum(model.get_submodule(p).weight.detach().abs().sum((1, 2, 3)) for p in producers)
    return torch.sort(torch.topk(score, keep).indices).values


def _kill(layer_type, norms, kept):
    """A fresh copy of the model with the BatchNorm weight and bias of every channel not in ``kept`` zero."""
    dead = _resnet(layer_type)
    for n in norms:
        bn = dead.get_submodule(n)
        gone = torch.ones(bn.num_features, dtype=torch.bool)
        gone[kept] = False
        with torch.no_grad():
            bn.weight[gone] = 0
            bn.bias[gone] = 0
    return dead


STAGE1 = dict(producers=[f"{S1}.0.shortcut.convolution", f"{S1}.0.layer.2.convolution", f"{S1}.1.layer.2.convolution"],
              readers=[(f"{S1}.1.layer.0.convolution", 1), ("classifier.1", 1)])
STAGE0 = dict(producers=[f"{S0}.0.shortcut.convolution", f"{S0}.0.layer.2.convolution"],
              readers=[(f"{S1}.0.layer.0.convolution", 1), (f"{S1}.0.shortcut.convolution", 1)])
STEM = dict(producers=[f"{EMBEDDER}.convolution"],
            readers=[(f"{S0}.0.layer.0.convolution", 1), (f"{S0}.0.shortcut.convolution", 1)])


@pytest.mark.parametrize("amounts, stream", [
    ({f"{S1}.*.layer.2.convolution": 0.25}, STAGE1),
    ({f"{S1}.*.layer.2.convolution": 0.25, f"{S1}.0.shortcut.convolution": 0.25}, STAGE1),   # projection named too
    ({f"{S0}.*.layer.2.convolution": 0.25}, STAGE0),
    ({f"{EMBEDDER}.convolution": 0.25}, STEM),
], ids=["stage1", "stage1-with-shortcut", "stage0", "embedder"])
def test_bottleneck_stream(amounts, stream):
    model = _resnet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pruned = wb.prune.channels(model, amounts)
    width = model.get_submodule(stream["producers"][0]).out_channels
    keep = width - width // 4
    idx = _kept(model, stream["producers"], keep)
    norms = [p.replace(".convolution", ".normalization") for p in stream["producers"]]
    for p, n in zip(stream["producers"], norms):
        old, new = model.get_submodule(p), pruned.get_submodule(p)
        assert torch.equal(new.weight, old.weight[idx])
        assert torch.equal(pruned.get_submodule(n).running_var, model.get_submodule(n).running_var[idx])
    for reader, _ in stream["readers"]:
        assert torch.equal(pruned.get_submodule(reader).weight, model.get_submodule(reader).weight[:, idx])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())     # the input model is untouched
    assert not torch.allclose(_logits(pruned), _logits(model), atol=1e-3)   # the removed channels did matter
    torch.testing.assert_close(_logits(pruned), _logits(_kill("bottleneck", norms, idx)), rtol=1e-5, atol=1e-5)


def test_every_stream_and_the_inner_convolutions_save_and_load(tmp_path):
    model = _resnet()
    amounts = {f"{EMBEDDER}.convolution": 0.25, "resnet.encoder.stages.*.layers.*.layer.2.convolution": 0.25,
               "resnet.encoder.stages.*.layers.*.layer.0.convolution": 0.5}
    pruned = wb.prune.channels(model, amounts)
    first = pruned.get_submodule(f"{S1}.0")      # reads stage 0's stream (24 of 32), writes stage 1's (48 of 64)
    assert (first.layer[0].convolution.in_channels, first.shortcut.convolution.in_channels) == (24, 24)
    assert (first.layer[0].convolution.out_channels, first.layer[1].convolution.in_channels) == (8, 8)
    assert (first.shortcut.convolution.out_channels, first.layer[2].normalization.num_features) == (48, 48)
    assert (pruned.get_submodule(f"{S0}.0.shortcut.convolution").in_channels, pruned.classifier[1].in_features) \
        == (12, 48)
    plan = wb.applied_plans(pruned)[-1]
    assert plan[f"{S1}.0.layer.0.convolution"] == wb.prune.Kept(out_channels=8, in_channels=24)
    assert plan["classifier.1"] == wb.prune.Kept(in_channels=48)
    assert wb.size_bytes(pruned) < wb.size_bytes(model)
    again = wb.load(wb.save(pruned, tmp_path / "resnet.safetensors"), base=model)
    assert torch.equal(_logits(again), _logits(pruned))
    assert model.classifier[1].in_features == 64


def test_taylor_ranks_a_stream_by_its_writers_summed():
    model = _resnet()
    labels = [torch.tensor([0, 3])]
    pruned = wb.prune.channels(model, {f"{S1}.*.layer.2.convolution": 0.5}, criterion="taylor",
                               calibration=[PIXELS], labels=labels)
    score = sum(wb.prune.channel_importance(model, p, "taylor", [PIXELS], labels) for p in STAGE1["producers"])
    idx = torch.sort(torch.topk(score, 32).indices).values
    assert torch.equal(pruned.classifier[1].weight, model.classifier[1].weight[:, idx])


def test_basic_blocks_identity_shortcuts_carry_the_embedder_stream(tmp_path):
    model = _resnet("basic")
    # stage 0's blocks have identity shortcuts: the embedder's output and both blocks' outputs are one stream
    writers = [f"{EMBEDDER}.convolution", f"{S0}.0.layer.1.convolution", f"{S0}.1.layer.1.convolution"]
    with pytest.raises(ValueError, match=rf"\['{EMBEDDER}.convolution'\] write too.*select them too"):
        wb.prune.channels(model, {f"{S0}.*.layer.1.convolution": 0.25})
    pruned = wb.prune.channels(model, {f"re:{EMBEDDER}.convolution|{S0}.\\d+.layer.1.convolution": 0.25})
    idx = _kept(model, writers, 12)
    for reader in (f"{S0}.0.layer.0.convolution", f"{S0}.1.layer.0.convolution", f"{S1}.0.layer.0.convolution",
                   f"{S1}.0.shortcut.convolution"):
        assert torch.equal(pruned.get_submodule(reader).weight, model.get_submodule(reader).weight[:, idx])
    norms = [w.replace(".convolution", ".normalization") for w in writers]
    torch.testing.assert_close(_logits(pruned), _logits(_kill("basic", norms, idx)), rtol=1e-5, atol=1e-5)
    # the last stage's stream (a projection shortcut, then the classifier) and the blocks' inner convolutions
    more = wb.prune.channels(pruned, {f"{S1}.0.layer.1.convolution": 0.5, "*.layer.0.convolution": 0.5})
    assert (more.classifier[1].in_features, more.get_submodule(f"{S1}.0.shortcut.normalization").num_features) == \
        (16, 16)
    again = wb.load(wb.save(more, tmp_path / "basic.safetensors"), base=model)
    assert torch.equal(_logits(again), _logits(more))


def test_partial_and_impossible_selections_are_refused_naming_the_layers():
    model = _resnet()
    with pytest.raises(ValueError, match=rf"'{S1}.0.layer.2.convolution' writes a residual stream that "
                                         rf"\['{S1}.1.layer.2.convolution'\] write too"):
        wb.prune.channels(model, {f"{S1}.0.layer.2.convolution": 0.25})
    with pytest.raises(ValueError, match=rf"\['{S1}.0.layer.2.convolution', '{S1}.1.layer.2.convolution'\] write "
                                         rf"too"):
        wb.prune.channels(model, {f"{S1}.0.shortcut.convolution": 0.25})
    with pytest.raises(ValueError, match="must be pruned alike, but were given different amounts"):
        wb.prune.channels(model, {f"{S1}.0.layer.2.convolution": 0.25, f"{S1}.1.layer.2.convolution": 0.5})
    backbone = _resnet(head=False)   # without the head the last stream is the model's output
    with pytest.raises(ValueError, match=r"cannot cut the output channels of 'encoder.stages.1.layers.0.layer.2."
                                         r"convolution': .* output of ResNetModel"):
        wb.prune.channels(backbone, {"encoder.stages.1.layers.*.layer.2.convolution": 0.25})
    assert wb.prune.channels(backbone, {"encoder.stages.0.layers.*.layer.2.convolution": 0.25}) \
        .encoder.stages[1].layers[0].shortcut.convolution.in_channels == 24


def test_explicit_consumers_of_a_stream():
    model = _resnet()
    consumers = wb.prune.transformer_ffn_consumers(model)
    assert consumers[f"{S1}.1.layer.2.convolution"] == [f"{S1}.1.layer.0.convolution", "classifier.1"]
    amounts = {f"{S1}.*.layer.2.convolution": 0.25}
    assert torch.equal(_logits(wb.prune.channels(model, amounts, consumers=consumers)),
                       _logits(wb.prune.channels(model, amounts)))
    assert isinstance(model.classifier[1], nn.Linear)
