"""`wb.export(format=ONNX(...))` of weight-only convolutions (`wb.quant.WeightOnly` on nn.Conv1d / Conv2d /
ConvTranspose2d), read back only with the ``onnx`` package and run only with ONNX Runtime (CPUExecutionProvider):
each convolution's weight is one ``DequantizeLinear`` whose integer initializer is the workbench's codes (unpacked here
with numpy from the workbench's byte layout, not with the exporter's code), whose scales are its fp16 scales (as fp32)
and whose zero points are its integer ones (symmetric: ``2^(bits-1)``); they dequantize bit for bit to the weight the
workbench computes with, and ONNX Runtime's outputs match the workbench model's.

Tolerance: the weights are exactly the workbench's and the activations stay float, so outputs differ by the
convolutions' fp32 summation order only (and, in digits-cnn, MatMulNBits' for fc1 / fc2). Measured max |difference|:
digits-cnn on 512 test digits (logits up to ~18) 7.6e-6 with digits-cnn-mixed.json (uint8 per-channel convs, opset
17) and 8.6e-6 with its convs as int4 groups of 32 (uint4 blocks, opset 21), top-1 equal on all 512; the random stacks
(outputs up to ~1.1) 1.2e-7 to 6.0e-7. Asserted: digits 5e-5 (an fp32 ulp at 18 is 1.9e-6: some 26 ulps), stacks 1e-5,
top-1 equal on every digit. An fp16 model (a ``Cast`` of the weight, fp16 convolutions): measured 4.9e-4 (one fp16
ulp at 0.5 - 1, outputs up to 0.9), asserted 4e-3.
"""
from collections import defaultdict

import numpy as np
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.export import ONNX
from workbench.quantization.formats import IntFormat
from workbench.quantization.modules import WeightOnlyConv1d, WeightOnlyConv2d, WeightOnlyConvTranspose2d

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
numpy_helper = onnx.numpy_helper

WO_CONVS = (WeightOnlyConv1d, WeightOnlyConv2d, WeightOnlyConvTranspose2d)
DIGITS_ATOL, STACK_ATOL = 5e-5, 1e-5


# --- reading the file back with the onnx package ---------------------------------------------------------------------

def _dq_weights(model) -> dict[str, dict]:
    """Layer name -> the ``DequantizeLinear`` that makes its float Conv / ConvTranspose weight (possibly through a
    ``Reshape``): codes, scale and zero point as numpy, their element types, the node's attributes, the op."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    consumers = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)

    def tensor(name: str):   # an initializer, a Constant, or an Identity of one (equal initializers merged)
        if name in inits:
            return inits[name]
        node = producer[name]
        if node.op_type == "Identity":
            return tensor(node.input[0])
        assert node.op_type == "Constant", node
        return node.attribute[0].t

    out = {}
    for dq in graph.node:
        if dq.op_type != "DequantizeLinear" or not dq.input[0].endswith(".qweight"):
            continue
        (op,) = consumers[dq.output[0]]
        between = []
        while op.op_type in ("Reshape", "Cast"):   # (rows, K) -> the weight's layout; fp32 -> an fp16 model's dtype
            between.append(op.op_type)
            (op,) = consumers[op.output[0]]
        reshaped = "Reshape" in between
        codes, scale, zero = (tensor(n) for n in dq.input)
        out[dq.input[0].removesuffix(".qweight")] = {
            "op": op.op_type, "reshaped": reshaped, "cast": "Cast" in between,
            "attrs": {a.name: onnx.helper.get_attribute_value(a) for a in dq.attribute},
            "types": (codes.data_type, scale.data_type, zero.data_type),
            "codes": numpy_helper.to_array(codes).astype(np.uint8), "scale": numpy_helper.to_array(scale),
            "zero": numpy_helper.to_array(zero).astype(np.uint8)}
    return out


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The workbench's rows (rows, bytes) -> (rows, count) codes: value i in bits [bits * (i % k), ...) of byte i // k,
    ``k = 8 // bits`` (3-bit codes sit in 4-bit slots)."""
    per_byte = 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    codes = (packed[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :count]


def _check_layers(folder, small, opset: int) -> dict[str, dict]:
    """Every weight-only convolution is one ``DequantizeLinear`` holding its codes, scales and zero points exactly."""
    model = onnx.load(folder / "model.onnx")
    assert {o.domain or "": o.version for o in model.opset_import}[""] == opset
    found = _dq_weights(model)
    layers = {n: m for n, m in small.named_modules() if isinstance(m, WO_CONVS)}
    assert sorted(found) == sorted(layers)
    T = onnx.TensorProto
    for name, m in layers.items():
        d, fmt, rows = found[name], m.fmt, m.weight_shape[0]
        g, G = fmt.groups(m.K)
        slot = 4 if fmt.bits == 3 else fmt.bits
        codes = _unpack(m.qweight.numpy(), slot, m.K)                                   # (rows, K)
        scale = m.scale.float().numpy()                                                 # (rows, G)
        zero = m.zero.numpy() if not fmt.symmetric else np.full((rows, G), 1 << (fmt.bits - 1), np.uint8)
        element = T.UINT8 if fmt.bits == 8 else T.UINT4
        assert d["types"] == (element, T.FLOAT, element), name
        assert d["op"] == ("ConvTranspose" if isinstance(m, WeightOnlyConvTranspose2d) else "Conv"), name
        assert d["cast"] == (m.bias.dtype == torch.float16), name
        if G == 1:   # per channel: axis 0, codes in the weight's layout
            assert d["attrs"].get("axis", 1) == 0 and "block_size" not in d["attrs"] and not d["reshaped"], name
            assert d["codes"].shape == m.weight_shape, name
            assert np.array_equal(d["codes"].reshape(rows, -1), codes), name
            assert np.array_equal(d["scale"], scale.reshape(rows)), name
            assert np.array_equal(d["zero"], zero.reshape(rows)), name
            w = (d["codes"].reshape(rows, -1).astype(np.float32) - d["zero"][:, None]) * d["scale"][:, None]
        else:        # blocked along the flattened input, then reshaped
            assert d["attrs"] == {"axis": 1, "block_size": g} and d["reshaped"], name
            assert np.array_equal(d["codes"], codes), name
            assert np.array_equal(d["scale"], scale) and np.array_equal(d["zero"], zero), name
            w = (codes.astype(np.float32) - np.repeat(zero, g, 1)[:, :m.K]) * np.repeat(d["scale"], g, 1)[:, :m.K]
        assert d["scale"].astype(np.float16).astype(np.float32).tobytes() == d["scale"].tobytes(), name   # fp16 values
        assert np.array_equal(w, m.dequantized_weight().numpy()), name   # the weight it computes with, bit for bit
    return found


def _run(folder, x: torch.Tensor) -> np.ndarray:
    assert [p.name for p in folder.iterdir()] == ["model.onnx"]
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    (name,) = [i.name for i in session.get_inputs()]
    return session.run(None, {name: x.numpy()})[0]


# --- digits-cnn with the plans of data/plans --------------------------------------------------------------------------

CONV_INT4_G32 = wb.quant.WeightOnly(bits=4, group_size=32)   # blocked uint4 convs beside fc1's MatMulNBits


@pytest.fixture(scope="module", params=["mixed", "conv-int4-g32"])
def digits(request):
    """digits-cnn with data/plans/digits-cnn-mixed.json (int8 per-channel convs, GPTQ int4 fc1, int8 fc2) - or the
    same with its convs as int4 groups of 32 - and 512 test digits."""
    task = wb.tasks.load("digits")
    plan = wb.Plan.read("data/plans/digits-cnn-mixed.json")
    if request.param == "conv-int4-g32":
        plan = wb.Plan({**plan, "conv*": CONV_INT4_G32})
    small = wb.apply(wb.models.load("digits-cnn"), plan, calibration=task.calibration(64),
                     pipeline="original", progress=False)
    return request.param, task, small, torch.from_numpy(task.split.x_test[:512])


def test_digits_cnn_convolutions_hold_the_workbench_codes(tmp_path, digits):
    which, task, small, x = digits
    prepared = ONNX.for_task(task).prepare(small, None)
    assert prepared.opset == (17 if which == "mixed" else 21)
    folder = wb.export(small, tmp_path / "out", format=ONNX.for_task(task))
    found = _check_layers(folder, small, prepared.opset)
    assert sorted(found) == ["conv1", "conv2", "conv3"]
    ops = [n.op_type for n in onnx.load(folder / "model.onnx").graph.node]
    assert ops.count("MatMulNBits") == 2   # fc1, fc2 as before


def test_digits_cnn_runs_in_onnx_runtime(tmp_path, digits):
    _, task, small, x = digits
    got = _run(wb.export(small, tmp_path / "out", format=ONNX.for_task(task)), x)
    with torch.no_grad():
        expected = small(x).numpy()
    assert got.shape == expected.shape == (512, 10)
    assert np.abs(got - expected).max() <= DIGITS_ATOL
    assert (got.argmax(1) == expected.argmax(1)).all()


# --- small stacks: Conv1d, grouped / padded Conv2d, ConvTranspose2d, 2 / 3 / 4 / 8 bits -------------------------------

Q = wb.quant.WeightOnly
STACKS = {
    "conv1d-int4-channel-asym": ([nn.Conv1d(3, 16, 5, padding=2), nn.ReLU(), nn.Conv1d(16, 8, 3, stride=2)], (3, 40),
                                 Q(bits=4, group_size=None, symmetric=False, kernel="reference")),
    "conv2d-int4-g16-grouped-reflect": ([nn.Conv2d(6, 8, 3, groups=2), nn.ReLU(),
                                         nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect")], (6, 10, 10),
                                        Q(bits=4, group_size=16, kernel="reference")),
    "conv-transpose2d-int8-g8-asym": ([nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2), nn.ReLU(),
                                       nn.Conv2d(6, 5, 3, padding=1)], (4, 7, 7),
                                      Q(bits=8, group_size=8, symmetric=False, kernel="reference")),
    "conv2d-int3-g32": ([nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3)], (3, 10, 10),
                        Q(bits=3, group_size=32, kernel="reference")),
    "conv1d-int2-channel": ([nn.Conv1d(3, 8, 3), nn.ReLU(), nn.Conv1d(8, 8, 3, dilation=2)], (3, 20),
                            Q(bits=2, group_size=None, kernel="reference")),
}


def _stack(key: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers, shape, config = STACKS[key]
    model = nn.Sequential(*layers).eval()
    small = wb.apply(model, {str(i): config for i, m in enumerate(layers) if not isinstance(m, nn.ReLU)},
                     progress=False)
    return small, torch.randn(8, *shape)


def _export(small, x, tmp_path):
    fmt = ONNX(example_inputs=(x[:1],), input_names=("x",), dynamic_axes={"x": {0: "batch"}})
    return wb.export(small, tmp_path / "out", format=fmt)


@pytest.mark.parametrize("key", sorted(STACKS))
def test_small_stacks_round_trip(tmp_path, key):
    small, x = _stack(key)
    _, _, config = STACKS[key]
    folder = _export(small, x, tmp_path)
    opset = 17 if config.bits == 8 and config.group_size is None else 21
    _check_layers(folder, small, opset)
    with torch.no_grad():
        expected = small(x).numpy()
    assert np.abs(_run(folder, x) - expected).max() <= STACK_ATOL


def test_fp16_model(tmp_path):
    """A model cast to fp16 after quantization: the fp32 ``DequantizeLinear`` output is cast to fp16, as the workbench
    casts its decoded weight, and the convolutions run in fp16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3)).eval()
    small = wb.apply(model, {"*": Q(bits=8, group_size=None, kernel="reference")}, progress=False).half()
    x = torch.randn(8, 3, 10, 10).half()
    folder = _export(small, x, tmp_path)
    _check_layers(folder, small, 17)
    with torch.no_grad():
        expected = small(x).float().numpy()
    got = _run(folder, x)
    assert got.dtype == np.float16 and np.abs(got.astype(np.float32) - expected).max() <= 4e-3


# --- what the export cannot hold: refused before anything is written -------------------------------------------------

def _refused(tmp_path, small, x, match):
    with pytest.raises(ValueError, match=match + ".*The ONNX export holds .*weight-only convolutions"):
        wb.export(small, tmp_path / "out", format=ONNX(example_inputs=(x,)))
    assert list(tmp_path.iterdir()) == []   # no folder, no partial folder


def _convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10)).eval()


@pytest.mark.parametrize("config, match", [
    (wb.quant.NF4(group_size=9), r"'0' stores NF4Format weights"),
    (wb.quant.FP8(), r"'0' stores FP8Format weights"),
], ids=["nf4", "fp8"])
def test_non_integer_convolutions_are_refused(tmp_path, config, match):
    small = wb.apply(_convnet(), {"0": config}, progress=False)
    _refused(tmp_path, small, torch.randn(2, 3, 8, 8), match)


def test_bf16_convolution_is_refused(tmp_path):
    conv = nn.Conv2d(3, 8, 3).to(torch.bfloat16)
    small = nn.Sequential(WeightOnlyConv2d.from_float(conv, IntFormat(bits=8, group_size=None), name="0")).eval()
    _refused(tmp_path, small, torch.randn(2, 3, 8, 8).to(torch.bfloat16), r"'0' computes in torch.bfloat16")
