"""`wb.models.load("model.gguf")`: a llama.cpp GGUF file read back as a transformers model whose Q8_0 / Q4_0 / Q4_1
tensors are the workbench's own packed layers.

Two sources of files: the workbench's exporter (a Llama, Qwen2 or GPT-2 with a plan applied, exported, loaded back:
the same codes,
fp16 scales and zero points bit for bit, the same logits, the plan recorded, and exporting again writes a byte-identical
tensor data section), and files written here with gguf-py alone the way llama.cpp's converter writes them (F32 / F16 /
BF16 floats, Q8_0 / Q4_0 blocks from gguf-py's reference quantizers, q/k rows in llama.cpp's order by the converter's
formula written out here): every loaded weight equals gguf-py's dequantization of the file bit for bit.

Tolerance: logits are compared with both models on the reference kernel, which computes with exactly the same fp32
weights through the same operations, so they are asserted equal (measured max |difference| 0).
"""
import json
import shutil

import numpy as np
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.quantization import WeightOnlyEmbedding, WeightOnlyLinear

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
T = gguf.GGMLQuantizationType

Q8 = wb.quant.WeightOnly(bits=8, group_size=32, kernel="reference")
Q4 = wb.quant.WeightOnly(bits=4, group_size=32, kernel="reference")
Q4_ASYM = wb.quant.WeightOnly(bits=4, group_size=32, symmetric=False, kernel="reference")
GRIDS = {"q8_0": (Q8, "Q8_0"), "q4_0": (Q4, "Q4_0"), "q4_1": (Q4_ASYM, "Q4_1")}


# --- models -----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    """tiny-llama's tokenizer.json alone (the exporter needs a vocabulary; the reader ignores it)."""
    from workbench.models.llama import TOKENIZER_FILE
    from workbench.paths import data_dir

    folder = tmp_path_factory.mktemp("tokenizer")
    shutil.copy(data_dir() / TOKENIZER_FILE, folder / "tokenizer.json")
    return folder


def _perturbed(model):
    torch.manual_seed(1)
    for p in model.parameters():   # (biases and norms start at zero / one: make them count)
        p.data.add_(torch.randn_like(p) * 0.02)
    return model.eval()


def _llama(**kw):
    """A small random GQA Llama (4 query / 2 kv heads) with a vocabulary the tokenizer covers."""
    cfg = dict(vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=0,
               eos_token_id=0, rms_norm_eps=1e-5, rope_theta=500000.0)
    torch.manual_seed(0)
    return _perturbed(transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg, **kw})))


def _qwen2():
    cfg = transformers.Qwen2Config(vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return _perturbed(transformers.Qwen2ForCausalLM(cfg))


def _gpt2(**kw):
    """A small random GPT-2 (Conv1D layers, fused q/k/v, learned positions, tied head by default)."""
    cfg = dict(vocab_size=4096, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return _perturbed(transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**cfg, **kw})))


GPT2_LAYERS = [f"transformer.h.{i}.{k}" for i in range(2) for k in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                     "mlp.c_proj")]


def _apply(model, config, plan):
    small = wb.apply(model, {pattern: config for pattern in plan}, progress=False)
    if not config.symmetric:   # Q4_1 holds -scale*zero as fp16: scales set to powers of two, the codes kept
        with torch.no_grad():
            for m in small.modules():
                if isinstance(m, (WeightOnlyLinear, WeightOnlyEmbedding)):
                    m.scale.copy_(torch.exp2(torch.log2(m.scale.float()).round()).half())
    return small


def _reference(model):
    for m in model.modules():
        if isinstance(m, WeightOnlyLinear):
            m.set_kernel("reference")
    return model


def _logits(model, seed=1):
    x = torch.randint(0, 4096, (1, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return _reference(model)(x).logits


# --- checks -----------------------------------------------------------------------------------------------------------

def _same_model(small, back):
    """Same structure and stored tensors bit for bit (packed codes, fp16 scales, zero points, float parameters), the
    same float config, the same logits."""
    assert type(back) is type(small) and not back.training
    want, got = small.state_dict(), back.state_dict()
    assert list(got) == list(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key
    for name, m in small.named_modules():
        assert type(back.get_submodule(name)) is type(m), name
        if isinstance(m, (WeightOnlyLinear, WeightOnlyEmbedding)):
            assert back.get_submodule(name).fmt == m.fmt, name
    SAME_CONFIG[small.config.model_type](small.config, back.config)
    assert torch.equal(_logits(back), _logits(small))


def _same_llama_config(cfg, back):
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(back, field) == getattr(cfg, field), field
    # (Qwen2's config has no head_dim unless given)
    assert back.head_dim == (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    assert back.rope_parameters["rope_theta"] == cfg.rope_parameters["rope_theta"]


def _same_gpt2_config(cfg, back):
    for field in ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "layer_norm_epsilon",
                  "activation_function", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(back, field) == getattr(cfg, field), field
    assert back.n_inner == (cfg.n_inner or 4 * cfg.n_embd)   # (the file always says; the default is 4 * n_embd)


SAME_CONFIG = {"llama": _same_llama_config, "qwen2": _same_llama_config, "gpt2": _same_gpt2_config}


def _tensor_data(path):
    """The tensor table (name, type, shape) and the tensor data section's bytes."""
    reader = gguf.GGUFReader(path)
    table = [(t.name, t.tensor_type, t.shape.tolist()) for t in reader.tensors]
    return table, path.read_bytes()[reader.data_offset:]


def _round_trip(tmp_path, small, **kw):
    """Export, load back, check; export the loaded model again: the same tensor data, byte for byte."""
    first = wb.export(small, tmp_path / "first", format="gguf", **kw) / "model.gguf"
    back = wb.models.load(first)
    # the loaded layers choose their kernel on this machine ("auto"); the comparisons below switch to the reference
    assert all(m.kernel_request == "auto" for m in back.modules() if isinstance(m, WeightOnlyLinear))
    _same_model(small, back)
    again = wb.export(back, tmp_path / "again", format="gguf", **kw) / "model.gguf"
    assert _tensor_data(again) == _tensor_data(first)
    return back


def _plan_of(back):
    """The recorded plan as {layer: (bits, group_size, symmetric)}."""
    (plan,) = wb.applied_plans(back)
    return {name: (c.bits, c.group_size, c.symmetric) for name, c in plan.items()}


# --- round trips through the workbench's exporter ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", GRIDS)
def test_gqa_llama_with_biases_round_trip(tmp_path, tokenizer_folder, kind):
    """Untied GQA Llama with attention and MLP biases (q/k rows and biases reordered in the file), every layer and
    lm_head quantized: the loaded model is the exported one."""
    config, ggml = GRIDS[kind]
    small = _apply(_llama(attention_bias=True, mlp_bias=True), config, ["model.layers.*", "lm_head"])
    back = _round_trip(tmp_path, small, base_folder=tokenizer_folder)
    assert back.config.attention_bias and back.config.mlp_bias and not back.config.tie_word_embeddings
    layers = [n for n, m in small.named_modules() if isinstance(m, WeightOnlyLinear)]
    assert len(layers) == 15 and _plan_of(back) == {n: (config.bits, 32, config.symmetric) for n in layers}
    fields = {k: f.contents() for k, f in gguf.GGUFReader(tmp_path / "again" / "model.gguf").fields.items()}
    assert json.loads(fields["general.producer.plans"]) == [p.to_dict() for p in wb.applied_plans(back)]


@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
def test_qwen2_round_trip(tmp_path, tokenizer_folder, kind):
    """Qwen2 (q/k/v biases, rows in Hugging Face's order), the embedding quantized too."""
    config, _ = GRIDS[kind]
    small = _apply(_qwen2(), config, ["model.layers.*", "model.embed_tokens"])
    back = _round_trip(tmp_path, small, base_folder=tokenizer_folder)
    assert isinstance(back, transformers.Qwen2ForCausalLM)
    assert isinstance(back.model.embed_tokens, WeightOnlyEmbedding) and isinstance(back.lm_head, nn.Linear)


def test_tiny_llama_round_trip_keeps_the_tied_embedding(tmp_path):
    """The zoo model: its tied embedding and lm_head quantized as one Q8_0 token_embd (no output tensor) come back as
    one stored copy shared by both layers; the layers Q4_0; the float model's norms F32."""
    small = _apply(wb.models.load("tiny-llama"), Q8, ["model.embed_tokens", "lm_head"])
    small = wb.apply(small, {"model.layers.*": Q4}, progress=False)
    first = wb.export(small, tmp_path / "first", format="gguf") / "model.gguf"
    assert "output.weight" not in [t.name for t in gguf.GGUFReader(first).tensors]
    back = wb.models.load(str(first))
    assert back.config.tie_word_embeddings
    embedding = back.model.embed_tokens
    assert back.lm_head.qweight is embedding.qweight and back.lm_head.scale is embedding.scale
    _same_model(small, back)
    assert {c for _, c in _plan_of(back).items()} == {(8, 32, True), (4, 32, True)}
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    from workbench.models.llama import TOKENIZER_FILE
    from workbench.paths import data_dir

    shutil.copy(data_dir() / TOKENIZER_FILE, tokenizer / "tokenizer.json")
    again = wb.export(back, tmp_path / "again", format="gguf", base_folder=tokenizer) / "model.gguf"
    assert _tensor_data(again) == _tensor_data(first)


@pytest.mark.parametrize("kind", [*GRIDS, "float"])
def test_gpt2_round_trip(tmp_path, tokenizer_folder, kind):
    """GPT-2 with its blocks quantized: the quantized attn_qkv / attn_output / ffn_up / ffn_down come back as the
    packed layers `wb.apply` made of the Conv1D layers (through a Linear), float ones as Conv1D layers holding the
    (in, out) weight again; the head tied to the embedding (no output tensor)."""
    model = _gpt2()
    small = model if kind == "float" else _apply(model, GRIDS[kind][0], ["transformer.h.*"])
    back = _round_trip(tmp_path, small, base_folder=tokenizer_folder)
    assert isinstance(back, transformers.GPT2LMHeadModel) and back.config.tie_word_embeddings
    assert back.lm_head.weight is back.transformer.wte.weight
    tensors = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "first" / "model.gguf").tensors}
    assert "output.weight" not in tensors
    if kind == "float":
        assert wb.applied_plans(back) == ()
        for name in GPT2_LAYERS:
            layer = back.get_submodule(name)
            assert type(layer) is transformers.pytorch_utils.Conv1D and layer.weight.is_contiguous(), name
        return
    config, ggml = GRIDS[kind]
    assert _plan_of(back) == {n: (config.bits, 32, config.symmetric) for n in GPT2_LAYERS}
    assert all(isinstance(back.get_submodule(n), WeightOnlyLinear) for n in GPT2_LAYERS)
    assert {n for n, t in tensors.items() if t == ggml} == {
        f"blk.{i}.{k}.weight" for i in range(2) for k in ("attn_qkv", "attn_output", "ffn_up", "ffn_down")}


def test_gpt2_untied_head_and_embeddings_quantized(tmp_path, tokenizer_folder):
    """An untied GPT-2 (an output tensor in the file) with its token and position embeddings and its head Q8_0, the
    blocks Q4_0 and one block's MLP left in floating point."""
    small = _apply(_gpt2(tie_word_embeddings=False), Q8, ["transformer.wte", "transformer.wpe", "lm_head"])
    small = wb.apply(small, {"transformer.h.1.mlp.*": None, "transformer.h.*": Q4}, progress=False)
    back = _round_trip(tmp_path, small, base_folder=tokenizer_folder)
    assert not back.config.tie_word_embeddings and isinstance(back.lm_head, WeightOnlyLinear)
    assert isinstance(back.transformer.wte, WeightOnlyEmbedding) and isinstance(back.transformer.wpe,
                                                                                 WeightOnlyEmbedding)
    assert type(back.transformer.h[1].mlp.c_fc) is transformers.pytorch_utils.Conv1D
    assert sorted({c for _, c in _plan_of(back).items()}) == [(4, 32, True), (8, 32, True)]


def test_float_model_loads_as_floats_with_no_plan(tmp_path, tokenizer_folder):
    model = _llama()
    back = _round_trip(tmp_path, model, base_folder=tokenizer_folder)
    assert wb.applied_plans(back) == () and not any(isinstance(m, WeightOnlyLinear) for m in back.modules())


# --- files written by gguf-py alone, llama.cpp's way ------------------------------------------------------------------

NAMES = {"model.embed_tokens": "token_embd", "lm_head": "output", "model.norm": "output_norm"}
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(key: str) -> str:
    """'model.layers.1.self_attn.q_proj.weight' -> 'blk.1.attn_q.weight'."""
    stem, leaf = key.rsplit(".", 1)
    if stem.startswith("model.layers."):
        i, _, rest = stem.removeprefix("model.layers.").partition(".")
        return f"blk.{i}.{BLOCK[rest]}.{leaf}"
    return f"{NAMES[stem]}.{leaf}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row reorder (convert_hf_to_gguf.py, LlamaModel.permute), as a formula."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write(path, model, arch="llama", types=None, extra=None, skip=(), hyper=None):
    """``model`` as llama.cpp's converter writes it: ``types`` (GGUF name -> ggml type; default F32) quantized by
    gguf-py's reference quantizers, ``extra`` raw tensors (name -> (uint8 bytes, type)) added, ``skip`` left out,
    ``hyper`` overriding {GGUFWriter method without add_: value}."""
    cfg = model.config
    writer = gguf.GGUFWriter(path, arch)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    values = dict(context_length=cfg.max_position_embeddings, embedding_length=cfg.hidden_size,
                  block_count=cfg.num_hidden_layers, feed_forward_length=cfg.intermediate_size,
                  head_count=cfg.num_attention_heads, head_count_kv=cfg.num_key_value_heads,
                  rope_dimension_count=head_dim, rope_freq_base=cfg.rope_parameters["rope_theta"],
                  layer_norm_rms_eps=cfg.rms_norm_eps)
    values.update(hyper or {})
    for method, value in values.items():
        getattr(writer, f"add_{method}")(value)
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads} if arch == "llama" else {}
    for key, t in model.state_dict().items():
        name = _gguf_name(key)
        if name in skip or (key == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        w = t.float().numpy()
        if name.split(".")[-2] in heads:
            w = _permute(w, heads[name.split(".")[-2]])
        kind = (types or {}).get(name, T.F32)
        if kind == T.F32:
            writer.add_tensor(name, w)
        elif kind == T.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
    for name, (data, kind) in (extra or {}).items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_llama_cpp_style_file_loads_exactly_what_ggml_dequantizes(tmp_path):
    """Q8_0 / Q4_0 blocks from gguf-py's quantizer, F16 and BF16 floats, a tied embedding: each loaded weight equals
    gguf-py's dequantization of its tensor (q/k rows put back in Hugging Face's order) bit for bit, and the logits
    those of the float model holding the dequantized weights."""
    model = _llama(tie_word_embeddings=True)
    types = {"blk.0.attn_q.weight": T.Q8_0, "blk.0.attn_k.weight": T.Q4_0, "blk.1.attn_k.weight": T.Q8_0,
             "blk.1.ffn_down.weight": T.Q4_0, "blk.1.ffn_up.weight": T.F16, "token_embd.weight": T.BF16}
    path = _write(tmp_path / "llama.gguf", model, types=types)
    back = wb.models.load(path)
    reader = gguf.GGUFReader(path)
    dequantized = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        kind = t.name.split(".")[-2]
        if kind in ("attn_q", "attn_k"):   # undo the converter's reorder: its inverse, written out
            heads = {"attn_q": 4, "attn_k": 2}[kind]
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        dequantized[t.name] = w
    assert back.config.tie_word_embeddings and back.lm_head.weight is back.model.embed_tokens.weight
    float_model = _llama(tie_word_embeddings=True)
    for key, t in float_model.state_dict().items():
        if key == "lm_head.weight":
            continue
        owner, leaf = key.rsplit(".", 1)
        m = back.get_submodule(owner)
        got = m.dequantized_weight() if isinstance(m, WeightOnlyLinear) else getattr(m, leaf).detach()
        want = dequantized[_gguf_name(key)]
        assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want), key
        ggml = types.get(_gguf_name(key), T.F32)
        assert isinstance(m, WeightOnlyLinear) == (ggml in (T.Q8_0, T.Q4_0)), key
        t.copy_(torch.from_numpy(want.copy()))
    assert _plan_of(back) == {"model.layers.0.self_attn.q_proj": (8, 32, True),
                              "model.layers.0.self_attn.k_proj": (4, 32, True),
                              "model.layers.1.self_attn.k_proj": (8, 32, True),
                              "model.layers.1.mlp.down_proj": (4, 32, True)}
    assert torch.equal(_logits(back), _logits(float_model))


# --- refusals ---------------------------------------------------------------------------------------------------------

def _refused(path, match, error=ValueError):
    with pytest.raises(error, match=match):
        wb.models.load(path)


def test_k_quants_and_other_types_the_grids_cannot_hold_are_refused(tmp_path):
    """Q4_K (raw blocks: gguf-py cannot quantize k-quants), Q5_0 (gguf-py's quantizer), F64: refused, naming the
    tensor and its type."""
    model = _llama(intermediate_size=256, num_hidden_layers=1)
    q4_k = np.zeros((64, 144), dtype=np.uint8)   # 64 rows of one 256-value super-block (144 bytes)
    path = _write(tmp_path / "q4k.gguf", model, skip={"blk.0.ffn_down.weight"},
                  extra={"blk.0.ffn_down.weight": (q4_k, T.Q4_K)})
    _refused(path, r"gguf load: tensor 'blk\.0\.ffn_down\.weight' is Q4_K, a k-quant.*reads Q4_0, Q4_1, Q8_0, BF16, "
                   r"F16, F32")
    _refused(_write(tmp_path / "q5.gguf", model, types={"blk.0.attn_v.weight": T.Q5_0}),
             r"tensor 'blk\.0\.attn_v\.weight' is Q5_0, a type no workbench grid holds exactly")


def test_q4_1_blocks_without_an_integer_zero_point_are_refused(tmp_path):
    """gguf-py's (llama.cpp's) Q4_1 quantizer takes each block's minimum as m: not -d * z for an integer z."""
    path = _write(tmp_path / "q4_1.gguf", _llama(), types={"blk.1.ffn_gate.weight": T.Q4_1})
    _refused(path, r"tensor 'blk\.1\.ffn_gate\.weight' is Q4_1 with blocks whose minimum m is not -d \* z for an "
                   r"integer zero point z in 0\.\.15 \(first: row 0, block 0")


def test_other_architectures_and_unknown_tensors_are_refused(tmp_path):
    model = _llama()
    _refused(_write(tmp_path / "falcon.gguf", model, arch="falcon"),
             r"is a 'falcon' model; this reader builds \['gpt2', 'llama', 'qwen2'\]")
    _refused(_write(tmp_path / "extra.gguf", model, extra={"blk.0.attn_qkv.weight": (np.zeros((8, 34), np.uint8),
                                                                                   T.Q8_0)}),
             r"tensor 'blk\.0\.attn_qkv\.weight' has no place in transformers' LlamaForCausalLM")
    _refused(_write(tmp_path / "missing.gguf", model, skip={"blk.1.ffn_norm.weight"}),
             r"needs 'model\.layers\.1\.post_attention_layernorm\.weight'.*'blk\.1\.ffn_norm\.weight'.*none of them")
    _refused(_write(tmp_path / "rope.gguf", model, hyper={"rope_scaling_type": gguf.RopeScalingType.LINEAR}),
             r"rope scaling \(llama\.rope\.scaling\.type = 'linear'\)")
    _refused(_write(tmp_path / "shape.gguf", model, hyper={"feed_forward_length": 128}),
             r"tensor 'blk\.0\.ffn_gate\.weight' \(F32\) holds 'model\.layers\.0\.mlp\.gate_proj\.weight' of shape "
             r"\(96, 64\); the hyper-parameters give \(128, 64\)")


def test_gpt2_with_grouped_key_value_heads_is_refused(tmp_path, tokenizer_folder):
    """A gpt2 file saying it has fewer key / value heads than query heads (the exporter's file, one key added)."""
    from workbench.export import GGUF

    fmt = GGUF()
    prepared = fmt.prepare(_gpt2(), tokenizer_folder)
    prepared.writer.add_head_count_kv(2)
    fmt.write(prepared, tmp_path)
    _refused(tmp_path / "model.gguf", r"has 2 key / value heads for 4 query heads; transformers' gpt2")


def test_a_missing_or_foreign_file_is_a_clear_error(tmp_path):
    _refused(tmp_path / "nowhere.gguf", r"nowhere\.gguf does not exist \(expected a llama\.cpp \.gguf file\)",
             FileNotFoundError)
    (tmp_path / "text.gguf").write_text("not a model")
    _refused(tmp_path / "text.gguf", r"text\.gguf is not a readable GGUF file")
