"""`wb.models.load(folder)` of compressed-tensors checkpoints: the quantized layers come back as the workbench's own
modules holding exactly the checkpoint's codes and scales, recorded as an applied plan.

- Written by `wb.export`: every stored tensor equals the original workbench module's bit for bit, logits are equal
  (reference kernels on both sides: the same numbers), and exporting the loaded model again writes the same tensors
  and the same quantization config.
- Written by compressed-tensors' own `ModelCompressor` (scales from its own `calculate_qparams`, a bf16 model as
  llm-compressor writes them): each layer's weight equals compressed-tensors' own decompression bit for bit, and the
  logits equal those of the same model holding those decompressed weights in plain nn.Linear layers.
- What the workbench cannot hold is refused with a ValueError naming the layer and the scheme.
"""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import workbench as wb
from workbench.quantization import W8A8Linear, WeightOnlyLinear

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SCHEMES = {
    "int4-g32-sym": wb.quant.WeightOnly(bits=4, group_size=32, kernel="reference"),
    "int4-g32-asym": wb.quant.WeightOnly(bits=4, group_size=32, symmetric=False, kernel="reference"),
    "int4-g128-sym": wb.quant.WeightOnly(bits=4, group_size=128, kernel="reference"),
    "int4-g128-asym": wb.quant.WeightOnly(bits=4, group_size=128, symmetric=False, kernel="reference"),
    "int8-channel": wb.quant.WeightOnly(bits=8, kernel="reference"),
    "w8a8-dynamic": wb.quant.Dynamic(kernel="reference"),
    "w8a8-static": wb.quant.Static(kernel="reference"),
}
SIZES = {"vocab_size": 128, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
Q_PROJ = r"'model\.layers\.0\.self_attn\.q_proj'"


def _llama(tie: bool = False, dtype=torch.float32):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SIZES, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def _qwen2():
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZES, tie_word_embeddings=False)).eval()


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


def _quantized(model) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (WeightOnlyLinear, W8A8Linear))}


def _reference(model):
    for m in _quantized(model).values():
        m.set_kernel("reference")
    return model


def _apply(model, scheme: str):
    calibration = [(_tokens(seed),) for seed in range(2)] if scheme == "w8a8-static" else None
    return wb.apply(model, {"model.layers.*": SCHEMES[scheme]}, calibration=calibration, progress=False)


def _edit_config(folder, change) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    change(config["quantization_config"])
    path.write_text(json.dumps(config))


# --- written by wb.export -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("build", [_llama, _qwen2], ids=["llama", "qwen2"])
def test_export_load_holds_the_same_codes_and_logits(tmp_path, build, scheme):
    small = _apply(build(), scheme)
    folder = wb.export(small, tmp_path / "out")
    loaded = wb.models.load(folder)

    assert type(loaded) is type(small) and not loaded.training
    ours, theirs = _quantized(loaded), _quantized(small)
    assert ours.keys() == theirs.keys() and len(ours) == 14
    for name, m in ours.items():
        assert type(m) is type(theirs[name])
        mine, original = dict(m.named_buffers()), dict(theirs[name].named_buffers())
        assert mine.keys() == original.keys()
        for key, t in mine.items():
            assert t.dtype == original[key].dtype and torch.equal(t, original[key]), (name, key)
        if m.bias is not None:
            assert torch.equal(m.bias, theirs[name].bias)
    assert type(loaded.lm_head) is nn.Linear and torch.equal(loaded.lm_head.weight, small.lm_head.weight)
    assert wb.size_bytes(loaded) == wb.size_bytes(small)

    (plan,) = wb.applied_plans(loaded)   # recognised as the workbench's own compression
    assert set(plan) == set(ours)
    kind = type(SCHEMES[scheme])
    assert all(type(c) is kind for c in plan.values())
    with torch.no_grad():
        assert torch.equal(_reference(loaded)(_tokens()).logits, small(_tokens()).logits)

    again = wb.export(loaded, tmp_path / "again")   # round trip: the same tensors, the same quantization config
    first, second = load_file(folder / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(first[k].dtype == second[k].dtype and torch.equal(first[k], second[k]) for k in first)
    config = [json.loads((f / "config.json").read_text())["quantization_config"] for f in (folder, again)]
    assert config[0] == config[1]


def test_mixed_schemes_and_ignored_layers(tmp_path):
    """Attention W8A8, MLP int4, layer 1's down_proj left in floating point: each layer as it was exported."""
    small = wb.apply(_llama(), {"model.layers.1.mlp.down_proj": None,
                                "model.layers.*.self_attn.*": SCHEMES["w8a8-dynamic"],
                                "model.layers.*.mlp.*": SCHEMES["int4-g32-asym"]}, progress=False)
    folder = wb.export(small, tmp_path / "mixed")
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["format"] == "mixed-precision"
    loaded = wb.models.load(folder)
    assert type(loaded.model.layers[0].self_attn.k_proj) is W8A8Linear
    assert type(loaded.model.layers[0].mlp.down_proj) is WeightOnlyLinear
    fp = loaded.model.layers[1].mlp.down_proj
    assert type(fp) is nn.Linear and torch.equal(fp.weight, small.model.layers[1].mlp.down_proj.weight)
    with torch.no_grad():
        assert torch.equal(_reference(loaded)(_tokens()).logits, small(_tokens()).logits)


def test_regex_targets_reach_only_the_linear_layers(tmp_path):
    """A ``re:`` target also matches the blocks holding the Linears; compressed-tensors quantizes only the Linears."""
    small = _apply(_llama(), "int4-g32-sym")
    folder = wb.export(small, tmp_path / "out")
    _edit_config(folder, lambda q: (_group(q).update(targets=["re:model\\.layers\\..*"]), q.update(ignore=[])))
    loaded = wb.models.load(folder)
    assert _quantized(loaded).keys() == _quantized(small).keys()


def test_pretrained_minilm(tmp_path):
    """The zoo's pretrained all-MiniLM-L6-v2 weights as a transformers BertModel, int4 asymmetric g32 encoder."""
    from workbench.models.minilm import minilm_path

    bert = transformers.BertModel.from_pretrained(minilm_path(), local_files_only=True).eval()
    small = wb.apply(bert, {"encoder.layer.*": SCHEMES["int4-g32-asym"]}, progress=False)
    loaded = wb.models.load(wb.export(small, tmp_path / "minilm"))
    assert len(_quantized(loaded)) == 36 and type(loaded.pooler.dense) is nn.Linear
    ids = torch.randint(1000, 5000, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ours = _reference(loaded)(input_ids=ids, attention_mask=mask).last_hidden_state
        assert torch.equal(ours, small(input_ids=ids, attention_mask=mask).last_hidden_state)


# --- written by compressed-tensors itself ---------------------------------------------------------------------------

def _compressed_by_compressed_tensors(folder, model, weights: dict, activations: dict | None, fmt: str):
    """Quantize ``model``'s layers (all nn.Linear but lm_head) the way compressed-tensors does it - its own
    `calculate_qparams` on each group's min / max, its own quantization in `ModelCompressor.compress_model` - and save
    the checkpoint the way llm-compressor saves one."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(type="int", dynamic=False, **weights)
    inputs = None if activations is None else QuantizationArgs(type="int", num_bits=8, symmetric=True, **activations)
    qconfig = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args,
                                                                              input_activations=inputs, format=fmt)},
                                 ignore=["lm_head"], quantization_status=QuantizationStatus.FROZEN)
    apply_quantization_config(model, qconfig, show_progress=False)
    with torch.no_grad():
        for name, m in model.named_modules():
            if not hasattr(m, "weight_scale"):
                continue
            w = m.weight                                                      # (N, K)
            g = args.group_size or w.shape[1]
            wg = w.reshape(w.shape[0], -1, g)                                 # (N, G, g)
            scale, zero = calculate_qparams(wg.amin(-1), wg.amax(-1), args)   # (N, G)
            m.weight_scale.copy_(scale.reshape(m.weight_scale.shape))
            if not args.symmetric:
                m.weight_zero_point.copy_(zero.reshape(m.weight_zero_point.shape))
            if activations is not None and not activations["dynamic"]:
                m.input_scale.fill_(0.02)
    ModelCompressor(quantization_config=qconfig).compress_model(model)
    folder.mkdir()
    model.config.architectures = [type(model).__name__]   # (what save_pretrained records)
    model.config.save_pretrained(folder)
    ModelCompressor(quantization_config=qconfig).update_config(str(folder))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return qconfig


def _decompressed(folder, qconfig, names) -> dict[str, torch.Tensor]:
    """Each layer's weight as compressed-tensors' own compressor of its format decompresses it."""
    from compressed_tensors.compressors import BaseCompressor

    (scheme,) = qconfig.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    tensors = load_file(folder / "model.safetensors")
    out = {}
    for name in names:
        local = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.rpartition(".")[0] == name}
        out[name] = compressor.decompress(local, scheme)["weight"]
    return out


@pytest.mark.parametrize("weights, activations, fmt, dtype, kind", [
    ({"num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": True}, None, "pack-quantized",
     torch.bfloat16, WeightOnlyLinear),
    ({"num_bits": 4, "strategy": "group", "group_size": 64, "symmetric": False}, None, "pack-quantized",
     torch.bfloat16, WeightOnlyLinear),
    ({"num_bits": 8, "strategy": "channel", "symmetric": True}, None, "pack-quantized", torch.bfloat16,
     WeightOnlyLinear),
    ({"num_bits": 4, "strategy": "channel", "symmetric": False}, None, "naive-quantized", torch.bfloat16,
     WeightOnlyLinear),
    ({"num_bits": 8, "strategy": "channel", "symmetric": True}, {"strategy": "token", "dynamic": True},
     "int-quantized", torch.float32, W8A8Linear),
    ({"num_bits": 8, "strategy": "channel", "symmetric": True}, {"strategy": "tensor", "dynamic": False},
     "int-quantized", torch.float32, W8A8Linear),
], ids=["int4-g32-sym-bf16", "int4-g64-asym-bf16", "int8-channel-bf16", "int4-channel-asym-naive-bf16",
     "w8a8-dynamic-fp32", "w8a8-static-fp32"])
def test_checkpoint_written_by_compressed_tensors(tmp_path, weights, activations, fmt, dtype, kind):
    import copy

    model = _llama(dtype=dtype)
    qconfig = _compressed_by_compressed_tensors(tmp_path / "ct", copy.deepcopy(model), weights, activations, fmt)
    loaded = wb.models.load(tmp_path / "ct")
    layers = _quantized(loaded)
    assert len(layers) == 14 and all(type(m) is kind for m in layers.values())
    assert loaded.dtype == dtype and wb.applied_plans(loaded)
    theirs = _decompressed(tmp_path / "ct", qconfig, layers)
    for name, m in layers.items():
        w = m.weight.decode()
        assert w.dtype == theirs[name].dtype == dtype and torch.equal(w, theirs[name]), name
        if isinstance(m, W8A8Linear) and m.static:
            assert m.act_scale.item() == torch.tensor(0.02).item()   # the stored fp32 value
    if kind is WeightOnlyLinear:   # transformers + compressed-tensors' own load (decompressed to nn.Linear): equal
        reader = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "ct", quantization_config=transformers.CompressedTensorsConfig(dequantize=True)).eval()
        assert type(reader.model.layers[0].mlp.up_proj) is nn.Linear
        with torch.no_grad():
            assert torch.equal(_reference(loaded)(_tokens()).logits, reader(_tokens()).logits)


def test_fp32_scales_that_fp16_cannot_hold_are_refused(tmp_path):
    """WeightOnlyLinear stores fp16 scales: compressed-tensors' fp32 scales would have to be rounded, changing the
    weights - refused, not rounded."""
    import copy

    _compressed_by_compressed_tensors(tmp_path / "ct", copy.deepcopy(_llama()),
                                      {"num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": True},
                                      None, "pack-quantized")
    with pytest.raises(ValueError, match=Q_PROJ + r" \(config group 'group_0': format pack-quantized, weights int4 "
                                          r"group group_size=32 symmetric\) has torch\.float32 weight scales that "
                                          r"torch\.float16 does not hold exactly"):
        wb.models.load(tmp_path / "ct")


# --- refusals: what the workbench cannot represent ------------------------------------------------------------------

@pytest.fixture
def exported(tmp_path):
    small = _apply(_llama(), "int4-g32-sym")
    return wb.export(small, tmp_path / "out")


def _group(q: dict) -> dict:
    (group,) = q["config_groups"].values()
    return group


def _float_weights(q):
    _group(q)["weights"].update(type="float", num_bits=8, strategy="channel", group_size=None)
    _group(q)["format"] = q["format"] = "float-quantized"


def _act_order(q):
    _group(q)["weights"]["actorder"] = "group"


def _tensor_strategy(q):
    _group(q)["weights"].update(strategy="tensor", group_size=None)


def _block_strategy(q):
    _group(q)["weights"].update(strategy="block", group_size=None, block_structure=[32, 32])


def _nvfp4(q):
    _group(q)["format"] = q["format"] = "nvfp4-pack-quantized"


def _w4a8(q):
    _group(q)["input_activations"] = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                      "dynamic": True}


def _six_bits(q):
    _group(q)["weights"]["num_bits"] = 6


def _output_activations(q):
    _group(q)["output_activations"] = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor",
                                       "dynamic": False}


def _embedding(q):
    _group(q)["targets"] = ["Embedding", "Linear"]


def _attention(q):
    _group(q)["targets"] = ["re:.*self_attn$"]


def _short_group(q):
    _group(q)["weights"]["group_size"] = 48


@pytest.mark.parametrize("change, match", [
    (_float_weights, Q_PROJ + r" \(config group 'group_0': format float-quantized, weights float8 channel.*is stored "
                     r"as 'float-quantized', which the workbench does not read"),
    (_act_order, Q_PROJ + r" .*stores GPTQ act-order with a column permutation"),
    (_tensor_strategy, Q_PROJ + r" .*weights int4 tensor symmetric.*has weight strategy 'tensor'"),
    (_block_strategy, Q_PROJ + r" .*has weight strategy 'block'"),
    (_nvfp4, Q_PROJ + r" .*is stored as 'nvfp4-pack-quantized'"),
    (_w4a8, Q_PROJ + r" .*input activations int8 token symmetric dynamic\).*W4A8"),
    (_six_bits, Q_PROJ + r" .*has 6-bit weights"),
    (_output_activations, Q_PROJ + r" .*quantizes its outputs"),
    (_embedding, r"'model\.embed_tokens' .*is quantized but is a Embedding layer, not an nn\.Linear"),
    (_attention, r"'model\.layers\.0\.self_attn' .*is quantized but is a LlamaAttention layer"),
    (_short_group, Q_PROJ + r" .*has a short last group \(group_size 48 does not divide the input size 128\)"),
], ids=["fp8", "act-order", "tensor-strategy", "block-strategy", "nvfp4", "w4a8", "6-bit", "output-activations",
        "embedding", "attention", "short-group"])
def test_schemes_the_workbench_cannot_hold_are_refused(exported, change, match):
    _edit_config(exported, change)
    with pytest.raises(ValueError, match=r"compressed-tensors checkpoint .*: layer " + match +
                                         r".*it is not loaded \(and not in floating point either\)"):
        wb.models.load(exported)


@pytest.mark.parametrize("key, value, match", [
    ("sparsity_config", {"format": "sparse-bitmask", "global_sparsity": 0.5}, "has a sparsity config"),
    ("transform_config", {"config_groups": {"u": {"type": "hadamard"}}}, "has a transform config"),
    ("kv_cache_scheme", {"num_bits": 8, "type": "float", "strategy": "tensor"}, "has kv-cache quantization"),
    ("quantization_status", "frozen", "has quantization_status 'frozen'"),
], ids=["sparse", "transform", "kv-cache", "not-compressed"])
def test_whole_model_features_are_refused(exported, key, value, match):
    _edit_config(exported, lambda q: q.update({key: value}))
    with pytest.raises(ValueError, match=match):
        wb.models.load(exported)


def test_a_stored_act_order_permutation_is_refused(exported):
    path = exported / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.1.mlp.up_proj.weight_g_idx"] = torch.zeros(128, dtype=torch.int32)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.up_proj' .*stores an act-order column "
                                         r"permutation \(weight_g_idx\)"):
        wb.models.load(exported)


def test_a_tensor_the_scheme_does_not_explain_is_refused(exported):
    path = exported / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.mlp.gate_proj.weight_global_scale"] = torch.ones(1)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj' .*stores tensors "
                                         r"\['weight_global_scale'\] that its scheme does not explain"):
        wb.models.load(exported)


def test_a_quantized_layer_tied_to_another_is_refused(tmp_path):
    small = _apply(_llama(tie=True), "int8-channel")
    folder = wb.export(small, tmp_path / "tied")   # lm_head (tied to the embedding) stays in floating point
    assert type(wb.models.load(folder).lm_head) is nn.Linear
    _edit_config(folder, lambda q: q.update(ignore=[]))
    with pytest.raises(ValueError, match=r"'lm_head' .*is quantized but shares its weight with "
                                         r"\['model\.embed_tokens'\]"):
        wb.models.load(folder)
