"""llama.cpp itself (llama-cpp-python, compiled by `make install`) loads every GGUF `wb.export` writes and computes
what the workbench model computes: logits for a prompt, greedy tokens, the tokenizer's ids.

Tolerances (KV cache fp32, no flash attention; measured on this machine):

* float models: llama.cpp's logits equal the workbench's within fp32 rounding in another order - max |difference|
  1.9e-5 with logits up to 20 on tiny-llama; asserted <= FLOAT_RTOL * max(1, max |logit|). GPT-2 more loosely
  (GELU_RTOL): ggml's GELU reads a table indexed by the input rounded to fp16 - measured 2.6e-4 with logits up to
  1.25 (6e-5 once that rounding is simulated; 5e-5 is the whole difference between the tanh and the erf GELU).
* quantized models: llama.cpp runs the same weights (tests/export/test_gguf.py: bit for bit) but its Q8_0 / Q4_0 /
  Q4_1 matrix products quantize the activations as well - each row in blocks of 32 to int8, scale max|x| / 127 kept
  in fp16, values rounded half to even - and GPT-2's GELU reads ggml's fp16 table. The tests simulate both on the
  workbench's side (`_ggml_activations`) and compare with that. Measured, max |difference| / max |logit|: 5e-7 on
  the random Llama / Qwen2 (Q8_0, Q4_0) and GPT-2 (Q8_0), 3e-3 on GPT-2 Q4_0 and 4.8e-3 on tiny-llama (a trained
  model with activation outliers: a value rounded the other way by fp32 noise moves a whole int8 step), against
  6e-3 to 1.5e-2 without the simulation; the simulation leaves at most 0.34 of the distance (norm over all
  logits), 0.55 on tiny-llama Q4_1 with PyTorch capped to AVX2 (other rounding flips in a trained model's 8
  layers). Asserted: max |llama.cpp - simulated| <= QUANT_RTOL * max |logit|, that distance at most SIM_RATIO of
  the distance to the plain workbench model, the same argmax at >= 90 % of the positions. A file read with another
  q/k row order or wrong scales moves the logits by whole units (2.7 of 20 on tiny-llama for the rope order alone).
"""
import contextlib

import numpy as np
import pytest
import torch

import workbench as wb
from workbench.export.llama_cpp import LlamaCpp, decode_table
from workbench.quantization import WeightOnlyLinear

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by `make install` (the `llama` extra)")
transformers = pytest.importorskip("transformers")

FLOAT_RTOL = 1e-4
GELU_RTOL = 1e-3
QUANT_RTOL = 1e-2
SIM_RATIO = 0.75
Q8 = wb.quant.WeightOnly(bits=8, group_size=32)
Q4 = wb.quant.WeightOnly(bits=4, group_size=32)
Q4_ASYM = wb.quant.WeightOnly(bits=4, group_size=32, symmetric=False)


def _tokens(n: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 4096, (1, n), generator=torch.Generator().manual_seed(seed))


def _logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits[0].float()


def _run(folder, tokens) -> torch.Tensor:
    with LlamaCpp(folder, threads=2, kv_type="f32") as runtime:
        return runtime.logits(tokens[0].tolist())


def _ggml_q8_0(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ggml's quantize_row_q8_0 rounds it (its SIMD path): blocks of 32 along the last dimension,
    ``d = max|x| / 127`` stored in fp16, ``q = round_half_even(x * 127 / max|x|)``, value ``q * fp16(d)``."""
    b = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = b.abs().amax(-1, keepdim=True)
    q = torch.round(b * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
    return (q * (amax / 127).half().float()).reshape(x.shape)


def _ggml_gelu(_, args, out):
    """ggml's GELU (tanh form) as its table computes it: looked up at the input rounded to fp16, the value fp16."""
    x = args[0]
    y = torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


@contextlib.contextmanager
def _ggml_activations(model):
    """The model's quantized layers see their input as llama.cpp's quantized matrix products do; GPT-2's GELU is
    ggml's table."""
    hooks = [m.register_forward_pre_hook(lambda _, args: (_ggml_q8_0(args[0]), *args[1:]))
             for m in model.modules() if isinstance(m, WeightOnlyLinear)]
    hooks += [m.register_forward_hook(_ggml_gelu) for m in model.modules()
              if type(m).__name__ == "NewGELUActivation"]
    try:
        yield model
    finally:
        for h in hooks:
            h.remove()


def _check_float(model, folder, tokens, rtol=FLOAT_RTOL):
    ours, theirs = _logits(model, tokens), _run(folder, tokens)
    scale = ours.abs().max().item()
    assert scale > 0.05 and (theirs - ours).abs().max().item() <= rtol * max(1.0, scale)


def _check_quantized(small, folder, tokens=None):
    tokens = _tokens() if tokens is None else tokens
    ours, theirs = _logits(small, tokens), _run(folder, tokens)
    with _ggml_activations(small):
        simulated = _logits(small, tokens)
    assert theirs.shape == ours.shape
    assert (theirs - simulated).abs().max().item() <= QUANT_RTOL * ours.abs().max().item()
    assert (theirs - simulated).norm().item() <= SIM_RATIO * (theirs - ours).norm().item()
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean().item() >= 0.9


# --- tiny-llama, the zoo's model with its own tokenizer ---------------------------------------------------------------

def test_float_tiny_llama_logits_and_greedy_tokens(tmp_path, tiny_llama):
    folder = wb.export(tiny_llama, tmp_path / "f32", format="gguf")
    tokens = _tokens()
    ours = _logits(tiny_llama, tokens)
    with LlamaCpp(folder, threads=2, kv_type="f32") as runtime:
        assert runtime.vocab == 4096 and runtime.context == tiny_llama.config.max_position_embeddings
        theirs = runtime.logits(tokens[0].tolist())
        assert (theirs - ours).abs().max().item() <= FLOAT_RTOL * ours.abs().max().item()
        generated = runtime.greedy(tokens[0, :8].tolist(), 16)
    with torch.no_grad():
        want = tiny_llama.generate(tokens[:, :8], max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                   pad_token_id=0)[0, 8:].tolist()
    assert generated == want


@pytest.mark.parametrize("config", [Q8, Q4, Q4_ASYM], ids=["q8_0", "q4_0", "q4_1-or-refused"])
def test_quantized_tiny_llama_is_the_workbench_model(tmp_path, tiny_llama, config):
    small = wb.apply(tiny_llama, {"model.layers.*": config}, progress=False)
    if not config.symmetric:
        # Q4_1 holds an asymmetric group only where -scale*zero is an fp16 value: make it so (scales powers of two)
        for m in small.modules():
            if isinstance(m, wb.quantization.WeightOnlyLinear):
                m.scale.copy_(torch.exp2(torch.round(torch.log2(m.scale.float()))).to(m.scale.dtype))
    folder = wb.export(small, tmp_path / "q", format="gguf")
    _check_quantized(small, folder)


def test_tokenizer_metadata_gives_the_same_ids(tmp_path, tiny_llama):
    """llama.cpp's tokenizer, built from the file's tokenizer.ggml.* fields alone, splits text as tokenizer.json
    does."""
    from tokenizers import Tokenizer

    from workbench.models.llama import TOKENIZER_FILE
    from workbench.paths import data_dir

    folder = wb.export(tiny_llama, tmp_path / "f32", format="gguf")
    reference = Tokenizer.from_file(str(data_dir() / TOKENIZER_FILE))
    texts = ["Once upon a time, there was a little girl named Lily.", "She liked to play  outside\nwith her dog!",
             "1234 + 5678 = 6912; ça va?"]
    with LlamaCpp(folder, threads=1) as runtime:
        for text in texts:
            assert runtime.tokenize(text) == reference.encode(text, add_special_tokens=False).ids, text


# --- random models of each architecture from small configs ------------------------------------------------------------

def _llama_gqa():
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False, attention_bias=True, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _qwen2():
    cfg = transformers.Qwen2Config(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=4096, n_positions=64, n_embd=128, n_layer=2, n_head=4, bos_token_id=0,
                                  eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


MODELS = {"llama-gqa-bias": (_llama_gqa, "model.layers.*"), "qwen2": (_qwen2, "model.layers.*"),
          "gpt2": (_gpt2, "transformer.h.*")}


@pytest.mark.parametrize("arch", MODELS)
def test_random_models_of_each_architecture(tmp_path, tokenizer_folder, arch):
    """Float: llama.cpp's logits equal the model's within fp32 rounding; int8 g32: the workbench's model with
    llama.cpp's activation rounding simulated."""
    build, layers = MODELS[arch]
    model = build()
    tokens = _tokens(16)
    _check_float(model, wb.export(model, tmp_path / "f32", format="gguf", base_folder=tokenizer_folder), tokens,
                 GELU_RTOL if arch == "gpt2" else FLOAT_RTOL)
    small = wb.apply(model, {layers: Q8}, progress=False)
    _check_quantized(small, wb.export(small, tmp_path / "q8", format="gguf", base_folder=tokenizer_folder), tokens)


# --- the runtime wrapper and the benchmark ----------------------------------------------------------------------------

def test_runtime_refuses_bad_input(tmp_path, tiny_llama):
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        LlamaCpp(tmp_path / "missing")
    folder = wb.export(tiny_llama, tmp_path / "f32", format="gguf")
    with pytest.raises(ValueError, match="kv_type"):
        LlamaCpp(folder, kv_type="q4")
    with LlamaCpp(folder, threads=1, context=32) as runtime:
        with pytest.raises(ValueError, match=r"token ids \[4096\] are outside the vocabulary of 4096"):
            runtime.logits([1, 4096])
        with pytest.raises(ValueError, match="exceed the context of 32 tokens"):
            runtime.greedy([1] * 20, 13)


def test_decode_table_smoke(tmp_path):
    df = decode_table("tiny-llama", formats=("q4_0",), threads=(1,), new_tokens=4, rounds=1, folder=tmp_path)
    assert list(df["path"]) == ["fp32 (PyTorch)", "q4_0 workbench", "q4_0 llama.cpp"]
    assert (df["tokens_per_s"] > 0).all() and np.isclose(df.loc[0, "vs_fp32"], 1.0)
    assert df["same_tokens_as_other_runtime"].iloc[1:].map(lambda v: isinstance(v, bool)).all()
    assert list(tmp_path.iterdir()) == []
