"""Exported models measured in the runtime they are deployed with (`workbench.export.runtimes`): `wb.measure` scores
ONNX Runtime and llama.cpp as it scores the workbench's model, `wb.speedup` times them side by side with it, and their
threads follow torch's setting.

Tolerances:

* digits, ONNX Runtime vs the workbench model, top-1 accuracy on the whole test split (540 digits): the MLP's
  MatMulNBits graph differs from the workbench only by fp32 summation order (tests/export/test_onnx.py: <= 5e-5 on
  logits up to ~30), so a prediction flips only at a near-tie of two logits: at most ONE_SAMPLE of accuracy. The static
  W8A8 CNN's QuantizeLinear can round an activation at a tie to the neighbouring code (tests/export/test_onnx_qdq.py:
  at most 13 codes in 131k, top-1 agreement on 512 digits 1.0): at most TWO_SAMPLES. Measured: equal for both.
* tiny-llama int4 g32 in llama.cpp: the logits of tests/export/test_llama_cpp.py (`_check_quantized`, its constants):
  llama.cpp quantizes the activations to Q8_0 in its matrix products, simulated on the workbench's side; the
  difference from that simulation <= QUANT_RTOL * max |logit| and <= SIM_RATIO of the distance to the plain workbench
  model, the same argmax at >= 90 % of positions. Quick perplexity (16 windows): within PPL_RTOL of the workbench
  model's - measured 162.1 vs 162.0 (0.06 %; the activation rounding is the whole difference).
* `generate` on the float tiny-llama (KV cache fp32): token for token Hugging Face's ``generate`` on the same model,
  stopping at an end-of-text token and padding as it does.
"""
import math

import numpy as np
import pytest
import torch

import workbench as wb
from workbench.export import ONNX, LlamaCppModel, OnnxRuntimeModel
from workbench.export.llama_cpp import LlamaCpp
from workbench.measurement import num_threads

ONE_SAMPLE = 1
TWO_SAMPLES = 2
PPL_RTOL = 0.01
Static = wb.quant.Static


# --- ONNX Runtime: digits ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def digits():
    return wb.tasks.load("digits")


def _onnx(small, task, folder):
    fmt = ONNX(example_inputs=task.example_inputs(1), input_names=("x",), dynamic_axes={"x": {0: "batch"}})
    return wb.export(small, folder, format=fmt)


@pytest.fixture(scope="module")
def exported(digits, tmp_path_factory):
    """name -> (the workbench model, its ONNX folder): digits-cnn static W8A8 (as tests/export/test_onnx_qdq.py
    builds and calibrates it) and digits-mlp weight-only int4 g32."""
    plan = wb.Plan({"conv*": Static(observer="percentile"), "fc1": Static(smooth_alpha=0.5, kernel="cpu"),
                    "fc2": Static(kernel="reference")})
    cnn = wb.apply(wb.models.load("digits-cnn"), plan, calibration=digits.calibration(256), pipeline="original",
                   progress=False)
    mlp = wb.apply(wb.models.load("digits-mlp"), {"fc*": wb.quant.WeightOnly(bits=4, group_size=32)}, progress=False)
    tmp = tmp_path_factory.mktemp("onnx")
    return {"cnn-w8a8": (cnn, _onnx(cnn, digits, tmp / "cnn"), TWO_SAMPLES),
            "mlp-int4": (mlp, _onnx(mlp, digits, tmp / "mlp"), ONE_SAMPLE)}


@pytest.mark.parametrize("name", ["cnn-w8a8", "mlp-int4"])
def test_measure_scores_onnx_runtime_as_the_workbench_model(digits, exported, name):
    small, folder, samples = exported[name]
    ours = wb.measure(small, digits, progress=False)
    theirs = wb.measure(OnnxRuntimeModel(folder), digits, progress=False, name=f"{name} (onnxruntime)")
    n = len(digits.split.x_test)
    assert abs(theirs.primary_value - ours.primary_value) * n <= samples + 1e-9
    assert theirs.primary_value > 0.9
    assert theirs.size_bytes == (folder / "model.onnx").stat().st_size
    assert theirs.dtypes == {"onnx file": theirs.size_bytes}
    assert theirs.kernels == {"OnnxRuntimeModel:onnxruntime": 1}
    assert "runtime's own allocations not seen" in theirs.memory_method
    assert math.isfinite(theirs.latency_ms) and theirs.latency_ms > 0


@pytest.mark.parametrize("name", ["cnn-w8a8", "mlp-int4"])
def test_speedup_of_onnx_runtime_over_the_workbench_model(digits, exported, name):
    small, folder, _ = exported[name]
    sp = wb.speedup(OnnxRuntimeModel(folder), small, digits, threads=1, budget_s=0.5)
    assert isinstance(sp, wb.Speedup) and sp.rounds >= 8 and sp.threads == 1
    assert all(math.isfinite(v) and v > 0 for v in (sp.ratio, sp.low, sp.high, sp.model_ms, sp.baseline_ms))
    assert sp.low <= sp.ratio <= sp.high


def test_onnx_runtime_threads_follow_torch(digits, exported):
    _, folder, _ = exported["mlp-int4"]
    runtime = OnnxRuntimeModel(folder)
    (x,) = digits.example_inputs(4)

    def used() -> int:
        return runtime.session.get_session_options().intra_op_num_threads

    with num_threads(1):
        one = runtime(x)
        first = runtime.session
        assert runtime.session_threads == 1 and used() == 1
    with num_threads(2):
        two = runtime(x)
        second = runtime.session
        assert second is not first and runtime.session_threads == 2 and used() == 2
        runtime(x)
        assert runtime.session is second   # rebuilt only when the count changes
    assert torch.allclose(one, two, atol=1e-5)
    sp = wb.speedup(runtime, runtime, x, threads=1, min_rounds=6, budget_s=0.1)
    assert sp.threads == 1 and runtime.session_threads == 1
    fixed = OnnxRuntimeModel(folder, threads=1)
    with num_threads(2):
        fixed(x)
        assert fixed.session_threads == 1


def test_onnx_runtime_model_inputs_and_refusals(tmp_path, digits, exported):
    small, folder, _ = exported["mlp-int4"]
    with pytest.raises(FileNotFoundError, match="no ONNX file at .*model.onnx"):
        OnnxRuntimeModel(tmp_path / "missing")
    runtime = OnnxRuntimeModel(folder / "model.onnx")   # the file itself, as well as its folder
    (x,) = digits.example_inputs(5)
    out = runtime(x)
    assert isinstance(out, torch.Tensor) and out.shape == (5, 10) and out.dtype == torch.float32
    assert torch.equal(runtime(x=x), out)
    with torch.no_grad():
        assert (out - small(x)).abs().max().item() <= 5e-5   # tests/export/test_onnx.py's tolerance
    with pytest.raises(TypeError, match=r"takes 1 input\(s\) \['x'\], got 2 positional"):
        runtime(x, x)
    with pytest.raises(TypeError, match=r"takes 1 input\(s\) \['x'\], got 0 positional"):
        runtime()
    with pytest.raises(TypeError, match=r"input 'x' .* is tensor\(float\), got a torch.float64 tensor"):
        runtime(x.double())


# --- llama.cpp: tiny-llama --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference():
    """tests/export/test_llama_cpp.py: its tolerances and its simulation of llama.cpp's activation rounding (skips,
    saying why, where llama-cpp-python is not installed)."""
    import test_llama_cpp

    return test_llama_cpp


@pytest.fixture(scope="module")
def q4(reference, tiny_llama, tmp_path_factory):
    small = wb.apply(tiny_llama, {"model.layers.*": reference.Q4}, progress=False)
    return small, wb.export(small, tmp_path_factory.mktemp("gguf") / "q4", format="gguf")


def _tokens(batch: int, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 4096, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_llama_cpp_model_logits_are_the_workbench_models(reference, tiny_llama, q4):
    small, folder = q4
    runtime = LlamaCppModel(folder, config=tiny_llama.config, threads=2, kv_type="f32")
    tokens = _tokens(2, 24)
    with torch.no_grad():
        theirs = runtime(tokens).logits                                  # (2, 24, 4096)
        ours = small(tokens).logits.float()
        with reference._ggml_activations(small):
            simulated = small(tokens).logits.float()
    assert theirs.dtype == torch.float32 and theirs.shape == ours.shape == (2, 24, 4096)
    assert (theirs - simulated).abs().max().item() <= reference.QUANT_RTOL * ours.abs().max().item()
    assert (theirs - simulated).norm().item() <= reference.SIM_RATIO * (theirs - ours).norm().item()
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean().item() >= 0.9
    with LlamaCpp(folder, threads=2, kv_type="f32") as alone:             # each row is a fresh sequence
        assert torch.equal(theirs[1], alone.logits(tokens[1].tolist()))


def test_generate_is_greedy_decoding_in_llama_cpp(tiny_llama, q4):
    _, folder = q4
    runtime = LlamaCppModel(folder, config=tiny_llama.config, threads=2)
    prompt = _tokens(2, 8)
    out = runtime.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out.dtype == torch.int64 and out.shape == (2, 20) and torch.equal(out[:, :8], prompt)
    with LlamaCpp(folder, threads=2) as alone:
        for row, ids in zip(out.tolist(), prompt.tolist()):
            assert row[8:] == alone.greedy(ids, 12)


def test_generate_stops_and_pads_as_hugging_face(tmp_path, tiny_llama):
    """On the float model (the same tokens in both runtimes): an end-of-text token that one sequence reaches ends it
    (padded after), or is masked until min_new_tokens, as in transformers."""
    runtime = LlamaCppModel(wb.export(tiny_llama, tmp_path / "f32", format="gguf"), config=tiny_llama.config,
                            threads=2, kv_type="f32")
    prompt = _tokens(2, 8, seed=3)
    args = dict(attention_mask=torch.ones_like(prompt), do_sample=False, pad_token_id=7)
    with torch.no_grad():
        free = tiny_llama.generate(prompt, max_new_tokens=10, min_new_tokens=10, **args)
    eos = int(free[0, 8 + 3])   # what the first sequence says fourth: made its end-of-text token
    assert eos not in free[1, 8:].tolist() and eos not in free[0, 8:11].tolist()
    got = {}
    for i, extra in enumerate((dict(eos_token_id=eos), dict(eos_token_id=[eos], min_new_tokens=6))):
        with torch.no_grad():
            want = tiny_llama.generate(prompt, max_new_tokens=10, **extra, **args)
        got[i] = runtime.generate(prompt, max_new_tokens=10, **extra, **args)
        assert torch.equal(got[i], want), extra
    stopped = got[0]
    assert stopped.shape == (2, 18) and stopped[0, 8 + 3] == eos and (stopped[0, 8 + 4:] == 7).all()
    assert not torch.equal(got[1][0, :8 + 4], stopped[0, :8 + 4])   # masked: another fourth token


def test_llama_cpp_threads_follow_torch(tiny_llama, q4):
    _, folder = q4
    runtime = LlamaCppModel(folder, config=tiny_llama.config)
    ids = _tokens(1, 4)
    for n in (1, 2, 1):
        with num_threads(n):
            runtime(ids)
            assert runtime.runtime.threads == n                # as llama.cpp's context reports it
    fixed = LlamaCppModel(folder, config=tiny_llama.config, threads=1)
    with num_threads(2):
        fixed.generate(ids, max_new_tokens=2)
        assert fixed.runtime.threads == 1


def test_measure_times_llama_cpp_beside_the_workbench_model(tiny_llama, q4):
    small, folder = q4
    runtime = LlamaCppModel(folder)                                     # config from the file's metadata
    assert runtime.config.vocab_size == 4096 and runtime.config.eos_token_id == tiny_llama.config.eos_token_id
    assert runtime.config.max_position_embeddings == tiny_llama.config.max_position_embeddings
    task = wb.tasks.load("tiny-llama")
    ours = task.evaluate(small, quick=True)["perplexity"]
    theirs = wb.measure(runtime, task, quick=True, progress=False, baseline=small, generate_tokens=8)
    assert abs(theirs.primary_value / ours - 1) <= PPL_RTOL
    assert theirs.tokens_per_s is not None and math.isfinite(theirs.tokens_per_s) and theirs.tokens_per_s > 0
    sp = theirs.speedup
    assert sp is not None and all(math.isfinite(v) for v in (sp.ratio, sp.low, sp.high))
    assert theirs.size_bytes == (folder / "model.gguf").stat().st_size
    assert theirs.kernels == {"LlamaCppModel:llama.cpp": 1}


def test_llama_cpp_model_refusals(tmp_path, tiny_llama, q4):
    _, folder = q4
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        LlamaCppModel(tmp_path / "missing")
    with pytest.raises(ValueError, match="config.vocab_size is 50257, the file .* has a vocabulary of 4096"):
        LlamaCppModel(folder, config=type("Config", (), {"vocab_size": 50257})())
    runtime = LlamaCppModel(folder, config=tiny_llama.config, threads=1)
    ids = _tokens(1, 4)
    with pytest.raises(ValueError, match="do_sample=True"):
        runtime.generate(ids, max_new_tokens=2, do_sample=True)
    with pytest.raises(ValueError, match="num_beams=2"):
        runtime.generate(ids, max_new_tokens=2, num_beams=2)
    with pytest.raises(ValueError, match="use_cache=False"):
        runtime.generate(ids, max_new_tokens=2, use_cache=False)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        runtime.generate(ids)
    with pytest.raises(TypeError, match=r"does not support \['temperature', 'top_k'\]"):
        runtime.generate(ids, max_new_tokens=2, temperature=0.7, top_k=5)
    with pytest.raises(ValueError, match="attention_mask with padded"):
        runtime(ids, attention_mask=torch.tensor([[0, 1, 1, 1]]))
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, tokens\) integer ids"):
        runtime(ids[0])
    assert np.isfinite(runtime(ids).logits.numpy()).all()
