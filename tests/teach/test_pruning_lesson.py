"""Lesson 20 (pruning): the lesson's masks agree with the package, the exercise checks pass the right answer and
explain typical mistakes, the figures build."""
import pandas as pd
import pytest
import torch

import workbench as wb
from workbench.teach import pruning as L


@pytest.fixture(autouse=True)
def _fresh_results():
    wb.teach.reset()
    yield
    wb.teach.reset()


@pytest.fixture(scope="module")
def cnn():
    return wb.models.load("digits-cnn")


def test_masks_have_their_patterns(cnn):
    w = cnn.fc1.weight.detach()                                            # (128, 256)
    masks = L.lesson_masks(w, 0.5)
    assert [L.mask_sparsity(m) for m in masks.values()] == [0.5, 0.5, 0.5]
    rows = masks["structured rows (L1)"]
    assert bool((rows.all(1) | ~rows.any(1)).all())                          # whole rows kept or dropped
    assert bool((masks["2:4 semi-structured"].reshape(-1, 4).sum(1) == 2).all())
    assert torch.equal(masks["unstructured magnitude"], wb.prune.masks.magnitude_mask(w, 0.5))
    with pytest.raises(ValueError, match="2-D"):
        L.lesson_masks(cnn.conv1.weight, 0.5)


def test_row_mask_removes_what_prune_channels_removes(cnn):
    w = cnn.conv1.weight.detach()
    mask = L.row_mask(w, 0.25)
    dropped = (~mask.reshape(32, -1).any(1)).nonzero().flatten()
    pruned = wb.prune.channels(cnn, {"conv1": 0.25}, example_inputs=wb.tasks.load("digits").example_inputs(2))
    kept = pruned.conv1.weight.detach()
    # the pruned model keeps exactly the other 24 channels, in order
    others = [i for i in range(32) if i not in dropped.tolist()]
    assert len(dropped) == 8 and torch.equal(kept, w[others])


def test_figures_build(cnn):
    w = cnn.fc1.weight.detach()
    fig = L.mask_heatmaps(w, L.lesson_masks(w), rows=8, cols=16, layer="fc1")
    assert len(fig.data) == 3 and all(t.type == "heatmap" for t in fig.data)
    assert len(fig.data[0].z) == 8 and len(fig.data[0].z[0]) == 16
    assert "fc1" in fig.layout.title.text and fig.layout.xaxis.title.text == "input (column)"
    bars = L.channel_norms(cnn, "conv1", 0.25)
    assert len(bars.data[0].y) == 32 and list(bars.data[0].marker.color).count("#d62728") == 8
    assert bars.layout.yaxis.title.text.startswith("L1")
    sweep = pd.DataFrame({"sparsity": [0.0, 0.5, 0.0, 0.5], "finetuned": [False, False, True, True],
                          "accuracy": [0.99, 0.9, 0.99, 0.98]})
    random = pd.DataFrame({"sparsity": [0.0, 0.5], "finetuned": [False, False], "accuracy": [0.99, 0.2]})
    curves = L.sparsity_curves(sweep, random, dense_accuracy=0.99)
    assert [t.name for t in curves.data] == ["magnitude", "magnitude + fine-tune", "random"]
    assert list(curves.data[1].x) == [0.0, 50.0] and "sparsity" in curves.layout.xaxis.title.text


def _kept(w1, keep=24, largest=True):
    return w1.abs().sum(dim=(1, 2, 3)).topk(keep, largest=largest).indices.sort().values


def test_structured_pair_check_passes_what_prune_channels_leaves(cnn):
    w1, w2 = cnn.conv1.weight.detach(), cnn.conv2.weight.detach()
    kept = _kept(w1)
    assert L.check_structured_pair((w1[kept], w2[:, kept]), cnn, "conv1", "conv2", amount=0.25).passed
    pruned = wb.prune.channels(cnn, {"conv1": 0.25}, example_inputs=wb.tasks.load("digits").example_inputs(2))
    assert L.check_structured_pair([pruned.conv1.weight, pruned.conv2.weight], cnn, "conv1", "conv2", 0.25).passed
    assert L.check_structured_pair(..., cnn, "conv1", "conv2", 0.25).status == "not attempted"


def test_structured_pair_check_names_plausible_wrong_implementations(cnn):
    w1, w2 = cnn.conv1.weight.detach(), cnn.conv2.weight.detach()
    kept = _kept(w1)
    fb = L.check_structured_pair((w1[kept], w2), cnn, "conv1", "conv2", 0.25)              # conv2 left alone
    assert fb.status == "failed" and "*input* dimension" in fb.hint and "item 1: expected shape" in fb.message
    assert "its own output channels" in L.check_structured_pair((w1[kept], w2[kept]), cnn, "conv1", "conv2", 0.25).hint
    zeroed1, zeroed2 = w1.clone(), w2.clone()
    gone = [i for i in range(32) if i not in kept.tolist()]
    zeroed1[gone], zeroed2[:, gone] = 0, 0
    assert "zeroed but still there" in L.check_structured_pair((zeroed1, zeroed2), cnn, "conv1", "conv2", 0.25).hint
    small = _kept(w1, largest=False)
    assert "*smallest*" in L.check_structured_pair((w1[small], w2[:, small]), cnn, "conv1", "conv2", 0.25).hint
    by_norm = w1.abs().sum(dim=(1, 2, 3)).topk(24).indices
    assert "original order" in L.check_structured_pair((w1[by_norm], w2[:, by_norm]), cnn, "conv1", "conv2", 0.25).hint
    l2 = w1.pow(2).sum(dim=(1, 2, 3)).topk(24).indices.sort().values
    assert "L2 norm" in L.check_structured_pair((w1[l2], w2[:, l2]), cnn, "conv1", "conv2", 0.25).hint
    own = w2.abs().sum(dim=(0, 2, 3)).topk(24).indices.sort().values
    assert "ranked by conv2's weights" in L.check_structured_pair((w1[own], w2[:, own]), cnn, "conv1", "conv2",
                                                                  0.25).hint
    assert "return the pair" in L.check_structured_pair(w1[kept], cnn, "conv1", "conv2", 0.25).hint
