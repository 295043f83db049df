"""Canonical layers: Hugging Face Conv1D -> nn.Linear, nn.MultiheadAttention -> SplitMultiheadAttention; outputs
equal to the originals (fp32 rounding), drop-in inside PyTorch's Transformer layers under inference_mode."""
import copy
import itertools

import pytest
import torch
from torch import nn

from workbench.models.canonical import SplitMultiheadAttention, canonicalize, conv1d_to_linear, needs_canonical

ATOL = 2e-5


def _close(a, b, atol=ATOL):
    assert a.shape == b.shape
    assert torch.allclose(a, b, atol=atol, rtol=1e-5), (a - b).abs().max().item()


# ----------------------------------------------------------------------------------------------------------------
# Conv1D

def test_conv1d_to_linear_same_output_and_shared_weight_stays_shared():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    a, b = Conv1D(7, 5), Conv1D(7, 5)
    b.weight = a.weight                                        # tied
    x = torch.randn(3, 4, 5)
    shared = {}
    la, lb = conv1d_to_linear(a, shared), conv1d_to_linear(b, shared)
    assert isinstance(la, nn.Linear) and (la.in_features, la.out_features) == (5, 7)
    _close(la(x), a(x), atol=1e-6)
    assert la.weight is lb.weight and la.bias is a.bias
    assert needs_canonical(a) and not needs_canonical(la)


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    return GPT2LMHeadModel(cfg).eval()


def test_gpt2_canonical_same_logits_tied_head_and_stable_names():
    model = _tiny_gpt2()
    ids = torch.randint(0, 97, (2, 11))
    with torch.inference_mode():
        ref = model(ids).logits
    canon = copy.deepcopy(model)
    changed = canonicalize(canon)
    assert sorted(changed) == sorted(f"transformer.h.{i}.{m}" for i in range(2)
                                     for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    assert changed["transformer.h.0.attn.c_attn"] == "Conv1D(nx=32, nf=96) -> Linear(32, 96)"
    assert not any(needs_canonical(m) for m in canon.modules())
    assert canon.lm_head.weight is canon.transformer.wte.weight            # still tied
    with torch.inference_mode():
        _close(canon(ids).logits, ref, atol=1e-4)
    again = copy.deepcopy(model)
    assert canonicalize(again) == changed                                  # deterministic
    sd1, sd2 = canon.state_dict(), again.state_dict()
    assert list(sd1) == list(sd2) and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    for m in model.modules():                                              # the original untouched
        assert not isinstance(m, nn.Linear) or m is model.lm_head


# ----------------------------------------------------------------------------------------------------------------
# MultiheadAttention

def _pair(**kw):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(**kw).eval()
    if mha.in_proj_bias is not None:                              # non-zero biases, so a mix-up would show
        nn.init.normal_(mha.in_proj_bias)
        nn.init.normal_(mha.out_proj.bias)
    return mha, SplitMultiheadAttention.from_mha(mha)


def _inputs(E, kdim, vdim, N, L, S, batch_first, batched=True):
    def t(n, e):
        if not batched:
            return torch.randn(n, e)
        return torch.randn(N, n, e) if batch_first else torch.randn(n, N, e)
    return t(L, E), t(S, kdim), t(S, vdim)


@pytest.mark.parametrize("batch_first,bias,kv,extra", list(itertools.product(
    (False, True), (True, False), ("same", "other"), ("none", "bias_kv", "zero_attn", "both"))))
def test_split_mha_matches_original(batch_first, bias, kv, extra):
    E, H, N, L, S = 16, 4, 3, 5, 5 if kv == "same" else 6
    kdim, vdim = (E, E) if kv == "same" else (10, 12)
    mha, split = _pair(embed_dim=E, num_heads=H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first,
                       add_bias_kv=extra in ("bias_kv", "both"), add_zero_attn=extra in ("zero_attn", "both"))
    q, k, v = _inputs(E, kdim, vdim, N, L, S, batch_first)
    kpm = torch.zeros(N, S, dtype=torch.bool)
    kpm[0, -2:] = True
    am_bool = torch.triu(torch.ones(L, S, dtype=torch.bool), diagonal=1 + S - L)
    am_float3 = torch.randn(N * H, L, S)
    for kw in ({}, {"key_padding_mask": kpm}, {"attn_mask": am_bool}, {"attn_mask": am_float3},
               {"attn_mask": am_bool, "key_padding_mask": kpm},
               {"attn_mask": am_float3, "key_padding_mask": kpm.float() * -1e9}):
        for need, avg in ((True, True), (True, False), (False, True)):
            o1, w1 = mha(q, k, v, need_weights=need, average_attn_weights=avg, **kw)
            o2, w2 = split(q, k, v, need_weights=need, average_attn_weights=avg, **kw)
            _close(o2, o1)
            assert (w1 is None) == (w2 is None)
            if w1 is not None:
                _close(w2, w1)


def test_split_mha_unbatched_causal_and_self_attention_under_inference_mode():
    mha, split = _pair(embed_dim=16, num_heads=2, batch_first=True)
    x = torch.randn(7, 16)
    causal = nn.Transformer.generate_square_subsequent_mask(7)
    for need in (True, False):
        _close(split(x, x, x, attn_mask=causal, is_causal=True, need_weights=need)[0],
               mha(x, x, x, attn_mask=causal, is_causal=True, need_weights=need)[0])
    xb = torch.randn(2, 7, 16)
    kpm = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])
    with torch.inference_mode():                                      # nn.MHA's own fast path on the original
        o1, _ = mha(xb, xb, xb, key_padding_mask=kpm, need_weights=False)
        o2, _ = split(xb, xb, xb, key_padding_mask=kpm, need_weights=False)
    _close(o2, o1)
    with pytest.raises(RuntimeError, match="is_causal"):
        split(x, x, x, is_causal=True)


def test_split_mha_names_and_compat_attributes():
    mha, split = _pair(embed_dim=8, num_heads=2)
    assert [n for n, _ in split.named_children()] == ["q_proj", "k_proj", "v_proj", "out_proj"]
    assert split.in_proj_weight is None and split._qkv_same_embed_dim is False
    _close(split.in_proj_bias, mha.in_proj_bias, atol=0)
    assert split.out_proj.weight is mha.out_proj.weight
    _, nobias = _pair(embed_dim=8, num_heads=2, bias=False)
    assert nobias.in_proj_bias is None


def test_split_mha_dropout_only_in_training():
    mha, split = _pair(embed_dim=16, num_heads=4, dropout=0.5)
    q = torch.randn(5, 2, 16)
    ref = mha(q, q, q)[0]
    _close(split(q, q, q)[0], ref)                                     # eval: no dropout
    split.train()
    for need in (True, False):
        a, b = split(q, q, q, need_weights=need)[0], split(q, q, q, need_weights=need)[0]
        assert not torch.allclose(a, b) and not torch.allclose(a, ref)


def _padding_batch(batch_first):
    torch.manual_seed(1)
    x = torch.randn(3, 6, 16) if batch_first else torch.randn(6, 3, 16)
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    kpm[2, 2:] = True
    return x, kpm


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "grad"])
def test_transformer_encoder_drop_in(batch_first, mode):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=batch_first)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x, kpm = _padding_batch(batch_first)
    ctx = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}[mode]
    canon = copy.deepcopy(enc)
    changed = canonicalize(canon)
    assert "layers.0.self_attn" in changed and "layers.1.self_attn" in changed
    keep = ~kpm if batch_first else ~kpm.t()                           # the fast path zeroes padded positions
    with ctx():
        for kw in ({}, {"src_key_padding_mask": kpm}):
            ref, out = enc(x, **kw), canon(x, **kw)
            _close(out[keep], ref[keep], atol=5e-5)
        causal = nn.Transformer.generate_square_subsequent_mask(6)
        _close(canon(x, mask=causal, is_causal=True), enc(x, mask=causal, is_causal=True), atol=5e-5)
        single = canon.layers[0]                                        # the layer alone, own fast path check
        _close(single(x, src_key_padding_mask=kpm)[keep], enc.layers[0](x, src_key_padding_mask=kpm)[keep], 5e-5)


def test_transformer_decoder_layer_drop_in():
    torch.manual_seed(0)
    dec = nn.TransformerDecoderLayer(16, 2, dim_feedforward=24, dropout=0.0, batch_first=True).eval()
    canon = copy.deepcopy(dec)
    assert sorted(canonicalize(canon)) == ["multihead_attn", "self_attn"]
    tgt, mem = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    mem_kpm = torch.zeros(2, 7, dtype=torch.bool)
    mem_kpm[1, 5:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    with torch.inference_mode():
        _close(canon(tgt, mem, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=mem_kpm),
               dec(tgt, mem, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=mem_kpm), atol=5e-5)


def test_shared_module_converted_once_and_errors_name_the_module():
    mha = nn.MultiheadAttention(8, 2)
    model = nn.ModuleDict({"a": mha, "b": mha, "lin": nn.Linear(3, 3)})
    changed = canonicalize(model)
    assert sorted(changed) == ["a", "b"] and model["a"] is model["b"]
    with pytest.raises(ValueError, match="'lin' is a Linear"):
        canonicalize(model, names=["lin"])
    with pytest.raises(ValueError, match="no module named 'nope'"):
        canonicalize(model, names=["nope"])
    with pytest.raises(ValueError, match="the model itself"):
        canonicalize(nn.MultiheadAttention(8, 2))
    only = nn.ModuleDict({"a": nn.MultiheadAttention(8, 2), "b": nn.MultiheadAttention(8, 2)})
    assert list(canonicalize(only, names=["b"])) == ["b"] and isinstance(only["a"], nn.MultiheadAttention)
    x = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(2, 8)])
    with pytest.raises(ValueError, match="nested"):
        model["a"](x, x, x)


def test_full_transformer_and_compressed_projection_drop_in():
    """nn.Transformer (encoder fast path + decoder) after canonicalising; then a projection swapped for a W8A8
    layer, which is what canonical form is for."""
    from workbench.quantization.modules import W8A8Linear

    torch.manual_seed(0)
    tr = nn.Transformer(16, 2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32, dropout=0.0,
                        batch_first=True).eval()
    canon = copy.deepcopy(tr)
    changed = canonicalize(canon)
    assert sorted(changed) == ["decoder.layers.0.multihead_attn", "decoder.layers.0.self_attn", "encoder",
                               "encoder.layers.0.self_attn"]
    src, tgt = torch.randn(2, 6, 16), torch.randn(2, 4, 16)
    causal = nn.Transformer.generate_square_subsequent_mask(4)
    with torch.inference_mode():
        ref = tr(src, tgt, tgt_mask=causal, tgt_is_causal=True)
        _close(canon(src, tgt, tgt_mask=causal, tgt_is_causal=True), ref, atol=5e-5)
        attn = canon.encoder.layers[0].self_attn
        attn.q_proj = W8A8Linear.from_float(attn.q_proj, name="encoder.layers.0.self_attn.q_proj")
        out = canon(src, tgt, tgt_mask=causal, tgt_is_causal=True)
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0)
    assert cos > 0.999 and not torch.equal(out, ref)
