"""Lesson 40's computations and figures: the formats, autocast, gradient underflow, loss-scale traces."""
from __future__ import annotations

import math
import warnings
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from workbench.plots.style import TEMPLATE

__all__ = ["DTYPES", "smallest_subnormal", "format_table", "Autocast", "autocast_table", "gradient_magnitudes",
           "autocast_gradients", "autocast_underflow", "underflow_fraction", "overflow_fraction", "scale_table",
           "scale_trace", "gradient_histogram", "scale_trace_figure"]


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_COLOURS = {"fp32": "#7f7f7f", "bf16": "#17becf", "fp16": "#2ca02c"}


def _dtype(d: str | torch.dtype) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    key = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}.get(d, d)
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {d!r}; use one of {sorted(DTYPES)} or a torch dtype")
    return DTYPES[key]


def smallest_subnormal(dtype: torch.dtype) -> float:
    """The smallest positive value ``dtype`` can hold: the smallest normal times the mantissa step."""
    info = torch.finfo(dtype)
    return float(info.smallest_normal) * float(info.eps)


def format_table(names: Sequence[str] = ("fp32", "bf16", "fp16")):
    """Bits, range and precision of each float format (a DataFrame indexed by name)."""
    import pandas as pd

    rows = []
    for name in names:
        d = _dtype(name)
        info = torch.finfo(d)
        rows.append({"format": name, "bits": info.bits, "exponent bits": info.bits - 1 - round(-math.log2(info.eps)),
                     "mantissa bits": round(-math.log2(info.eps)), "largest": float(info.max),
                     "smallest normal": float(info.smallest_normal), "smallest subnormal": smallest_subnormal(d),
                     "relative step (eps)": float(info.eps), "bytes per value": info.bits // 8})
    return pd.DataFrame(rows).set_index("format")


class Autocast(nn.Module):
    """Runs ``model`` under ``torch.autocast`` (weights stay fp32; matmuls and convolutions run in ``dtype``,
    the weights cast on every call) and returns fp32 outputs."""

    def __init__(self, model: nn.Module, dtype: str | torch.dtype = torch.bfloat16):
        super().__init__()
        self.model, self.dtype = model, _dtype(dtype)
        self.kernel = f"autocast:{str(self.dtype).removeprefix('torch.')}"

    def forward(self, *args):
        device = next(self.model.parameters()).device.type
        with torch.autocast(device, dtype=self.dtype):
            out = self.model(*args)
        return out.float()


def autocast_table(model: nn.Module, inputs: tuple, dtype: str | torch.dtype = torch.bfloat16):
    """One row per leaf module called in one forward pass under autocast: its parameters' dtype and the dtype
    of the output it produced (a DataFrame). Repeated module types are listed once per name."""
    import pandas as pd

    rows, handles = [], []
    for name, mod in model.named_modules():
        if next(mod.children(), None) is not None:
            continue
        param = next(mod.parameters(recurse=False), None)

        def hook(m, args, out, name=name, param=param):
            out = out[0] if isinstance(out, tuple) else out
            rows.append({"layer": name, "type": type(m).__name__,
                         "weights": str(param.dtype).removeprefix("torch.") if param is not None else "-",
                         "input": str(args[0].dtype).removeprefix("torch.") if args else "-",
                         "output": str(out.dtype).removeprefix("torch.")})
        handles.append(mod.register_forward_hook(hook))
    device = next(model.parameters()).device.type
    try:
        with torch.no_grad(), torch.autocast(device, dtype=_dtype(dtype)):
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return pd.DataFrame(rows, columns=["layer", "type", "weights", "input", "output"])


def gradient_magnitudes(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """|gradients| of one fp32 forward + backward of the cross-entropy of ``model(inputs)`` against ``targets``:
    ``"activations"`` - the gradients flowing back into every Linear / Conv output (what an fp16 backward pass
    would store), and ``"weights"`` - the parameters' gradients. Flattened fp32 tensors."""
    grads: list[torch.Tensor] = []
    handles = [m.register_full_backward_hook(lambda mod, gin, gout: grads.append(gout[0].detach().abs().flatten()))
               for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))]
    was_training = model.training
    model.eval()
    try:
        model.zero_grad(set_to_none=True)
        logits = model(inputs)                                                   # (..., classes)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        with warnings.catch_warnings():  # the first layer's input needs no gradient: its hook still sees outputs
            warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
            loss.backward()
        weights = torch.cat([p.grad.detach().abs().flatten() for p in model.parameters() if p.grad is not None])
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return {"activations": torch.cat(grads).float(), "weights": weights.float()}


def autocast_gradients(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                       dtype: str | torch.dtype = torch.float16, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Gradients of one real forward + backward of the cross-entropy under ``torch.autocast(cpu, dtype)`` (no
    autocast for fp32), the loss multiplied by ``scale`` and the gradients divided by it again in fp32:
    ``"weights"`` - every Linear / Conv weight's ``.grad`` (fp32, since the master weights are fp32, but computed
    by the backward of the layer's 16-bit matmul, so it underflows there first), ``"activations"`` - the
    gradients flowing into those layers' outputs (16-bit under autocast). Flattened fp32, in a fixed order."""
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))]
    acts: list[torch.Tensor] = [torch.empty(0)] * len(layers)

    def hook(i):
        return lambda mod, gin, gout: acts.__setitem__(i, gout[0].detach().float().flatten())

    handles = [m.register_full_backward_hook(hook(i)) for i, m in enumerate(layers)]
    was_training = model.training
    model.eval()
    d = _dtype(dtype)
    try:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=d, enabled=d != torch.float32):
            logits = model(inputs)                                               # (..., classes)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
            (loss * scale).backward()
        weights = torch.cat([m.weight.grad.detach().float().flatten() / scale for m in layers])
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return {"weights": weights, "activations": torch.cat(acts) / scale}


def autocast_underflow(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                       dtype: str | torch.dtype = torch.float16, scales: Sequence[float] = (1.0, 2.0 ** 16)):
    """Measured, not predicted: the same pass in fp32 and under ``dtype`` autocast at each loss scale. One row per
    (gradient kind, scale): how many gradients are non-zero in fp32, how many of those came out exactly 0 under
    autocast (count and fraction), and the median fp32 magnitude of the lost ones."""
    import pandas as pd

    ref = autocast_gradients(model, inputs, targets, torch.float32)
    rows = []
    for s in scales:
        got = autocast_gradients(model, inputs, targets, dtype, s)
        for kind in ("weights", "activations"):
            r, g = ref[kind], got[kind]
            nonzero = r != 0
            lost = nonzero & (g == 0)
            rows.append({"gradients": kind, "scale": f"2^{round(math.log2(s))}", "non-zero in fp32": int(nonzero.sum()),
                         "lost (→ 0)": int(lost.sum()), "fraction lost": float(lost.sum() / nonzero.sum().clamp(min=1)),
                         "median fp32 |g| of the lost": float(r.abs()[lost].median()) if bool(lost.any())
                         else float("nan")})
    return pd.DataFrame(rows).set_index(["gradients", "scale"])


def underflow_fraction(values: torch.Tensor, dtype: str | torch.dtype = torch.float16, scale: float = 1.0) -> float:
    """Fraction of the non-zero ``values`` that become 0 when ``values * scale`` is stored in ``dtype``."""
    v = values.detach().float().flatten()
    nonzero = v != 0
    stored = (v * scale).to(_dtype(dtype))
    return float(((stored == 0) & nonzero).sum()) / max(int(nonzero.sum()), 1)


def overflow_fraction(values: torch.Tensor, dtype: str | torch.dtype = torch.float16, scale: float = 1.0) -> float:
    """Fraction of ``values`` that become inf when ``values * scale`` is stored in ``dtype``."""
    v = values.detach().float().flatten()
    return float(torch.isinf((v * scale).to(_dtype(dtype))).sum()) / max(v.numel(), 1)


def scale_table(values: torch.Tensor, scales: Sequence[float] = (1.0, 2.0 ** 8, 2.0 ** 16, 2.0 ** 24),
                dtype: str | torch.dtype = torch.float16):
    """For each loss scale: the fraction of ``values`` lost to underflow and to overflow in ``dtype``."""
    import pandas as pd

    rows = [{"scale": f"2^{round(math.log2(s))}", "underflow (→ 0)": underflow_fraction(values, dtype, s),
             "overflow (→ inf)": overflow_fraction(values, dtype, s)} for s in scales]
    return pd.DataFrame(rows).set_index("scale")


def scale_trace(model: nn.Module, task, *, steps: int = 40, init_scale: float = 2.0 ** 24,
                growth_interval: int = 10, lr: float = 1e-3, batch_size: int = 64, seed: int = 0):
    """Train ``model`` (a copy; fp32 master weights) for ``steps`` fp16 autocast steps with `wb.precision.AmpStep`
    and record the GradScaler's scale and whether each step was skipped (a DataFrame)."""
    import copy

    import pandas as pd

    from workbench.precision import AmpStep

    m = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    amp = AmpStep(m, opt, "fp16", init_scale=init_scale, growth_interval=growth_interval)
    split = task.split
    g = torch.Generator().manual_seed(seed)
    x, y = torch.from_numpy(split.x_train), torch.from_numpy(split.y_train)
    rows = []
    for step in range(1, steps + 1):
        idx = torch.randint(len(x), (batch_size,), generator=g)
        scale, skipped = amp.scale, amp.skipped
        amp(lambda idx=idx: F.cross_entropy(m(x[idx]), y[idx]))
        rows.append({"step": step, "scale": scale, "skipped": amp.skipped > skipped})
    return pd.DataFrame(rows)


# --- figures -------------------------------------------------------------------------------------------

def gradient_histogram(grads: dict[str, torch.Tensor], scale: float | None = None, bins: int = 90,
                       lo_log2: int = -50, hi_log2: int = 10):
    """Histograms of log2 |gradient| (fraction of values per bin) with fp16's limits marked: the zone where
    values flush to zero, the subnormal zone, and the overflow limit. With ``scale``, the first tensor's
    histogram shifted by the loss scale is drawn too."""
    import plotly.graph_objects as go

    fig = go.Figure()
    sets = dict(grads)
    if scale is not None:
        first = next(iter(grads))
        sets[f"{first} × {scale:g} (loss scale 2^{round(math.log2(scale))})"] = next(iter(grads.values())) * scale
    colours = ["#1f77b4", "#ff7f0e", "#9467bd", "#8c564b"]
    edges = torch.linspace(lo_log2, hi_log2, bins + 1, dtype=torch.float64)
    centres = ((edges[1:] + edges[:-1]) / 2).tolist()
    for i, (name, v) in enumerate(sets.items()):
        a = v.detach().double().flatten()
        a = a[a > 0].log2().clamp(lo_log2, hi_log2)
        frac = (torch.histogram(a, edges).hist / max(a.numel(), 1)).tolist()
        fig.add_trace(go.Scatter(x=centres, y=frac, mode="lines", line=dict(shape="hvh", width=2,
                                                                              color=colours[i % len(colours)]),
                                 fill="tozeroy", name=name,
                                 hovertemplate=name + ": |g| ≈ 2^%{x:.1f}: %{y:.2%}<extra></extra>"))
    sub, normal = math.log2(smallest_subnormal(torch.float16)), math.log2(torch.finfo(torch.float16).smallest_normal)
    top = math.log2(torch.finfo(torch.float16).max)
    fig.add_vrect(x0=lo_log2, x1=sub - 1, fillcolor="#d62728", opacity=0.12, line_width=0,
                  annotation_text="fp16: flushed to 0", annotation_position="top left")
    fig.add_vrect(x0=sub - 1, x1=normal, fillcolor="#ff7f0e", opacity=0.08, line_width=0,
                  annotation_text="subnormal", annotation_position="top left")
    fig.add_vline(x=top, line=dict(color="#d62728", dash="dot"), annotation_text="65504 (overflow)",
                  annotation_position="top left")
    fig.update_layout(title="Real gradient magnitudes against fp16's range (bf16's smallest subnormal is 2^-133)",
                      xaxis_title="log2 |gradient|  (2^-24 ≈ 6e-8 is fp16's smallest subnormal)",
                      yaxis_title="fraction of values", template=TEMPLATE, height=440,
                      legend=dict(orientation="h", y=-0.25))
    return fig


def scale_trace_figure(trace):
    """The GradScaler's loss scale per step (log2 axis), skipped steps marked."""
    import plotly.graph_objects as go

    log2 = [math.log2(s) for s in trace["scale"]]
    skipped = trace["skipped"].tolist()
    fig = go.Figure(go.Scatter(x=trace["step"].tolist(), y=log2, mode="lines", line=dict(shape="hv", width=3),
                               name="loss scale", hovertemplate="step %{x}: scale 2^%{y:.0f}<extra></extra>"))
    fig.add_trace(go.Scatter(x=[s for s, k in zip(trace["step"], skipped, strict=True) if k],
                             y=[v for v, k in zip(log2, skipped, strict=True) if k], mode="markers",
                             name="step skipped (inf)", marker=dict(symbol="x", size=11, color="#d62728")))
    fig.update_layout(title="Dynamic loss scaling: halve and skip on overflow, double after good steps",
                      xaxis_title="training step", yaxis_title="log2(loss scale)", template=TEMPLATE,
                      height=380)
    return fig
