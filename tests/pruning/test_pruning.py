"""Pruning masks, storages, fine-tuning with masks, save/load, bad input; low-rank SVD."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.pruning import PrunedConv2d, PrunedLinear, SparseLinear, masks


def test_masks_prune_exact_counts():
    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(0))
    m = masks.magnitude_mask(w, 0.3)
    assert int((~m).sum()) == round(0.3 * w.numel())
    assert w.abs()[~m].max() <= w.abs()[m].min()              # the pruned ones are the smallest
    r = masks.random_mask(w, 0.3, seed=1)
    assert int((~r).sum()) == int((~m).sum()) and not torch.equal(r, m)
    assert masks.magnitude_mask(w, 0.0).all()


def test_2_4_masks_have_exactly_two_of_every_four():
    w = torch.randn(16, 64)
    m = masks.nm_mask(w, 2, 4)
    assert (m.reshape(16, 16, 4).sum(-1) == 2).all()
    kept = (w.abs() * m).reshape(16, 16, 4)
    dropped = (w.abs() * ~m).reshape(16, 16, 4)
    assert (kept.amax(-1) >= dropped.amax(-1)).all()
    model = wb.apply(nn.Sequential(nn.Linear(64, 16)), {"0": wb.prune.NM(2, 4)})
    assert (model[0].mask.reshape(16, 16, 4).sum(-1) == 2).all()


def test_global_threshold():
    weights = {"a": torch.arange(1.0, 11.0), "b": torch.arange(11.0, 31.0)}
    s = masks.global_sparsities(weights, 0.5)                  # the 15 smallest of 30: all of a, 5 of b
    assert s == {"a": 1.0, "b": 0.25}
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with torch.no_grad():
        model[0].weight.copy_(10 + torch.rand(8, 8))           # every weight of layer 0 is larger
        model[1].weight.copy_(torch.rand(8, 8))
    plan = wb.prune.global_plan(model, "*", 0.3)
    sp = {k: c.sparsity for k, c in plan.items()}
    assert sp == {"0": 0.0, "1": 38 / 64}                      # the small-weight layer takes all the pruning
    tiny_first = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 400))
    with torch.no_grad():
        tiny_first[0].weight.mul_(1e-3)
    with pytest.raises(ValueError, match="would prune every weight of '0'"):
        wb.prune.global_plan(tiny_first, "*", 0.5)


@pytest.mark.parametrize("config", [wb.prune.Magnitude(0.9, "csr"), wb.prune.NM(1, 4, "csr")], ids=repr)
def test_csr_storage_saves_bytes_and_computes_the_same(config, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    dense = wb.apply(model, {"0": type(config)(**{**config.__dict__, "storage": "dense"})})
    sparse = wb.apply(model, {"0": config})
    assert isinstance(sparse[0], SparseLinear) and type(dense[0]) is nn.Linear
    from workbench.pruning.modules import csr_bytes
    kept = int((dense[0].weight != 0).sum())
    assert wb.size_bytes(sparse[0]) == csr_bytes(128, kept) + 128 * 4   # values + int32 indices + bias
    assert wb.size_bytes(sparse[0]) < 0.6 * wb.size_bytes(dense[0])
    x = torch.randn(7, 256)
    with torch.no_grad():
        torch.testing.assert_close(sparse(x), dense(x), rtol=1e-5, atol=1e-5)
        again = wb.load(wb.save(sparse, tmp_path / "s.safetensors"), base=model)
        assert torch.equal(again(x), sparse(x))


@pytest.mark.slow   # trains (fine-tuning): ~30 s
def test_magnitude_beats_random_and_finetune_recovers(tmp_path):
    """digits-cnn at 50 % unstructured sparsity + a 3-epoch fine-tune loses <= 0.5 points."""
    model = wb.models.load("digits-cnn")
    task = wb.tasks.load("digits")
    base = task.evaluate(model)["accuracy"]
    plan = wb.Plan({"conv*": wb.prune.Magnitude(0.5), "fc*": wb.prune.Magnitude(0.5)})
    pruned = wb.apply(model, plan)
    assert isinstance(pruned.conv2, PrunedConv2d) and isinstance(pruned.fc1, PrunedLinear)
    rnd = wb.apply(model, {"conv*": wb.prune.Random(0.5), "fc*": wb.prune.Random(0.5)})
    assert task.evaluate(pruned)["accuracy"] > task.evaluate(rnd)["accuracy"] + 0.1
    wb.training.fit_classifier(pruned, task, epochs=3, lr=1e-3, progress=False)
    assert all(abs(s - 0.5) < 1e-3 for s in wb.prune.sparsity_of(pruned).values())  # masks held
    final = wb.prune.finalize(pruned)
    assert type(final.fc1) is nn.Linear and float((final.fc1.weight == 0).float().mean()) >= 0.5
    acc = task.evaluate(final)["accuracy"]
    assert acc >= base - 0.005, (base, acc)
    again = wb.load(wb.save(final, tmp_path / "p.safetensors"))
    x = task.example_inputs(8)[0]
    with torch.no_grad():
        assert torch.equal(again(x), final(x))


def test_pruning_bad_input():
    lin = nn.Sequential(nn.Linear(10, 4))
    for bad in (1.0, -0.1, 1.5, True):
        with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
            wb.prune.Magnitude(bad)
    with pytest.raises(wb.ApplyError, match="N:M 2:4 needs the input dimension to be a multiple of 4, got 10"):
        wb.apply(lin, {"0": wb.prune.NM(2, 4)})
    with pytest.raises(ValueError, match="NM needs integers 0 < n < m"):
        wb.prune.NM(4, 4)
    with pytest.raises(ValueError, match="storage must be one of"):
        wb.prune.Magnitude(0.5, "coo")


def test_svd_rank_and_energy(tmp_path):
    torch.manual_seed(0)
    low = torch.randn(64, 8) @ torch.randn(8, 96)                    # rank 8
    lin = nn.Linear(96, 64)
    with torch.no_grad():
        lin.weight.copy_(low + 1e-3 * torch.randn(64, 96))
    model = nn.Sequential(lin)
    x = torch.randn(5, 96)
    f = wb.apply(model, {"0": wb.lowrank.SVD(energy=0.999)})
    assert f[0].rank == 8                                            # the energy finds the true rank
    with torch.no_grad():
        assert (f(x) - model(x)).norm() / model(x).norm() < 1e-2   # only the 1e-3 noise is dropped
    assert wb.applied_plans(f)[0]["0"] == wb.lowrank.SVD(rank=8)    # the concrete rank is recorded
    again = wb.load(wb.save(f, tmp_path / "l.safetensors"), base=model)
    with torch.no_grad():
        assert torch.equal(again(x), f(x))
    s = wb.lowrank.summary(model, f)
    assert s.loc[0, "params_after"] == 8 * (96 + 64) and s.loc[0, "params_saved"] == 64 * 96 - 8 * 160
    with pytest.raises(wb.ApplyError, match=r"rank 65 exceeds min\(out, in\) = 64"):
        wb.apply(model, {"0": wb.lowrank.SVD(rank=65)})
    with pytest.raises(ValueError, match="exactly one of rank= or energy="):
        wb.lowrank.SVD()
    with pytest.raises(ValueError, match=r"SVD.energy must be in \(0, 1\]"):
        wb.lowrank.SVD(energy=1.5)


@pytest.mark.slow
def test_svd_of_minilm_ffn(minilm, minilm_task):
    f = wb.apply(minilm, {"encoder.layer.*.intermediate.dense": wb.lowrank.SVD(energy=0.9),
                          r"re:encoder\.layer\.\d+\.output\.dense": wb.lowrank.SVD(energy=0.9)}, progress=False)
    s = wb.lowrank.summary(minilm, f)
    assert len(s) == 12 and (s["rank"] < 384).all()
    fid = minilm_task.fidelity(f, quick=True)
    assert 0.5 < fid < 0.999
