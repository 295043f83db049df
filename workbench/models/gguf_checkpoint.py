"""Read a llama.cpp GGUF file as a transformers model: ``wb.models.load("path/to/model.gguf")``.

The other way of `workbench.export.gguf`. The file is read with gguf-py's `GGUFReader` (a memory-mapped parse of
the header and tensor table: nothing is unpickled or executed); its ``general.architecture`` picks the transformers
class (``llama`` -> ``LlamaForCausalLM``, ``qwen2`` -> ``Qwen2ForCausalLM``, ``gpt2`` -> ``GPT2LMHeadModel``),
whose config comes from the hyper-parameters (``{arch}.embedding_length``, ``block_count``, ``feed_forward_length``,
``attention.head_count``, ``context_length``; for llama / qwen2 ``attention.head_count_kv`` / ``key_length`` /
``layer_norm_rms_epsilon`` and ``rope.freq_base``; for gpt2 ``attention.layer_norm_epsilon`` and the tanh GELU
(``gelu_new``) llama.cpp's gpt2 graph computes; the vocabulary size from ``token_embd``'s rows; tied embeddings when
there is no ``output`` tensor; Llama's attention / MLP biases when the file has them; bos / eos / padding ids from
``tokenizer.ggml.*``). The tokenizer itself is not read.

Each quantized tensor becomes the workbench's own packed layer holding the file's codes and fp16 scales exactly - the
inverse of the exporter's table, nothing dequantized and quantized again:

| ggml type (32-value block) | the layer (`WeightOnlyLinear` / `WeightOnlyEmbedding`) | codes, scale, zero |
|---|---|---|
| ``Q8_0``: fp16 ``d``, 32 int8 ``q`` | ``WeightOnly(bits=8, group_size=32)`` | ``q + 128``, ``d``, (128) |
| ``Q4_0``: fp16 ``d``, 16 nibble bytes | ``WeightOnly(bits=4, group_size=32)`` | nibbles, ``d``, (8) |
| ``Q4_1``: fp16 ``d``, ``m``, nibbles | ``WeightOnly(bits=4, group_size=32, symmetric=False)`` | nibbles, ``d``, z |
| ``F32`` / ``F16`` / ``BF16`` | the float layer (fp32 parameters, exact) | - |

(``z``: the integer in 0..15 with ``m = -d * z`` exactly; the symmetric grids' zero points are implicit.) The
workbench therefore computes with bit for bit the weight ggml dequantizes (`workbench.export.gguf` says why the two
products agree). The layers are built through the workbench's own path: a `Plan` naming each quantized layer with its
`WeightOnly` config, `build_skeleton` on the float model built under `empty_weights` (no float copy of a quantized
weight is ever made), then the file's values loaded into it - so `applied_plans` records the plan, and exporting the
model to GGUF again writes the same tensor data. For ``llama``, the q/k rows (codes with their scales, float rows,
biases) are put back in Hugging Face's order (`rope_rows` undone). For ``gpt2``, transformers' ``Conv1D`` stores its
weight (in, out): a float ``attn_qkv`` / ``attn_output`` / ``ffn_up`` / ``ffn_down`` goes back transposed into the
``Conv1D``; a quantized one names its ``Conv1D`` in the plan, which `build_skeleton` rewrites to a Linear
(`workbench.plans.layers.canonicalize_for`) before making it the packed layer - the structure `wb.apply` builds - and
the file's (out, in) blocks are that layer's rows as they are. The model is on the CPU; its quantized layers choose
their kernel there (``"auto"``).

Refused, naming the tensor and its ggml type (ValueError): k-quants (``Q4_K`` ...), ``Q5_0`` / ``Q5_1``, i-quants and
every other type the workbench's grids cannot hold; ``Q4_1`` blocks whose minimum is not ``-d * z`` for an integer
``z`` in 0..15; non-finite scales. Refused (ValueError): architectures other than the ones above, naming the file's,
hyper-parameters transformers' class would run differently (rope scaling, a partial rotary dimension, key and value
heads of different sizes, a gpt2 with fewer key / value heads than query heads), tensors the class has no place for
and tensors it needs that the file lacks.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from workbench.export.gguf import BLOCK, architectures, block_types, rope_rows
from workbench.quantization import formats as fm

__all__ = ["load_gguf", "Grid", "grids", "float_types", "config_builders"]


def _refuse(what: str) -> ValueError:
    return ValueError(f"gguf load: {what}")


# --- ggml blocks -> the workbench's codes, scales and zero points ----------------------------------------------------

# (tensor name, blocks (R, G, bytes per block) uint8) -> codes (R, G, 32) uint8, scale (R, G) fp16, zero (R, G) uint8
# (the symmetric grids' implicit mid-point, which `formats.pack_int` does not store)
Decoder = Callable[[str, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


def _fp16(b: np.ndarray) -> np.ndarray:
    """(R, G, 2) uint8, little-endian ``ggml_half`` -> (R, G) float16."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float16)


def _nibbles(b: np.ndarray) -> np.ndarray:
    """(R, G, 16) bytes -> (R, G, 32) codes: value j in the low nibble of byte j, value j + 16 in its high one."""
    return np.concatenate([b & 0x0F, b >> 4], axis=-1)


def _finite(name: str, what: str, x: np.ndarray) -> np.ndarray:
    bad = ~np.isfinite(x)
    if bad.any():
        r, g = (int(i) for i in np.argwhere(bad)[0])
        raise _refuse(f"tensor {name!r} has non-finite fp16 {what}s (first: row {r}, block {g}; {int(bad.sum())} of "
                      f"{bad.size}), which the workbench does not hold (a damaged file?)")
    return x


def _q8_0(name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _finite(name, "scale", _fp16(blocks[..., :2]))                                # (R, G)
    u = blocks[..., 2:] ^ np.uint8(0x80)                       # int8 q -> u = q + 128: the sign bit flipped
    return u, d, np.full(d.shape, 128, np.uint8)


def _q4_0(name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _finite(name, "scale", _fp16(blocks[..., :2]))                                # (R, G)
    return _nibbles(blocks[..., 2:]), d, np.full(d.shape, 8, np.uint8)                # (R, G, 32)


def _q4_1(name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _finite(name, "scale", _fp16(blocks[..., :2]))                                # (R, G)
    m = _finite(name, "minimum", _fp16(blocks[..., 2:4]))
    d64, m64 = d.astype(np.float64), m.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(d64 != 0, np.rint(-m64 / d64), 0.0)                              # (R, G)
    exact = (z >= 0) & (z <= 15) & (-d64 * z == m64)    # d * z is exact in float64 (11-bit times 4-bit)
    if not exact.all():
        r, g = (int(i) for i in np.argwhere(~exact)[0])
        raise _refuse(f"tensor {name!r} is Q4_1 with blocks whose minimum m is not -d * z for an integer zero point z "
                      f"in 0..15 (first: row {r}, block {g}: d = {float(d[r, g])!r}, m = {float(m[r, g])!r}; "
                      f"{int((~exact).sum())} of {exact.size} blocks), so the workbench's asymmetric int4 grid "
                      f"(integer zero points) cannot hold it exactly")
    return _nibbles(blocks[..., 4:]), d, z.astype(np.uint8)


_DECODERS: dict[tuple[int, bool], Decoder] = {(8, True): _q8_0, (4, True): _q4_0, (4, False): _q4_1}


@dataclass(frozen=True)
class Grid:
    """A ggml block type the workbench holds exactly: the `WeightOnly` config of its grid, and how blocks become the
    grid's codes, scales and zero points."""

    config: Any          # wb.quant.WeightOnly(bits, group_size=32, symmetric)
    decode: Decoder

    def tensors(self, name: str, data: np.ndarray, rows: int, K: int) -> dict[str, torch.Tensor]:
        """The layer's stored tensors (``qweight`` / ``scale`` / ``zero``, `formats.IntFormat`'s layout) from the
        ggml blocks ``data`` (rows, G * bytes per block) uint8."""
        G = K // BLOCK
        codes, scale, zero = self.decode(name, np.asarray(data).reshape(rows, G, -1))
        fmt = self.config.format()
        return fm.pack_int(torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, K))), torch.from_numpy(scale),
                           torch.from_numpy(zero), fmt)


@functools.cache
def grids() -> dict[Any, Grid]:
    """gguf.GGMLQuantizationType -> the workbench grid holding it: the exporter's table (`block_types`) read back."""
    from workbench.quantization.configs import WeightOnly

    return {block.ggml: Grid(WeightOnly(bits=bits, group_size=BLOCK, symmetric=symmetric), _DECODERS[bits, symmetric])
            for (bits, symmetric), block in block_types().items() if (bits, symmetric) in _DECODERS}


def _bf16(data: np.ndarray) -> torch.Tensor:
    """gguf-py gives BF16 as raw bytes (rows, 2 * K): reinterpreted, widened exactly to fp32."""
    raw = np.ascontiguousarray(data).view("<u2").astype(np.int16)                     # (rows, K) bit patterns
    return torch.from_numpy(raw).view(torch.bfloat16).float()


@functools.cache
def float_types() -> dict[Any, Callable[[np.ndarray], torch.Tensor]]:
    """gguf.GGMLQuantizationType -> how its data becomes an fp32 tensor (exactly)."""
    from gguf import GGMLQuantizationType as T

    return {T.F32: lambda a: torch.from_numpy(np.array(a, dtype=np.float32)),
            T.F16: lambda a: torch.from_numpy(np.array(a, dtype=np.float32)),
            T.BF16: _bf16}


def _check_type(t) -> None:
    if t.tensor_type in grids() or t.tensor_type in float_types():
        return
    held = sorted(k.name for k in grids()) + sorted(k.name for k in float_types())
    kquant = t.tensor_type.name.endswith("_K")
    why = ("a k-quant: super-blocks of 256 values with quantized sub-block scales and minimums, which no workbench "
           "grid (one fp16 scale, and an integer zero point, per group) holds" if kquant else
           "a type no workbench grid holds exactly")
    raise _refuse(f"tensor {t.name!r} is {t.tensor_type.name}, {why}. The workbench reads {', '.join(held)}: "
                  f"quantize the float model with wb.apply(WeightOnly(bits=8 or 4, group_size=32)) instead, or "
                  f"re-quantize the file to Q8_0 / Q4_0 with llama.cpp")


# --- hyper-parameters -> a transformers config -----------------------------------------------------------------------

class _Fields:
    """The file's key-value metadata, read by key with errors naming the key."""

    def __init__(self, reader, path: Path):
        self.path = path
        self.values = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}

    def get(self, key: str, default: Any = ...) -> Any:
        if key in self.values:
            return self.values[key]
        if default is ...:
            raise _refuse(f"{self.path} has no {key!r}, which the model's config needs")
        return default

    def integer(self, key: str, default: Any = ...) -> int:
        v = self.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool):
            raise _refuse(f"{self.path}: {key!r} is {v!r}, not one integer (per-layer values are not read)")
        return v


def _decimal(x: float) -> float:
    """A float32 hyper-parameter as the shortest decimal that is that float32 (1e-06, not 9.999999974752427e-07)."""
    return float(str(np.float32(x)))


def _vocabulary_size(fields: _Fields, arch: str, tensors: dict[str, Any]) -> int:
    """The vocabulary size: ``token_embd``'s rows (checked against ``{arch}.vocab_size`` when the file has it)."""
    embedding = tensors.get("token_embd.weight")
    if embedding is None:
        raise _refuse(f"{fields.path} has no tensor 'token_embd.weight'")
    vocab = int(embedding.shape[1])   # ggml's dims: (K, rows)
    if fields.get(f"{arch}.vocab_size", vocab) != vocab:
        raise _refuse(f"{fields.path}: {arch}.vocab_size is {fields.get(f'{arch}.vocab_size')}, token_embd has "
                      f"{vocab} rows")
    return vocab


def _shared_fields(fields: _Fields, tensors: dict[str, Any]) -> dict[str, Any]:
    """The config fields every architecture reads the same way: the head's tying and the special token ids."""
    return dict(tie_word_embeddings="output.weight" not in tensors,
                bos_token_id=fields.get("tokenizer.ggml.bos_token_id", None),
                eos_token_id=fields.get("tokenizer.ggml.eos_token_id", None),
                pad_token_id=fields.get("tokenizer.ggml.padding_token_id", None))


def _llama_family(fields: _Fields, arch: str, tensors: dict[str, Any], heads: int) -> dict[str, Any]:
    """The config fields Llama and Qwen2 share: RMSNorm, rotary embeddings, SiLU-gated MLP, grouped-query attention."""
    hidden = fields.integer(f"{arch}.embedding_length")
    head_dim = fields.integer(f"{arch}.attention.key_length", hidden // heads)
    value_dim = fields.integer(f"{arch}.attention.value_length", head_dim)
    rotary = fields.integer(f"{arch}.rope.dimension_count", head_dim)
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or fields.get(f"{arch}.rope.scaling.factor", 1.0) not in (0.0, 1.0):
        raise _refuse(f"{fields.path} has rope scaling ({arch}.rope.scaling.type = {scaling!r}), which this reader "
                      f"does not set up")
    if value_dim != head_dim or rotary != head_dim:
        raise _refuse(f"{fields.path} has key_length {head_dim}, value_length {value_dim} and rope.dimension_count "
                      f"{rotary}; transformers' {arch} computes with one head_dim, rotated whole")
    return dict(vocab_size=_vocabulary_size(fields, arch, tensors), hidden_size=hidden,
                intermediate_size=fields.integer(f"{arch}.feed_forward_length"),
                num_hidden_layers=fields.integer(f"{arch}.block_count"), num_attention_heads=heads,
                num_key_value_heads=fields.integer(f"{arch}.attention.head_count_kv", heads), head_dim=head_dim,
                max_position_embeddings=fields.integer(f"{arch}.context_length"),
                rms_norm_eps=_decimal(fields.get(f"{arch}.attention.layer_norm_rms_epsilon")),
                rope_theta=_decimal(fields.get(f"{arch}.rope.freq_base", 10000.0)), **_shared_fields(fields, tensors))


def _llama(fields: _Fields, tensors: dict[str, Any]) -> dict[str, Any]:
    """Llama: attention biases (q, k, v, o together) and MLP biases are flags of the config."""
    heads = fields.integer("llama.attention.head_count")

    def has(kinds: tuple[str, ...]) -> bool:
        return any(n.endswith(f".{k}.bias") for n in tensors for k in kinds)

    return {**_llama_family(fields, "llama", tensors, heads),
            "attention_bias": has(("attn_q", "attn_k", "attn_v", "attn_output")),
            "mlp_bias": has(("ffn_gate", "ffn_up", "ffn_down"))}


def _qwen2(fields: _Fields, tensors: dict[str, Any]) -> dict[str, Any]:
    """Qwen2: q/k/v biases always, no sliding window (llama.cpp's qwen2 graph has none)."""
    return {**_llama_family(fields, "qwen2", tensors, fields.integer("qwen2.attention.head_count")),
            "use_sliding_window": False}


def _gpt2(fields: _Fields, tensors: dict[str, Any]) -> dict[str, Any]:
    """GPT-2: LayerNorm with bias, learned positions, one fused q/k/v projection, the tanh GELU (llama.cpp's ggml_gelu;
    transformers' ``gelu_new``), every head the same size."""
    heads = fields.integer("gpt2.attention.head_count")
    kv_heads = fields.integer("gpt2.attention.head_count_kv", heads)
    if kv_heads != heads:
        raise _refuse(f"{fields.path} has {kv_heads} key / value heads for {heads} query heads; transformers' gpt2 "
                      f"attention has one of each per head")
    return dict(vocab_size=_vocabulary_size(fields, "gpt2", tensors), n_embd=fields.integer("gpt2.embedding_length"),
                n_layer=fields.integer("gpt2.block_count"), n_head=heads,
                n_positions=fields.integer("gpt2.context_length"),
                n_inner=fields.integer("gpt2.feed_forward_length"), activation_function="gelu_new",
                layer_norm_epsilon=_decimal(fields.get("gpt2.attention.layer_norm_epsilon")),
                **_shared_fields(fields, tensors))


ConfigBuilder = Callable[[_Fields, dict[str, Any]], dict[str, Any]]


def config_builders() -> dict[str, ConfigBuilder]:
    """Hugging Face architecture -> the config fields read from a GGUF file of it (the architectures this reader
    builds, each written by the exporter, `workbench.export.gguf.architectures`)."""
    return {"LlamaForCausalLM": _llama, "Qwen2ForCausalLM": _qwen2, "GPT2LMHeadModel": _gpt2}


def _architecture(fields: _Fields) -> tuple[str, Any]:
    """(Hugging Face architecture, its `workbench.export.gguf.Architecture`) for the file's general.architecture."""
    name = fields.get("general.architecture")
    readable = {a.name: (hf, a) for hf, a in architectures().items() if hf in config_builders()}
    if name not in readable:
        raise _refuse(f"{fields.path} is a {name!r} model; this reader builds {sorted(readable)} "
                      f"({', '.join(readable[n][0] for n in sorted(readable))})")
    return readable[name]


# --- the whole model -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Source:
    """Where one of the float model's tensors comes from in the file."""

    tensor: Any               # gguf.ReaderTensor
    kind: Any                 # gguf.MODEL_TENSOR
    heads: int | None         # llama.cpp's q/k row order to undo (`rope_rows`), per this many heads; None: as stored
    # the weight of a Conv1D, which stores it (in, out): float data goes back transposed; quantized blocks are the
    # rows of the Linear the plan rewrites the Conv1D to, as they are
    in_out: bool = False


def _sources(base: nn.Module, arch, config, tensors: dict[str, Any], cls_name: str) -> dict[str, _Source]:
    """Float model key -> its tensor in the file (tied keys -> the one tensor), every file tensor used once."""
    import gguf
    from gguf import MODEL_TENSOR as T
    from transformers.pytorch_utils import Conv1D

    names = gguf.TensorNameMap(arch.arch, config.num_hidden_layers)
    heads = {T.ATTN_Q: config.num_attention_heads, T.ATTN_K: config.num_key_value_heads} if arch.rope_rows else {}
    groups: dict[int, list[str]] = {}
    for key, t in base.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(key)
    out: dict[str, _Source] = {}
    used: set[str] = set()
    for keys in groups.values():
        found = {k: names.get_type_and_name(k, try_suffixes=(".weight", ".bias")) for k in keys}
        present = [(k, f) for k, f in found.items() if f is not None and f[1] in tensors]
        if len(present) != 1:
            wanted = [f[1] if f else k for k, f in found.items()]
            raise _refuse(f"transformers' {cls_name} needs {keys[0]!r}, which the file holds as "
                          f"{' or '.join(map(repr, wanted))}: " + ("it has none of them" if not present else
                                                                   "it has more than one"))
        kind, name = present[0][1]
        used.add(name)
        for k in keys:
            owner, _, leaf = k.rpartition(".")
            in_out = leaf == "weight" and type(base.get_submodule(owner)) is Conv1D   # exact class, as canonicalize
            out[k] = _Source(tensors[name], kind, heads.get(kind), in_out)
    extra = sorted(set(tensors) - used)
    if extra:
        raise _refuse(f"tensor {extra[0]!r} has no place in transformers' {cls_name} built from the file's "
                      f"hyper-parameters ({len(extra)} such tensor(s): {extra[:5]})")
    return out


def _plan(base: nn.Module, sources: dict[str, _Source]):
    """The `Plan` naming every layer whose weight is a quantized tensor of the file, with the grid's config (a Conv1D
    too: `build_skeleton` rewrites what the plan reaches to a Linear first, as `wb.apply` does)."""
    from workbench.plans import Plan

    entries = {}
    for key, s in sources.items():
        grid = grids().get(s.tensor.tensor_type)
        if grid is None:
            continue
        owner, _, leaf = key.rpartition(".")
        module = base.get_submodule(owner)
        if leaf != "weight" or not (isinstance(module, (nn.Linear, nn.Embedding)) or s.in_out):
            raise _refuse(f"tensor {s.tensor.name!r} is {s.tensor.tensor_type.name}, but it is {key!r} of a "
                          f"{type(module).__name__}; the workbench quantizes Linear (Conv1D) and Embedding weights "
                          f"only")
        entries[owner] = grid.config
    return Plan(entries)


def _values(sources: dict[str, _Source], expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The compressed model's state dict from the file: each file tensor decoded once (tied keys share the objects,
    so `load_state_dict(assign=True)` keeps them tied); shapes and dtypes checked against the model, naming the
    tensor."""
    decoded: dict[str, Any] = {}

    def decode(s: _Source) -> Any:
        t = s.tensor
        if t.name in decoded:
            return decoded[t.name]
        dims = tuple(int(n) for n in reversed(t.shape.tolist()))          # (rows, K) or (n,)
        grid = grids().get(t.tensor_type)
        if grid is not None:
            value: Any = grid.tensors(t.name, t.data, dims[0], dims[1])
        else:
            w = float_types()[t.tensor_type](t.data).reshape(dims)                  # (rows, K) or (n,)
            value = {"": w.t().contiguous() if s.in_out else w}                     # Conv1D: (in, out)
        if s.heads is not None:                                            # llama.cpp's q/k rows -> Hugging Face's
            back = torch.argsort(rope_rows(dims[0], s.heads))
            value = {k: v[back] for k, v in value.items()}
        decoded[t.name] = value
        return value

    out: dict[str, torch.Tensor] = {}
    made: dict[tuple[str, str], torch.Tensor] = {}   # (file tensor, leaf) -> the one object every tied key gets
    for key, want in expected.items():
        owner, _, leaf = key.rpartition(".")
        float_key = f"{owner}.weight" if leaf in ("qweight", "scale", "zero") else key
        source = sources[float_key]
        part = leaf if float_key != key else ""
        if (source.tensor.name, part) not in made:
            value = decode(source)[part]
            if tuple(value.shape) != tuple(want.shape):
                raise _refuse(f"tensor {source.tensor.name!r} ({source.tensor.tensor_type.name}) holds {key!r} of "
                              f"shape {tuple(value.shape)}; the hyper-parameters give {tuple(want.shape)}")
            value = value.to(want.dtype)                                   # fp32 from F16 / BF16: exact
            if isinstance(want, nn.Parameter):
                value = nn.Parameter(value, requires_grad=want.requires_grad)
            made[source.tensor.name, part] = value
        out[key] = made[source.tensor.name, part]
    return out


def load_gguf(path: str | os.PathLike) -> nn.Module:
    """The model in the GGUF file ``path`` (see the module docstring), in eval mode."""
    import transformers
    from gguf import GGUFReader

    from workbench.plans import build_skeleton
    from workbench.plans.io import empty_weights

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} {'is not a file' if path.exists() else 'does not exist'} (expected a "
                                f"llama.cpp .gguf file)")
    try:
        reader = GGUFReader(path)
    except ValueError as e:   # gguf-py's errors for a wrong magic, version or a damaged table
        raise _refuse(f"{path} is not a readable GGUF file: {e}") from None
    if reader.byte_order != "I":
        raise _refuse(f"{path} is a big-endian GGUF file; this reader reads little-endian files")
    fields = _Fields(reader, path)
    cls_name, arch = _architecture(fields)
    tensors = {t.name: t for t in reader.tensors}
    for t in tensors.values():
        _check_type(t)
    cls = getattr(transformers, cls_name)
    config = cls.config_class(architectures=[cls_name], **config_builders()[cls_name](fields, tensors))
    with empty_weights():                                     # parameters on the meta device: no float copy
        base = cls(config)
    sources = _sources(base, arch, config, tensors, cls_name)
    plan = _plan(base, sources)
    model = build_skeleton(base, [plan] if len(plan) else [], values=False)
    model.load_state_dict(_values(sources, model.state_dict(keep_vars=True)), strict=True, assign=True)
    for m in model.modules():   # built on the meta device: choose the "auto" kernel again, here
        set_kernel = getattr(m, "set_kernel", None)
        if getattr(m, "kernel_request", None) == "auto" and callable(set_kernel):
            set_kernel("auto")
    return model.eval()
