"""One-shot calibrated pruning (Wanda, SparseGPT) on a small random-init Llama, block by block.

Random-init Llamas have isotropic activations; real LLMs have a few loud channels. The RMSNorm gains are set to
log-normal values so the projections after them see such channels ("real-ish" inputs), which is where scoring
by the inputs pays off."""

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.plans.layers import capture_inputs
from workbench.pruning.oneshot import sparsegpt_prune, wanda_mask

transformers = pytest.importorskip("transformers")
P = wb.prune


def llama_with_loud_channels(layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "LlamaRMSNorm":
                m.weight.copy_(torch.exp(1.5 * torch.randn(m.weight.shape, generator=g)))
    return model


def batches(n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 128, (2, 32), generator=g),) for _ in range(n)]


def rel_error(X, W, Wp):
    return float((X @ (W - Wp).T).pow(2).sum() / (X @ W.T).pow(2).sum())


@pytest.mark.parametrize("nm", [None, (2, 4)])
def test_sparsegpt_beats_wanda_beats_magnitude_on_the_same_layer(nm):
    model = llama_with_loud_channels()
    name = "model.layers.1.mlp.up_proj"
    inputs = capture_inputs(model, [name], batches(), progress=False)[name]
    X = torch.cat([b[0].reshape(-1, 64) for b in inputs]).double()                    # (tokens, 64)
    W = model.get_submodule(name).weight.detach().double()
    magnitude = (P.masks.nm_mask(W, *nm) if nm else P.masks.magnitude_mask(W, 0.5))
    wanda = wanda_mask(W, inputs, 0.5, nm)
    sgpt_w, sgpt_keep = sparsegpt_prune(W, inputs, 0.5, nm)
    for keep in (magnitude, wanda, sgpt_keep):
        assert int(keep.sum()) == W.numel() // 2
        if nm:
            assert (keep.reshape(-1, 4).sum(1) == 2).all()
    assert torch.equal(sgpt_w != 0, sgpt_keep)
    e_mag, e_wanda, e_sgpt = rel_error(X, W, W * magnitude), rel_error(X, W, W * wanda), rel_error(X, W, sgpt_w)
    assert e_sgpt < e_wanda < e_mag, (e_sgpt, e_wanda, e_mag)


@pytest.mark.parametrize("config", [P.Wanda(0.5), P.Wanda(nm=(2, 4)), P.SparseGPT(0.6), P.SparseGPT(nm=(2, 4))])
def test_plans_prune_a_llama_block_by_block_to_exactly_the_sparsity_asked(config):
    model = llama_with_loud_channels()
    plan = {"lm_head": None, "model.layers.*": config}
    small = wb.apply(model, plan, calibration=batches(2), progress=False)
    report = wb.applied_report(small)
    assert set(report[report.status == "compressed"].calibration) == {"sequential"}
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("model.layers.")]
    for n in linears:
        w = small.get_submodule(n).weight
        assert isinstance(small.get_submodule(n), P.PrunedLinear)
        assert int((w == 0).sum()) == round(config.sparsity * w.numel()), n
        if config.nm:
            assert ((w != 0).reshape(-1, 4).sum(1) == 2).all(), n
    with torch.inference_mode():
        x = batches(1, seed=5)[0][0]
        a, b = model(x).logits, small(x).logits
    assert torch.isfinite(b).all() and not torch.equal(a, b)


def test_two_four_storage_and_save_load(tmp_path):
    model = llama_with_loud_channels(1)
    small = wb.apply(model, {"lm_head": None, "model.layers.*": P.SparseGPT(nm=(2, 4), storage="2:4")},
                     calibration=batches(2), progress=False)
    assert isinstance(small.model.layers[0].mlp.up_proj, P.SemiStructuredLinear)
    wb.save(small, tmp_path / "s.safetensors")
    again = wb.load(tmp_path / "s.safetensors", base=model)
    x = batches(1, seed=5)[0][0]
    with torch.inference_mode():
        assert torch.equal(small(x).logits, again(x).logits)


def test_configs_are_validated_and_round_trip_through_json():
    assert P.Wanda(nm=(2, 4)).sparsity == 0.5
    plan = wb.Plan({"a": P.Wanda(nm=(2, 4)), "b": P.SparseGPT(0.7, damp=0.05)})
    assert wb.Plan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="nm needs integers"):
        P.Wanda(nm=(4, 2))
    with pytest.raises(ValueError, match="storage '2:4'"):
        P.SparseGPT(0.5, storage="2:4")
    with pytest.raises(ValueError, match="damp"):
        P.SparseGPT(damp=2.0)
    with pytest.raises(ValueError, match="calibration data is required"):
        wb.apply(nn.Sequential(nn.Linear(8, 8)), {"0": P.Wanda()})
