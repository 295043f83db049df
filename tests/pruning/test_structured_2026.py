"""Channel pruning of 2026 layouts (issue 35) on tiny random transformers models: GPT-NeoX and Falcon feed-forward
blocks (FalconLinear, an nn.Linear subclass with its own forward), Phi-3's fused gate_up_proj, fused
mixture-of-experts modules (Mixtral, Qwen2-MoE with its shared expert, GPT-OSS's transposed, interleaved layout
with biases), Hugging Face ResNet's bottlenecks (BatchNorm statistics cut too); refusals that name the layer.

The reference for "the pruned model computes the right thing": make the channels to remove dead in a copy of the
original (their producer rows zero, or tiny with the consumer's columns zero), so the norm criterion removes exactly
them and the pruned model must give the dead copy's output."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.pruning import moe

T = pytest.importorskip("transformers")

IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))


def _logits(model, ids=IDS):
    with torch.inference_mode():
        return model(ids).logits


def _dead(n: int, seed: int) -> torch.Tensor:
    """Half of ``n`` channels, chosen at random (sorted)."""
    return torch.sort(torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: n // 2]).values


def _roundtrip(pruned, base, tmp_path, ids=IDS):
    again = wb.load(wb.save(pruned, tmp_path / "pruned.safetensors"), base=base)
    assert torch.equal(_logits(again, ids), _logits(pruned, ids))


# ---------------------------------------------------------------- GPT-NeoX, Falcon: dense_h_to_4h -> dense_4h_to_h

def _neox():
    torch.manual_seed(0)
    return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                                num_hidden_layers=2, num_attention_heads=4,
                                                max_position_embeddings=32)).eval()


def _falcon():
    torch.manual_seed(0)
    return T.FalconForCausalLM(T.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=4, max_position_embeddings=32)).eval()


@pytest.mark.parametrize("build, prefix", [(_neox, "gpt_neox.layers"), (_falcon, "transformer.h")],
                         ids=["gpt-neox", "falcon"])
def test_dense_h_to_4h_blocks(build, prefix, tmp_path):
    model = build()
    width = model.get_submodule(f"{prefix}.0.mlp.dense_h_to_4h").out_features
    pattern = f"{prefix}.*.mlp.dense_h_to_4h"
    assert wb.prune.transformer_ffn_consumers(model)[f"{prefix}.1.mlp.dense_h_to_4h"] == \
        [f"{prefix}.1.mlp.dense_4h_to_h"]
    pruned = wb.prune.channels(model, {pattern: 0.5})
    mlp, old = pruned.get_submodule(f"{prefix}.0.mlp"), model.get_submodule(f"{prefix}.0.mlp")
    assert (mlp.dense_h_to_4h.out_features, mlp.dense_4h_to_h.in_features) == (width // 2, width // 2)
    assert type(mlp.dense_h_to_4h) is nn.Linear    # FalconLinear computes nn.Linear's: the cut layer is one
    assert old.dense_h_to_4h.out_features == width                  # the input model is untouched
    _roundtrip(pruned, model, tmp_path)
    dead = build()                                  # (GELU(0) = 0: a zero row and bias is a dead channel)
    for i in range(2):
        layer = dead.get_submodule(f"{prefix}.{i}.mlp.dense_h_to_4h")
        with torch.no_grad():
            layer.weight[_dead(width, i)] = 0
            if layer.bias is not None:
                layer.bias[_dead(width, i)] = 0
    torch.testing.assert_close(_logits(wb.prune.channels(dead, {pattern: 0.5})), _logits(dead), rtol=1e-5,
                               atol=1e-5)


def test_a_linear_subclass_computing_something_else_is_not_cut():
    class Shifted(nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1

    model = nn.Sequential(Shifted(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"it matches '0' \(Shifted\)"):
        wb.prune.channels(model, {"0": 0.5})


# ---------------------------------------------------------------- Phi-3: gate_up_proj (2I rows) -> down_proj (I)

def _phi3():
    torch.manual_seed(0)
    return T.Phi3ForCausalLM(T.Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          pad_token_id=0, bos_token_id=0, eos_token_id=0)).eval()


def test_phi3_fused_gate_up(tmp_path):
    model = _phi3()
    pattern = "model.layers.*.mlp.gate_up_proj"
    pruned = wb.prune.channels(model, {pattern: 0.25})
    old, new = model.model.layers[0].mlp, pruned.model.layers[0].mlp
    assert (new.gate_up_proj.out_features, new.down_proj.in_features) == (36, 18)
    # channel j is rows j (gate) and 24 + j (up), ranked together, and column j of down_proj
    w = old.gate_up_proj.weight.detach()
    idx = torch.sort(torch.topk(w[:24].abs().sum(1) + w[24:].abs().sum(1), 18).indices).values
    assert torch.equal(new.gate_up_proj.weight, w[torch.cat([idx, 24 + idx])])
    assert torch.equal(new.down_proj.weight, old.down_proj.weight[:, idx])
    assert wb.applied_plans(pruned)[-1]["model.layers.0.mlp.gate_up_proj"] == wb.prune.Kept(out_channels=36)
    _roundtrip(pruned, model, tmp_path)
    # dead channels: a zero gate row and a zero up row (SiLU(0) * 0 = 0)
    dead = _phi3()
    for i in range(2):
        d = _dead(24, i)
        with torch.no_grad():
            dead.model.layers[i].mlp.gate_up_proj.weight[torch.cat([d, 24 + d])] = 0
    small = wb.prune.channels(dead, {pattern: 0.5})
    torch.testing.assert_close(_logits(small), _logits(dead), rtol=1e-5, atol=1e-5)
    # explicit consumers= of the same block: the layout's halves are still cut together
    again = wb.prune.channels(dead, {pattern: 0.5}, consumers=wb.prune.transformer_ffn_consumers(dead))
    assert torch.equal(_logits(again), _logits(small))


# ---------------------------------------------------------------- fused experts

def _mixtral(implementation=None):
    torch.manual_seed(0)
    model = T.MixtralForCausalLM(T.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 num_local_experts=4, num_experts_per_tok=2,
                                                 max_position_embeddings=32)).eval()
    if implementation is not None:
        model.config._experts_implementation = implementation
    return model


def _kill_concatenated(experts, seed):
    """Mixtral / Qwen2-MoE layout (E, 2I, H): expert e's dead channels j get zero gate row j and up row I + j."""
    width = experts.intermediate_dim
    with torch.no_grad():
        for e in range(experts.gate_up_proj.shape[0]):
            d = _dead(width, seed + e)
            experts.gate_up_proj[e, torch.cat([d, width + d])] = 0


@pytest.mark.parametrize("implementation", [None, "eager"], ids=["default", "eager"])
def test_mixtral_experts(implementation, tmp_path):
    model = _mixtral(implementation)
    pattern = "model.layers.*.mlp.experts"
    pruned = wb.prune.channels(model, {pattern: 0.5})
    ex, old = pruned.model.layers[0].mlp.experts, model.model.layers[0].mlp.experts
    assert ex.gate_up_proj.shape == (4, 32, 32) and ex.down_proj.shape == (4, 32, 16) and ex.intermediate_dim == 16
    assert old.gate_up_proj.shape == (4, 64, 32) and old.intermediate_dim == 32     # the input model is untouched
    # each expert ranks and keeps its own channels
    w = old.gate_up_proj.detach()
    for e in range(4):
        idx = torch.sort(torch.topk(w[e, :32].abs().sum(1) + w[e, 32:].abs().sum(1), 16).indices).values
        assert torch.equal(ex.gate_up_proj[e], w[e, torch.cat([idx, 32 + idx])])
        assert torch.equal(ex.down_proj[e], old.down_proj[e][:, idx])
    assert wb.applied_plans(pruned)[-1]["model.layers.1.mlp.experts"] == moe.KeptExperts(intermediate=16)
    assert wb.size_bytes(pruned) < wb.size_bytes(model)
    _roundtrip(pruned, model, tmp_path)
    dead = _mixtral(implementation)
    for i in range(2):
        _kill_concatenated(dead.model.layers[i].mlp.experts, 10 * i)
    torch.testing.assert_close(_logits(wb.prune.channels(dead, {pattern: 0.5})), _logits(dead), rtol=1e-5,
                               atol=1e-5)


def _qwen2_moe():
    torch.manual_seed(0)
    return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                                  moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  num_experts=4, num_experts_per_tok=2,
                                                  max_position_embeddings=32)).eval()


def test_qwen2_moe_experts_and_shared_expert(tmp_path):
    model = _qwen2_moe()
    amounts = {"model.layers.*.mlp.experts": 0.25, "model.layers.*.mlp.shared_expert.gate_proj": 0.25}
    pruned = wb.prune.channels(model, amounts)
    mlp = pruned.model.layers[1].mlp
    # 24 - 6 = 18 channels, rounded to a multiple of 8 (grouped matmuls need 16-byte rows): 16
    assert mlp.experts.gate_up_proj.shape == (4, 32, 32) and mlp.experts.down_proj.shape == (4, 32, 16)
    assert mlp.shared_expert.up_proj.out_features == mlp.shared_expert.down_proj.in_features == 30
    _roundtrip(pruned, model, tmp_path)
    dead = _qwen2_moe()
    for i in range(2):
        _kill_concatenated(dead.model.layers[i].mlp.experts, 10 * i)
    small = wb.prune.channels(dead, {"model.layers.*.mlp.experts": 0.34})   # 24 - 8 = 16: exactly the live ones
    assert small.model.layers[0].mlp.experts.intermediate_dim == 16
    torch.testing.assert_close(_logits(small), _logits(dead), rtol=1e-5, atol=1e-5)


def _gpt_oss():
    torch.manual_seed(0)
    model = T.GptOssForCausalLM(T.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                               max_position_embeddings=32)).eval()
    with torch.no_grad():   # GPT-OSS initialises its expert biases to zero: give them values
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.2)
    return model


def test_gpt_oss_transposed_interleaved_experts_with_biases(tmp_path):
    model = _gpt_oss()
    pattern = "model.layers.*.mlp.experts"
    pruned = wb.prune.channels(model, {pattern: 0.5})
    ex = pruned.model.layers[0].mlp.experts
    assert ex.gate_up_proj.shape == (4, 32, 32) and ex.gate_up_proj_bias.shape == (4, 32)
    assert ex.down_proj.shape == (4, 16, 32) and ex.down_proj_bias.shape == (4, 32) and ex.intermediate_size == 16
    _roundtrip(pruned, model, tmp_path)
    dead = _gpt_oss()                               # channel j: columns 2j (gate) and 2j + 1 (up), and their biases
    experts = dead.model.layers[0].mlp.experts
    with torch.no_grad():
        for e in range(4):
            d = _dead(32, e)
            cols = torch.stack([2 * d, 2 * d + 1], 1).flatten()
            experts.gate_up_proj[e][:, cols] = 0
            experts.gate_up_proj_bias[e][cols] = 0
    out = _logits(wb.prune.channels(dead, {pattern: 0.5}))
    torch.testing.assert_close(out, _logits(dead), rtol=1e-5, atol=1e-5)


def test_experts_refusals():
    model = _mixtral()
    with pytest.raises(ValueError, match=r"it matches 'model.layers.0.mlp.gate' \(MixtralTopKRouter\)"):
        wb.prune.channels(model, {"model.layers.*.mlp.gate": 0.5})
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts' \(MixtralExperts\).*not 'taylor'"):
        wb.prune.channels(model, {"model.layers.*.mlp.experts": 0.5}, criterion="taylor", calibration=[IDS])
    with pytest.raises(ValueError, match=r"0.05 of 'model.layers.0.mlp.experts' would keep 32 of .* 32 channels"):
        wb.prune.channels(model, {"model.layers.*.mlp.experts": 0.05})

    class Unflagged(nn.Module):   # a fused gate_up_proj, but nothing says whether it is [gate; up] or interleaved
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(2, 16, 4))
            self.down_proj = nn.Parameter(torch.randn(2, 4, 8))

    with pytest.raises(ValueError, match=r"'block.experts' \(Unflagged\).*no is_concatenated flag"):
        wb.prune.channels(nn.ModuleDict({"block": nn.ModuleDict({"experts": Unflagged()})}), {"*experts": 0.5})
    with pytest.raises(wb.ApplyError, match="KeptExperts records what wb.prune.channels / experts removed"):
        wb.apply(model, {"model.layers.0.mlp.experts": moe.KeptExperts(8)})
    with pytest.raises(ValueError, match="positive int"):
        moe.KeptExperts(0)


# ---------------------------------------------------------------- Hugging Face ResNet bottlenecks

def _resnet():
    torch.manual_seed(0)
    model = T.ResNetForImageClassification(T.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[32, 64],
                                                          depths=[1, 2], layer_type="bottleneck", num_labels=5))
    g = torch.Generator().manual_seed(3)
    for m in model.modules():   # trained-looking BatchNorms
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.copy_(0.1 * torch.randn(m.num_features, generator=g))
                m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=g))
                m.weight.copy_(1 + 0.1 * torch.randn(m.num_features, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.num_features, generator=g))
    return model.eval()


PIXELS = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
BOTTLENECKS = ["resnet.encoder.stages.0.layers.0.layer", "resnet.encoder.stages.1.layers.0.layer",
               "resnet.encoder.stages.1.layers.1.layer"]


def test_resnet_bottleneck_convolutions(tmp_path):
    model = _resnet()
    amounts = {"resnet.encoder.stages.*.layers.*.layer.0.convolution": 0.5,
               "resnet.encoder.stages.*.layers.*.layer.1.convolution": 0.25}
    pruned = wb.prune.channels(model, amounts)
    old, new = model.get_submodule(BOTTLENECKS[1]), pruned.get_submodule(BOTTLENECKS[1])   # 64 -> 16 -> 16 -> 64
    assert (new[0].convolution.out_channels, new[0].normalization.num_features, new[1].convolution.in_channels) == \
        (8, 8, 8)
    assert (new[1].convolution.out_channels, new[1].normalization.num_features, new[2].convolution.in_channels) == \
        (12, 12, 12)
    idx = torch.sort(torch.topk(old[0].convolution.weight.detach().abs().sum((1, 2, 3)), 8).indices).values
    assert torch.equal(new[0].normalization.running_mean, old[0].normalization.running_mean[idx])
    assert torch.equal(new[1].convolution.weight, old[1].convolution.weight[:, idx][
        torch.sort(torch.topk(old[1].convolution.weight.detach().abs().sum((1, 2, 3)), 12).indices).values])
    again = wb.load(wb.save(pruned, tmp_path / "resnet.safetensors"), base=model)
    with torch.inference_mode():
        assert torch.equal(again(PIXELS).logits, pruned(PIXELS).logits)
    # dead channels (tiny producer kernels, zero consumer columns): removing them changes nothing, whatever the
    # BatchNorm between makes of them
    dead = _resnet()
    for i, path in enumerate(BOTTLENECKS):
        block = dead.get_submodule(path)
        width = block[0].convolution.out_channels
        d = _dead(width, i)
        with torch.no_grad():
            block[0].convolution.weight[d] *= 1e-3
            block[1].convolution.weight[:, d] = 0
    small = wb.prune.channels(dead, {"resnet.encoder.stages.*.layers.*.layer.0.convolution": 0.5})
    with torch.inference_mode():
        torch.testing.assert_close(small(PIXELS).logits, dead(PIXELS).logits, rtol=1e-5, atol=1e-5)


def test_resnet_block_output_alone_is_refused_naming_the_rest_of_its_stream():
    # a block's output channels are a residual stream's: cut only with every block writing it (see
    # tests/pruning/test_structured_resnet_hf.py)
    with pytest.raises(ValueError, match=r"'resnet.encoder.stages.1.layers.0.layer.2.convolution' writes a residual "
                                         r"stream that \['resnet.encoder.stages.1.layers.1.layer.2.convolution'\]"):
        wb.prune.channels(_resnet(), {"resnet.encoder.stages.1.layers.0.layer.2.convolution": 0.25})


# ---------------------------------------------------------------- unknown layouts name the layer

def test_mamba_in_proj_is_refused_naming_the_layer():
    torch.manual_seed(0)
    model = T.MambaForCausalLM(T.MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=1,
                                             expand=2, conv_kernel=4)).eval()
    with pytest.raises(ValueError, match=r"'backbone.layers.0.mixer.in_proj' \(Linear\) is not the input projection "
                                         r"of a block.*read inside MambaMixer 'backbone.layers.0.mixer'"):
        wb.prune.channels(model, {"backbone.layers.*.mixer.in_proj": 0.25})


# ---------------------------------------------------------------- whole experts, by routing share

def test_experts_by_routing_share(tmp_path):
    model = _gpt_oss()
    router = model.model.layers[0].mlp.router
    with torch.no_grad():
        router.bias[[0, 2]] = -1e4                   # experts 0 and 2 never get a token
    counts = moe.routed_tokens(model, [IDS])["model.layers.0.mlp.experts"]
    assert counts[[0, 2]].tolist() == [0, 0] and int(counts.sum()) == IDS.numel() * router.top_k
    fewer = moe.experts(model, 0.5, calibration=[IDS])
    ex, r = fewer.model.layers[0].mlp.experts, fewer.model.layers[0].mlp.router
    assert (ex.num_experts, r.num_experts, ex.gate_up_proj.shape[0], ex.down_proj_bias.shape[0]) == (2, 2, 2, 2)
    assert torch.equal(r.weight, router.weight[[1, 3]]) and torch.equal(r.bias, router.bias[[1, 3]])
    assert torch.equal(ex.down_proj[1], model.model.layers[0].mlp.experts.down_proj[3])
    # the removed experts were never routed to: the output is the same
    torch.testing.assert_close(_logits(fewer), _logits(model), rtol=1e-5, atol=1e-5)
    assert model.model.layers[0].mlp.experts.num_experts == 4                      # the input model is untouched
    _roundtrip(fewer, model, tmp_path)
    # then cut the remaining experts' channels too: both records rebuild on load
    both = wb.prune.channels(fewer, {"model.layers.*.mlp.experts": 0.5})
    assert both.model.layers[0].mlp.experts.gate_up_proj.shape == (2, 32, 32)
    _roundtrip(both, model, tmp_path)


def test_expert_pruning_refusals():
    model = _mixtral()
    with pytest.raises(ValueError, match=r"router 'model.layers.0.mlp.gate' picks 2 experts per token"):
        moe.experts(model, 0.75, calibration=[IDS])
    with pytest.raises(ValueError, match="calibration"):
        moe.experts(model, 0.5, calibration=[])
    with pytest.raises(ValueError, match="no mixture-of-experts block"):
        moe.experts(_phi3(), 0.5, calibration=[IDS])
