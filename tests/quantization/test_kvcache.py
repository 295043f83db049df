"""KV-cache quantization (workbench.quantization.kvcache): round-trip bounds, scale shapes, bytes, and a Hugging Face
Llama attending to its quantized cache."""
import pytest
import torch
from torch import nn

from workbench.quantization import kvcache
from workbench.quantization.kvcache import KVCacheFormat

SCALES = ("token", "head", "channel")


def _kv(seed=0, shape=(2, 3, 17, 8)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 5] *= 20                                                   # an outlier channel, as keys have
    return x


@pytest.mark.parametrize("per, scale_shape", [("token", (2, 3, 17, 1)), ("head", (2, 3, 1, 1)),
                                              ("channel", (2, 3, 1, 8))])
def test_int8_scales_follow_the_granularity_and_the_error_is_at_most_half_a_step(per, scale_shape):
    x = _kv()
    q, scale = kvcache.quantize(x, KVCacheFormat(torch.int8, per))
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.shape == scale_shape
    err = (kvcache.dequantize(q, scale) - x).abs()
    assert bool((err <= scale * (0.5 + 1e-4)).all())                  # (the top value sits on a half step)
    assert int(q.abs().max()) >= 127                                  # the largest magnitude uses the grid's edge


def test_fp8_e4m3_round_trip_is_within_its_relative_precision():
    x = _kv()
    y = kvcache.fake_quantize(x, KVCacheFormat(torch.float8_e4m3fn, "token"))
    q, scale = kvcache.quantize(x, KVCacheFormat(torch.float8_e4m3fn, "token"))
    assert q.dtype == torch.float8_e4m3fn
    normal = x.abs() > scale * 2 ** -6                                # e4m3's smallest normal, in x's units
    assert bool(((y - x).abs()[normal] <= x.abs()[normal] * 2 ** -4 + 1e-7).all())   # 3 mantissa bits


def test_finer_scales_are_more_accurate_on_outlier_channels():
    x = _kv()
    err = {p: float((kvcache.fake_quantize(x, KVCacheFormat(torch.int8, p)) - x).pow(2).sum()) for p in SCALES}
    assert err["channel"] < err["token"] < err["head"]


def test_bad_formats_and_tensors_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="dtype"):
        KVCacheFormat(torch.float16)
    with pytest.raises(ValueError, match="per"):
        KVCacheFormat(torch.int8, "row")
    with pytest.raises(ValueError, match="kv_heads"):
        kvcache.quantize(torch.randn(3, 4), KVCacheFormat())
    with pytest.raises(ValueError, match="context"):
        kvcache.cache_bytes(_config(), -1)


def _config(**kw):
    from transformers import LlamaConfig

    args = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
    args.update(kw)
    return LlamaConfig(**args)


def test_bytes_count_keys_and_values_of_every_layer_and_kv_head():
    cfg = _config()                                                  # 2 layers, 2 kv heads of dim 8
    assert kvcache.bytes_per_position(cfg) == 2 * 2 * 2 * 8 * 2      # fp16
    assert kvcache.bytes_per_position(cfg, KVCacheFormat(torch.int8, "token")) == 2 * 2 * 2 * 8 + 2 * 2 * 2 * 4
    assert kvcache.cache_bytes(cfg, 10, KVCacheFormat(torch.int8, "head")) == 10 * 64 + 2 * 2 * 2 * 4
    assert kvcache.cache_bytes(cfg, 10, KVCacheFormat(torch.int8, "channel")) == 10 * 64 + 2 * 2 * 2 * 8 * 4


def _llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config()).eval()


def test_a_llama_attends_to_its_quantized_cache_and_gets_its_attention_back():
    model = _llama()
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.inference_mode():
        ref = model(ids).logits
        with kvcache.quantized_kv_cache(model, KVCacheFormat(torch.int8, "token")):
            int8 = model(ids).logits
        with kvcache.quantized_kv_cache(model, KVCacheFormat(torch.float8_e4m3fn, "head")):
            fp8 = model(ids).logits
        again = model(ids).logits
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(again, ref)
    rel = {k: float((v - ref).norm() / ref.norm()) for k, v in (("int8", int8), ("fp8", fp8))}
    assert 0 < rel["int8"] < 0.01 and 0 < rel["fp8"] < 0.1 and rel["int8"] < rel["fp8"]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())   # weights untouched


def test_the_attention_is_restored_after_an_error_and_non_hf_models_are_refused():
    model = _llama()
    with pytest.raises(RuntimeError, match="boom"):
        with kvcache.quantized_kv_cache(model, KVCacheFormat()):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(TypeError, match="pluggable attention"):
        with kvcache.quantized_kv_cache(nn.Linear(2, 2), KVCacheFormat()):
            pass
    with pytest.raises(TypeError, match="KVCacheFormat"):
        with kvcache.quantized_kv_cache(model, "int8"):
            pass


def test_fewer_bits_use_the_same_grid_with_fewer_levels_and_count_fewer_bytes():
    x = torch.tensor([0.5, 1.5, 2.5, -7.5, 7.0, 0.0, 3.49, -0.5]).reshape(1, 1, 1, 8)   # max|x| 7.5: scale 1 at 4 bits
    q, scale = kvcache.quantize(x, KVCacheFormat(torch.int8, "token", bits=4))
    assert scale.item() == 1.0
    assert q.flatten().tolist() == [0, 2, 2, -8, 7, 0, 3, 0]        # round half to even, codes in [-8, 7]
    q3, scale3 = kvcache.quantize(x, KVCacheFormat(torch.int8, "token", bits=3))
    assert scale3.item() == pytest.approx(7.5 / 3.5) and int(q3.min()) == -4 and int(q3.max()) <= 3
    cfg = _config()
    int4 = KVCacheFormat(torch.int8, "token", bits=4)
    assert kvcache.bytes_per_position(cfg, int4) == 2 * 2 * 2 * 8 / 2 + 2 * 2 * 2 * 4   # half a byte a value
    assert KVCacheFormat(bits=4, rotate=True).label == "int4 per token, rotated"
    for bad in (dict(bits=1), dict(bits=9), dict(dtype=torch.float8_e4m3fn, bits=4)):
        with pytest.raises(ValueError, match="bits"):
            KVCacheFormat(**bad)


def test_rotated_keys_and_values_give_the_same_attention_before_rounding(monkeypatch):
    """With the rounding replaced by the identity, the rotated cache computes exactly the attention it had (queries
    and keys turned alike, values turned back at the output); with 3-bit rounding it is a different model (the
    rotation really acts)."""
    model = _llama()
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = model(ids).logits
        with kvcache.quantized_kv_cache(model, KVCacheFormat(bits=3, rotate=True)):
            turned3 = model(ids).logits
        with kvcache.quantized_kv_cache(model, KVCacheFormat(bits=3)):
            plain3 = model(ids).logits
        monkeypatch.setattr(kvcache, "fake_quantize", lambda x, fmt: x)
        with kvcache.quantized_kv_cache(model, KVCacheFormat(bits=3, rotate=True)):
            turned = model(ids).logits
    torch.testing.assert_close(turned, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(turned3, plain3, atol=1e-4)


def _generate(model, ids, **kw):
    with torch.inference_mode():
        return model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                              return_dict_in_generate=True, output_scores=True, **kw)


@pytest.mark.parametrize("fmt", [KVCacheFormat(), KVCacheFormat(bits=4), KVCacheFormat(bits=3), KVCacheFormat(bits=2),
                                 KVCacheFormat(torch.float8_e4m3fn)], ids=lambda f: f.label)
def test_the_stored_cache_computes_what_the_fake_quantized_one_does_and_holds_its_bytes(fmt):
    """Each token quantized once with its own scale and stored (packed below 8 bits) is what `quantized_kv_cache`
    attends to: greedy generation gives the same tokens and the same scores, bit for bit; the cache holds exactly
    `cache_bytes` of the tokens it saw."""
    model = _llama()
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    cache = kvcache.QuantizedKVCache(model, fmt)
    stored = _generate(model, ids, past_key_values=cache)
    with kvcache.quantized_kv_cache(model, fmt):
        fake = _generate(model, ids)
    assert torch.equal(stored.sequences, fake.sequences)
    assert all(torch.equal(a, b) for a, b in zip(stored.scores, fake.scores))
    tokens = stored.sequences.shape[1] - 1   # (the last token is generated, never cached)
    assert cache.nbytes() == 2 * kvcache.cache_bytes(model.config, tokens, fmt)   # batch 2
    if fmt.bits < 8:
        assert cache.layers[0]._quantized_keys[0].dtype == torch.uint8    # packed codes
        assert cache.layers[0]._quantized_keys[0].shape[-1] == 8 * fmt.slot_bits // 8


def test_the_stored_rotated_cache_turns_back_exactly_and_beams_reorder(monkeypatch):
    model = _llama()
    ids = torch.randint(1, 64, (1, 9), generator=torch.Generator().manual_seed(4))
    plain = _generate(model, ids)
    turned4 = _generate(model, ids, past_key_values=kvcache.QuantizedKVCache(model, KVCacheFormat(bits=2,
                                                                                                   rotate=True)))
    flat4 = _generate(model, ids, past_key_values=kvcache.QuantizedKVCache(model, KVCacheFormat(bits=2)))
    assert not all(torch.equal(a, b) for a, b in zip(turned4.scores, flat4.scores))   # the rotation acts
    beams = _generate(model, ids, num_beams=3, past_key_values=kvcache.QuantizedKVCache(model, KVCacheFormat()))
    with kvcache.quantized_kv_cache(model, KVCacheFormat()):
        assert torch.equal(beams.sequences, _generate(model, ids, num_beams=3).sequences)
    # with the rounding taken out, the rotated storage gives back exactly the attention of the float model
    monkeypatch.setattr(kvcache, "quantize", lambda x, fmt: (x.float(), torch.ones(*x.shape[:-1], 1)))
    turned = _generate(model, ids, past_key_values=kvcache.QuantizedKVCache(model, KVCacheFormat(rotate=True)))
    assert torch.equal(turned.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(turned.scores), torch.stack(plain.scores), rtol=1e-5, atol=1e-5)


def test_the_stored_cache_refuses_scales_that_would_change_and_other_models():
    with pytest.raises(ValueError, match="per-token"):
        kvcache.QuantizedKVCache(_llama(), KVCacheFormat(per="head"))
    with pytest.raises(TypeError, match="transformers decoder"):
        kvcache.QuantizedKVCache(nn.Linear(2, 2), KVCacheFormat())
    with pytest.raises(TypeError, match="KVCacheFormat"):
        kvcache.QuantizedKVCache(_llama(), "int8")


def test_the_stored_cache_crops_and_repeats_what_it_stores():
    """What assisted decoding and batch expansion do to a cache: cropping the last tokens and feeding them again gives
    the same logits and the same stored bytes as the first time; repeating the batch repeats codes and scales."""
    model = _llama()
    ids = torch.randint(1, 64, (1, 10), generator=torch.Generator().manual_seed(5))
    fmt = KVCacheFormat(bits=4)
    with torch.inference_mode():
        cache = kvcache.QuantizedKVCache(model, fmt)
        model(ids[:, :7], past_key_values=cache)
        first = model(ids[:, 7:], past_key_values=cache).logits
        held = cache.nbytes()
        cache.crop(-3)   # (transformers: a negative count of tokens to remove)
        assert cache.get_seq_length() == 7 and cache.layers[0]._quantized_keys[0].shape[-2] == 7
        again = model(ids[:, 7:], past_key_values=cache).logits
        assert torch.equal(again, first) and cache.nbytes() == held
        cache.batch_repeat_interleave(3)
        assert all(t.shape[0] == 3 for t in cache.layers[1]._quantized_values)
        cache.batch_select_indices(torch.tensor([0, 2]))
        assert all(t.shape[0] == 2 for t in cache.layers[1]._quantized_values)
