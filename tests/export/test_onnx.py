"""`wb.export(format=ONNX(example_inputs=...))`, read back only with the ``onnx`` package and run only with ONNX Runtime
(CPUExecutionProvider): every quantized Linear is a ``com.microsoft.MatMulNBits`` node whose initializers, unpacked
here with numpy from the operator's spec (not with the exporter's code), are the workbench's codes, scales and zero
points and dequantize bit for bit to the weight it computes with; ONNX Runtime's outputs match the workbench model;
refusals of what the export cannot hold, before anything is written.

Tolerance: MatMulNBits (accuracy_level 0: fp32 activations) computes with exactly the workbench's weights in another
summation order, so outputs differ by fp32 rounding only. Measured max |difference|: digits MLP logits (up to ~30)
3.8e-6 to 5.7e-6 over the three plans below, MiniLM sentence embeddings (L2-normalised) 2.4e-7 (int4 g32), random
Linear stacks (outputs up to 0.8) 1e-7. Asserted: MLP <= 5e-5, MiniLM <= 1e-5, small stacks <= 1e-5.
"""
import numpy as np
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.export import ONNX
from workbench.quantization import WeightOnlyLinear, packing

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
numpy_helper = onnx.numpy_helper

Q4 = wb.quant.WeightOnly(bits=4, group_size=32, kernel="reference")
Q4_G64_ASYM = wb.quant.WeightOnly(bits=4, group_size=64, symmetric=False, kernel="reference")
Q8_CHANNEL = wb.quant.WeightOnly(bits=8, group_size=None, kernel="reference")
Q8_G128_ASYM = wb.quant.WeightOnly(bits=8, group_size=128, symmetric=False, kernel="reference")


# --- reading the file back, from the MatMulNBits spec -----------------------------------------------------------------

def _session(folder):
    assert [p.name for p in folder.iterdir()] == ["model.onnx"]
    return ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])


def _nbits_nodes(folder) -> dict[str, dict]:
    """B's initializer name -> the node's attributes and initializers (numpy), for every MatMulNBits node."""
    model = onnx.load(folder / "model.onnx")
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            assert node.domain == "com.microsoft"
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            arrays = [inits[name] for name in node.input[1:]]
            out[node.input[1]] = {**attrs, "B": arrays[0], "scales": arrays[1],
                                  "zero_points": arrays[2] if len(arrays) > 2 else None}
    return out


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """(..., bytes) uint8 -> (..., count) codes: value i in bits [bits * (i % per_byte), ...) of byte i // per_byte."""
    per_byte = 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    codes = (packed[..., None] >> shifts) & ((1 << bits) - 1)                  # (..., bytes, per_byte)
    return codes.reshape(*packed.shape[:-1], -1)[..., :count]


def _decoded(node: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """codes (N, K), scales (N, n_blocks), zero points (N, n_blocks) and the dequantized weight (N, K), in fp32."""
    K, N, bits, block = node["K"], node["N"], node["bits"], node["block_size"]
    n_blocks = -(-K // block)
    assert node["B"].dtype == np.uint8 and node["B"].shape == (N, n_blocks, block * bits // 8)
    codes = _unpack(node["B"], bits, block).reshape(N, n_blocks * block)       # (N, n_blocks * block)
    scales = node["scales"].reshape(N, n_blocks)
    if node["zero_points"] is None:
        zero = np.full((N, n_blocks), 1 << (bits - 1), dtype=np.uint8)          # the spec's default
    else:
        assert node["zero_points"].shape == (N, -(-n_blocks * bits // 8))
        zero = _unpack(node["zero_points"], bits, n_blocks)                     # (N, n_blocks)
    w = (codes.reshape(N, n_blocks, block).astype(np.float32) - zero[..., None]) * scales[..., None]
    return codes[:, :K], scales, zero, w.reshape(N, -1)[:, :K]


def _check_layers(folder, small):
    """Every quantized layer is one MatMulNBits node holding its codes, scales and zero points exactly."""
    nodes = _nbits_nodes(folder)
    layers = {n: m for n, m in small.named_modules() if isinstance(m, WeightOnlyLinear)}
    assert sorted(nodes) == sorted(f"{n}.qweight" for n in layers)
    for name, m in layers.items():
        node = nodes[f"{name}.qweight"]
        fmt = m.fmt
        N, K = m.weight_shape
        g, _ = fmt.groups(K)
        assert (node["K"], node["N"], node["bits"], node["block_size"], node["accuracy_level"]) == (K, N, fmt.bits,
                                                                                                    g, 0)
        codes, scales, zero, w = _decoded(node)
        assert node["scales"].dtype == np.float32
        assert np.array_equal(codes, packing.unpack(m.qweight, fmt.bits, K).numpy()), name
        assert np.array_equal(scales, m.scale.float().numpy()), name
        if not fmt.symmetric:
            assert np.array_equal(zero, m.zero.numpy()), name
        assert np.array_equal(w, m.dequantized_weight().numpy()), name   # bit for bit


# --- round trips ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlp():
    return wb.models.load("digits-mlp")


@pytest.mark.parametrize("plan", [
    {"fc1": Q4, "fc2": Q4_G64_ASYM},                   # fc3 stays float (a Gemm)
    {"fc*": Q8_CHANNEL},                               # per channel: K = 64, 256, 128 are powers of two
    {"fc2": Q8_G128_ASYM, "fc3": wb.quant.WeightOnly(bits=2, group_size=16, symmetric=False, kernel="reference")},
], ids=["int4-g32-and-g64-asym", "int8-per-channel", "int8-g128-asym-int2-g16"])
def test_digits_mlp_round_trip(tmp_path, mlp, plan):
    small = wb.apply(mlp, plan, progress=False)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0))
    fmt = ONNX(example_inputs=(x[:1],), input_names=("x",), dynamic_axes={"x": {0: "batch"}})
    folder = wb.export(small, tmp_path / "out", format=fmt)
    _check_layers(folder, small)
    (got,) = _session(folder).run(None, {"x": x.numpy()})   # another batch size than traced
    with torch.no_grad():
        expected = small(x).numpy()
    assert np.abs(got - expected).max() <= 5e-5


def test_short_last_group_is_a_padded_block(tmp_path):
    """K = 80 with groups of 32: the last block holds 16 codes and 16 zero-code paddings that MatMulNBits ignores."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(80, 48), nn.ReLU(), nn.Linear(48, 16)).eval()
    small = wb.apply(model, {"0": wb.quant.WeightOnly(bits=4, group_size=32, symmetric=False, kernel="reference"),
                             "2": wb.quant.WeightOnly(bits=8, group_size=32, kernel="reference")}, progress=False)
    x = torch.randn(3, 80)
    folder = wb.export(small, tmp_path / "out", format=ONNX(example_inputs=(x,)))
    _check_layers(folder, small)
    node = _nbits_nodes(folder)["0.qweight"]
    assert node["B"].shape == (48, 3, 16) and not node["B"][:, 2, 8:].any()   # the padding: zero codes
    (got,) = _session(folder).run(None, {_session(folder).get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        assert np.abs(got - small(x).numpy()).max() <= 1e-5


def test_minilm_round_trip(tmp_path):
    """The real pretrained MiniLM (a BertModel wrapper returning normalised sentence embeddings)."""
    model = wb.models.load("minilm")
    small = wb.apply(model, {"encoder.layer.*.attention.*": Q4, "encoder.layer.*.intermediate.*": Q8_G128_ASYM,
                             "encoder.layer.*.output.dense": Q4_G64_ASYM}, progress=False)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (2, 9), generator=gen)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    fmt = ONNX(example_inputs=(ids, mask), input_names=("input_ids", "attention_mask"))
    folder = wb.export(small, tmp_path / "out", format=fmt)
    _check_layers(folder, small)
    (got,) = _session(folder).run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    with torch.no_grad():
        expected = small(ids, mask).numpy()
    assert np.abs(got - expected).max() <= 1e-5


# --- what the export cannot hold: refused before anything is written -------------------------------------------------

def _refused(tmp_path, model, fmt, error, match):
    with pytest.raises(error, match=match):
        wb.export(model, tmp_path / "out", format=fmt)
    assert list(tmp_path.iterdir()) == []   # no folder, no partial folder


def _stack(k: int = 96) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(k, 32), nn.ReLU(), nn.Linear(32, 8)).eval()


@pytest.mark.parametrize("config, match", [
    (wb.quant.NF4(group_size=32), "stores NF4Format weights"),
    (wb.quant.WeightOnly(bits=4, group_size=32, symmetric=False, method="hqq", kernel="reference"),
     r"has real-valued \(HQQ\) zero points"),
    (wb.quant.WeightOnly(bits=3, group_size=32, kernel="reference"), "stores 3-bit codes"),
    (wb.quant.WeightOnly(bits=4, group_size=48, kernel="reference"), "has groups of 48"),
    (wb.quant.WeightOnly(bits=4, group_size=8, kernel="reference"), "has groups of 8"),
    (wb.quant.WeightOnly(bits=8, group_size=None, kernel="reference"), "is per channel over an input of 96"),
    (wb.quant.Dynamic(kernel="reference"), "is a W8A8 layer.*QDQ graph.*not written"),
    (wb.prune.Magnitude(sparsity=0.5), "is a PrunedLinear"),
    (wb.lowrank.SVD(rank=8), "is a LowRankLinear"),
], ids=["nf4", "hqq", "3-bit", "group-48", "group-8", "per-channel-96", "w8a8", "pruned", "low-rank"])
def test_refused_layers(tmp_path, config, match):
    small = wb.apply(_stack(), {"0": config}, progress=False)
    fmt = ONNX(example_inputs=(torch.randn(2, 96),))
    _refused(tmp_path, small, fmt, ValueError, r"onnx export: '0' " + match + ".*The ONNX export holds")


def test_awq_smoothing_is_refused(tmp_path):
    model = _stack(64)
    config = wb.quant.WeightOnly(bits=4, group_size=32, method="awq", kernel="reference")
    small = wb.apply(model, {"0": config}, calibration=[(torch.randn(4, 64),)], progress=False)
    _refused(tmp_path, small, ONNX(example_inputs=(torch.randn(2, 64),)), ValueError,
             "'0' divides its inputs by an AWQ smoothing vector")


def test_example_inputs_are_required(tmp_path, mlp):
    small = wb.apply(mlp, {"fc1": Q4}, progress=False)
    _refused(tmp_path, small, "onnx", ValueError, r"needs example inputs: pass format=ONNX\(example_inputs=")
