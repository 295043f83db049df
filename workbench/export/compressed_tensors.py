"""Export to compressed-tensors: llm-compressor's checkpoint format, read by vLLM and transformers' ``from_pretrained``.

    wb.export(small, "llama-w4a16", format="compressed-tensors", base_folder="llama")

A Hugging Face checkpoint folder: ``config.json`` (the model's config with a ``quantization_config`` written by
compressed-tensors' own `ModelCompressor.update_config`), ``model.safetensors`` and, from ``base_folder``, the
tokenizer files. The tensors are the workbench's own - the codes and scales `wb.apply` chose, never quantized
again - packed with compressed-tensors' own `pack_to_int32`, so its decompression gives exactly the weight the
workbench computes with (for fp32 models; scales are written in fp32, which holds the workbench's fp16 weight-only
scales and fp32 W8A8 scales exactly).

| workbench layer | compressed-tensors scheme | format | tensors (per layer) |
|---|---|---|---|
| `WeightOnlyLinear`, `IntFormat` 2-8 bits, per channel or group, symmetric | ``weights`` int, ``symmetric: true``, strategy channel / group | ``pack-quantized`` | ``weight_packed`` int32 (N, K*bits/32), ``weight_scale`` (N, G), ``weight_shape`` |
| the same, asymmetric (integer zero point) | ``symmetric: false`` | ``pack-quantized`` | + ``weight_zero_point`` int32, packed along N |
| `WeightOnlyLinear`, `FP8Format` e4m3 (``wb.quant.FP8()``: fp32 scale per row) | ``weights`` float 8 bits, strategy channel | ``naive-quantized`` | ``weight`` float8_e4m3fn (N, K), ``weight_scale`` (N, 1) |
| `WeightOnlyLinear`, `NVFP4Format` (``wb.quant.NVFP4()``) | ``weights`` float 4 bits, strategy tensor_group, group 16, e4m3 scales (NVFP4A16) | ``nvfp4-pack-quantized`` | ``weight_packed`` uint8 (N, K/2), ``weight_scale`` float8_e4m3fn (N, K/16), ``weight_global_scale`` (1,) |
| `WeightOnlyLinear`, `MXFP8Format` (``wb.quant.MXFP8()``) | ``weights`` float 8 bits, strategy group, group 32, uint8 E8M0 scales (MXFP8A16) | ``mxfp8-quantized`` | ``weight`` float8_e4m3fn (N, K), ``weight_scale`` uint8 (N, K/32) |
| `WeightOnlyLinear`, `MXFP4Format` (``wb.quant.MXFP4()``) | ``weights`` float 4 bits, strategy group, group 32, uint8 E8M0 scales (MXFP4A16) | ``mxfp4-pack-quantized`` | ``weight_packed`` uint8 (N, K/2), ``weight_scale`` uint8 (N, K/32) |
| `W8A8Linear`, dynamic | int8 channel weights + ``input_activations`` int8 per token, dynamic | ``int-quantized`` | ``weight`` int8 (N, K), ``weight_scale`` (N, 1) |
| `W8A8Linear`, static | + ``input_activations`` int8 per tensor, static | ``int-quantized`` | + ``input_scale`` (1,) |
| any layer the plan left in floating point | listed in ``ignore`` | - | ``weight`` (and ``bias``) as they are |

The 4-bit floating-point layers are written as stored: E2M1 codes two per byte (the first value of a pair in the low
nibble, as both pack them), the e4m3 or E8M0 block scales and NVFP4's tensor scale (``weight_global_scale``: the
scale a value is divided by, ``e2m1 * weight_scale / weight_global_scale``, as in the workbench). compressed-tensors
decompresses them in bf16: MXFP4 weights exactly (an E2M1 value times a power of two), NVFP4's within bf16's rounding of
``weight_scale / weight_global_scale`` (within 2^-8 relative; measured 3.3e-3 at most).

Codes map one to one: the workbench stores unsigned codes ``u`` (a symmetric format with the implicit zero point
``2^(bits-1)``), compressed-tensors signed ones ``q = u - 2^(bits-1)`` (its zero points shifted the same way), and
both dequantize as ``(q - z) * s`` in the scale's dtype.

``wb.export(..., requantize=True)`` re-quantizes what the format cannot hold as it is into the nearest grid it holds
(`CompressedTensors.nearest`: the same bits and group as integer codes, FP8 e4m3 for e5m2).

Refused before anything is written, naming the layer: NF4 and FP8 e5m2 weights, HQQ's real-valued zero points, AWQ's and
SmoothQuant's per-input-channel smoothing (it would have to be folded into the previous layer), GPTQ act-order with
a stored column permutation (compressed-tensors removed ``actorder="group"`` / ``g_idx``; ``static_groups=True``
stores none), a last group shorter than ``group_size``, quantized embeddings and convolutions, pruned, low-rank or
cast layers, any layer the reader (the model class built from ``config.json``) would not build as an ``nn.Linear``
of the same shape - e.g. GPT-2's ``Conv1D``, which compressed-tensors cannot quantize - and a quantized layer tied
to another (``tie_word_embeddings``).
"""
from __future__ import annotations

import copy
import enum
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

import torch
from torch import nn

from workbench.export import ExportFormat, integer_weight_problem, register_export_format
from workbench.plans import applied_plans
from workbench.quantization import packing
from workbench.quantization.formats import FP8Format, MXFP4Format, MXFP8Format, NVFP4Format
from workbench.quantization.modules import W8A8Linear, WeightOnlyLinear

__all__ = ["CompressedTensors", "Activations", "Scheme", "LAYER_ENCODERS", "BASE_FILES"]

# What is copied from ``base_folder``: the tokenizer and processor files (top level only)
BASE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "vocab.txt", "merges.txt",
              "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json")
ALLOWED = ("integer weight-only nn.Linear (2-8 bits, per channel or whole groups, symmetric or with an integer zero "
           "point: pack-quantized), NVFP4, MXFP4 and MXFP8 weight-only nn.Linear (whole blocks), W8A8 int8 nn.Linear (int8 "
           "per-channel weights, dynamic per-token or static "
           "per-tensor activations: int-quantized) and floating-point layers")


class Activations(enum.Enum):
    """How a layer's inputs are quantized at run time."""

    NONE = "none"                       # weight-only
    DYNAMIC_PER_TOKEN = "dynamic per-token int8"
    STATIC_PER_TENSOR = "static per-tensor int8"


@dataclass(frozen=True)
class Scheme:
    """One compressed-tensors config group: what its layers store (hashable: layers with equal schemes share one)."""

    bits: int
    group_size: int | None        # None: per output channel
    symmetric: bool
    activations: Activations = Activations.NONE
    kind: str = "int"             # "int" codes, "float" (FP8 e4m3 values), "nvfp4" / "mxfp4" (E2M1), "mxfp8" (e4m3)

    @property
    def format(self) -> str:
        """The compressed-tensors `CompressionFormat` value its layers are stored in."""
        if self.kind in ("nvfp4", "mxfp4"):
            return f"{self.kind}-pack-quantized"
        if self.kind == "mxfp8":
            return "mxfp8-quantized"
        if self.kind == "float":
            return "naive-quantized"   # float8 weights as they are (the float-quantized alias wants activations)
        return "pack-quantized" if self.activations is Activations.NONE else "int-quantized"

    def to_ct(self, targets: list[str]):
        """The `compressed_tensors.QuantizationScheme` of this group."""
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        if self.kind in ("nvfp4", "mxfp4", "mxfp8"):   # compressed-tensors' NVFP4A16 / MXFP4A16 / MXFP8A16 presets
            scale_dtype = torch.float8_e4m3fn if self.kind == "nvfp4" else torch.uint8
            weights = QuantizationArgs(num_bits=self.bits, type="float", symmetric=True, dynamic=False,
                                       strategy="tensor_group" if self.kind == "nvfp4" else "group",
                                       group_size=self.group_size, scale_dtype=scale_dtype, zp_dtype=scale_dtype)
        else:
            weights = QuantizationArgs(num_bits=self.bits, type=self.kind, symmetric=self.symmetric, dynamic=False,
                                       strategy="channel" if self.group_size is None else "group",
                                       group_size=self.group_size)
        inputs = None
        if self.activations is not Activations.NONE:
            per_token = self.activations is Activations.DYNAMIC_PER_TOKEN
            inputs = QuantizationArgs(num_bits=8, type="int", symmetric=True, dynamic=per_token,
                                      strategy="token" if per_token else "tensor")
        return QuantizationScheme(targets=targets, weights=weights, input_activations=inputs, format=self.format)


# --- one quantized layer -> (scheme, its tensors under local names) ------------------------------------------------

Encoder = Callable[[str, nn.Module], tuple[Scheme, dict[str, torch.Tensor]]]
LAYER_ENCODERS: dict[type[nn.Module], Encoder] = {}   # module class -> encoder, filled by `_encodes`


def _encodes(cls: type[nn.Module]) -> Callable[[Encoder], Encoder]:
    def register(fn: Encoder) -> Encoder:
        LAYER_ENCODERS[cls] = fn
        return fn
    return register


def _refuse(name: str, what: str) -> ValueError:
    return ValueError(f"compressed-tensors export: {name!r} {what}. The format holds {ALLOWED}.")


@_encodes(WeightOnlyLinear)
def _weight_only(name: str, m: WeightOnlyLinear) -> tuple[Scheme, dict[str, torch.Tensor]]:
    """pack-quantized: the stored codes shifted to signed, packed by compressed-tensors; scales in fp32. FP8 (e4m3)
    weights: naive-quantized, the float8 values as stored with their fp32 per-row scales."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    if isinstance(m.fmt, FP8Format):
        return _fp8_weight_only(name, m)
    if isinstance(m.fmt, (NVFP4Format, MXFP4Format, MXFP8Format)):
        return _block_float_weight_only(name, m)
    why = integer_weight_problem(m)
    if why:
        raise _refuse(name, why)
    fmt = m.fmt
    rows, K = m.out_features, m.in_features
    g, G = fmt.groups(K)
    if G > 1 and K % g:
        raise _refuse(name, f"has a short last group (group_size {g} does not divide the input size {K}); "
                            f"compressed-tensors needs whole groups")
    # per channel: no group size, or one (short) group per row; otherwise whole groups of g, even when G == 1, so
    # that a plan's layers share one scheme (transformers' dequantize=True path reads only the first config group)
    group_size = None if fmt.group_size is None or K % g else g
    half = 1 << (fmt.bits - 1)
    codes = packing.unpack(m.qweight.detach().cpu(), fmt.slot_bits, K)               # (N, K) uint8, 0 .. 2^bits - 1
    if int(codes.max()) >= 1 << fmt.bits:
        raise _refuse(name, f"holds codes above {fmt.bits}-bit range (up to {int(codes.max())})")
    tensors = {"weight_packed": pack_to_int32((codes.to(torch.int16) - half).to(torch.int8), fmt.bits),
               "weight_scale": m.scale.detach().cpu().float().contiguous(),            # (N, G): fp16 values, exact
               "weight_shape": torch.tensor([rows, K])}
    if not fmt.symmetric:
        zero = m.zero.detach().cpu()                                                    # (N, G) uint8
        if int(zero.max()) >= 1 << fmt.bits:
            raise _refuse(name, f"holds zero points above the {fmt.bits}-bit range")
        tensors["weight_zero_point"] = pack_to_int32((zero.to(torch.int16) - half).to(torch.int8), fmt.bits,
                                                     packed_dim=0)
    return Scheme(fmt.bits, group_size, fmt.symmetric), tensors


def _fp8_weight_only(name: str, m: WeightOnlyLinear) -> tuple[Scheme, dict[str, torch.Tensor]]:
    """W8A16 FP8: compressed-tensors' float type is e4m3 (its FP8 schemes); both dequantize as ``q * s`` in fp32."""
    if m.fmt.dtype != torch.float8_e4m3fn:
        raise _refuse(name, f"stores {m.fmt.dtype} weights; compressed-tensors' FP8 is float8_e4m3fn")
    for leaf in ("smooth", "perm"):
        if leaf in m._buffers:
            raise _refuse(name, "divides its inputs by an AWQ smoothing vector" if leaf == "smooth" else
                          "stores a column permutation")
    return Scheme(8, None, True, kind="float"), {"weight": m.qweight.detach().cpu().contiguous(),       # (N, K)
                                                "weight_scale": m.scale.detach().cpu().float().contiguous()}   # (N, 1)


def _block_float_weight_only(name: str, m: WeightOnlyLinear) -> tuple[Scheme, dict[str, torch.Tensor]]:
    """NVFP4 / MXFP4: the packed E2M1 codes and the block (and tensor) scales as stored; MXFP8: the e4m3 values and
    their E8M0 block scales."""
    for leaf, what in (("smooth", "divides its inputs by an AWQ smoothing vector"),
                       ("perm", "stores a column permutation")):
        if leaf in m._buffers:
            raise _refuse(name, what)
    if getattr(m, "act_bits", None) is not None:
        raise _refuse(name, f"rounds its input to {m.act_bits} bits per token")
    kind, g, K = m.fmt.name, m.fmt.group_size, m.in_features
    if K % g:
        raise _refuse(name, f"has a short last block ({kind} blocks of {g} do not divide the input size {K})")
    values = "weight" if kind == "mxfp8" else "weight_packed"
    tensors = {values: m.qweight.detach().cpu().contiguous(),          # (N, K / 2) uint8, or (N, K) float8 e4m3
               "weight_scale": m.scale.detach().cpu().contiguous()}    # (N, K / g) e4m3 / E8M0
    if kind == "nvfp4":
        tensors["weight_global_scale"] = m.global_scale.detach().cpu().float().reshape(1)
    return Scheme(8 if kind == "mxfp8" else 4, g, True, kind=kind), tensors


@_encodes(W8A8Linear)
def _w8a8(name: str, m: W8A8Linear) -> tuple[Scheme, dict[str, torch.Tensor]]:
    """int-quantized: int8 (N, K) weights, fp32 per-channel scales, the calibrated input scale when static."""
    if hasattr(m, "smooth"):
        raise _refuse(name, "divides its inputs by a SmoothQuant smoothing vector, which compressed-tensors cannot "
                            "store (it would have to be folded into the layer before)")
    tensors = {"weight": m.qweight_t.detach().cpu().t().contiguous(),                   # (N, K) int8
               "weight_scale": m.scale.detach().cpu().float().t().contiguous()}         # (N, 1)
    if m.static:
        tensors["input_scale"] = m.act_scale.detach().cpu().float().reshape(1)
    activations = Activations.STATIC_PER_TENSOR if m.static else Activations.DYNAMIC_PER_TOKEN
    return Scheme(8, None, True, activations), tensors


def _encoder_for(module: nn.Module) -> Encoder | None:
    return LAYER_ENCODERS.get(type(module))


def _made_by_workbench(module: nn.Module) -> bool:
    return type(module).__module__.partition(".")[0] == "workbench"


def _whole_group(group_size: int | None, K: int) -> int | None:
    """The group size nearest ``group_size`` that leaves no short group (compressed-tensors needs whole groups):
    itself where it divides ``K`` or spans it (one group per row), else the largest divisor of K below it, or per
    channel (None) where that would be under half of it."""
    if group_size is None or K % group_size == 0 or group_size > K:
        return group_size
    divisor = next(d for d in range(group_size, 0, -1) if K % d == 0)
    return divisor if 2 * divisor >= group_size else None


# --- the whole model ------------------------------------------------------------------------------------------------

@dataclass
class Prepared:
    """What `CompressedTensors.write` writes: config, tensors, the files to copy, and the per-layer schemes."""

    config: object                                   # a copy of the model's PretrainedConfig, ready to save
    quantization_config: object | None               # compressed_tensors.QuantizationConfig (None: nothing quantized)
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]                         # safetensors header: format and producer versions
    provenance: dict                                 # config.json's "workbench_export": versions and applied plans
    generation_config: object | None = None
    files: list[Path] = field(default_factory=list)
    layers: dict[str, Scheme] = field(default_factory=dict)   # quantized layer -> its scheme
    ignore: list[str] = field(default_factory=list)           # the reader's nn.Linear layers kept in floating point


def _hugging_face(model: nn.Module):
    """transformers, once ``model`` is known to be a `PreTrainedModel` (the format needs its config)."""
    import sys

    transformers = sys.modules.get("transformers")   # a PreTrainedModel exists only if transformers was imported
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"compressed-tensors export needs a Hugging Face PreTrainedModel (its config.json describes "
                        f"the architecture to the reader); got a {type(model).__name__}")
    return transformers


def _reader_model(model: nn.Module) -> nn.Module:
    """The model the reader builds from config.json, with meta tensors (no memory)."""
    config = copy.deepcopy(model.config)
    try:
        with torch.device("meta"):
            return type(model)(config)
    except Exception as e:
        raise TypeError(f"compressed-tensors export: {type(model).__name__} could not be rebuilt from its config "
                        f"({type(e).__name__}: {e}), so what the reader builds cannot be checked") from e


def _check_reader_linear(name: str, m: nn.Module, ref: nn.Module | None, conv1d: type) -> None:
    """A quantized layer must be an nn.Linear of the same shape in the model the reader builds."""
    if isinstance(ref, conv1d):
        raise _refuse(name, "is a Conv1D in the model transformers builds from config.json (GPT-2 style, weight "
                            "stored (in, out)); compressed-tensors quantizes only nn.Linear layers, so the quantized "
                            "layer could not be loaded - keep it in floating point (a plan entry "
                            f"{{{name!r}: None}})")
    if not isinstance(ref, nn.Linear):
        kind = "no layer" if ref is None else f"a {type(ref).__name__}"
        raise _refuse(name, f"is quantized, but the model built from config.json has {kind} there, not an "
                            f"nn.Linear")
    shape = (m.out_features, m.in_features)
    if tuple(ref.weight.shape) != shape or (ref.bias is None) != (m.bias is None):
        raise _refuse(name, f"has weight {shape} (bias: {m.bias is not None}), but config.json builds "
                            f"{tuple(ref.weight.shape)} (bias: {ref.bias is not None}): its structure changed")


@register_export_format
@dataclass(frozen=True)
class CompressedTensors(ExportFormat):
    """compressed-tensors checkpoint folders (see the module docstring for what each layer becomes)."""

    name: ClassVar[str] = "compressed-tensors"

    def prepare(self, model: nn.Module, base_folder: Path | None) -> Prepared:
        import compressed_tensors
        from compressed_tensors.quantization import QuantizationConfig

        import workbench

        transformers = _hugging_face(model)
        from transformers.pytorch_utils import Conv1D

        reader = _reader_model(model)
        ref_modules = dict(reader.named_modules())
        layers: dict[str, Scheme] = {}
        tensors: dict[str, torch.Tensor] = {}
        for name, module in model.named_modules():
            encode = _encoder_for(module)
            if encode is not None:
                _check_reader_linear(name, module, ref_modules.get(name), Conv1D)
                scheme, local = encode(name, module)
                layers[name] = scheme
                tensors.update({f"{name}.{k}": v for k, v in local.items()})
                if module.bias is not None:
                    tensors[f"{name}.bias"] = module.bias.detach().cpu()
            elif _made_by_workbench(module):
                raise _refuse(name, f"is a {type(module).__name__} ({type(module).__module__}), which the format "
                                    f"cannot hold")
        plain = self._plain_tensors(model, reader, ref_modules, set(layers), Conv1D)
        tensors.update(plain)

        ignore = [n for n, m in reader.named_modules() if isinstance(m, nn.Linear) and n not in layers]
        qconfig = None
        if layers:
            groups: dict[Scheme, list[str]] = {}
            for name, scheme in layers.items():
                groups.setdefault(scheme, []).append(name)
            one = len(groups) == 1   # one scheme: every nn.Linear but the ignored ones, as llm-compressor writes it
            config_groups = {f"group_{i}": scheme.to_ct(["Linear"] if one else names)
                             for i, (scheme, names) in enumerate(groups.items())}
            formats = {scheme.format for scheme in groups}
            qconfig = QuantizationConfig(config_groups=config_groups, quantization_status="compressed",
                                         format=formats.pop() if len(formats) == 1 else "mixed-precision",
                                         ignore=ignore)
        config = copy.deepcopy(model.config)
        config.architectures = [type(model).__name__]
        config.dtype = model.dtype
        producer = {"producer": f"workbench {workbench.__version__}",
                    "compressed_tensors_version": compressed_tensors.__version__,
                    "transformers_version": transformers.__version__}
        provenance = {**producer, "plans": [p.to_dict() for p in applied_plans(model)]}
        generation = getattr(model, "generation_config", None)
        files = self._base_files(base_folder, model, generation is not None)
        return Prepared(config, qconfig, tensors, {"format": "pt", **producer}, provenance, generation, files, layers,
                        ignore)

    # --- the nearest grid compressed-tensors holds, for a layer it cannot hold as it is (`workbench.export.fit`) ------

    def nearest(self, name: str, module: nn.Module):
        """None where the format holds the layer as it is; else integer codes of the same bits and group (NF4 ->
        int4, HQQ -> integer zero points, AWQ smoothing and act-order permutations -> the effective weight on the same
        grid; a short last group -> the largest whole group not above it), FP8 e5m2 -> e4m3, a smoothed dynamic W8A8
        layer -> plain dynamic W8A8. Refuses what it can hold in no grid: quantized embeddings and convolutions,
        pruned, low-rank and cast layers, static SmoothQuant layers (their activation scale needs calibration)."""
        from workbench.export.fit import holds_as_is, weight_grid
        from workbench.quantization.configs import FP8, Dynamic, WeightOnly

        encode = _encoder_for(module)
        if encode is None:
            if _made_by_workbench(module) and not type(module).__module__.startswith("workbench.models"):
                raise _refuse(name, f"is a {type(module).__name__} ({type(module).__module__}), which the format "
                                    f"cannot hold in any grid, so re-quantizing it cannot help")
            return None
        if holds_as_is(encode, name, module):
            return None
        if isinstance(module, W8A8Linear):
            if module.static:
                raise _refuse(name, "is a static W8A8 layer with SmoothQuant smoothing; its activation scale was "
                                    "calibrated on the smoothed inputs, so it cannot be re-quantized without "
                                    "calibration data - apply wb.quant.Static() without smooth_alpha")
            return Dynamic()
        if isinstance(module.fmt, FP8Format):
            return FP8()   # e4m3, one scale per row
        grid = weight_grid(module)
        return WeightOnly(bits=grid.bits, group_size=_whole_group(grid.group_size, module.in_features),
                          symmetric=grid.symmetric)

    @staticmethod
    def _plain_tensors(model: nn.Module, reader: nn.Module, ref_modules: dict[str, nn.Module], quantized: set[str],
                       conv1d: type) -> dict[str, torch.Tensor]:
        """The floating-point tensors of every layer not quantized, under the reader's names and layouts (a Conv1D
        the workbench rewrote as an nn.Linear is written transposed back); tied copies once."""
        expected = reader.state_dict()                                   # meta tensors: names and shapes
        ties = getattr(reader, "all_tied_weights_keys", None) or {}      # target -> source: written once, as source
        for target, source in ties.items():
            owners = [k.rpartition(".")[0] for k in (target, source)]
            if any(o in quantized for o in owners):
                raise _refuse(next(o for o in owners if o in quantized),
                              f"is quantized, but {target!r} is tied to {source!r} (tie_word_embeddings): the "
                              f"reader loads one tensor for both - leave both in floating point or untie them")
        tied = set(ties)
        modules = dict(model.named_modules())
        out: dict[str, torch.Tensor] = {}
        for key, t in model.state_dict().items():
            owner, _, leaf = key.rpartition(".")
            if owner in quantized:
                continue
            if key not in expected:
                raise _refuse(owner, f"holds {key!r}, which the model built from config.json does not have: its "
                                     f"structure changed")
            if key in tied:
                continue
            t = t.detach().cpu()
            if isinstance(ref_modules.get(owner), conv1d) and type(modules[owner]) is nn.Linear and leaf == "weight":
                t = t.t()                                                # back to Conv1D's (in, out)
            if tuple(t.shape) != tuple(expected[key].shape):
                raise _refuse(owner, f"has {key!r} of shape {tuple(t.shape)}, config.json builds "
                                     f"{tuple(expected[key].shape)}: its structure changed")
            out[key] = t.contiguous()
        missing = [k for k in expected if k not in out and k not in tied
                   and k.rpartition(".")[0] not in quantized]
        if missing:
            raise _refuse(missing[0].rpartition(".")[0], f"has no tensor for {missing[0]!r}, which the model built "
                                                         f"from config.json expects")
        return out

    @staticmethod
    def _base_files(base_folder: Path | None, model: nn.Module, has_generation: bool) -> list[Path]:
        if base_folder is None:
            return []
        found = base_folder / "config.json"
        if found.is_file():
            base_type = json.loads(found.read_text()).get("model_type")
            if base_type is not None and base_type != model.config.model_type:
                raise ValueError(f"base_folder {base_folder} holds a {base_type!r} model, the model is a "
                                 f"{model.config.model_type!r}")
        names = BASE_FILES if has_generation else (*BASE_FILES, "generation_config.json")
        return [base_folder / n for n in names if (base_folder / n).is_file()]

    def write(self, prepared: Prepared, folder: Path) -> None:
        from compressed_tensors.compressors import ModelCompressor
        from safetensors.torch import save_file

        prepared.config.save_pretrained(folder)
        if prepared.quantization_config is not None:   # compressed-tensors writes its own config entry
            ModelCompressor(quantization_config=prepared.quantization_config).update_config(str(folder))
        path = folder / "config.json"
        config = json.loads(path.read_text())
        config["workbench_export"] = prepared.provenance
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        weights = folder / "model.safetensors"
        save_file(prepared.tensors, str(weights), metadata=prepared.metadata)
        weights.chmod(path.stat().st_mode & 0o777)   # (safetensors creates it 0600; the folder is for others to read)
        if prepared.generation_config is not None:
            prepared.generation_config.save_pretrained(folder)
        for f in prepared.files:
            shutil.copy2(f, folder / f.name)
