"""Structured and head pruning on Hugging Face models built from tiny random configs (GPT-2 with Conv1D, Llama with
SwiGLU and grouped-query attention, BERT, T5, ViT) and on nn.TransformerEncoder: feed-forward blocks found, heads
and channels really removed, bookkeeping updated, forward under inference_mode, exact where the removed units were
dead, save -> load identical, clear refusals."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.pruning.head_layouts import LAYOUTS, _out_view
from workbench.pruning.structured import out_in, run

T = pytest.importorskip("transformers")

IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))


def _model(arch):
    torch.manual_seed(0)
    if arch == "gpt2":
        m = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                           bos_token_id=0, eos_token_id=0))
        batch = {"input_ids": IDS}
    elif arch == "llama":
        m = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))
        batch = {"input_ids": IDS}
    elif arch == "bert":
        m = T.BertModel(T.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=16))
        batch = {"input_ids": IDS}
    elif arch == "t5":
        m = T.T5Model(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                                 num_heads=4))
        batch = {"input_ids": IDS, "decoder_input_ids": IDS}
    else:
        m = T.ViTModel(T.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=48))
        batch = {"pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))}
    return m.eval(), batch


ARCHS = ["gpt2", "llama", "bert", "t5", "vit"]
FFN = {"gpt2": ("transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"),
       "llama": ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj"),
       "bert": ("encoder.layer.0.intermediate.dense", "encoder.layer.0.output.dense"),
       "t5": ("encoder.block.0.layer.1.DenseReluDense.wi", "encoder.block.0.layer.1.DenseReluDense.wo"),
       "vit": ("layers.0.mlp.fc1", "layers.0.mlp.fc2")}


def _params(m):
    return sum(p.numel() for p in m.parameters())


def _out(model, batch):
    with torch.inference_mode():
        return run(model, batch)


def _zero_out_channels(layer, idx):
    with torch.no_grad():
        _out_view(layer)[idx] = 0
        if layer.bias is not None:
            layer.bias[idx] = 0


@pytest.mark.parametrize("arch", ARCHS)
def test_ffn_channels(arch, tmp_path):
    model, batch = _model(arch)
    consumers = wb.prune.transformer_ffn_consumers(model)
    producer, consumer = FFN[arch]
    assert consumers[producer] == [consumer] and len({c[0] for c in consumers.values()}) == 2 * (1 + (arch == "t5"))
    ref = _out(model, batch)
    # half of every block's hidden channels dead (their producers' rows zero): l1 removes exactly those
    for p in consumers:
        _zero_out_channels(model.get_submodule(p), torch.arange(0, out_in(model.get_submodule(p))[0], 2))
    dead_ref = _out(model, batch)
    small = wb.prune.channels(model, {p: 0.5 for p in consumers}, consumers=consumers)
    torch.testing.assert_close(_out(small, batch), dead_ref, rtol=1e-4, atol=1e-5)
    assert _params(small) < _params(model) and wb.size_bytes(small) < wb.size_bytes(model)
    fresh, _ = _model(arch)                         # on live weights pruning changes the output
    pruned = wb.prune.channels(fresh, {p: 0.5 for p in consumers}, consumers=consumers)
    out = _out(pruned, batch)
    assert (out - ref).norm() / ref.norm() > 1e-3
    torch.testing.assert_close(_out(fresh, batch), ref, rtol=0, atol=0)      # the input model is untouched
    again = wb.load(wb.save(pruned, tmp_path / "ffn.safetensors"), base=fresh)
    assert torch.equal(_out(again, batch), out)


def test_llama_gate_and_up_are_cut_together():
    model, batch = _model("llama")
    small = wb.prune.channels(model, {"model.layers.*.mlp.gate_proj": 0.25},
                              consumers=wb.prune.transformer_ffn_consumers(model), criterion="taylor",
                              calibration=[batch])
    mlp = small.model.layers[1].mlp
    assert mlp.gate_proj.out_features == mlp.up_proj.out_features == mlp.down_proj.in_features == 36
    with pytest.raises(ValueError, match="must be pruned alike"):
        wb.prune.channels(model, {"model.layers.0.mlp.gate_proj": 0.25, "model.layers.0.mlp.up_proj": 0.5},
                          consumers=wb.prune.transformer_ffn_consumers(model))


def _kill_head(model, unit):
    """Zero the values of ``unit`` in every attention block: that head (key/value group) contributes nothing."""
    for name, m in model.named_modules():
        lay = next((lay for lay in LAYOUTS if lay.match(m)), None)
        if lay is not None:
            layer, rows = lay.values(m, unit)
            _zero_out_channels(layer, rows)


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_heads(arch, tmp_path):
    model, batch = _model(arch)
    ref = _out(model, batch)
    per = 2 if arch == "llama" else 1               # Llama here: 4 query heads sharing 2 key/value heads
    fewer = wb.prune.attention_heads(model, per, [batch])
    out = _out(fewer, batch)
    assert (out - ref).norm() / ref.norm() > 1e-3
    assert _params(fewer) < _params(model)
    torch.testing.assert_close(_out(model, batch), ref, rtol=0, atol=0)
    kept = wb.applied_plans(fewer)[-1]
    assert set(kept.values()) == {wb.prune.KeptHeads(heads=4 - per)}
    again = wb.load(wb.save(fewer, tmp_path / "heads.safetensors"), base=model)
    assert torch.equal(_out(again, batch), out)
    # a dead head is the one removed, and removing it changes nothing
    _kill_head(model, 1)
    dead_ref = _out(model, batch)
    exact = wb.prune.attention_heads(model, per, [batch])
    torch.testing.assert_close(_out(exact, batch), dead_ref, rtol=1e-4, atol=1e-5)
    if arch == "gpt2":
        attn = exact.transformer.h[0].attn
        assert (attn.num_heads, attn.split_size, attn.c_attn.weight.shape) == (3, 24, (72, 32))
        assert type(attn.c_attn) is nn.Linear and type(exact.transformer.h[0].mlp.c_fc).__name__ == "Conv1D"
    elif arch == "llama":
        attn = exact.model.layers[0].self_attn
        assert attn.k_proj.out_features == 8 and attn.q_proj.out_features == 16 and attn.num_key_value_groups == 2
    elif arch == "bert":
        sa = exact.encoder.layer[0].attention.self
        assert (sa.num_attention_heads, sa.all_head_size, sa.query.out_features) == (3, 24, 24)
    elif arch == "t5":
        first = exact.encoder.block[0].layer[0].SelfAttention
        assert first.n_heads == 3 and first.relative_attention_bias.weight.shape[1] == 3
        assert exact.decoder.block[1].layer[1].EncDecAttention.n_heads == 3


def test_head_pruning_refusals():
    model, batch = _model("llama")
    with pytest.raises(ValueError, match="grouped-query attention.*multiple of 2"):
        wb.prune.attention_heads(model, 1, [batch])
    with pytest.raises(ValueError, match="would remove every head"):
        wb.prune.attention_heads(model, 4, [batch])
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2,
                                enable_nested_tensor=False)
    with pytest.raises(ValueError, match="'layers.0.self_attn' is an nn.MultiheadAttention"):
        wb.prune.attention_heads(enc, 1, [torch.randn(2, 5, 32)])
    with pytest.raises(wb.ApplyError, match="KeptHeads records what wb.prune.attention_heads removed"):
        wb.apply(model, {"model.layers.0.self_attn": wb.prune.KeptHeads(2)})


def test_transformer_encoder_ffn_and_the_fx_error():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2,
                                enable_nested_tensor=False).eval()
    x = torch.randn(3, 7, 32)
    # fx cannot trace the encoder: its feed-forward blocks are found by structure; a layer outside them is refused
    # with the fx error, naming the layer and pointing to consumers=
    auto = wb.prune.channels(enc, {"layers.0.linear1": 0.5})
    assert auto.layers[0].linear1.out_features == 32 and auto.layers[0].linear2.in_features == 32
    with pytest.raises(ValueError, match="could not be traced.*consumers=.*layers.0.self_attn.out_proj"):
        wb.prune.channels(enc, {"layers.0.self_attn.out_proj": 0.5})
    consumers = wb.prune.transformer_ffn_consumers(enc)
    assert consumers == {"layers.0.linear1": ["layers.0.linear2"], "layers.1.linear1": ["layers.1.linear2"]}
    small = wb.prune.channels(enc, {"layers.*.linear1": 0.5}, consumers=consumers, criterion="taylor",
                              calibration=[x])
    assert small.layers[0].linear1.out_features == 32 and small.layers[1].linear2.in_features == 32
    with torch.inference_mode():
        fast, ref = small(x), enc(x)                 # the fused path with the smaller feed-forward
    assert (fast - ref).norm() / ref.norm() > 1e-3
    with torch.no_grad():
        torch.testing.assert_close(small.train()(x), fast, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="found no transformer feed-forward block.*consumers="):
        wb.prune.transformer_ffn_consumers(nn.Sequential(nn.Linear(4, 4)))
