"""Quantization-aware training: `prepare` inserts fake quantization, any training loop trains, `convert`
produces the same real quantized modules as post-training quantization.

    qmodel = wb.qat.prepare(model, wb.Plan({"conv*": wb.quant.WeightOnly(2, None), "fc*": ...}))
    wb.training.fit_classifier(qmodel, task, epochs=3, lr=1e-3)       # or your own loop
    small = wb.qat.convert(qmodel)                                    # WeightOnlyConv2d / WeightOnlyLinear ...

Fake quantization rounds in the forward pass and lets gradients through the rounding unchanged (the
straight-through estimator), except where values were clamped to the grid's ends (zero gradient there).
Weights follow `WeightOnly` configs (integer formats, per channel or per group) and `Dynamic` configs
(int8 weights per channel + int8 activations per token). With ``learnable_scales=True`` the weight scales
of `WeightOnly` layers are parameters trained by the same loss (LSQ, Esser et al. 2020, with its gradient
scaling); `convert` then stores those learned scales. Fake quantization uses exactly the grid `convert`
stores (fp16 scales included), so the converted model computes what was trained. Supported layers: those
post-training quantization takes - nn.Linear, nn.Conv1d, nn.Conv2d (a "same"-padding subclass keeps its
padding), nn.ConvTranspose2d and nn.Embedding for `WeightOnly`; nn.Linear for `Dynamic` - chosen the same way
(`configs._FormatHandler`), with the same short last group where ``group_size`` does not divide the input size.
"""
from __future__ import annotations

import copy
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from workbench.plans.layers import applied_plans, canonicalize_for, record_plan, share_tied, swap_layers, tie_groups
from workbench.plans.plan import Plan
from workbench.quantization import formats as fm
from workbench.quantization.configs import Dynamic, Method, WeightOnly, _computation
from workbench.quantization.experts import takes_experts
from workbench.quantization.modules import KernelPath
from workbench.quantization.primitives import choose_qparams, fp16_scale, qrange

__all__ = ["prepare", "convert", "fake_quantize_ste", "grad_scale", "QATLinear", "QATConv1d", "QATConv2d",
           "QATConvTranspose2d", "QATEmbedding"]


def fake_quantize_ste(xg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Grouped values ``(G, K)`` -> quantized-dequantized values, with straight-through gradients.

    Gradients reach ``xg`` where the value was inside the grid (clamped values get none) and reach ``scale``
    when it requires grad (LSQ)."""
    xs = xg * (1.0 / scale)                                   # the reciprocal, exactly as `primitives.quantize`
    rounded = xs + (torch.round(xs) - xs).detach()           # round forward, identity backward
    q = torch.clamp(rounded + zero, qmin, qmax)
    return (q - zero) * scale


def grad_scale(t: torch.Tensor, factor: float) -> torch.Tensor:
    """Value of ``t``, gradient multiplied by ``factor`` (LSQ's step-size gradient scaling)."""
    return (t - t * factor).detach() + t * factor


class _QATMixin:
    """Shared by QATLinear / QATConv2d: fake-quantized weight (and optionally activations)."""

    @property
    def rounds_activations(self) -> bool:   # (see WeightOnlyLinear.rounds_activations)
        return bool(getattr(self, "act_quant", False))

    def _setup(self, config, learnable_scales: bool, kernel: str = "reference") -> None:
        self.qconfig = config
        self.kernel = KernelPath(kernel)   # chosen once; compared by identity in forward
        w2d = self.weight.detach().reshape(self.weight.shape[0], -1)
        if isinstance(config, WeightOnly):
            self.bits, self.group_size, self.symmetric = config.bits, config.group_size, config.symmetric
            self.act_quant = False
        else:  # Dynamic: int8 per-channel weights, int8 per-token activations
            self.bits, self.group_size, self.symmetric = 8, None, True
            self.act_quant = True
        self.weight_scale = None
        if learnable_scales and not self.act_quant:  # W8A8 stores min/max scales: nothing to learn there
            scale, _ = choose_qparams(self._groups(w2d), self.bits, self.symmetric)
            self.weight_scale = nn.Parameter(scale)                                # (G, 1)

    def _groups(self, w2d: torch.Tensor) -> torch.Tensor:
        """``(rows, K)`` -> ``(rows * ceil(K / g), g)``, a short last group zero-padded (as `formats` stores it)."""
        return fm.padded_groups(w2d, w2d.shape[1] if self.group_size is None else self.group_size)

    def fake_weight(self) -> torch.Tensor:
        w2d = self.weight.reshape(self.weight.shape[0], -1)
        rows, K = w2d.shape
        wg = self._groups(w2d)                                                     # (rows * G, g)
        qmin, qmax = qrange(self.bits, True)
        scale, zero = choose_qparams(wg.detach(), self.bits, self.symmetric)
        if self.weight_scale is not None:
            scale = grad_scale(self.weight_scale.abs() + 1e-12, 1.0 / math.sqrt(wg.shape[1] * qmax))
        if not self.act_quant:  # weight-only formats store fp16 scales: train on exactly that grid (STE)
            scale = scale + (fp16_scale(scale) - scale).detach()
        fake = self._fake(wg, scale, zero.float(), qmin, qmax).reshape(rows, -1)[:, :K]
        return fake.reshape(self.weight.shape)

    def fake_input(self, x: torch.Tensor) -> torch.Tensor:
        if not self.act_quant:
            return x
        xg = x.reshape(-1, x.shape[-1])
        scale, zero = choose_qparams(xg.detach(), 8, symmetric=True)
        return self._fake(xg, scale, zero.float(), -128, 127).reshape(x.shape)

    def _fake(self, xg, scale, zero, qmin, qmax) -> torch.Tensor:
        """Fake quantization of grouped values: the fused Triton kernel (forward + straight-through backward)
        or the PyTorch expression; the same numbers (tests compare them bit for bit)."""
        if self.kernel is KernelPath.TRITON:
            from workbench_kernels.fake_quant import fake_quantize

            return fake_quantize(xg.contiguous(), scale.detach().contiguous(), zero.contiguous(), qmin, qmax)
        return fake_quantize_ste(xg, scale, zero, qmin, qmax)


class QATLinear(_QATMixin, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.fake_input(x), self.fake_weight(), self.bias)


class QATConv1d(_QATMixin, nn.Conv1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.fake_weight(), self.bias)


class QATConv2d(_QATMixin, nn.Conv2d):
    input_padding = None  # the InputPadding of a "same"-padding Conv2d subclass, applied first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_padding is not None:
            x = self.input_padding(x, {"kernel_size": self.kernel_size, "stride": self.stride,
                                       "dilation": self.dilation})
        return self._conv_forward(x, self.fake_weight(), self.bias)


class QATConvTranspose2d(_QATMixin, nn.ConvTranspose2d):
    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        output_padding = self._output_padding(x, output_size, self.stride, self.padding, self.kernel_size, 2,
                                              self.dilation)
        return F.conv_transpose2d(x, self.fake_weight(), self.bias, self.stride, self.padding, output_padding,
                                  self.groups, self.dilation)


class QATEmbedding(_QATMixin, nn.Embedding):
    """Embedding with a fake-quantized table (weight-only: rows are the embeddings, groups along ``embedding_dim``)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.fake_weight(), self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)


def _conv_kwargs(m: nn.Module) -> dict:
    return dict(stride=m.stride, padding=m.padding, dilation=m.dilation, groups=m.groups, bias=m.bias is not None,
                padding_mode=m.padding_mode)


def _plain_copy(qat: nn.Module) -> nn.Module:
    """The float layer a QAT module trains (same class family, its current weights)."""
    if isinstance(qat, QATLinear):
        plain = nn.Linear(qat.in_features, qat.out_features, bias=qat.bias is not None)
    elif isinstance(qat, QATEmbedding):
        plain = nn.Embedding(qat.num_embeddings, qat.embedding_dim, padding_idx=qat.padding_idx)
    elif isinstance(qat, QATConvTranspose2d):
        plain = nn.ConvTranspose2d(qat.in_channels, qat.out_channels, qat.kernel_size,
                                   output_padding=qat.output_padding, **_conv_kwargs(qat))
    else:
        kind = nn.Conv1d if isinstance(qat, QATConv1d) else nn.Conv2d
        plain = kind(qat.in_channels, qat.out_channels, qat.kernel_size, **_conv_kwargs(qat))
    plain.weight.copy_(qat.weight)
    if getattr(qat, "bias", None) is not None:
        plain.bias.copy_(qat.bias)
    return plain


_QAT_CLASSES = {nn.Linear: QATLinear, nn.Conv1d: QATConv1d, nn.Conv2d: QATConv2d,
                nn.ConvTranspose2d: QATConvTranspose2d, nn.Embedding: QATEmbedding}


def _qat_module(name: str, module: nn.Module, config, learnable_scales: bool, kernel: str,
                shared: dict | None = None) -> nn.Module:
    if isinstance(config, WeightOnly):
        if config.method is not Method.RTN:
            raise ValueError(f"{name!r}: QAT trains the weights; use method='rtn' (got {config.method.value!r})")
        if config.act_bits is not None:
            raise ValueError(f"{name!r}: QAT of WeightOnly trains the weights with its inputs as they come; "
                             f"act_bits={config.act_bits} (rounded activations) is a post-training setting")
    elif isinstance(config, Dynamic):
        if config.smooth_alpha is not None:
            raise ValueError(f"{name!r}: SmoothQuant is a post-training method; use Dynamic() without smooth_alpha")
    else:
        raise TypeError(f"{name!r}: QAT supports WeightOnly and Dynamic configs, got {type(config).__name__}")
    fm.check_finite(name, module.weight)
    kind, padding = _computation(name, module, f"QAT with {type(config).__name__}")
    if isinstance(config, Dynamic) and kind is not nn.Linear:
        raise TypeError(f"{name!r}: QAT with Dynamic supports nn.Linear, not {type(module).__name__}")
    m = module
    if kind is nn.Linear:
        new = QATLinear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
    elif kind is nn.Embedding:
        if m.max_norm is not None:
            raise ValueError(f"{name!r}: embeddings with max_norm renormalise their weights in place and cannot be "
                             f"stored quantized")
        new = QATEmbedding(m.num_embeddings, m.embedding_dim, padding_idx=m.padding_idx, device="meta")
    elif kind is nn.ConvTranspose2d:
        new = QATConvTranspose2d(m.in_channels, m.out_channels, m.kernel_size, output_padding=m.output_padding,
                                 device="meta", **_conv_kwargs(m))
    else:
        new = _QAT_CLASSES[kind](m.in_channels, m.out_channels, m.kernel_size, device="meta", **_conv_kwargs(m))
        if padding is not None:
            new.input_padding = padding
    shared = {} if shared is None else shared   # tied weights (lm_head / wte) stay one trained Parameter
    if id(module.weight) not in shared:
        shared[id(module.weight)] = nn.Parameter(module.weight.detach().clone())
    new.weight = shared[id(module.weight)]
    if getattr(module, "bias", None) is not None:
        new.bias = nn.Parameter(module.bias.detach().clone())
    new._setup(config, learnable_scales, kernel)
    return new


QAT_PLAN_ATTR = "_workbench_qat_plan"


def prepare(model: nn.Module, plan: Plan, learnable_scales: bool = False, kernel: str = "reference") -> nn.Module:
    """A copy of ``model`` with fake quantization on the layers ``plan`` selects (ready to train).

    ``kernel``: "reference" (PyTorch ops, any device) or "triton" (`workbench_kernels.fake_quant`: forward and
    straight-through backward fused, on a CUDA GPU; not with ``learnable_scales``, whose scale gradients
    the PyTorch path computes)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    if kernel not in ("reference", "triton"):
        raise ValueError(f"qat.prepare: kernel must be 'reference' or 'triton', got {kernel!r}")
    if kernel == "triton":
        from workbench_kernels import triton_available

        if learnable_scales:
            raise ValueError("qat.prepare: learnable_scales trains the scales through the PyTorch path; "
                             "use kernel='reference' with them")
        device = next(iter(model.parameters())).device
        if not triton_available(device):
            raise RuntimeError(f"qat.prepare: kernel='triton' needs a CUDA GPU (or TRITON_INTERPRET=1); the model "
                               f"is on {device}")
    plan = plan if isinstance(plan, Plan) else Plan(plan)
    if plan.stages:   # (wb.load would run them on the base of a model trained without them)
        raise ValueError(f"qat.prepare takes per-layer entries; this plan has model-level stages "
                         f"({', '.join(repr(s) for s in plan.stages)}): apply them first (wb.apply with a plan of "
                         f"only the stages) and prepare the result")
    target = copy.deepcopy(model)
    canonicalize_for(target, plan)   # Conv1D / MultiheadAttention the plan reaches, as wb.apply and wb.load do
    replacements = {}
    shared: dict = {}
    experts: list[str] = []
    for a in plan.resolve(target):
        module = target.get_submodule(a.name)
        if takes_experts(module):   # fused 3-D experts: wb.apply quantizes them; QAT trains 2-D layers
            if a.pattern == a.name:
                raise ValueError(f"{a.name!r} ({type(module).__name__}): QAT fake-quantizes nn.Linear / Conv / "
                                 f"Embedding weights, not fused mixture-of-experts tensors; quantize the experts "
                                 f"after training with wb.apply")
            experts.append(a.name)
            continue
        replacements[a.name] = _qat_module(a.name, module, a.config, learnable_scales, kernel, shared)
    if experts:
        warnings.warn(f"qat.prepare passed over {len(experts)} fused mixture-of-experts module(s) "
                      f"({', '.join(experts[:3])}{', ...' if len(experts) > 3 else ''}): QAT fake-quantizes 2-D "
                      f"weights; they train in full precision and stay so after convert (quantize them after "
                      f"training with wb.apply)", stacklevel=2)
        plan = Plan([*((n, None) for n in experts), *plan.items()], stages=plan.stages)
    swap_layers(target, replacements)
    object.__setattr__(target, QAT_PLAN_ATTR, plan)
    return target


def _real_module(name: str, qat: nn.Module) -> nn.Module:
    """The config's own handler builds the stored module from the trained float layer (`Handler.from_trained`)."""
    from workbench.plans.registry import handler_for

    with torch.no_grad():
        return handler_for(qat.qconfig).from_trained(name, _plain_copy(qat), qat.qconfig, qat.weight_scale,
                                                     getattr(qat, "input_padding", None))


def convert(model: nn.Module) -> nn.Module:
    """A copy of a `prepare`d (and trained) model with real quantized modules in place of the fake ones.
    The result records the plan, so `wb.save` / `wb.load` work as for PTQ."""
    plan = getattr(model, QAT_PLAN_ATTR, None)
    if plan is None:
        raise ValueError("convert expects a model returned by wb.qat.prepare")
    target = copy.deepcopy(model)
    replacements = {name: _real_module(name, m) for name, m in target.named_modules()
                    if isinstance(m, _QATMixin)}
    for group in tie_groups(target):   # one stored copy of a tied weight, as wb.apply keeps it
        if all(n in replacements for n in group):
            share_tied(group, replacements)
    swap_layers(target, replacements)
    target.__dict__.pop(QAT_PLAN_ATTR, None)
    record_plan(target, (*applied_plans(model), plan))
    return target.eval()
