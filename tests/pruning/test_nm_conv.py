"""N:M masks of convolutions: groups of m consecutive input channels at one (output, kernel position), as sparse
tensor cores and NVIDIA's ASP use them - never a group mixing kernel positions."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.pruning import masks


def _groups_along_inputs(w):   # (out, in, kh, kw) -> (out, kh, kw, in/4, 4): 4 consecutive inputs per group
    o, i, kh, kw = w.shape
    return w.permute(0, 2, 3, 1).reshape(o, kh, kw, i // 4, 4)


def test_conv2d_two_of_every_four_input_channels_at_each_kernel_position():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 3), nn.ReLU(), nn.Conv2d(16, 12, (3, 2)))   # a non-square kernel too
    pruned = wb.apply(model, {"0": wb.prune.NM(2, 4), "2": wb.prune.NM(2, 4)}, progress=False)
    for i in ("0", "2"):
        w = pruned.get_submodule(i).weight.detach()
        zeros = (_groups_along_inputs(w) == 0).sum(-1)                     # (out, kh, kw, groups)
        assert bool((zeros == 2).all()), f"layer {i}: a group of 4 input channels without exactly 2 zeros"
        # the two kept are the two largest |w| of their group
        orig = _groups_along_inputs(model.get_submodule(i).weight.detach()).abs()
        torch.testing.assert_close(_groups_along_inputs(w).abs().sum(-1), orig.topk(2, -1).values.sum(-1))
    # a flattened (in, kh, kw) grouping would not give this: a group of 4 there mixes kernel positions
    w0 = model[0].weight.detach()
    flat = masks.nm_groups(w0.reshape(w0.shape[0], -1), 4)
    along = masks.nm_groups(w0, 4)
    assert not torch.equal(flat, along)
    assert torch.equal(along[0], w0[0, 0:4, 0, 0])                          # first group: channels 0-3 at (0, 0)


def test_grouped_conv_and_conv1d_group_their_own_input_channels():
    conv = nn.Conv2d(16, 8, 3, groups=2)             # 8 input channels per group
    conv1d = nn.Conv1d(12, 4, 5)
    model = nn.Sequential(conv, nn.Conv2d(8, 8, 1))
    w = wb.apply(model, {"0": wb.prune.NM(2, 4)}, progress=False)[0].weight.detach()
    assert bool(((_groups_along_inputs(w) == 0).sum(-1) == 2).all())
    m1 = masks.nm_mask(conv1d.weight, 2, 4)                                 # (out, in, k)
    assert bool((m1.permute(0, 2, 1).reshape(4, 5, 3, 4).sum(-1) == 2).all())
    assert torch.equal(masks.nm_ungroup(masks.nm_groups(conv.weight, 4), conv.weight.shape), conv.weight)


def test_input_channels_not_a_multiple_of_m_are_refused_naming_the_layer():
    cnn = wb.models.load("digits-cnn")               # conv1 takes 1 input channel
    with pytest.raises(wb.ApplyError, match=r"'conv1'.*multiple of 4, got 1"):
        wb.apply(cnn, {"conv1": wb.prune.NM(2, 4)}, progress=False)
    depthwise = nn.Sequential(nn.Conv2d(8, 8, 3, groups=8))
    with pytest.raises(wb.ApplyError, match=r"'0'.*input channels per group"):
        wb.apply(depthwise, {"0": wb.prune.NM(2, 4)}, progress=False)
    assert cnn.conv1.weight.detach().count_nonzero() == cnn.conv1.weight.numel()   # the model is not mutated


def test_conv_2_4_survives_save_and_load(tmp_path):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3))
    pruned = wb.apply(model, {"*": wb.prune.NM(2, 4)}, progress=False)
    again = wb.load(wb.save(pruned, tmp_path / "p.safetensors"), base=model)
    x = torch.randn(2, 8, 9, 9)
    with torch.no_grad():
        assert torch.equal(again(x), pruned(x))
    dense = wb.prune.finalize(pruned, "dense")
    assert bool(((_groups_along_inputs(dense[2].weight.detach()) == 0).sum(-1) == 2).all())
