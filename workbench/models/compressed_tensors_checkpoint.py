"""Reading compressed-tensors checkpoints (llm-compressor's format, and `wb.export(format="compressed-tensors")`'s).

``wb.models.load(folder)`` of a Hugging Face folder whose ``config.json`` has a compressed-tensors
``quantization_config`` comes here (from `workbench.models.checkpoint`). The model class comes from the config as for
any checkpoint; each quantized nn.Linear becomes the workbench's own packed module holding exactly the checkpoint's
integer codes, scales and zero points (never dequantized and quantized again), and the result carries the plan that
builds those modules (`wb.applied_plans`), so `wb.measure`, `wb.compare`, `wb.save` and `wb.export` treat it as a
model the workbench compressed itself: exporting it again writes the same tensors.

- int weights of 2/3/4/8 bits, strategy channel or group, symmetric or with a zero point, inputs not quantized
  (``pack-quantized``; ``int-quantized`` / ``naive-quantized`` store one int8 per code) -> `WeightOnlyLinear`
  (plan config ``wb.quant.WeightOnly``);
- int8 symmetric channel weights with int8 symmetric inputs, dynamic per token (``int-quantized``) -> `W8A8Linear`
  (``wb.quant.Dynamic``); the same with static per-tensor inputs (``input_scale``) -> ``wb.quant.Static``;
- layers in ``ignore``, and those no config group targets, stay as they are, in floating point.

Codes: compressed-tensors stores signed codes ``q`` (``-2^(b-1) .. 2^(b-1) - 1``), the workbench unsigned ones
``u = q + 2^(b-1)`` (zero points shifted alike); both dequantize as ``(q - z) * s``. Scales: `WeightOnlyLinear` stores
fp16 scales, so a checkpoint's scales are taken only when fp16 holds them exactly (the workbench's own exports, bf16
checkpoints within fp16's range); W8A8 scales are fp32, which holds fp16 / bf16 / fp32 scales exactly.

Refused with a ValueError naming the layer and its scheme (whole-model features: naming the feature), before any
weight is put in a model - never loaded in floating point instead: float weights (fp8, nvfp4 / mxfp4), act-order
with a stored column permutation (``actorder="group"``, ``weight_g_idx``), strategies other than channel / group
(tensor, block, tensor_group), short last groups, bit widths other than 2/3/4/8, W4A8 and asymmetric or non-8-bit
activations, output-activation and kv-cache quantization, sparsity and transform (rotation) configs, a status other
than "compressed", quantized embeddings or attention, a quantized layer tied to another, weight-only scales fp16 cannot
hold (e.g. an fp32 model's: they would have to be rounded), and any tensor the scheme does not explain.

The modules compute with the workbench's numerics: weight-only layers exactly as compressed-tensors' decompression
(the same weights); W8A8 layers quantize their inputs with the workbench's per-token rule, which can differ from
compressed-tensors' fake quantization by one code of one value per token (`workbench.export.compressed_tensors`).
"""
from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from workbench.plans import Config, Plan, build_skeleton, tie_groups
from workbench.quantization import packing
from workbench.quantization.configs import Dynamic, Static, WeightOnly
from workbench.quantization.formats import IntFormat

__all__ = ["is_compressed_tensors", "load_compressed_tensors", "workbench_config", "READERS", "BUFFERS", "LOADS"]

LOADS = ("integer weight-only nn.Linear (2/3/4/8 bits, channel or whole groups, symmetric or with an integer zero "
         "point) and W8A8 int8 nn.Linear (int8 symmetric channel weights, symmetric int8 inputs dynamic per token "
         "or static per tensor)")
_WEIGHT_ONLY_BITS = (2, 3, 4, 8)


def is_compressed_tensors(config: dict) -> bool:
    """Whether a ``config.json`` (as a dict) describes a compressed-tensors checkpoint."""
    quant = config.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "compressed-tensors"


def _refuse(folder: Path, name: str, scheme: str, why: str) -> ValueError:
    return ValueError(f"compressed-tensors checkpoint {folder}: layer {name!r} ({scheme}) {why}; it is not loaded "
                      f"(and not in floating point either). The workbench loads {LOADS}.")


def _describe(scheme, fmt: str | None) -> str:
    """A short description of one config group's scheme, for error messages."""
    def args(a) -> str:
        if a is None:
            return "none"
        group = f" group_size={a.group_size}" if a.group_size else ""
        extra = "".join(f" {k}={v}" for k, v in (("actorder", a.actorder), ("block", a.block_structure)) if v)
        return (f"{a.type}{a.num_bits} {a.strategy}{group} {'symmetric' if a.symmetric else 'asymmetric'}"
                f"{' dynamic' if a.dynamic else ''}{extra}")

    out = f"format {fmt}, weights {args(scheme.weights)}"
    if scheme.input_activations is not None:
        out += f", input activations {args(scheme.input_activations)}"
    if scheme.output_activations is not None:
        out += f", output activations {args(scheme.output_activations)}"
    return out


# --- config.json: the quantization config, and which layer holds which scheme ------------------------------------

_REMOVED_ACTORDER = ("group", "dynamic", True)   # act-order with a stored permutation (compressed-tensors removed it)


def _quantization_config(folder: Path, raw: dict):
    """The checkpoint's `compressed_tensors.QuantizationConfig` and the config groups that use a stored act-order
    permutation (which compressed-tensors 0.20 itself no longer parses: refused per layer, once layers are known).
    Whole-model features the workbench cannot hold are refused here."""
    from compressed_tensors.quantization import QuantizationConfig

    raw = copy.deepcopy(raw)
    where = f"compressed-tensors checkpoint {folder}"
    for key, what in (("sparsity_config", "a sparsity config (sparse weight storage)"),
                      ("transform_config", "a transform config (rotations the weights were multiplied by)"),
                      ("kv_cache_scheme", "kv-cache quantization"),
                      ("moe_sparsity_config", "an MoE expert-sparsity config")):
        if raw.get(key):
            raise ValueError(f"{where} has {what} ({key}: {json.dumps(raw[key])[:200]}), which the workbench cannot "
                             f"represent; it is not loaded. The workbench loads {LOADS}.")
        raw.pop(key, None)
    permuted = []
    groups = raw.get("config_groups")
    for group_name, group in (groups.items() if isinstance(groups, dict) else ()):
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict) and weights.get("actorder") in _REMOVED_ACTORDER:
            permuted.append(group_name)
            weights["actorder"] = None
    try:
        qconfig = QuantizationConfig.model_validate(raw)
    except Exception as e:   # pydantic's ValidationError, or the library's own checks
        raise ValueError(f"{where}: its quantization_config is not one compressed-tensors "
                         f"{_ct_version()} reads: {e}") from None
    status = getattr(qconfig.quantization_status, "value", qconfig.quantization_status)
    if status != "compressed":
        raise ValueError(f"{where} has quantization_status {status!r}: its weights are not stored compressed (codes "
                         f"and scales), so there are no codes to load")
    return qconfig, permuted


def _ct_version() -> str:
    import compressed_tensors

    return compressed_tensors.__version__


@dataclass(frozen=True)
class Layer:
    """One quantized layer of the checkpoint: its config group, scheme, storage format and workbench config."""

    name: str
    group: str
    scheme: Any        # compressed_tensors.QuantizationScheme
    format: str        # a compressed_tensors.config.CompressionFormat value
    config: Config     # the workbench config whose module holds it
    shape: tuple[int, int]   # (out_features, in_features)


def _format_of(scheme, qconfig) -> str:
    """The storage format of a scheme's layers: its own, the checkpoint's (unless mixed), else what compressed-tensors
    infers for an nn.Linear with that scheme."""
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.config import CompressionFormat

    if scheme.format is not None:
        return CompressionFormat(scheme.format).value
    if qconfig.format and qconfig.format != CompressionFormat.mixed_precision.value:
        return CompressionFormat(qconfig.format).value
    return infer_module_format(nn.Linear, scheme).value


def layers_of(folder: Path, reader: nn.Module, qconfig, permuted: list[str]) -> dict[str, Layer]:
    """Every layer of ``reader`` (the model built from config.json, on the meta device) that a config group quantizes,
    matched the way compressed-tensors matches them (targets: class names, exact names, ``re:`` patterns; ``ignore``),
    with its workbench config - or a refusal naming the first layer that cannot be held."""
    from compressed_tensors.quantization.lifecycle.initialize import is_cached_attention_module
    from compressed_tensors.utils.match import is_narrow_match, match_named_modules, match_targets

    target_groups: dict[str, list[str]] = {}
    for group_name, scheme in qconfig.config_groups.items():
        for target in scheme.targets:
            target_groups.setdefault(target, []).append(group_name)
    out: dict[str, Layer] = {}
    for name, module in match_named_modules(reader, list(target_groups), qconfig.ignore or []):
        hits = {g for t in match_targets(name, module, list(target_groups)) for g in target_groups[t]}
        schemes = {g: qconfig.config_groups[g] for g in sorted(hits)}
        first = next(iter(schemes))
        scheme = schemes[first]
        fmt = _format_of(scheme, qconfig)
        described = f"config group {first!r}: {_describe(scheme, fmt)}"
        if len({s.model_dump_json() for s in schemes.values()}) > 1:
            raise _refuse(folder, name, described, f"is targeted by config groups {sorted(schemes)} with different "
                                                   f"schemes")
        if first in permuted or any(g in permuted for g in schemes):
            raise _refuse(folder, name, described, "stores GPTQ act-order with a column permutation "
                                                   "(actorder='group', weight_g_idx), which the workbench's modules "
                                                   "cannot hold")
        if not isinstance(module, nn.Linear):
            # compressed-tensors quantizes nn.Linear, nn.Embedding and (narrowly targeted) attention; any other module
            # a pattern reaches (e.g. the block holding the targeted Linears) it leaves alone, and so does this
            if isinstance(module, nn.Embedding) or (is_cached_attention_module(module)
                                                    and is_narrow_match(reader, scheme.targets, name)):
                raise _refuse(folder, name, described, f"is quantized but is a {type(module).__name__} layer, not "
                                                       f"an nn.Linear: only quantized nn.Linear layers load (not "
                                                       f"quantized embeddings or attention)")
            continue
        config = workbench_config(scheme, fmt, lambda why: _refuse(folder, name, described, why))
        out[name] = Layer(name, first, scheme, fmt, config, (module.out_features, module.in_features))
    return out


def workbench_config(scheme, fmt: str, refuse: Callable[[str], ValueError]) -> Config:
    """The workbench config whose module holds a layer of ``scheme`` stored in ``fmt`` exactly; ``refuse(why)`` makes
    the error for anything else."""
    w, a = scheme.weights, scheme.input_activations
    if fmt not in READERS:
        raise refuse(f"is stored as {fmt!r}, which the workbench does not read (it reads {', '.join(READERS)})")
    if w is None:
        raise refuse("quantizes activations only")
    if scheme.output_activations is not None:
        raise refuse("quantizes its outputs, which no workbench module does")
    if w.type != "int":
        raise refuse(f"has {w.type} weights ({w.num_bits} bits: fp8 / fp4), which the workbench's integer modules "
                     f"cannot hold")
    if w.dynamic is not False:
        raise refuse("quantizes its weights dynamically")
    if w.strategy not in ("channel", "group") or w.block_structure:
        raise refuse(f"has weight strategy {w.strategy!r}: the workbench stores scales per output channel or per "
                     f"group along the input")
    if w.strategy == "group" and not (isinstance(w.group_size, int) and w.group_size > 0):
        raise refuse(f"has strategy 'group' with group_size {w.group_size!r}")
    group_size = w.group_size if w.strategy == "group" else None
    if a is None:
        if w.num_bits not in _WEIGHT_ONLY_BITS:
            raise refuse(f"has {w.num_bits}-bit weights; the workbench's integer formats have {_WEIGHT_ONLY_BITS} "
                         f"bits")
        return WeightOnly(bits=w.num_bits, group_size=group_size, symmetric=bool(w.symmetric))
    if (w.num_bits, w.strategy, bool(w.symmetric)) != (8, "channel", True):
        raise refuse("quantizes its inputs, which the workbench does only with int8 symmetric per-channel weights "
                     "(W8A8); W4A8 and the like are not workbench layers")
    if a.type != "int" or a.num_bits != 8 or not a.symmetric:
        raise refuse(f"quantizes its inputs to {'' if a.symmetric else 'asymmetric '}{a.type}{a.num_bits}; "
                     f"W8A8Linear quantizes them to symmetric int8")
    if a.dynamic is True and a.strategy == "token":
        return Dynamic()
    if a.dynamic is False and a.strategy == "tensor":
        return Static()
    raise refuse(f"quantizes its inputs {'dynamically' if a.dynamic else 'statically'} per {a.strategy}; "
                 f"W8A8Linear does dynamic per-token or static per-tensor")


# --- one layer's stored tensors -> codes, scales, zero points -------------------------------------------------------

@dataclass
class Stored:
    """One quantized layer as compressed-tensors stores it, unpacked: signed integer codes and their parameters."""

    codes: torch.Tensor                     # (N, K) int8, signed
    scale: torch.Tensor                     # (N, G) as stored (fp32 / bf16 / fp16)
    zero: torch.Tensor | None = None        # (N, G) signed integer zero points (asymmetric only)
    input_scale: torch.Tensor | None = None  # (1,) static per-tensor input scale


Reader = Callable[[Layer, dict[str, torch.Tensor], Callable[[str], ValueError]], Stored]
READERS: dict[str, Reader] = {}   # compressed-tensors format -> reader of one layer's tensors, filled by `_reads`


def _reads(*formats: str) -> Callable[[Reader], Reader]:
    def register(fn: Reader) -> Reader:
        for f in formats:
            READERS[f] = fn
        return fn
    return register


def _expect(t: dict[str, torch.Tensor], key: str, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...] | None,
            refuse: Callable[[str], ValueError]) -> torch.Tensor:
    if key not in t:
        raise refuse(f"has no {key!r} tensor in the checkpoint")
    x = t[key]
    if x.dtype not in dtypes:
        raise refuse(f"stores {key!r} as {x.dtype}, expected {' or '.join(map(str, dtypes))}")
    if shape is not None and tuple(x.shape) != shape:
        raise refuse(f"stores {key!r} of shape {tuple(x.shape)}, expected {shape}")
    return x


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int8, torch.int16, torch.int32, torch.int64)


def _scale_shape(layer: Layer, refuse: Callable[[str], ValueError]) -> tuple[int, int]:
    N, K = layer.shape
    g = layer.scheme.weights.group_size if layer.scheme.weights.strategy == "group" else None
    if g is None:
        return N, 1
    if K % g:
        raise refuse(f"has a short last group (group_size {g} does not divide the input size {K})")
    return N, K // g


def _symmetric_zero(t: dict[str, torch.Tensor], key: str, refuse: Callable[[str], ValueError]) -> None:
    """A symmetric scheme may still carry an all-zero zero point; anything else contradicts the scheme."""
    z = t.get(key)
    if z is not None and bool((z != 0).any()):
        raise refuse(f"is symmetric but stores a non-zero {key!r}")


@_reads("pack-quantized")
def _packed(layer: Layer, t: dict[str, torch.Tensor], refuse: Callable[[str], ValueError]) -> Stored:
    """int32 words, each holding 32 / bits consecutive codes (compressed-tensors' `unpack_from_int32`)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    N, K = layer.shape
    bits = layer.scheme.weights.num_bits
    words = -(-K * bits // 32)
    shape = _expect(t, "weight_shape", _INTS, (2,), refuse)
    if tuple(shape.tolist()) != (N, K):
        raise refuse(f"has weight_shape {tuple(shape.tolist())}, but the model built from config.json has an "
                     f"nn.Linear of {(N, K)} there")
    packed = _expect(t, "weight_packed", (torch.int32,), (N, words), refuse)
    scale = _expect(t, "weight_scale", _FLOATS, _scale_shape(layer, refuse), refuse)
    codes = unpack_from_int32(packed, bits, torch.Size((N, K)))                     # (N, K) int8, signed
    zero = None
    if layer.scheme.weights.symmetric:
        _symmetric_zero(t, "weight_zero_point", refuse)
    else:
        G = scale.shape[1]
        zp = _expect(t, "weight_zero_point", (torch.int32,), (-(-N * bits // 32), G), refuse)
        zero = unpack_from_int32(zp, bits, torch.Size((N, G)), packed_dim=0)        # (N, G) int8, signed
    return Stored(codes, scale, zero)


@_reads("int-quantized", "naive-quantized")
def _int8(layer: Layer, t: dict[str, torch.Tensor], refuse: Callable[[str], ValueError]) -> Stored:
    """One int8 per code, ``weight`` (N, K); W8A8's static input scale beside it."""
    codes = _expect(t, "weight", (torch.int8,), layer.shape, refuse)
    scale = _expect(t, "weight_scale", _FLOATS, _scale_shape(layer, refuse), refuse)
    zero = None
    if layer.scheme.weights.symmetric:
        _symmetric_zero(t, "weight_zero_point", refuse)
    else:
        zero = _expect(t, "weight_zero_point", _INTS, tuple(scale.shape), refuse)
    input_scale = None
    if isinstance(layer.config, Static):
        input_scale = _expect(t, "input_scale", _FLOATS, None, refuse)
        if input_scale.numel() != 1:
            raise refuse(f"stores a static input scale of shape {tuple(input_scale.shape)}, expected one value")
        _symmetric_zero(t, "input_zero_point", refuse)
    return Stored(codes, scale, zero, input_scale)


_KNOWN = {"weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "input_scale",
          "input_zero_point"}


def _check_names(layer: Layer, t: dict[str, torch.Tensor], refuse: Callable[[str], ValueError]) -> None:
    """Refuse any tensor the layer's scheme does not explain (an act-order permutation, global scales, ...)."""
    if "weight_g_idx" in t:
        raise refuse("stores an act-order column permutation (weight_g_idx), which the workbench's modules cannot "
                     "hold")
    allowed = set(_KNOWN)
    if not isinstance(layer.config, Static):
        allowed -= {"input_scale", "input_zero_point"}
    allowed -= {"weight"} if layer.format == "pack-quantized" else {"weight_packed", "weight_shape"}
    unknown = sorted(set(t) - allowed)
    if unknown:
        raise refuse(f"stores tensors {unknown} that its scheme does not explain")


# --- codes -> the workbench module's buffers, by config type --------------------------------------------------------

def _in_range(x: torch.Tensor, bits: int, what: str, refuse: Callable[[str], ValueError]) -> torch.Tensor:
    """Signed codes -> the workbench's unsigned ones (uint8), refusing any outside the ``bits``-bit range."""
    u = x.to(torch.int16) + (1 << (bits - 1))
    if bool((u < 0).any()) or bool((u >= 1 << bits).any()):
        raise refuse(f"holds {what} outside the {bits}-bit range")
    return u.to(torch.uint8)


def _exact(x: torch.Tensor, dtype: torch.dtype, what: str, refuse: Callable[[str], ValueError]) -> torch.Tensor:
    """``x`` in ``dtype``, refusing values that ``dtype`` does not hold exactly (or that are not finite)."""
    if not bool(torch.isfinite(x).all()):
        raise refuse(f"has {what} that are not finite")
    y = x.to(dtype)
    if not torch.equal(y.to(x.dtype), x):
        bad = int((y.to(x.dtype) != x).sum())
        raise refuse(f"has {x.dtype} {what} that {dtype} does not hold exactly ({bad} of {x.numel()} values); the "
                     f"workbench stores them in {dtype}, and rounding them would change the weights")
    return y.contiguous()


Buffers = Callable[[Layer, Stored, Callable[[str], ValueError]], dict[str, torch.Tensor]]


def _weight_only(layer: Layer, s: Stored, refuse: Callable[[str], ValueError]) -> dict[str, torch.Tensor]:
    """`WeightOnlyLinear`'s ``qweight`` (unsigned codes, packed by `packing`), fp16 ``scale``, uint8 ``zero``."""
    assert isinstance(layer.config, WeightOnly)
    fmt: IntFormat = layer.config.format()
    out = {"qweight": packing.pack(_in_range(s.codes, fmt.bits, "codes", refuse), fmt.slot_bits),
           "scale": _exact(s.scale, torch.float16, "weight scales", refuse)}                 # (N, G)
    if s.zero is not None:
        out["zero"] = _in_range(s.zero, fmt.bits, "zero points", refuse)                     # (N, G)
    return out


def _w8a8(layer: Layer, s: Stored, refuse: Callable[[str], ValueError]) -> dict[str, torch.Tensor]:
    """`W8A8Linear`'s ``qweight_t`` (in, out) int8, fp32 ``scale`` (1, out) and, static, the scalar ``act_scale``."""
    out = {"qweight_t": s.codes.t().contiguous(),                                             # (K, N)
           "scale": _exact(s.scale, torch.float32, "weight scales", refuse).t().contiguous()}  # (1, N)
    if s.input_scale is not None:
        out["act_scale"] = _exact(s.input_scale, torch.float32, "input scales", refuse).reshape(())
    return out


BUFFERS: dict[type[Config], Buffers] = {WeightOnly: _weight_only, Dynamic: _w8a8, Static: _w8a8}


# --- the checkpoint's tensors --------------------------------------------------------------------------------------

def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files ``from_pretrained`` reads: ``model.safetensors``, or those its index names."""
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    if index.is_file():
        names = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        return [folder / n for n in names]
    raise FileNotFoundError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")


def _read_tensors(folder: Path, quantized: set[str]) -> tuple[dict[str, dict[str, torch.Tensor]],
                                                              dict[str, torch.Tensor]]:
    """(quantized layer -> its tensors under local names, every other tensor under its full name); the quantized
    layers' biases go with the floating-point tensors (the reader's nn.Linear holds them)."""
    from safetensors import safe_open

    layers: dict[str, dict[str, torch.Tensor]] = {n: {} for n in quantized}
    plain: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        for path in _weight_files(folder):
            f = stack.enter_context(safe_open(str(path), "pt"))
            for key in f.keys():
                owner, _, leaf = key.rpartition(".")
                if owner in layers and leaf != "bias":
                    layers[owner][leaf] = f.get_tensor(key)
                else:
                    plain[key] = f.get_tensor(key)
    return layers, plain


# --- the whole checkpoint ------------------------------------------------------------------------------------------

def load_compressed_tensors(folder: Path, auto) -> nn.Module:
    """The model in ``folder`` (a compressed-tensors checkpoint; ``auto``: the transformers Auto class its
    architecture loads with) with its quantized layers as workbench modules, in eval mode (see the module docstring)."""
    import transformers

    raw = json.loads((folder / "config.json").read_text())["quantization_config"]
    qconfig, permuted = _quantization_config(folder, raw)
    config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    if hasattr(config, "quantization_config"):   # loaded here, not by transformers' quantizer
        del config.quantization_config
    with torch.device("meta"):
        reader = auto.from_config(config)         # the architecture, to match targets against (no memory)
    layers = layers_of(folder, reader, qconfig, permuted)
    for group in tie_groups(reader):
        tied = [n for n in group if n in layers]
        if tied:
            layer = layers[tied[0]]
            raise _refuse(folder, layer.name, f"config group {layer.group!r}: {_describe(layer.scheme, layer.format)}",
                          f"is quantized but shares its weight with {[n for n in group if n != layer.name]} "
                          f"(tie_word_embeddings); the workbench does not quantize one of two tied layers")
    stored, plain = _read_tensors(folder, set(layers))
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype), None)
    dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32   # (what from_pretrained loads the rest in)
    buffers: dict[str, dict[str, torch.Tensor]] = {}
    for name, layer in layers.items():
        def refuse(why: str, layer: Layer = layer) -> ValueError:
            return _refuse(folder, layer.name, f"config group {layer.group!r}: {_describe(layer.scheme, layer.format)}",
                           why)
        _check_names(layer, stored[name], refuse)
        buffers[name] = BUFFERS[type(layer.config)](layer, READERS[layer.format](layer, stored[name], refuse), refuse)
        stored[name] = {}   # (the unpacked codes are in `buffers` now)
        # the reader's nn.Linear needs a weight to load: a zero-strided placeholder (one value), replaced below
        plain[f"{name}.weight"] = torch.zeros((), dtype=dtype).expand(*layer.shape)

    generation = None
    if (folder / "generation_config.json").is_file():
        generation = transformers.GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    model, info = type(reader).from_pretrained(None, config=config, state_dict=plain, generation_config=generation,
                                               output_loading_info=True)
    problems = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if problems or info.get("error_msgs"):
        raise ValueError(f"compressed-tensors checkpoint {folder}: its tensors do not match the model config.json "
                         f"builds: {problems or info['error_msgs']}")
    if not layers:
        return model.eval()
    return _with_workbench_layers(folder, model, layers, buffers)


def _with_workbench_layers(folder: Path, model: nn.Module, layers: dict[str, Layer],
                           buffers: dict[str, dict[str, torch.Tensor]]) -> nn.Module:
    """``model`` with each quantized layer rebuilt the way `wb.load` rebuilds a saved model - the structure from the
    plan (`build_skeleton`, which records it as applied), then each tensor put in place: the layers' codes and
    scales from ``buffers``, everything else ``model``'s own tensors (not copied)."""
    plan = Plan({name: layer.config for name, layer in layers.items()})
    skeleton = build_skeleton(model, [plan], values=False)
    source = model.state_dict(keep_vars=True)
    filled: dict[int, torch.Tensor] = {}
    for key, t in skeleton.state_dict(keep_vars=True).items():
        owner, _, attr = key.rpartition(".")
        if id(t) not in filled:
            value = buffers[owner][attr] if attr in buffers.get(owner, {}) else source[key].detach()
            if tuple(value.shape) != tuple(t.shape):
                raise ValueError(f"compressed-tensors checkpoint {folder}: {key!r} has shape {tuple(value.shape)}, "
                                 f"the workbench module expects {tuple(t.shape)}")
            if value.dtype != t.dtype:   # a quantized layer's bias in W8A8Linear's fp32
                if not (value.is_floating_point() and t.is_floating_point()):
                    raise ValueError(f"compressed-tensors checkpoint {folder}: {key!r} is {value.dtype}, the "
                                     f"workbench module expects {t.dtype}")
                value = value.to(t.dtype)
            filled[id(t)] = nn.Parameter(value, t.requires_grad) if isinstance(t, nn.Parameter) else value
        module = skeleton.get_submodule(owner)
        slots: dict = module._parameters if attr in module._parameters else module._buffers
        slots[attr] = filled[id(t)]
    left = [n for n, t in [*skeleton.named_parameters(), *skeleton.named_buffers()] if t.device.type == "meta"]
    if left:
        raise ValueError(f"compressed-tensors checkpoint {folder}: nothing loaded {left[:5]}")
    for m in skeleton.modules():   # built on the meta device: choose the "auto" kernel again, for the CPU
        set_kernel = getattr(m, "set_kernel", None)
        if getattr(m, "kernel_request", None) == "auto" and callable(set_kernel):
            set_kernel("auto")
    return skeleton.eval()
