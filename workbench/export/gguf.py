"""Export to GGUF: one ``model.gguf`` file that llama.cpp (and everything built on it) loads, written with gguf-py.

    wb.export(small, "tiny-llama-q4", format="gguf")                       # zoo model: its own tokenizer
    wb.export(small, "llama-q8", format=GGUF(float_type="f16"), base_folder="llama")   # tokenizer.json from there

The file holds the hyper-parameters llama.cpp reads (``{arch}.context_length``, ``embedding_length``,
``block_count``, ``feed_forward_length``, ``attention.head_count`` / ``head_count_kv`` / ``key_length`` /
``value_length`` / ``layer_norm_rms_epsilon``, ``rope.dimension_count`` / ``freq_base``, ``vocab_size``; per
architecture, `architectures`), the vocabulary (``tokenizer.ggml.*``, `gguf_vocab`: a byte-level BPE as
``model = "gpt2"`` with ``pre = "gpt-2"`` / ``"llama-bpe"`` / ``"qwen2"`` (`gguf_vocab.PRE_TOKENIZERS`), or a
SentencePiece-style byte-fallback BPE (Llama-2, Mistral, TinyLlama, Gemma) as ``model = "llama"`` with per-token
scores (`gguf_vocab.SPM_LAYOUTS`): tokens in id order, token types, merges / scores, bos / eos / padding ids, whether
to add bos / eos), ``general.architecture``,
``general.file_type``, and the producer (``general.producer``: workbench version, gguf-py version, applied plans).

Quantized layers are written as the ggml block that holds the workbench's grid exactly - the codes and fp16 scales
`wb.apply` chose, never quantized again - so gguf-py's (and llama.cpp's) dequantization gives bit for bit the weight
the workbench computes with (a 32-value group along the input is one ggml block):

| workbench layer (`WeightOnlyLinear` / `WeightOnlyEmbedding`, `IntFormat`) | ggml type | block (32 values) | dequantized |
|---|---|---|---|
| 8 bits, ``group_size=32``, symmetric: codes ``u`` 0..255, implicit zero 128 | ``Q8_0`` | fp16 ``d`` = scale, 32 int8 ``q = u - 128`` | ``d * q`` |
| 4 bits, ``group_size=32``, symmetric: codes ``u`` 0..15, implicit zero 8 | ``Q4_0`` | fp16 ``d`` = scale, 16 bytes: value ``j`` in the low nibble of byte ``j``, ``j + 16`` in its high nibble | ``d * (u - 8)`` |
| 4 bits, ``group_size=32``, integer zero ``z``, where ``-scale * z`` is an fp16 value in every group | ``Q4_1`` | fp16 ``d`` = scale, fp16 ``m = -scale * z``, 16 bytes as Q4_0 | ``d * u + m`` |
| a layer the plan left in floating point (embedding and ``lm_head`` included) | ``F32`` (``F16`` with ``float_type="f16"``) | - | - |
| norms and biases | ``F32`` | - | - |

Why these are exact (fp32 arithmetic, as gguf-py's numpy and llama.cpp's reference dequantizers compute): the
workbench computes ``(u - z) * s`` with ``u - z`` a small integer, one rounding; ``d * (u - 8)`` and ``d * q`` are
the same product. For Q4_1, ``d * u`` is exact (an 11-bit significand times a 4-bit integer) and, when ``m`` is
exactly ``-s * z``, ``d * u + m`` rounds the same real number ``s * (u - z)`` once; ``m`` is checked per group.

Tensor names come from gguf-py's own `TensorNameMap` (``token_embd``, ``blk.N.attn_norm``, ``attn_q`` / ``attn_k`` /
``attn_v`` / ``attn_output``, ``ffn_norm``, ``ffn_gate`` / ``ffn_up`` / ``ffn_down``, ``output_norm``, ``output``).
An ``lm_head`` tied to the embedding is not written: llama.cpp reads ``token_embd`` for both. For ``llama``,
llama.cpp's rotary embedding rotates adjacent pairs while Hugging Face's rotates the two halves of each head, so
the rows of ``attn_q`` / ``attn_k`` (weights, codes with their scales, and biases) are reordered per head, as
llama.cpp's own converter does; whole rows move, so the groups along the input are untouched.

Architectures: ``LlamaForCausalLM`` (``llama``; GQA, optional attention / MLP biases) and ``Qwen2ForCausalLM``
(``qwen2``; q/k/v biases, no reordering: llama.cpp's qwen2 uses the halves rotation too), with plain rotary
embeddings (no rope scaling, no sliding window), SiLU MLPs; ``GPT2LMHeadModel`` (``gpt2``: ``position_embd``, the
fused ``attn_qkv`` as one tensor, LayerNorms and Linears with biases, ``{arch}.attention.layer_norm_epsilon``; a
float ``Conv1D`` weight, stored (in, out) by transformers, is written transposed; a quantized one was rewritten to a
Linear by the plan and is written as its blocks), with the tanh GELU llama.cpp computes.

``wb.export(..., requantize=True)`` re-quantizes what GGUF cannot hold as it is into the nearest grid it holds
(`nearest`: Q4_0's for 2-, 3- and 4-bit codes and NF4, Q8_0's for 8-bit codes, FP8 and W8A8 weights).

Refused before anything is written, naming the layer: other group sizes, a short last group, 2/3-bit codes, 8-bit
codes with a zero point, asymmetric 4-bit codes whose ``-scale * zero`` is not an fp16 value (Q4_1's minimum is
fp16), HQQ's real-valued zero points, NF4 and FP8 weights, AWQ smoothing and GPTQ act-order permutations, W8A8
layers (GGUF stores weights only; llama.cpp quantizes activations itself), pruned, low-rank and cast layers; models
of other architectures (TypeError), configs llama.cpp would run differently (rope scaling, sliding window, another
activation), and a model whose vocabulary is unknown or neither a byte-level nor a SentencePiece-style BPE: llama.cpp
loads no model without its vocabulary, so the tokenizer comes from ``base_folder/tokenizer.json`` or, for zoo models,
the zoo's own.
"""
from __future__ import annotations

import enum
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np
import torch
from torch import nn

from workbench.export import ExportFormat, integer_weight_problem, register_export_format
from workbench.export.gguf_vocab import chat_template, read_vocabulary, tokenizer_file
from workbench.plans import applied_plans
from workbench.quantization import packing
from workbench.quantization.formats import MXFP4Format
from workbench.quantization.modules import W8A8Linear, WeightOnlyEmbedding, WeightOnlyLinear
from workbench.quantization.primitives import E8M0_NAN

__all__ = ["GGUF", "FloatType", "BlockType", "Architecture", "FILE_NAME", "block_types", "architectures", "rope_rows"]

FILE_NAME = "model.gguf"
BLOCK = 32   # values per block of Q8_0 / Q4_0 / Q4_1 (ggml's QK8_0 = QK4_0 = QK4_1 = 32)
ALLOWED = ("WeightOnly(bits=8, group_size=32) symmetric as Q8_0, WeightOnly(bits=4, group_size=32) symmetric as Q4_0 "
           "(asymmetric as Q4_1 where -scale*zero is an fp16 value), MXFP4 as MXFP4, and floating-point layers as "
           "F32 / F16")


def _refuse(name: str, what: str) -> ValueError:
    return ValueError(f"gguf export: {name!r} {what}. GGUF (llama.cpp) holds {ALLOWED}.")


class FloatType(str, enum.Enum):
    """How the layers the plan left in floating point are stored (norms and biases are always F32)."""

    F32 = "f32"
    F16 = "f16"


# --- the ggml block types: one row per workbench grid they hold exactly ----------------------------------------------

Encoder = Callable[[str, np.ndarray, np.ndarray, "np.ndarray | None"], np.ndarray]


@dataclass(frozen=True)
class BlockType:
    """A ggml block type (32 consecutive values of a row) and how the workbench's codes and scales become its bytes."""

    ggml: Any          # gguf.GGMLQuantizationType
    file_type: Any     # gguf.LlamaFileType of a file mostly of this type
    encode: Encoder    # (layer, codes (R, G, 32) uint8, scale (R, G) fp16, zero (R, G) uint8 | None) -> (R, G, bytes)


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    """(R, G) float16 -> (R, G, 2) uint8, little-endian as ggml stores ``ggml_half``."""
    return np.ascontiguousarray(x.astype("<f2")).view(np.uint8).reshape(*x.shape, 2)


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """(R, G, 32) codes 0..15 -> (R, G, 16) bytes: value j in the low nibble of byte j, value j + 16 in its high one."""
    return codes[..., :BLOCK // 2] | (codes[..., BLOCK // 2:] << 4)


def _q8_0(name: str, codes: np.ndarray, scale: np.ndarray, zero: np.ndarray | None) -> np.ndarray:
    q = (codes.astype(np.int16) - 128).astype(np.int8).view(np.uint8)                 # (R, G, 32): u - 128
    return np.concatenate([_fp16_bytes(scale), q], axis=-1)                           # (R, G, 34)


def _q4_0(name: str, codes: np.ndarray, scale: np.ndarray, zero: np.ndarray | None) -> np.ndarray:
    return np.concatenate([_fp16_bytes(scale), _nibbles(codes)], axis=-1)             # (R, G, 18)


def _q4_1(name: str, codes: np.ndarray, scale: np.ndarray, zero: np.ndarray | None) -> np.ndarray:
    assert zero is not None
    exact = -(scale.astype(np.float64) * zero)                                        # (R, G): -s * z, exact
    m = exact.astype(np.float16)
    bad = m.astype(np.float64) != exact
    if bad.any():
        r, g = (int(i) for i in np.argwhere(bad)[0])
        raise _refuse(name, f"has asymmetric 4-bit groups whose minimum -scale*zero is not an fp16 value (first: row "
                            f"{r}, group {g}: -{float(scale[r, g])!r} * {int(zero[r, g])} = {float(exact[r, g])!r}; "
                            f"{int(bad.sum())} of {bad.size} groups), so Q4_1's fp16 minimum cannot hold it exactly - "
                            f"quantize symmetrically (Q4_0)")
    return np.concatenate([_fp16_bytes(scale), _fp16_bytes(m), _nibbles(codes)], axis=-1)   # (R, G, 20)


@functools.cache
def block_types() -> dict[tuple[int, bool], BlockType]:
    """(bits, symmetric) -> the ggml block type holding that workbench grid exactly (gguf-py imported on first use)."""
    from gguf import GGMLQuantizationType as T
    from gguf import LlamaFileType as F

    return {(8, True): BlockType(T.Q8_0, F.MOSTLY_Q8_0, _q8_0),
            (4, True): BlockType(T.Q4_0, F.MOSTLY_Q4_0, _q4_0),
            (4, False): BlockType(T.Q4_1, F.MOSTLY_Q4_1, _q4_1)}


def _mxfp4(name: str, codes: np.ndarray, scale: np.ndarray, zero: np.ndarray | None) -> np.ndarray:
    """ggml's block_mxfp4: the E8M0 exponent byte, then the 32 E2M1 codes two a byte (Q4_0's nibble order). ggml reads
    ``kvalues_mxfp4[code] * 2^(e - 128)``, its table the E2M1 values doubled: the same value for the same code."""
    return np.concatenate([scale[..., None], _nibbles(codes)], axis=-1)               # (R, G, 17)


@functools.cache
def mxfp4_block() -> BlockType:
    from gguf import GGMLQuantizationType as T
    from gguf import LlamaFileType as F

    return BlockType(T.MXFP4, F.MOSTLY_MXFP4_MOE, _mxfp4)


# --- one quantized layer -> ggml blocks ------------------------------------------------------------------------------

LayerEncoder = Callable[[str, nn.Module], tuple[np.ndarray, BlockType]]
LAYER_ENCODERS: dict[type[nn.Module], LayerEncoder] = {}   # module class -> encoder, filled by `_encodes`


def _encodes(*classes: type[nn.Module]) -> Callable[[LayerEncoder], LayerEncoder]:
    def register(fn: LayerEncoder) -> LayerEncoder:
        for cls in classes:
            LAYER_ENCODERS[cls] = fn
        return fn
    return register


@_encodes(WeightOnlyLinear, WeightOnlyEmbedding)
def _weight_only(name: str, m: nn.Module) -> tuple[np.ndarray, BlockType]:
    """The stored codes and fp16 scales as ggml blocks ``(rows, G * bytes per block)`` uint8, nothing re-quantized."""
    if isinstance(m.fmt, MXFP4Format):   # E2M1 codes and E8M0 exponents as they are
        rows, K = m.weight_shape
        if K % BLOCK:
            raise _refuse(name, f"has rows of {K} values, not whole MXFP4 blocks of {BLOCK}")
        exponents = m.scale.detach().cpu().numpy()                                    # (rows, G) uint8
        if (exponents == E8M0_NAN).any():
            raise _refuse(name, "has MXFP4 blocks with a NaN scale, which ggml's E8M0 reads as 2^127")
        codes = packing.unpack(m.qweight.detach().cpu(), 4, K).reshape(rows, K // BLOCK, BLOCK).numpy()
        return mxfp4_block().encode(name, codes, exponents, None).reshape(rows, -1), mxfp4_block()
    why = integer_weight_problem(m)
    if why:
        raise _refuse(name, why)
    fmt = m.fmt
    block = block_types().get((fmt.bits, fmt.symmetric))
    if block is None:
        kind = "symmetric" if fmt.symmetric else "asymmetric (zero-point)"
        raise _refuse(name, f"stores {kind} {fmt.bits}-bit codes, which no ggml block type holds exactly")
    rows, K = m.weight_shape
    g, G = fmt.groups(K)
    if g != BLOCK or K % BLOCK:
        raise _refuse(name, f"has groups of {g} values over an input of {K}; ggml's blocks are whole groups of "
                            f"{BLOCK} (WeightOnly(group_size=32) on an input that is a multiple of 32)")
    codes = packing.unpack(m.qweight.detach().cpu(), fmt.slot_bits, K)                # (rows, K) uint8
    if int(codes.max()) >= 1 << fmt.bits:
        raise _refuse(name, f"holds codes above the {fmt.bits}-bit range (up to {int(codes.max())})")
    scale = m.scale.detach().cpu()                                                    # (rows, G)
    half = scale.half()
    if not torch.equal(half.float(), scale.float()) or not torch.isfinite(half).all():
        raise _refuse(name, "has scales that are not finite fp16 values (ggml stores fp16 scales)")
    zero = None
    if not fmt.symmetric:
        zero = m.zero.detach().cpu().numpy()                                          # (rows, G) uint8
    blocks = block.encode(name, codes.reshape(rows, G, BLOCK).numpy(), half.numpy(), zero)   # (rows, G, bytes)
    return blocks.reshape(rows, -1), block


@_encodes(W8A8Linear)
def _w8a8(name: str, m: nn.Module) -> tuple[np.ndarray, BlockType]:
    raise _refuse(name, "is a W8A8 layer (int8 activations quantized by the layer); GGUF stores weights only - "
                        "llama.cpp quantizes activations itself, so there is no activation quantization to record: "
                        "use WeightOnly(bits=8, group_size=32) for Q8_0 weights")


def _made_by_workbench(module: nn.Module) -> bool:
    return type(module).__module__.partition(".")[0] == "workbench"


# --- architectures ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Shape:
    """The model's dimensions as llama.cpp reads them from the config."""

    vocab: int
    layers: int
    heads: int
    kv_heads: int
    weights: dict[Any, tuple[int, ...]]   # gguf.MODEL_TENSOR -> the weight's shape in Hugging Face's (out, in) layout
    hyper: tuple[tuple[str, Any], ...]    # (gguf.GGUFWriter method without ``add_``, value), in writing order


def _refuse_config(what: str) -> ValueError:
    return ValueError(f"gguf export: the model's config has {what}, which this exporter does not write (llama.cpp "
                      f"would run a different model)")


def _llama_shape(config) -> _Shape:
    """Llama / Qwen2: RMSNorm, rotary embeddings, SiLU-gated MLP, grouped-query attention."""
    from gguf import MODEL_TENSOR as T

    if getattr(config, "hidden_act", "silu") != "silu":
        raise _refuse_config(f"hidden_act={config.hidden_act!r} (the llama / qwen2 graphs use SiLU)")
    if getattr(config, "pretraining_tp", 1) != 1:
        raise _refuse_config(f"pretraining_tp={config.pretraining_tp}")
    if getattr(config, "use_sliding_window", False):
        raise _refuse_config("use_sliding_window=True")
    rope = getattr(config, "rope_parameters", None)    # transformers 5; 4.x: rope_theta + rope_scaling
    if rope is None:
        rope = {"rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise _refuse_config(f"rope scaling {rope!r}")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim % 2:
        raise _refuse_config(f"an odd head_dim {head_dim}")
    h, ff, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = heads * head_dim, kv_heads * head_dim
    weights = {T.TOKEN_EMBD: (vocab, h), T.OUTPUT: (vocab, h), T.OUTPUT_NORM: (h,), T.ATTN_NORM: (h,),
               T.FFN_NORM: (h,), T.ATTN_Q: (q, h), T.ATTN_K: (kv, h), T.ATTN_V: (kv, h), T.ATTN_OUT: (h, q),
               T.FFN_GATE: (ff, h), T.FFN_UP: (ff, h), T.FFN_DOWN: (h, ff)}
    hyper = (("context_length", config.max_position_embeddings), ("embedding_length", h),
             ("block_count", config.num_hidden_layers), ("feed_forward_length", ff), ("head_count", heads),
             ("head_count_kv", kv_heads), ("key_length", head_dim), ("value_length", head_dim),
             ("rope_dimension_count", head_dim), ("rope_freq_base", float(rope["rope_theta"])),
             ("layer_norm_rms_eps", float(config.rms_norm_eps)), ("vocab_size", vocab))
    return _Shape(vocab, config.num_hidden_layers, heads, kv_heads, weights, hyper)


# the activations llama.cpp's gpt2 graph computes (ggml_gelu: the tanh approximation)
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def _gpt2_shape(config) -> _Shape:
    """GPT-2: LayerNorm with bias, learned positions, one fused q/k/v projection, GELU (tanh) MLP."""
    from gguf import MODEL_TENSOR as T

    if config.activation_function not in GPT2_ACTIVATIONS:
        raise _refuse_config(f"activation_function={config.activation_function!r} (llama.cpp's gpt2 graph computes "
                             f"the tanh GELU: {list(GPT2_ACTIVATIONS)})")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if getattr(config, flag, False):
            raise _refuse_config(f"{flag}=True")
    if not getattr(config, "scale_attn_weights", True):
        raise _refuse_config("scale_attn_weights=False")
    h, heads, vocab = config.n_embd, config.n_head, config.vocab_size
    ff = config.n_inner or 4 * h
    weights = {T.TOKEN_EMBD: (vocab, h), T.POS_EMBD: (config.n_positions, h), T.OUTPUT: (vocab, h),
               T.OUTPUT_NORM: (h,), T.ATTN_NORM: (h,), T.ATTN_QKV: (3 * h, h), T.ATTN_OUT: (h, h),
               T.FFN_NORM: (h,), T.FFN_UP: (ff, h), T.FFN_DOWN: (h, ff)}
    hyper = (("context_length", config.n_positions), ("embedding_length", h), ("block_count", config.n_layer),
             ("feed_forward_length", ff), ("head_count", heads), ("layer_norm_eps", float(config.layer_norm_epsilon)),
             ("vocab_size", vocab))
    return _Shape(vocab, config.n_layer, heads, heads, weights, hyper)


@dataclass(frozen=True)
class Architecture:
    """How one Hugging Face decoder maps onto a llama.cpp architecture."""

    arch: Any                 # gguf.MODEL_ARCH
    rope_rows: bool           # llama.cpp rotates adjacent pairs: q/k rows reordered per head (`rope_rows`)
    biases: frozenset         # the gguf.MODEL_TENSOR kinds that may carry a bias
    required: tuple           # the gguf.MODEL_TENSOR kinds the graph needs: whole-model ones, then per block
    per_block: frozenset      # which of them are per block
    shape: Callable[[Any], _Shape] = _llama_shape   # config -> dimensions (refusing what llama.cpp runs otherwise)

    @property
    def name(self) -> str:
        from gguf import MODEL_ARCH_NAMES

        return MODEL_ARCH_NAMES[self.arch]


@functools.cache
def architectures() -> dict[str, Architecture]:
    """Hugging Face architecture (``config.json``'s ``architectures``) -> how it is written."""
    from gguf import MODEL_ARCH
    from gguf import MODEL_TENSOR as T

    llama_block = (T.ATTN_NORM, T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT, T.FFN_NORM, T.FFN_GATE, T.FFN_UP,
                   T.FFN_DOWN)
    llama = (T.TOKEN_EMBD, T.OUTPUT_NORM) + llama_block
    gpt2_block = (T.ATTN_NORM, T.ATTN_QKV, T.ATTN_OUT, T.FFN_NORM, T.FFN_UP, T.FFN_DOWN)
    return {"LlamaForCausalLM": Architecture(MODEL_ARCH.LLAMA, True, frozenset(
                {T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT, T.FFN_GATE, T.FFN_UP, T.FFN_DOWN}), llama,
                frozenset(llama_block)),
            "Qwen2ForCausalLM": Architecture(MODEL_ARCH.QWEN2, False, frozenset({T.ATTN_Q, T.ATTN_K, T.ATTN_V}),
                                             llama, frozenset(llama_block)),
            "GPT2LMHeadModel": Architecture(MODEL_ARCH.GPT2, False, frozenset(
                {T.OUTPUT_NORM, T.ATTN_NORM, T.ATTN_QKV, T.ATTN_OUT, T.FFN_NORM, T.FFN_UP, T.FFN_DOWN}),
                (T.TOKEN_EMBD, T.POS_EMBD, T.OUTPUT_NORM) + gpt2_block, frozenset(gpt2_block), _gpt2_shape)}


def rope_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order llama.cpp's "normal" rope expects: per head, Hugging Face's [first half | second half] of the
    head's rows interleaved into adjacent pairs. ``w_gguf = w_hf[rope_rows(...)]``."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, 2, half).transpose(1, 2).reshape(-1)   # (rows,)


def _conv1d_weight(module: nn.Module, leaf: str, t: torch.Tensor) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2's Linear) stores its weight (in, out): written transposed."""
    return leaf == "weight" and type(module).__name__ == "Conv1D" and t.ndim == 2


# --- the whole model -------------------------------------------------------------------------------------------------

@dataclass
class _Tensor:
    """One tensor of the file, in Hugging Face's row order until `_place` moves it."""

    key: str                   # the Hugging Face state-dict key it comes from
    owner: str                 # the module holding it (named in errors)
    shape: tuple[int, ...]     # its float shape in the model
    data: np.ndarray           # float (rows, ...) or uint8 ggml blocks (rows, bytes)
    block: BlockType | None = None   # the blocks' type; None: float (F32 / F16 as the dtype says)


@dataclass
class Prepared:
    """What `GGUF.write` writes: a filled gguf-py writer (nothing on disk yet; written once) and what went in."""

    writer: Any                                            # gguf.GGUFWriter, path None
    tensors: dict[str, str] = field(default_factory=dict)  # GGUF tensor name -> ggml type name
    layers: dict[str, str] = field(default_factory=dict)   # quantized workbench layer -> ggml type name
    tied: dict[str, str] = field(default_factory=dict)     # Hugging Face key not written -> the key it is tied to
    tokenizer: Path | None = None


@register_export_format
@dataclass(frozen=True)
class GGUF(ExportFormat):
    """A llama.cpp GGUF file (see the module docstring for what each layer becomes)."""

    name: ClassVar[str] = "gguf"
    float_type: FloatType = FloatType.F32   # the layers left in floating point: "f32" or "f16"

    def __post_init__(self):
        try:
            object.__setattr__(self, "float_type", FloatType(self.float_type))
        except ValueError:
            raise ValueError(f"gguf export: float_type must be one of {[t.value for t in FloatType]}, got "
                             f"{self.float_type!r}") from None

    def prepare(self, model: nn.Module, base_folder: Path | None) -> Prepared:
        import gguf

        arch = self._architecture(model)
        shape = arch.shape(model.config)
        if base_folder is not None and (base_folder / "config.json").is_file():
            base_type = json.loads((base_folder / "config.json").read_text()).get("model_type")
            if base_type is not None and base_type != model.config.model_type:
                raise ValueError(f"base_folder {base_folder} holds a {base_type!r} model, the model is a "
                                 f"{model.config.model_type!r}")
        tensors, tied = self._tensors(model)
        placed = self._place(tensors, tied, arch, shape)
        vocabulary = read_vocabulary(tokenizer_file(model, base_folder), shape.vocab)

        writer = gguf.GGUFWriter(path=None, arch=arch.name)
        self._hyper_parameters(writer, model, shape, placed)
        vocabulary.add_to(writer, model.config, chat_template(base_folder))
        for name, t in placed.items():
            writer.add_tensor(name, t.data, raw_dtype=t.block.ggml if t.block else None)
        return Prepared(writer, {n: t.block.ggml.name if t.block else t.data.dtype.name for n, t in placed.items()},
                        {t.owner: t.block.ggml.name for t in placed.values() if t.block is not None}, tied,
                        vocabulary.source)

    @staticmethod
    def _architecture(model: nn.Module) -> Architecture:
        import sys

        transformers = sys.modules.get("transformers")   # a PreTrainedModel exists only if transformers was imported
        supported = sorted(architectures())
        if transformers is None or not isinstance(model, transformers.PreTrainedModel):
            raise TypeError(f"gguf export needs a Hugging Face model of a llama.cpp architecture ({supported}); got a "
                            f"{type(model).__name__}")
        found = architectures().get(type(model).__name__)
        if found is None:
            raise TypeError(f"gguf export writes {supported}; got a {type(model).__name__}")
        return found

    def _tensors(self, model: nn.Module) -> tuple[list[_Tensor], dict[str, str]]:
        """Every stored tensor of the model, quantized layers as ggml blocks; tied copies once (the first)."""
        out: list[_Tensor] = []
        seen: dict[int, str] = {}   # id of a stored weight -> the first key holding it
        tied: dict[str, str] = {}

        def once(key: str, t: torch.Tensor) -> bool:
            if id(t) in seen:
                tied[key] = seen[id(t)]
                return False
            seen[id(t)] = key
            return True

        for name, module in model.named_modules():
            encode = LAYER_ENCODERS.get(type(module))
            if encode is not None:
                key = f"{name}.weight"
                blocks, block = encode(name, module)   # (refuses first; a tied copy is encoded and dropped)
                if once(key, module.qweight):
                    out.append(_Tensor(key, name, tuple(module.weight_shape), blocks, block))
                floats = {"bias": module._parameters.get("bias")}
            elif _made_by_workbench(module):
                raise _refuse(name, f"is a {type(module).__name__} ({type(module).__module__}), which GGUF cannot "
                                    f"hold")
            else:
                floats = {**module._parameters, **{k: b for k, b in module._buffers.items()
                                                   if k not in module._non_persistent_buffers_set}}
            for leaf, t in floats.items():
                key = f"{name}.{leaf}" if name else leaf
                if t is not None and once(key, t):
                    if _conv1d_weight(module, leaf, t):
                        t = t.t()
                    out.append(_Tensor(key, name, tuple(t.shape), self._float(t)))
        return out, tied

    def _float(self, t: torch.Tensor) -> np.ndarray:
        t = t.detach().cpu()
        if t.ndim >= 2 and self.float_type is FloatType.F16:
            return t.to(torch.float16).numpy()                 # (rows, K)
        return t.to(torch.float32).numpy()                     # norms and biases: always F32

    @staticmethod
    def _place(tensors: list[_Tensor], tied: dict[str, str], arch: Architecture, shape: _Shape) -> dict[str, _Tensor]:
        """GGUF name -> tensor, in llama.cpp's row order; refuses what the architecture's graph has no place for."""
        import gguf
        from gguf import MODEL_TENSOR as T

        names = gguf.TensorNameMap(arch.arch, shape.layers)
        expected = shape.weights
        heads = {T.ATTN_Q: shape.heads, T.ATTN_K: shape.kv_heads}
        placed: dict[str, _Tensor] = {}
        for t in tensors:
            found = names.get_type_and_name(t.key, try_suffixes=(".weight", ".bias"))
            bias = t.key.endswith(".bias")
            if found is None or found[0] not in expected or (bias and found[0] not in arch.biases):
                raise _refuse(t.owner, f"holds {t.key!r}, which llama.cpp's {arch.name} graph has no tensor for")
            kind, name = found
            want = expected[kind][:1] if bias else expected[kind]
            if t.shape != want:
                raise _refuse(t.owner, f"has {t.key!r} of shape {t.shape}; the config's dimensions give {want} (its "
                                       f"structure changed, which llama.cpp cannot read)")
            if arch.rope_rows and kind in heads:
                t.data = t.data[rope_rows(t.shape[0], heads[kind]).numpy()]   # whole rows: (rows, ...) reordered
            placed[name] = t
        for key, source in tied.items():
            kinds = [names.get_type(k, try_suffixes=(".weight",)) for k in (key, source)]
            if kinds != [T.OUTPUT, T.TOKEN_EMBD]:
                raise _refuse(key.rpartition(".")[0], f"holds {key!r} tied to {source!r}; llama.cpp shares only the "
                                                      f"output head with the token embedding")
        required = [gguf.TENSOR_NAMES[k] for k in arch.required if k not in arch.per_block] + [
            gguf.TENSOR_NAMES[k].format(bid=i) for i in range(shape.layers) for k in arch.required
            if k in arch.per_block]
        if not tied:
            required.append(gguf.TENSOR_NAMES[T.OUTPUT])
        missing = [n + ".weight" for n in required if n + ".weight" not in placed]
        if missing:
            raise ValueError(f"gguf export: the model has no tensor for {missing[:3]} (of {len(missing)} missing); "
                             f"llama.cpp's {arch.name} graph needs them")
        return placed

    def _hyper_parameters(self, writer, model: nn.Module, shape: _Shape, placed: dict[str, _Tensor]) -> None:
        import importlib.metadata

        import gguf

        import workbench
        from workbench.models import source_of

        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(source_of(model) or Path(getattr(model.config, "_name_or_path", "") or "").name
                        or type(model).__name__)
        for key, value in shape.hyper:
            getattr(writer, f"add_{key}")(value)
        writer.add_file_type(self._file_type(placed))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_string("general.producer", f"workbench {workbench.__version__}")
        writer.add_string("general.producer.gguf_py", importlib.metadata.version("gguf"))
        writer.add_string("general.producer.plans", json.dumps([p.to_dict() for p in applied_plans(model)]))

    # --- the nearest grid GGUF holds, for a layer it cannot hold as it is (`workbench.export.fit`) -------------------

    def nearest(self, name: str, module: nn.Module):
        """None where a block type holds the layer as it is; else the symmetric block-32 grid of Q4_0 (2-, 3- and
        4-bit codes, NF4) or Q8_0 (8-bit codes, FP8, W8A8 weights); refuses rows that are not whole blocks and layers
        that are not quantized weights (pruned, low-rank, cast)."""
        from workbench.export.fit import holds_as_is, weight_grid
        from workbench.quantization.configs import WeightOnly

        encode = LAYER_ENCODERS.get(type(module))
        if encode is None:
            if _made_by_workbench(module) and not type(module).__module__.startswith("workbench.models"):
                raise _refuse(name, f"is a {type(module).__name__} ({type(module).__module__}), which GGUF cannot "
                                    f"hold; it is not a quantized weight, so re-quantizing it cannot help")
            return None
        K = module.weight.shape[1]   # (the drop-in weight's metadata: nothing decoded)
        if K % BLOCK:
            raise _refuse(name, f"has rows of {K} values, not whole ggml blocks of {BLOCK}, so no block type holds "
                                f"it however it is quantized - keep it in floating point (a plan entry "
                                f"{{{name!r}: None}})")
        if holds_as_is(encode, name, module):
            return None
        return WeightOnly(bits=4 if weight_grid(module).bits <= 4 else 8, group_size=BLOCK)

    def _file_type(self, placed: dict[str, _Tensor]):
        """The block type holding the most values (llama.cpp's "mostly Q4_0" ...); all float: F32 or F16."""
        from gguf import LlamaFileType

        counts: dict[Any, int] = {}
        for t in placed.values():
            if t.block is not None:
                counts[t.block.file_type] = counts.get(t.block.file_type, 0) + int(np.prod(t.shape))
        if counts:
            return max(counts, key=counts.__getitem__)
        return LlamaFileType.MOSTLY_F16 if self.float_type is FloatType.F16 else LlamaFileType.ALL_F32

    def write(self, prepared: Prepared, folder: Path) -> None:
        writer = prepared.writer
        try:
            writer.write_header_to_file(folder / FILE_NAME)
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
