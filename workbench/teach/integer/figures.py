"""Lab 14's computations and figures: the integer-only digits CNN, its fake-quant reference, its tables."""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from workbench.models.architectures import DigitsCNN
from workbench.models.fuse import fold_batchnorm, fold_pair
from workbench.plots.style import TEMPLATE
from workbench.quantization import integer as I
from workbench.quantization import primitives as P

__all__ = ["LAYERS", "IntegerCNN", "fold", "float_stages", "convert", "integer_forward", "fake_quant_forward",
           "layer_lsb_table", "accuracy_table", "multiplier_table", "folding_table", "lsb_figure", "accuracy_figure",
           "multiplier_figure", "folding_figure", "layer_input", "accumulator", "asymmetric_weights", "logits",
           "integer_layer"]


LAYERS = ("conv1", "conv2", "conv3", "fc1", "fc2")
_RELU = {"conv1": True, "conv2": True, "conv3": True, "fc1": True, "fc2": False}
_POOL = {"conv1": False, "conv2": True, "conv3": True, "fc1": False, "fc2": False}
QMIN, QMAX = P.qrange(8, True)


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, DigitsCNN):
        raise TypeError(f"this lab runs the zoo's digits-cnn (a DigitsCNN), got {type(model).__name__}")


def fold(model: nn.Module) -> nn.Module:
    """A copy of the digits CNN with each BatchNorm folded into its convolution (`fuse.fold_batchnorm`)."""
    _check_model(model)
    folded = copy.deepcopy(model).eval()
    result = fold_batchnorm(folded)
    if len(result.folded) != 3:
        raise RuntimeError(f"expected three conv + BatchNorm pairs to fold, folded {result.folded}")
    return folded


def float_stages(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The float activations at each quantization point of the digits CNN for pixels ``x`` ``(B, 64)``:
    ``input`` and each layer's output after its ReLU (before pooling). Runs the same operations as
    ``DigitsCNN.forward`` (BatchNorms included when not folded)."""
    _check_model(model)
    out = {"input": x.view(-1, 1, 8, 8)}
    h = out["input"]
    with torch.no_grad():
        for i, name in enumerate(("conv1", "conv2", "conv3"), start=1):
            h = F.relu(getattr(model, f"bn{i}")(getattr(model, name)(h)))
            out[name] = h
            h = F.max_pool2d(h, 2) if _POOL[name] else h
        h = F.relu(model.fc1(h.flatten(1)))
        out["fc1"] = h
        out["fc2"] = model.fc2(h)
    return out


def _act_qparams(x: torch.Tensor) -> tuple[float, int]:
    """Static asymmetric int8 (scale, zero point) of an activation from its calibration min / max."""
    s, z = P.choose_qparams(x.detach().reshape(1, -1), 8, symmetric=False)
    return float(s), int(z)


@dataclass(frozen=True)
class IntegerCNN:
    """The digits CNN as integer layers: ``layers[name]`` an `IntegerLinear` per conv / Linear, and the
    input's (scale, zero point)."""

    layers: dict
    input_scale: float
    input_zero_point: int
    folded: nn.Module

    def with_multiplier_bits(self, bits: int) -> "IntegerCNN":
        """The same model with every requantization multiplier held in ``bits`` bits instead of 31."""
        layers = {}
        for name, layer in self.layers.items():
            m = layer.input_scale * layer.weight_scale.double() / layer.output_scale
            m0, shift = I.quantize_multiplier(m, bits)
            layers[name] = replace(layer, multiplier=m0, shift=shift)
        return replace(self, layers=layers)


def convert(model: nn.Module, calibration: torch.Tensor, multiplier_bits: int = 31) -> IntegerCNN:
    """Fold the BatchNorms, calibrate every activation's int8 range on ``calibration`` pixels ``(B, 64)`` and
    quantize each layer to an `IntegerLinear` (the model itself is not changed)."""
    folded = fold(model)
    acts = float_stages(folded, calibration)
    qp = {k: _act_qparams(v) for k, v in acts.items()}
    layers, previous = {}, "input"
    for name in LAYERS:
        module = getattr(folded, name)
        (sx, zx), (sy, zy) = qp[previous], qp[name]
        layers[name] = I.IntegerLinear.from_float(module.weight, module.bias, sx, zx, sy, zy, relu=_RELU[name],
                                                  multiplier_bits=multiplier_bits)
        previous = name
    return IntegerCNN(layers, *qp["input"], folded)


def _quantize_input(net: IntegerCNN, x: torch.Tensor) -> torch.Tensor:
    s, z = torch.tensor([[net.input_scale]]), torch.tensor([[net.input_zero_point]])
    return P.quantize(x.reshape(1, -1), s, z, QMIN, QMAX).reshape(-1, 1, 8, 8)


def _pool_codes(q: torch.Tensor) -> torch.Tensor:
    """2x2 max-pool of integer codes ``(N, C, H, W)`` (a max of codes is the code of the max)."""
    n, c, h, w = q.shape
    return q.reshape(n, c, h // 2, 2, w // 2, 2).amax(dim=(3, 5))


def _next_input(name: str, q: torch.Tensor) -> torch.Tensor:
    q = _pool_codes(q) if _POOL[name] else q
    return q.flatten(1) if name == "conv3" else q


def integer_layer(net: IntegerCNN, name: str, q_in: torch.Tensor) -> torch.Tensor:
    """Output codes of layer ``name`` for its input codes (conv: ``(N, C, H, W)``; Linear: ``(N, K)``)."""
    layer = net.layers[name]
    if name.startswith("conv"):
        return I.integer_conv2d(q_in, layer, (3, 3), padding=1)
    return I.integer_linear(q_in, layer)


def integer_forward(net: IntegerCNN, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Integer codes at every quantization point for pixels ``x`` ``(B, 64)``: the input is quantized once,
    then only integer operations run. ``out["fc2"]`` holds the logits' int8 codes."""
    out = {"input": _quantize_input(net, x)}
    q = out["input"]
    for name in LAYERS:
        out[name] = integer_layer(net, name, q)
        q = _next_input(name, out[name])
    return out


def layer_input(codes: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The input codes layer ``name`` receives, from the codes at every point (`integer_forward`)."""
    previous = "input" if name == LAYERS[0] else LAYERS[LAYERS.index(name) - 1]
    return codes["input"] if previous == "input" else _next_input(previous, codes[previous])


def accumulator(net: IntegerCNN, name: str, q_in: torch.Tensor) -> torch.Tensor:
    """Layer ``name``'s int32 accumulator, bias included, ``(rows, C)`` (conv: one row per output pixel)."""
    layer = net.layers[name]
    cols = I.im2col(q_in, (3, 3), 1, layer.input_zero_point) if name.startswith("conv") else q_in.to(torch.int32)
    return cols @ layer.weight.to(torch.int32).T + layer.bias


def asymmetric_weights(net: IntegerCNN, name: str = "fc2") -> tuple[torch.Tensor, int]:
    """Layer ``name``'s float weights as uint8 per-tensor asymmetric codes (Jacob et al.'s weight format):
    ``(q_w (C, K) uint8, z_w)``."""
    layer = net.layers[name]
    w = layer.weight.float() * layer.weight_scale[:, None]
    q, _, z = P.quantize_affine(w, 8, P.PerTensor(), symmetric=False, signed=False)
    return q, int(z)


def _fake_layer(net: IntegerCNN, name: str, q_in: torch.Tensor) -> torch.Tensor:
    """The float fake-quant layer: dequantized input and weights, float conv / Linear with the float bias,
    ReLU, then the output quantizer (round half to even); returns its codes."""
    layer = net.layers[name]
    x = (q_in.to(torch.float64) - layer.input_zero_point) * layer.input_scale
    w = layer.weight.to(torch.float64) * layer.weight_scale.double()[:, None]
    b = layer.bias_float.double()
    if name.startswith("conv"):
        y = F.conv2d(x, w.reshape(w.shape[0], -1, 3, 3), b, padding=1)
    else:
        y = F.linear(x, w, b)
    y = F.relu(y) if _RELU[name] else y
    q = torch.round(y / layer.output_scale) + layer.output_zero_point
    return q.clamp(QMIN, QMAX).to(torch.int8)


def fake_quant_forward(net: IntegerCNN, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Codes at every quantization point of the float fake-quant model (float arithmetic, quantized values)."""
    out = {"input": _quantize_input(net, x)}
    q = out["input"]
    for name in LAYERS:
        out[name] = _fake_layer(net, name, q)
        q = _next_input(name, out[name])
    return out


def logits(net: IntegerCNN, codes: torch.Tensor) -> torch.Tensor:
    """Dequantized logits from the last layer's codes."""
    layer = net.layers["fc2"]
    return (codes.to(torch.float32) - layer.output_zero_point) * layer.output_scale


def layer_lsb_table(net: IntegerCNN, x: torch.Tensor, codes: dict[str, torch.Tensor] | None = None):
    """Per layer, the integer layer against the fake-quant layer on the *same* input codes (the reference's):
    max |difference| and the share of outputs that differ, in output codes (LSB); and end to end (each path
    fed its own previous codes; ``codes``: `integer_forward`'s result for ``x``, if already computed). Columns:
    layer, max_lsb, differ, max_lsb_end_to_end."""
    import pandas as pd

    ref = fake_quant_forward(net, x)
    own = integer_forward(net, x) if codes is None else codes
    rows, q = [], ref["input"]
    for name in LAYERS:
        got = integer_layer(net, name, q).to(torch.int32)
        diff = (got - ref[name].to(torch.int32)).abs()
        end = (own[name].to(torch.int32) - ref[name].to(torch.int32)).abs()
        rows.append({"layer": name, "max_lsb": int(diff.max()), "differ": float((diff > 0).float().mean()),
                     "max_lsb_end_to_end": int(end.max())})
        q = _next_input(name, ref[name])
    return pd.DataFrame(rows)


def _accuracy(pred: torch.Tensor, y: torch.Tensor) -> float:
    return float((pred == y).float().mean())


def accuracy_table(model: nn.Module, net: IntegerCNN, x: torch.Tensor, y: torch.Tensor,
                   codes: dict[str, torch.Tensor] | None = None):
    """Test accuracy and logit SQNR (against fp32) of fp32, the fake-quant model and the integer-only model,
    and how often the integer model's prediction equals the fake-quant one's (``codes``: `integer_forward`'s
    result for ``x``, if already computed)."""
    import pandas as pd

    with torch.no_grad():
        ref = model(x)
    fq = logits(net, fake_quant_forward(net, x)["fc2"])
    io = logits(net, (integer_forward(net, x) if codes is None else codes)["fc2"])
    rows = [{"model": "fp32", "accuracy": _accuracy(ref.argmax(1), y), "logit_sqnr_db": float("inf"),
             "same_prediction_as_fake_quant": _accuracy(ref.argmax(1), fq.argmax(1))},
            {"model": "fake-quant (float arithmetic)", "accuracy": _accuracy(fq.argmax(1), y),
             "logit_sqnr_db": P.sqnr(ref, fq), "same_prediction_as_fake_quant": 1.0},
            {"model": "integer-only", "accuracy": _accuracy(io.argmax(1), y), "logit_sqnr_db": P.sqnr(ref, io),
             "same_prediction_as_fake_quant": _accuracy(io.argmax(1), fq.argmax(1))}]
    return pd.DataFrame(rows)


def _floor_requantize(net: IntegerCNN, name: str, q_in: torch.Tensor) -> torch.Tensor:
    """Layer ``name`` with a truncating (floor) shift instead of the rounding one."""
    layer = net.layers[name]
    cols = (I.im2col(q_in, (3, 3), 1, layer.input_zero_point) if name.startswith("conv") else q_in.to(torch.int32))
    acc = cols @ layer.weight.to(torch.int32).T + layer.bias
    q = torch.bitwise_right_shift(acc.to(torch.int64) * layer.multiplier, layer.shift) + layer.output_zero_point
    q = q.clamp(layer.qmin, layer.qmax).to(torch.int8)
    if name.startswith("conv"):
        n, _, h, w = q_in.shape
        q = q.reshape(n, h, w, -1).permute(0, 3, 1, 2)
    return q


def multiplier_table(net: IntegerCNN, x: torch.Tensor, y: torch.Tensor, bits=(31, 8, 4, 1), samples: int = 128):
    """How the requantization multiplier's precision matters: for ``M0`` held in each of ``bits`` bits (1 bit:
    M rounded to a power of two), and for a truncating shift, the layer-wise max and mean signed difference
    from the fake-quant codes (in LSB, on the first ``samples`` images) and the test accuracy of the integer
    model on all of ``x``."""
    import pandas as pd

    ref = fake_quant_forward(net, x[:samples])
    full = fake_quant_forward(net, x)
    variants = [(f"M0 in {b} bits", b, net.with_multiplier_bits(b), integer_layer) for b in bits]
    variants.append(("31 bits, truncating shift", 31, net, _floor_requantize))
    rows = []
    for label, b, variant, run in variants:
        worst, bias, q = 0, [], ref["input"]
        for name in LAYERS:
            d = run(variant, name, q).to(torch.int32) - ref[name].to(torch.int32)
            worst, q = max(worst, int(d.abs().max())), _next_input(name, ref[name])
            bias.append(float(d.float().mean()))
        if run is integer_layer:
            out = integer_forward(variant, x)["fc2"]
        else:
            q = full["input"]
            for name in LAYERS:
                out = run(variant, name, q)
                q = _next_input(name, out)
        rows.append({"variant": label, "multiplier_bits": b, "max_lsb": worst, "mean_signed_lsb": sum(bias) / 5,
                     "accuracy": _accuracy(out.argmax(1), y)})
    return pd.DataFrame(rows)


def folding_table(model: nn.Module, calibration: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                  low_bits: int = 3):
    """Why BatchNorm is folded before quantizing (float simulations): logit SQNR against fp32 and accuracy of

    - int8 per-channel weights (what the integer model deploys): ``fold, then quantize`` against ``no folding``,
      where the conv output is quantized to int8 *before* BatchNorm (the extra requantization an unfolded
      BatchNorm needs in an integer-only model);
    - ``low_bits`` per-tensor weights (Jacob et al.'s per-tensor grids, at a width where the effect shows on this
      small model): ``fold, then quantize`` against ``quantize, then fold``, where the conv weights are
      quantized first (as QAT without folding trains them) and the folded weights ``Q(W) gamma / sigma``, off
      the grid, are quantized again."""
    import pandas as pd

    _check_model(model)
    with torch.no_grad():
        ref = model(x)

    def fq_weights(m: nn.Module, bits: int, granularity) -> nn.Module:
        for name in LAYERS:
            layer = getattr(m, name)
            layer.weight.data = P.fake_quantize(layer.weight.data, bits, granularity, symmetric=True)
        return m

    def quantize_then_fold(bits: int, granularity) -> nn.Module:
        m = fq_weights(copy.deepcopy(model).eval(), bits, granularity)
        for i in (1, 2, 3):
            fold_pair(getattr(m, f"conv{i}"), getattr(m, f"bn{i}"))
            setattr(m, f"bn{i}", nn.Identity())
        return fq_weights(m, bits, granularity)

    unfolded = fq_weights(copy.deepcopy(model).eval(), 8, P.PerChannel(0))
    with torch.no_grad():                      # calibration ranges of the conv outputs before BatchNorm
        h = calibration.view(-1, 1, 8, 8)
        for i, name in enumerate(("conv1", "conv2", "conv3"), start=1):
            c = getattr(unfolded, name)(h)
            bn = getattr(unfolded, f"bn{i}")
            h = F.relu(bn(c))
            h = F.max_pool2d(h, 2) if _POOL[name] else h
            setattr(unfolded, f"bn{i}", nn.Sequential(_FakeQuant(*_act_qparams(c)), bn))
    variants = [("int8 per channel", "fold, then quantize", fq_weights(fold(model), 8, P.PerChannel(0))),
                ("int8 per channel", "no folding: int8 before BatchNorm", unfolded),
                (f"int{low_bits} per tensor", "fold, then quantize", fq_weights(fold(model), low_bits, P.PerTensor())),
                (f"int{low_bits} per tensor", "quantize, then fold", quantize_then_fold(low_bits, P.PerTensor()))]
    rows = []
    for weights, label, m in variants:
        with torch.no_grad():
            o = m(x)
        rows.append({"weights": weights, "variant": label, "logit_sqnr_db": P.sqnr(ref, o),
                     "accuracy": _accuracy(o.argmax(1), y)})
    return pd.DataFrame(rows)


class _FakeQuant(nn.Module):
    """Static int8 fake quantization of a tensor (float simulation of one more quantization point)."""

    def __init__(self, scale: float, zero_point: int):
        super().__init__()
        self.scale, self.zero_point = scale, zero_point

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, z = torch.tensor([[self.scale]]), torch.tensor([[self.zero_point]])
        return P.dequantize(P.quantize(x.reshape(1, -1), s, z, QMIN, QMAX), s, z).reshape(x.shape)


# --- figures -------------------------------------------------------------------------------------------

def lsb_figure(table):
    """Bars: per layer, the largest difference from the fake-quant codes (same inputs) and the share that
    differ at all."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=["largest |difference| (output LSB)",
                                                        "outputs that differ (share)"])
    fig.add_trace(go.Bar(x=list(table["layer"]), y=list(table["max_lsb"]), name="max |diff|",
                         marker_color="#1f77b4", text=list(table["max_lsb"]), textposition="outside"), row=1, col=1)
    fig.add_trace(go.Bar(x=list(table["layer"]), y=list(table["differ"]), name="share differing",
                         marker_color="#ff7f0e", text=[f"{v:.2%}" for v in table["differ"]],
                         textposition="outside"), row=1, col=2)
    fig.update_yaxes(range=[0, max(2, int(table["max_lsb"].max()) + 1)], row=1, col=1)
    fig.update_layout(title="Integer-only layer vs float fake-quant layer, same input codes", showlegend=False,
                      template=TEMPLATE, height=400)
    return fig


def accuracy_figure(table):
    """Accuracy and logit SQNR of fp32, fake-quant and integer-only."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=["test accuracy", "logit SQNR vs fp32 (dB)"])
    colours = ["#7f7f7f", "#1f77b4", "#2ca02c"]
    fig.add_trace(go.Bar(x=list(table["model"]), y=list(table["accuracy"]), marker_color=colours,
                         text=[f"{v:.4f}" for v in table["accuracy"]], textposition="outside"), row=1, col=1)
    part = table[table["model"] != "fp32"]
    fig.add_trace(go.Bar(x=list(part["model"]), y=list(part["logit_sqnr_db"]), marker_color=colours[1:],
                         text=[f"{v:.1f}" for v in part["logit_sqnr_db"]], textposition="outside"), row=1, col=2)
    fig.update_yaxes(range=[0.9, 1.005], row=1, col=1)
    fig.update_layout(title="Integers only: the accuracy of the fake-quant model it implements", showlegend=False,
                      template=TEMPLATE, height=420)
    return fig


def multiplier_figure(table):
    """Layer-wise error (LSB) against the multiplier's mantissa bits, with the truncating shift as a marker."""
    import plotly.graph_objects as go

    rounded = table[table["variant"].str.startswith("M0")]
    floor = table[~table["variant"].str.startswith("M0")]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=list(rounded["multiplier_bits"]), y=list(rounded["max_lsb"]), mode="lines+markers",
                             name="max |diff| (rounding shift)", line=dict(color="#1f77b4")))
    fig.add_trace(go.Scatter(x=list(rounded["multiplier_bits"]), y=list(rounded["mean_signed_lsb"]),
                             mode="lines+markers", name="mean signed diff (rounding shift)",
                             line=dict(color="#2ca02c", dash="dot")))
    fig.add_trace(go.Scatter(x=list(floor["multiplier_bits"]), y=list(floor["mean_signed_lsb"]), mode="markers",
                             name="mean signed diff, truncating shift", marker=dict(size=14, color="#d62728",
                                                                                     symbol="x")))
    fig.update_xaxes(type="log", title="bits of the fixed-point multiplier M0 (log scale)")
    fig.update_yaxes(title="difference from fake-quant (output LSB)")
    fig.update_layout(title="A coarse multiplier or a truncating shift moves outputs off the reference",
                      template=TEMPLATE, height=420)
    return fig


def folding_figure(table):
    """Logit SQNR of the folding orders, grouped by weight format."""
    import plotly.graph_objects as go

    colours = {"fold, then quantize": "#2ca02c", "no folding: int8 before BatchNorm": "#d62728",
               "quantize, then fold": "#ff7f0e"}
    fig = go.Figure()
    for label, part in table.groupby("variant", sort=False):
        fig.add_trace(go.Bar(x=list(part["weights"]), y=list(part["logit_sqnr_db"]), name=label,
                             marker_color=colours.get(label),
                             text=[f"{s:.1f} dB, acc {a:.3f}" for s, a in zip(part["logit_sqnr_db"], part["accuracy"],
                                                                              strict=True)],
                             textposition="outside"))
    fig.update_layout(barmode="group", title="Fold BatchNorm first: then the weights you quantize are the weights "
                      "you run", xaxis_title="weight format", yaxis_title="logit SQNR vs fp32 (dB, higher is better)",
                      template=TEMPLATE, height=440)
    return fig
