"""`wb.export(format=ONNX(...))` of static W8A8 models (`wb.quant.Static`) as QDQ graphs, read back only with the
``onnx`` package and run only with ONNX Runtime (CPUExecutionProvider, default graph optimizations): each layer's
``DequantizeLinear`` weight initializers are the workbench's int8 codes and fp32 scales, its activation
``QuantizeLinear`` / ``DequantizeLinear`` pair holds its calibrated scale, ONNX Runtime's outputs match the workbench
model on the tasks' real inputs, and what the export cannot hold is refused before anything is written.

Tolerances. ONNX Runtime computes on the same int8 grid, but ``QuantizeLinear`` divides by the scale where the
workbench multiplies by its fp32 reciprocal, its convolutions / GEMMs sum in another order, and where a layer's output
feeds a ``QuantizeLinear`` it rounds the float bias to int32 at ``s_x s_w`` itself (to fuse QLinearConv). So an
activation whose ``x / s`` lies at a rounding tie can land on the neighbouring int8 code; nothing else differs. The
digits and small-stack tests check exactly that, code by code (ONNX Runtime's codes read from its ``QuantizeLinear``
outputs, the workbench's from its layers' inputs):

1. every layer's codes are within one of the workbench's, in at most 1e-3 (digits) / 1e-2 (small stacks) of them -
   measured: digits-cnn on 512 test digits 0 / 0 / 4 / 13 / 13 of 33k / 1M / 524k / 131k / 66k codes; the Conv1d
   stack 0 / 5 / 15 of 7.7k / 41k / 9.7k; the ConvTranspose2d stack none;
2. ONNX Runtime's output is the workbench's last layer run on ONNX Runtime's own input codes, up to fp32 summation
   order: measured <= 5.7e-6 (digits logits up to 18), 1.3e-7 (stacks); asserted 1e-4;
3. hence each sample's output differs from the workbench's by at most (its flipped last-layer codes) x ``s_x max|w|``
   (one code of the last layer's input moves an output by ``s_x |w|``), + 1e-4: measured up to 0.40 (digits) and
   1.0 (Conv1d stack) of that bound; max |difference| 0.050 (digits), 0.0070 (Conv1d stack), 1.3e-7 (the other);
4. the graph as ONNX Runtime runs it unread (free to fuse) differs from the one read by at most one such code:
   measured 0. Top-1 agreement on the 512 digits: measured 1.0, asserted >= 0.99.

efficientnet-lite0 (50 quantized layers, 10 evaluation views): a tie flipped early is amplified through 50 layers of
BatchNorm and ReLU6 (codes differ by up to ~17 near the head), so the difference is compared with the same model's own
sensitivity to rounding: the workbench model with every quantized layer's input multiplied by ``1 + 2^-23`` (each
value moved by an fp32 ulp or two) moves the logits (up to ~11) by ||d|| = 3.72, max 0.156; ONNX Runtime's ||d|| =
3.63, max 0.149 (the W8A8 error itself, against fp32: ||d|| = 10.4). Asserted: <= 2x that baseline, and top-1
agreement (measured 10 / 10) >= 0.9.
"""
from collections import defaultdict

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper
from torch import nn

import workbench as wb
from workbench.export import ONNX
from workbench.quantization import W8A8Linear
from workbench.quantization.modules import W8A8Conv1d, W8A8Conv2d, W8A8ConvTranspose2d
from workbench.quantization.primitives import quantize_per_tensor

Static = wb.quant.Static
W8A8_LAYERS = (W8A8Linear, W8A8Conv1d, W8A8Conv2d, W8A8ConvTranspose2d)
FP32_ORDER_ATOL = 1e-4


# --- reading the file back with the onnx package ---------------------------------------------------------------------

def _qdq_groups(model: onnx.ModelProto) -> dict[str, dict]:
    """Layer name -> its QDQ group, found from the ``{layer}.qweight`` initializer a ``DequantizeLinear`` reads:
    the float op it feeds, the activation ``DequantizeLinear`` / ``QuantizeLinear`` on that op's input (and a
    ``Div`` before it), with every scale and zero point read as numpy."""
    graph = model.graph
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    consumers = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)

    def value(name: str) -> np.ndarray:   # an initializer, a Constant, or an Identity of one (merged initializers)
        if name in inits:
            return inits[name]
        node = producer[name]
        if node.op_type == "Identity":
            return value(node.input[0])
        assert node.op_type == "Constant", node
        return numpy_helper.to_array(node.attribute[0].t)

    def attrs(node) -> dict:
        return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}

    groups = {}
    for dq_w in graph.node:
        if dq_w.op_type != "DequantizeLinear" or not dq_w.input[0].endswith(".qweight"):
            continue
        (op,) = consumers[dq_w.output[0]]
        assert op.input[1] == dq_w.output[0]
        dq_x = producer[op.input[0]]
        q_x = producer[dq_x.input[0]]
        assert (dq_x.op_type, q_x.op_type) == ("DequantizeLinear", "QuantizeLinear")
        div = producer.get(q_x.input[0])
        smooth = value(div.input[1]) if div is not None and div.op_type == "Div" else None
        groups[dq_w.input[0].removesuffix(".qweight")] = {
            "op": op.op_type, "op_attrs": attrs(op), "axis": attrs(dq_w).get("axis", 1),
            "codes": value(dq_w.input[0]), "scale": value(dq_w.input[1]), "zero": value(dq_w.input[2]),
            "act_scale": [value(q_x.input[1]), value(dq_x.input[1])], "act_zero": [value(q_x.input[2]),
                                                                                  value(dq_x.input[2])],
            "smooth": smooth, "codes_out": q_x.output[0]}
    return groups


def _w8a8(small: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in small.named_modules() if isinstance(m, W8A8_LAYERS)}


def _stored(m: nn.Module) -> np.ndarray:
    """The layer's int8 codes in the float layer's weight layout."""
    return (m.qweight_t.t() if isinstance(m, W8A8Linear) else m.qweight).numpy()


def _check_layers(folder, small) -> dict[str, dict]:
    """Every static W8A8 layer is one QDQ group holding its codes and scales exactly."""
    groups = _qdq_groups(onnx.load(folder / "model.onnx"))
    layers = _w8a8(small)
    assert sorted(groups) == sorted(layers)
    for name, m in layers.items():
        g = groups[name]
        assert g["codes"].dtype == np.int8 and np.array_equal(g["codes"], _stored(m)), name
        assert g["scale"].dtype == np.float32 and np.array_equal(g["scale"], m.scale.reshape(-1).numpy()), name
        assert g["axis"] == 0 and g["zero"].dtype == np.int8 and not g["zero"].any(), name
        for s, z in zip(g["act_scale"], g["act_zero"]):
            assert s.dtype == np.float32 and s.shape == () and s == m.act_scale.numpy(), name
            assert z.dtype == np.int8 and z.shape == () and z == 0, name
        smooth = getattr(m, "smooth", None)
        assert (g["smooth"] is None) == (smooth is None), name
        if smooth is not None:
            assert np.array_equal(g["smooth"], smooth.numpy()), name
        w = g["codes"].astype(np.float32) * g["scale"].reshape(-1, *(1,) * (g["codes"].ndim - 1))
        multiplied = m.weight.decode() if smooth is None else (m.qweight_t.float() * m.scale).t()   # (W * smooth)
        assert np.array_equal(w, multiplied.numpy()), name          # the weight it computes with, bit for bit
        expected_op = {W8A8Linear: "Gemm", W8A8Conv1d: "Conv", W8A8Conv2d: "Conv",
                       W8A8ConvTranspose2d: "ConvTranspose"}[type(m)]
        assert g["op"] == expected_op, name
        if expected_op == "Gemm":
            assert g["op_attrs"].get("transB") == 1, name
    return groups


def _session(folder, optimized=None):
    """ONNX Runtime on the exported file, default optimizations (``optimized``: where to save the graph it runs)."""
    assert [p.name for p in folder.iterdir()] == ["model.onnx"]
    options = ort.SessionOptions()
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])


def _run_with_codes(folder, groups, x) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """ONNX Runtime's output and the int8 codes of each layer's ``QuantizeLinear`` (made graph outputs, so ONNX
    Runtime does not fuse them away)."""
    model = onnx.load(folder / "model.onnx")
    for g in groups.values():
        model.graph.output.append(onnx.helper.make_tensor_value_info(g["codes_out"], onnx.TensorProto.INT8, None))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    outputs = dict(zip(names, session.run(None, {"x": x.numpy()})))
    return outputs[names[0]], {layer: outputs[g["codes_out"]] for layer, g in groups.items()}


def _compare_codes(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray], max_fraction: float) -> np.ndarray:
    """Each layer's codes differ by at most one (a rounding tie), in at most ``max_fraction`` of them; returns which
    samples (first dimension) have any code that differs."""
    flipped = None
    for name, mine in ours.items():
        diff = np.abs(mine.astype(np.int32) - theirs[name].reshape(mine.shape).astype(np.int32))
        assert diff.max() <= 1, name
        assert (diff > 0).mean() <= max_fraction, (name, int((diff > 0).sum()), diff.size)
        sample = diff.reshape(len(diff), -1).any(axis=1)
        flipped = sample if flipped is None else flipped | sample
    assert flipped is not None
    return flipped


def _workbench_codes(small, x, names=None) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """The model's output and the int8 codes each W8A8 layer (or those in ``names``) quantizes its input to, by the
    workbench's own rule."""
    codes = {}

    def hook(name):
        def record(module, args):
            xi = args[0] if getattr(module, "smooth", None) is None else args[0] / module.smooth
            padding = getattr(module, "conv_args", {}).get("input_padding")
            if padding is not None:   # ("same" padding: the export pads before quantizing, to the same codes)
                xi = padding(xi, module.conv_args)
            codes[name] = quantize_per_tensor(xi, module.act_scale)[0].reshape(xi.shape).numpy()
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in _w8a8(small).items() if names is None or n in names]
    try:
        with torch.no_grad():
            y = small(x)
    finally:
        for h in handles:
            h.remove()
    return y, codes


def _ulp_noise_outputs(small, x) -> torch.Tensor:
    """The model's output with every W8A8 layer's input multiplied by 1 + 2^-23: each value moved by one or two fp32
    ulps, as a different summation order moves it."""

    def jitter(module, args):
        return (args[0] * (1 + 2.0 ** -23),)

    handles = [m.register_forward_pre_hook(jitter) for m in _w8a8(small).values()]
    try:
        with torch.no_grad():
            return small(x)
    finally:
        for h in handles:
            h.remove()


def _export(small, x, tmp_path):
    fmt = ONNX(example_inputs=(x[:1],), input_names=("x",), dynamic_axes={"x": {0: "batch"}})
    return wb.export(small, tmp_path / "out", format=fmt)


# --- round trips ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def digits():
    """digits-cnn with static W8A8 convs and Linears (fc1 SmoothQuant-smoothed), calibrated on 256 training digits."""
    model = wb.models.load("digits-cnn")
    task = wb.tasks.load("digits")
    plan = wb.Plan({"conv*": Static(observer="percentile"), "fc1": Static(smooth_alpha=0.5, kernel="cpu"),
                    "fc2": Static(kernel="reference")})
    small = wb.apply(model, plan, calibration=task.calibration(256), pipeline="original", progress=False)
    return small, torch.from_numpy(task.split.x_test[:512])


def test_digits_cnn_initializers_are_the_workbench_codes(tmp_path, digits):
    small, x = digits
    groups = _check_layers(_export(small, x, tmp_path), small)
    assert sorted(groups) == ["conv1", "conv2", "conv3", "fc1", "fc2"]
    assert groups["fc1"]["smooth"] is not None and groups["fc2"]["smooth"] is None


def _matches_workbench(folder, small, x, last: str, max_fraction: float, optimized=None) -> tuple[np.ndarray,
                                                                                                    np.ndarray]:
    """ONNX Runtime's output on ``x`` against the workbench's, explained code by code (see the module docstring):
    activation codes within one of the workbench's; the output that of the last layer (``last``) run on ONNX
    Runtime's own input codes; so each sample's output within its flipped last-layer codes times ``s_x max|w|``."""
    got, theirs = _run_with_codes(folder, _qdq_groups(onnx.load(folder / "model.onnx")), x)
    (plain,) = _session(folder, optimized).run(None, {"x": x.numpy()})
    expected, ours = _workbench_codes(small, x)
    expected = expected.numpy()
    layer = small.get_submodule(last)
    step = float(layer.act_scale) * float(layer.weight.decode().abs().max())   # one input code of the last layer
    # the graph as it is (ONNX Runtime may fuse QDQ groups that reading the codes kept apart): within one code
    assert np.abs(plain - got).max() <= step

    _compare_codes(ours, theirs, max_fraction)
    codes = theirs[last].reshape(ours[last].shape)
    with torch.no_grad():
        forced = layer(torch.from_numpy(codes).float() * layer.act_scale).numpy()
    assert np.abs(got - forced).max() <= FP32_ORDER_ATOL
    flips = (codes != ours[last]).reshape(len(x), -1).sum(axis=1)                   # (B,)
    err = np.abs(got - expected).reshape(len(x), -1).max(axis=1)                    # (B,)
    assert (err <= flips * step + FP32_ORDER_ATOL).all(), (err.max(), flips.max(), step)
    return got, expected


def test_digits_cnn_runs_in_onnx_runtime(tmp_path, digits):
    small, x = digits
    got, expected = _matches_workbench(_export(small, x, tmp_path), small, x, "fc2", 1e-3)
    assert (got.argmax(1) == expected.argmax(1)).mean() >= 0.99


@pytest.mark.parametrize("layers, shape", [
    ([nn.Conv1d(3, 16, 5, padding=2), nn.ReLU(), nn.Conv1d(16, 8, 3, stride=2), nn.Conv1d(8, 8, 3)], (3, 40)),
    ([nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2), nn.ReLU(), nn.Conv2d(6, 5, 3, padding=1), nn.Flatten(),
      nn.Linear(5 * 11 * 11, 7)], (4, 5, 5)),
], ids=["conv1d", "conv-transpose2d-grouped"])
def test_small_stacks(tmp_path, layers, shape):
    """Conv1d, grouped ConvTranspose2d and Linear on random data. In the first, conv 2's output is conv 3's
    QuantizeLinear input: ONNX Runtime fuses that QDQ group into QLinearConv (with its own int32 bias)."""
    torch.manual_seed(0)
    model = nn.Sequential(*layers).eval()
    calibration = [(torch.randn(16, *shape),) for _ in range(2)]
    small = wb.apply(model, {"*": Static(kernel="reference")}, calibration=calibration, pipeline="original",
                     progress=False)
    x = torch.randn(64, *shape)
    folder = _export(small, x, tmp_path)
    _check_layers(folder, small)
    _matches_workbench(folder, small, x, str(len(small) - 1), 1e-2, optimized=tmp_path / "optimized.onnx")
    ops = {n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node}
    assert ("QLinearConv" in ops) == isinstance(small[2], W8A8Conv1d)


def test_efficientnet_lite0_round_trip(tmp_path):
    model = wb.models.load("efficientnet-lite0")
    task = wb.tasks.load("imagenet-photos")
    small = wb.apply(model, {"*": Static(kernel="reference")}, calibration=task.calibration(4), pipeline="original",
                     progress=False)
    (x,) = task.example_inputs(10)
    folder = _export(small, x, tmp_path)
    groups = _check_layers(folder, small)
    assert len(groups) == 50                                  # 49 "same"-padded convolutions and the classifier
    first, last = ["_conv_stem", "_blocks.0._depthwise_conv"], "_fc"
    got, theirs = _run_with_codes(folder, {n: groups[n] for n in [*first, last]}, x)
    expected, ours = _workbench_codes(small, x, [*first, last])
    expected = expected.numpy()
    _compare_codes({n: ours[n] for n in first}, theirs, 1e-3)   # before rounding differences have cascaded
    with torch.no_grad():
        forced = small._fc(torch.from_numpy(theirs[last]).float() * small._fc.act_scale).numpy()
    assert np.abs(got - forced).max() <= FP32_ORDER_ATOL

    baseline = _ulp_noise_outputs(small, x).numpy() - expected
    assert np.abs(baseline).max() > 0                         # (the baseline does perturb the model)
    err = got - expected
    assert np.linalg.norm(err) <= 2 * np.linalg.norm(baseline), (np.linalg.norm(err), np.linalg.norm(baseline))
    assert np.abs(err).max() <= 2 * np.abs(baseline).max()
    assert (got.argmax(1) == expected.argmax(1)).mean() >= 0.9


# --- what the export cannot hold: refused before anything is written -------------------------------------------------

def _refused(tmp_path, small, x, match):
    with pytest.raises(ValueError, match=match + ".*The ONNX export holds .*static W8A8"):
        wb.export(small, tmp_path / "out", format=ONNX(example_inputs=(x,)))
    assert list(tmp_path.iterdir()) == []   # no folder, no partial folder


def _convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10)).eval()


def test_dynamic_w8a8_is_refused(tmp_path):
    calibration = [(torch.randn(8, 3, 8, 8),)]
    small = wb.apply(_convnet(), {"0": Static(kernel="reference"), "3": wb.quant.Dynamic(kernel="reference")},
                     calibration=calibration, pipeline="original",
                     progress=False)
    _refused(tmp_path, small, torch.randn(2, 3, 8, 8), r"'3' is a W8A8 layer with dynamic activations")


def test_scales_cast_from_fp32_are_refused(tmp_path):
    small = wb.apply(_convnet(), {"*": Static(kernel="reference")}, calibration=[(torch.randn(8, 3, 8, 8),)],
                     pipeline="original", progress=False).half()
    _refused(tmp_path, small, torch.randn(2, 3, 8, 8).half(), r"'0' holds scale in torch.float16, not torch.float32")
