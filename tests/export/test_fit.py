"""`workbench.export.fit` and ``wb.export(..., requantize=...)``: layers a format cannot hold as they are, re-quantized
(round to nearest from the weight they compute with) into the nearest grid the format holds, then read back by the
format's own reader - gguf-py, transformers (compressed-tensors), ONNX Runtime - as exactly the fitted weights; the
report lists exactly those layers, with the weight change and, with a task, the measured metric change; the model
passed in is never modified; layers nothing in the format is near (pruned, low-rank) are refused by name.

Measured here (tiny-llama, its task's quick subset): NF4 g64 -> Q4_0 changes the effective weights by 9.1 to 9.8 %
(||W' - W|| / ||W||), int4 g64 -> g32 by 7.2 to 7.5 %; asserted < 15 %. The perplexity change is only asserted to be
measured and finite (its size depends on the model, not on this code).
"""
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.export import GGUF, ONNX
from workbench.export.fit import COLUMNS, QualityChange, RequantizedWarning, fit, float_layer
from workbench.quantization import WeightOnlyLinear

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

NF4 = wb.quant.NF4(group_size=64)
W4_G64 = wb.quant.WeightOnly(bits=4, group_size=64, kernel="reference")
Q4_0 = wb.quant.WeightOnly(bits=4, group_size=32, kernel="reference")
GGUF_PLAN = {"model.layers.0.mlp.*": NF4, "model.layers.1.self_attn.*": W4_G64, "model.layers.2.mlp.*": Q4_0}
NF4_LAYERS = [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")]
G64_LAYERS = [f"model.layers.1.self_attn.{p}_proj" for p in "qkvo"]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    after = model.state_dict()
    return after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def _weight_change(old: nn.Module, new: nn.Module) -> float:
    w, w2 = old.effective_weight().float(), new.effective_weight().float()
    return float((w2 - w).norm() / w.norm())


def _llama(tie: bool = False):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


# --- tiny-llama to GGUF -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small():
    return wb.apply(wb.models.load("tiny-llama"), GGUF_PLAN, progress=False)


@pytest.fixture(scope="module")
def fitted_gguf(small):
    """(fitted, report, the small model's tensors before fit) of `fit(small, "gguf", tiny-llama's task)`."""
    before = _state(small)
    fitted, report = fit(small, "gguf", wb.tasks.load("tiny-llama"), progress=False)
    return fitted, report, before


def test_gguf_refuses_nf4_and_group_64_and_names_requantize(small, tmp_path):
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj' stores NF4Format weights.*"
                                         r"pass requantize=True.*7 layer\(s\)"):
        wb.export(small, tmp_path / "out", format="gguf")
    assert not list(tmp_path.iterdir())


def test_fit_report_lists_exactly_the_requantized_layers(small, fitted_gguf):
    fitted, report, before = fitted_gguf
    assert _unchanged(small, before)                                     # the user's model, as it was
    assert list(report.columns) == COLUMNS
    assert list(report["layer"]) == NF4_LAYERS + G64_LAYERS
    assert list(report["from"]) == [NF4] * 3 + [W4_G64] * 4
    assert list(report["to"]) == [wb.quant.WeightOnly(bits=4, group_size=32)] * 7
    for row in report.itertuples(index=False):
        new = fitted.get_submodule(row.layer)
        assert new.fmt == wb.quant.WeightOnly(bits=4, group_size=32).format()
        assert row.weight_change == pytest.approx(_weight_change(small.get_submodule(row.layer), new), rel=1e-5)
        assert 0 < row.weight_change < 0.15
    kept = fitted.get_submodule("model.layers.2.mlp.up_proj")            # already Q4_0's grid: not touched
    assert torch.equal(kept.qweight, small.get_submodule("model.layers.2.mlp.up_proj").qweight)
    quality = report.attrs["quality"]
    assert isinstance(quality, QualityChange) and quality.metric == "perplexity" and quality.quick
    assert all(math.isfinite(x) for x in (quality.before, quality.after, quality.change, quality.error))
    assert quality.change == quality.after - quality.before and quality.before != quality.after
    assert ("within sampling error" in quality.verdict) == (abs(quality.change) <= quality.error)


def test_fitted_model_records_a_plan_that_saves_and_loads(fitted_gguf, tmp_path):
    fitted, _, _ = fitted_gguf
    (plan,) = wb.applied_plans(fitted)
    assert list(plan)[:7] == NF4_LAYERS + G64_LAYERS and list(plan)[7:] == ["model.layers.2.mlp.*"]
    rebuilt = wb.load(wb.save(fitted, tmp_path / "fitted.safetensors"))
    x = torch.randint(0, 4096, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(rebuilt(x).logits, fitted(x).logits)


def _gguf_weights(folder, config) -> dict[str, np.ndarray]:
    """Hugging Face layer name -> its weight as gguf-py dequantizes it, q/k rows back in Hugging Face's order."""
    reader = gguf.GGUFReader(folder / "model.gguf")
    kinds = {"attn_q": ("self_attn.q_proj", config.num_attention_heads),
             "attn_k": ("self_attn.k_proj", config.num_key_value_heads), "attn_v": ("self_attn.v_proj", 0),
             "attn_output": ("self_attn.o_proj", 0), "ffn_gate": ("mlp.gate_proj", 0), "ffn_up": ("mlp.up_proj", 0),
             "ffn_down": ("mlp.down_proj", 0)}
    out = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] != "blk" or parts[2] not in kinds or parts[3] != "weight":
            continue
        shape = tuple(int(n) for n in reversed(t.shape))
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)           # (rows, K) float32
        leaf, heads = kinds[parts[2]]
        if heads:   # llama.cpp's adjacent-pair rope order -> Hugging Face's halves, per head
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        out[f"model.layers.{parts[1]}.{leaf}"] = (t.tensor_type.name, w)
    return out


def test_gguf_requantize_writes_the_fitted_weights_exactly(small, fitted_gguf, tmp_path):
    fitted, _, before = fitted_gguf
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folder = wb.export(small, tmp_path / "q4", format=GGUF(), requantize=True)
    ours = [w for w in caught if issubclass(w.category, RequantizedWarning)]
    assert len(ours) == 1
    text = str(ours[0].message)
    assert "re-quantized 7 layer(s) gguf cannot hold" in text and "model.layers.0.mlp.gate_proj" in text
    assert "requantize=task" in text                                     # no task: the metric was not measured
    assert _unchanged(small, before)
    weights = _gguf_weights(folder, small.config)
    quantized = {n: m for n, m in fitted.named_modules() if isinstance(m, WeightOnlyLinear)}
    assert {n for n, (kind, _) in weights.items() if kind != "F32"} == set(quantized)   # the rest: F32
    for name, m in quantized.items():
        kind, w = weights[name]
        assert kind == "Q4_0" and np.array_equal(w, m.dequantized_weight().numpy()), name


# --- compressed-tensors: NF4, AWQ, GPTQ act-order, HQQ on a small random Llama ----------------------------------------

def _calibrated(plan):
    return wb.apply(_llama(), plan, calibration=[(_tokens(seed),) for seed in range(2)], progress=False)


def test_effective_weight_is_what_the_layer_computes():
    """The float layer fit re-quantizes computes what the compressed layer computes: smoothing divided out,
    permutation undone (checked against each layer's own forward on a probe input)."""
    small = _calibrated({
        "model.layers.0.mlp.gate_proj": wb.quant.WeightOnly(bits=4, group_size=32, method="awq", kernel="reference"),
        "model.layers.0.mlp.up_proj": wb.quant.WeightOnly(bits=4, group_size=32, method="gptq", act_order=True,
                                                          kernel="reference"),
        "model.layers.0.mlp.down_proj": wb.quant.WeightOnly(bits=4, group_size=32, symmetric=False, method="hqq",
                                                            kernel="reference"),
        "model.layers.1.mlp.*": NF4})
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(2))
    for name, m in small.named_modules():
        if isinstance(m, WeightOnlyLinear):
            layer = float_layer(name, m)
            probe = x[..., :m.in_features]
            with torch.no_grad():
                torch.testing.assert_close(layer(probe), m(probe), rtol=1e-5, atol=1e-6)
    assert "smooth" in small.model.layers[0].mlp.gate_proj._buffers
    assert "perm" in small.model.layers[0].mlp.up_proj._buffers


def _load(folder, dequantize: bool = False):
    kw = {"quantization_config": transformers.CompressedTensorsConfig(dequantize=True)} if dequantize else {}
    return transformers.AutoModelForCausalLM.from_pretrained(folder, **kw).eval()


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
@pytest.mark.parametrize("plan, to, dequantize", [
    ({"model.layers.0.mlp.*": NF4,
      "model.layers.1.mlp.*": wb.quant.WeightOnly(bits=4, group_size=64, method="awq", kernel="reference"),
      "model.layers.1.self_attn.*": wb.quant.WeightOnly(bits=4, group_size=64, method="gptq", act_order=True,
                                                        kernel="reference")},
     wb.quant.WeightOnly(bits=4, group_size=64), False),
    ({"model.layers.*.mlp.*": wb.quant.WeightOnly(bits=4, group_size=64, symmetric=False, method="hqq",
                                                   kernel="reference")},
     wb.quant.WeightOnly(bits=4, group_size=64, symmetric=False), True),
], ids=["nf4-awq-gptq", "hqq"])
def test_compressed_tensors_fitted_and_read_back_by_transformers(tmp_path, plan, to, dequantize):
    pytest.importorskip("compressed_tensors")
    small = _calibrated(plan)
    before = _state(small)
    with pytest.raises(ValueError, match=r"'model\.layers\.\d\.(mlp|self_attn)\.\w+_proj' .*requantize=True"):
        wb.export(small, tmp_path / "refused", format="compressed-tensors")
    fitted, report = fit(small, "compressed-tensors", progress=False)
    assert _unchanged(small, before)
    quantized = [n for n, m in small.named_modules() if isinstance(m, WeightOnlyLinear)]
    assert list(report["layer"]) == quantized and set(report["to"]) == {to}
    assert report.attrs["quality"] is None and (report["weight_change"] < 0.15).all()
    folder = wb.export(fitted, tmp_path / "out", format="compressed-tensors")
    reader = _load(folder, dequantize)
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(reader(x).logits, fitted(x).logits, rtol=0, atol=1e-5)


def test_fit_keeps_tied_layers_sharing_one_stored_weight():
    small = wb.apply(_llama(tie=True), {"*": NF4}, progress=False)
    fitted, report = fit(small, "gguf", progress=False)
    assert {"model.embed_tokens", "lm_head"} <= set(report["layer"])
    assert fitted.lm_head.qweight is fitted.model.embed_tokens.qweight
    assert fitted.lm_head.scale is fitted.model.embed_tokens.scale


# --- ONNX: digits-mlp with int3 and a group of 24 ---------------------------------------------------------------------

def test_onnx_int3_and_group_24_refused_then_fitted(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    task = wb.tasks.load("digits")
    small = wb.apply(wb.models.load("digits-mlp"), {
        "fc1": wb.quant.WeightOnly(bits=3, group_size=32, kernel="reference"),
        "fc2": wb.quant.WeightOnly(bits=4, group_size=24, kernel="reference"),
        "fc3": wb.quant.WeightOnly(bits=4, group_size=32, kernel="reference")}, progress=False)
    before = _state(small)
    fmt = ONNX.for_task(task, batch_size=4)
    with pytest.raises(ValueError, match=r"'fc1' stores 3-bit codes.*requantize=True.*'fc1' -> WeightOnly · 4 bits · "
                                         r"group 32.*'fc2' -> WeightOnly · 4 bits · group 16"):
        wb.export(small, tmp_path / "refused", format=fmt)
    with pytest.warns(RequantizedWarning, match=r"re-quantized 2 layer\(s\) onnx.*accuracy .* -> "):
        folder = wb.export(small, tmp_path / "out", format=fmt, requantize=task)
    assert _unchanged(small, before)
    fitted, report = fit(small, fmt, progress=False)
    assert list(report["layer"]) == ["fc1", "fc2"]
    assert list(report["to"]) == [wb.quant.WeightOnly(bits=4, group_size=g) for g in (32, 16)]
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    x = fmt.example_inputs[0]
    (got,) = session.run(None, {"input0": x.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(got, fitted(x).numpy(), rtol=0, atol=5e-5)


# --- what nothing in a format is near: refused by name ----------------------------------------------------------------

@pytest.mark.parametrize("config, kind", [(wb.prune.Magnitude(sparsity=0.5), "PrunedLinear"),
                                          (wb.lowrank.SVD(rank=8), "LowRankLinear")], ids=["pruned", "low-rank"])
@pytest.mark.parametrize("format", ["gguf", "compressed-tensors", ONNX(example_inputs=(_tokens(),))],
                         ids=["gguf", "compressed-tensors", "onnx"])
def test_pruned_and_low_rank_layers_are_refused_by_name(config, kind, format, tmp_path):
    small = wb.apply(_llama(), {"model.layers.0.mlp.*": NF4, "model.layers.1.mlp.up_proj": config}, progress=False)
    with pytest.raises(ValueError, match=rf"'model\.layers\.1\.mlp\.up_proj' is a {kind}"):
        fit(small, format, progress=False)
    with pytest.raises(ValueError) as refused:   # re-quantizing is no way out here: not offered
        wb.export(small, tmp_path / "out", format=format)
    assert "requantize" not in str(refused.value)
    with pytest.raises(ValueError, match=rf"'model\.layers\.1\.mlp\.up_proj' is a {kind}"):
        wb.export(small, tmp_path / "out", format=format, requantize=True)
    assert not list(tmp_path.iterdir())
