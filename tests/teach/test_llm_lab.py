"""Lab 60's exercise checks (workbench.teach.llm): each rejects a plausible wrong implementation with its specific
hint and accepts the worked solution, whose expected value comes from the package."""
import pytest
import torch

from workbench import teach
from workbench.quantization import formats, packing
from workbench.teach import llm as L


def _worked(checker, *args, **kwargs):
    """The check filled by its worked solution (as the lab's regression run does)."""
    teach.use_solutions(True)
    try:
        return checker(..., *args, **kwargs)
    finally:
        teach.use_solutions(False)


def _activations(seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(64, 48, generator=g)
    X[:, 7] *= 30                                                                   # an outlier channel
    return X


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2)


SHAPES = {"a": (96, 64), "b": (64, 192)}


def test_weight_bytes_rejects_the_codes_alone_and_accepts_the_worked_solution():
    codes = (96 * 64 + 64 * 192) // 2
    fb = L.check_weight_bytes(codes, SHAPES, bits=4, group_size=64)
    assert fb.status == "failed" and "2-byte fp16 scale" in fb.hint
    assert _worked(L.check_weight_bytes, SHAPES, bits=4, group_size=64).passed
    assert L.weight_bytes(SHAPES, formats.IntFormat(4, 64)) == codes + (96 * 1 + 64 * 3) * 2


def test_roofline_bound_rejects_ignoring_the_kv_cache():
    fb = L.check_roofline_bound(10e9 / 5e6, 10e9, 5e6, 1e6)
    assert fb.status == "failed" and "KV cache" in fb.hint
    assert _worked(L.check_roofline_bound, 10e9, 5e6, 1e6).passed


def test_per_token_rejects_per_tensor_and_the_127_grid_and_tolerates_rounding_ties():
    X = _activations()
    s = X.abs().max() / 127.5
    per_tensor = torch.clamp(torch.round(X / s), -128, 127) * s
    fb = L.check_per_token(per_tensor, X)
    assert fb.status == "failed" and "whole tensor" in fb.hint
    s127 = X.abs().amax(1, keepdim=True) / 127
    fb = L.check_per_token(torch.clamp(torch.round(X / s127), -128, 127) * s127, X)
    assert fb.status == "failed" and "127.5" in fb.hint
    assert _worked(L.check_per_token, X).passed
    s_tok = X.abs().amax(1, keepdim=True) / 127.5                 # division instead of the reciprocal: ties may flip
    assert L.check_per_token(torch.clamp(torch.round(X / s_tok), -128, 127) * s_tok, X).passed


def test_per_channel_rejects_per_token():
    X = _activations()
    s = X.abs().amax(1, keepdim=True) / 127.5
    fb = L.check_per_channel(torch.clamp(torch.round(X * (1 / s)), -128, 127) * s, X)
    assert fb.status == "failed" and "per token" in fb.hint
    assert _worked(L.check_per_channel, X).passed


def test_group_scales_reject_the_qmax_7_grid_and_match_the_package():
    W = torch.randn(16, 128, generator=torch.Generator().manual_seed(2))
    fb = L.check_group_scales(W.reshape(16, 2, 64).abs().amax(2) / 7, W, group_size=64)
    assert fb.status == "failed" and "7.5" in fb.hint
    assert _worked(L.check_group_scales, W, group_size=64).passed


def test_int4_pack_rejects_swapped_nibbles():
    codes = torch.randint(0, 16, (8, 32), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    c = codes.reshape(8, 16, 2)
    fb = L.check_int4_pack((c[..., 0] << 4) | c[..., 1], codes)
    assert fb.status == "failed" and "swapped" in fb.hint
    fb = _worked(L.check_int4_pack, codes)
    assert fb.passed and torch.equal(packing.unpack(fb.answer, 4, 32), codes)


def test_nf4_rejects_the_uniform_int4_grid():
    W = torch.randn(8, 128, generator=torch.Generator().manual_seed(4))
    int4 = formats.IntFormat(4, 64)
    fb = L.check_nf4(formats.decode(formats.encode(W, int4), int4, 128), W, group_size=64)
    assert fb.status == "failed" and "normal-quantile" in fb.hint
    assert _worked(L.check_nf4, W, group_size=64).passed


def test_kv_quantizer_rejects_one_scale_per_head():
    k = torch.randn(1, 2, 10, 16, generator=torch.Generator().manual_seed(5))
    s = k.abs().amax(dim=(2, 3), keepdim=True) / 127.5
    fb = L.check_kv_quantizer(torch.clamp(torch.round(k / s), -128, 127) * s, k)
    assert fb.status == "failed" and "per head" in fb.hint
    assert _worked(L.check_kv_quantizer, k).passed


def test_kv_bytes_reject_counting_query_heads():
    cfg = _config()                                                # 3 layers, 2 kv heads of 16
    fb = L.check_kv_bytes(2 * 3 * 4 * 16 * 2, cfg, bytes_per_value=2)
    assert fb.status == "failed" and "num_key_value_heads" in fb.hint
    fb = _worked(L.check_kv_bytes, cfg, bytes_per_value=2)
    assert fb.passed and fb.answer == 2 * 3 * 2 * 16 * 2


def test_activation_errors_rank_the_scale_granularities_on_an_outlier_channel():
    X = _activations()
    W = torch.randn(24, 48, generator=torch.Generator().manual_seed(6))
    table = L.activation_errors(X, W, ratio=4.0).set_index("scales")["output error"]
    assert table["per channel"] < table["per token"] < table["per tensor"]
    split = table[[k for k in table.index if k.startswith("LLM.int8")][0]]
    assert split < table["per token"]                              # the outlier channel kept in float


def test_attention_inputs_record_one_layer_as_its_cache_holds_it_and_restore_the_attention():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config()).eval()
    ids = torch.randint(1, 64, (1, 20), generator=torch.Generator().manual_seed(7))
    q, k, v, scaling = L.attention_inputs(model, ids, layer=1)
    assert q.shape == (1, 4, 20, 16) and k.shape == v.shape == (1, 2, 20, 16) and scaling == pytest.approx(0.25)
    assert model.config._attn_implementation == "sdpa"
    with torch.inference_mode():
        cache = model(ids, use_cache=True).past_key_values
    assert torch.allclose(cache.layers[1].keys, k) and torch.allclose(cache.layers[1].values, v)
    errors = L.kv_errors(q, k, v, scaling).set_index("format")["keys + values"]
    assert 0 < errors["int8 per token"] < errors["fp8 e4m3fn per token"]
    with pytest.raises(ValueError, match="layers"):
        L.attention_inputs(model, ids, layer=9)
