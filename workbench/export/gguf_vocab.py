"""The vocabulary of a GGUF file: a Hugging Face byte-level BPE (``tokenizer.json``) as ``tokenizer.ggml.*``.

llama.cpp loads no model without its vocabulary. A GPT-2-style byte-level BPE (model ``BPE`` without byte fallback,
no normalizer, a ``ByteLevel`` pre-tokenizer with GPT-2's split regex and no prefix space) is written as
``tokenizer.ggml.model = "gpt2"``, ``pre = "gpt-2"``: every id's token in id order (ids the tokenizer lacks as unused
``[PAD<i>]``), token types (special added tokens CONTROL, other added tokens USER_DEFINED), the merges as
``"left right"`` in rank order, and whether the post-processor adds a bos / eos token. Other tokenizers (WordPiece,
SentencePiece, byte-fallback BPE, Llama-3-style split regexes) are refused: llama.cpp would split text differently.

Where it comes from (`tokenizer_file`): ``base_folder/tokenizer.json``, or, for a zoo model, the zoo's own.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from torch import nn

__all__ = ["Vocabulary", "read_vocabulary", "tokenizer_file", "chat_template"]


@dataclass(frozen=True)
class Vocabulary:
    """A byte-level BPE tokenizer as GGUF stores it (``tokenizer.ggml.*``)."""

    tokens: list[str]   # every id of the model's vocabulary in id order ("[PAD<i>]" where the tokenizer has none)
    types: list[int]    # gguf.TokenType per token
    merges: list[str]   # "left right", in rank order
    add_bos: bool
    add_eos: bool
    source: Path
    pre: str = "gpt-2"  # llama.cpp's pre-tokenizer: GPT-2's split regex

    def add_to(self, writer, config, chat_template: str | None = None) -> None:
        """Record the vocabulary in a `gguf.GGUFWriter`, with the bos / eos / padding ids of the model's ``config``."""
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        writer.add_token_merges(self.merges)
        for attr, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                          ("pad_token_id", writer.add_pad_token_id)):
            value = getattr(config, attr, None)
            value = value[0] if isinstance(value, (list, tuple)) and value else value   # several eos: the first
            if isinstance(value, int):
                if not 0 <= value < len(self.tokens):
                    raise ValueError(f"gguf export: config.{attr} = {value} is outside the vocabulary "
                                     f"({len(self.tokens)} tokens)")
                add(value)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(self.add_eos)
        if chat_template:
            writer.add_chat_template(chat_template)


def _template_ends(post: dict) -> tuple[bool, bool]:
    """(adds a special token first, adds one last) for a single sequence, from tokenizer.json's post_processor."""
    processors = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    for p in processors:
        if p.get("type") == "TemplateProcessing" and p.get("single"):
            single = p["single"]
            return "SpecialToken" in single[0], "SpecialToken" in single[-1]
    return False, False


def read_vocabulary(path: Path, vocab_size: int) -> Vocabulary:
    """The byte-level BPE in ``path`` (a tokenizer.json) for a model of ``vocab_size`` ids; ValueError for any other
    kind of tokenizer (llama.cpp's "gpt-2" pre-tokenizer would split the text differently)."""
    from gguf import TokenType

    spec = json.loads(Path(path).read_text(encoding="utf-8"))
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    byte_level = (model.get("type") == "BPE" and not model.get("byte_fallback") and spec.get("normalizer") is None
                  and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"))
    if not byte_level:
        raise ValueError(f"gguf export: the tokenizer {path} is not a GPT-2-style byte-level BPE (model "
                         f"{model.get('type')!r}, byte_fallback {model.get('byte_fallback')}, normalizer "
                         f"{(spec.get('normalizer') or {}).get('type')!r}, pre-tokenizer {pre.get('type')!r}); this "
                         f"exporter writes byte-level BPE vocabularies only (tokenizer.ggml.model 'gpt2', pre 'gpt-2')")
    ids = {i: t for t, i in model["vocab"].items()}                  # id -> token
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    ids.update({i: a["content"] for i, a in added.items()})
    if max(ids) >= vocab_size:
        raise ValueError(f"gguf export: the tokenizer {path} has ids up to {max(ids)}, the model's vocabulary only "
                         f"{vocab_size}: not this model's tokenizer")
    tokens = [ids.get(i, f"[PAD{i}]") for i in range(vocab_size)]

    def kind(i: int) -> int:
        if i not in ids:
            return TokenType.UNUSED
        if i in added:
            return TokenType.CONTROL if added[i].get("special") else TokenType.USER_DEFINED
        return TokenType.NORMAL

    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    add_bos, add_eos = _template_ends(spec.get("post_processor") or {})
    return Vocabulary(tokens, [int(kind(i)) for i in range(vocab_size)], merges, add_bos, add_eos, Path(path))


def _zoo_tokenizers() -> dict[str, Path]:
    """Zoo model name -> its tokenizer.json."""
    from workbench.models import llama
    from workbench.paths import data_dir

    return {"tiny-llama": data_dir() / llama.TOKENIZER_FILE}


def tokenizer_file(model: nn.Module, base_folder: Path | None) -> Path:
    """The tokenizer.json of ``model``: ``base_folder``'s, else the zoo's for a zoo model; ValueError without one."""
    from workbench.models import source_of

    if base_folder is not None:
        if (base_folder / "tokenizer.json").is_file():
            return base_folder / "tokenizer.json"
        raise ValueError(f"gguf export: base_folder {base_folder} has no tokenizer.json; GGUF holds the vocabulary "
                         f"(llama.cpp loads no model without it)")
    found = _zoo_tokenizers().get(source_of(model) or "")
    if found is None:
        raise ValueError("gguf export needs the model's vocabulary (llama.cpp loads no model without it): pass "
                         "base_folder=<the checkpoint folder, with its tokenizer.json>")
    return found


def chat_template(base_folder: Path | None) -> str | None:
    """``base_folder``'s chat template (chat_template.jinja, or tokenizer_config.json's ``chat_template``), if any."""
    if base_folder is None:
        return None
    if (base_folder / "chat_template.jinja").is_file():
        return (base_folder / "chat_template.jinja").read_text(encoding="utf-8")
    config = base_folder / "tokenizer_config.json"
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template") if config.is_file() else None
    return template if isinstance(template, str) else None
