"""The vocabulary of a GGUF file: a Hugging Face byte-level BPE (``tokenizer.json``) as ``tokenizer.ggml.*``.

llama.cpp loads no model without its vocabulary. A byte-level BPE (model ``BPE`` without byte fallback, dropout or
sub-word affixes) is written as ``tokenizer.ggml.model = "gpt2"``: every id's token in id order (ids the tokenizer
lacks as unused ``[PAD<i>]``), token types (special added tokens CONTROL, other added tokens USER_DEFINED), the
merges as ``"left right"`` in rank order, and whether the post-processor adds a bos / eos token.

llama.cpp does not read the tokenizer's split regex from the file: ``tokenizer.ggml.pre`` names one it has built in.
So the pre-tokenizer is recognised by what tokenizer.json says - the split regex, exactly as written there (GPT-2's
is the one ``ByteLevel(use_regex=true)`` applies; the others come as ``Split(Regex, "Isolated", invert=false)``
followed by ``ByteLevel(use_regex=false)``), never a prefix space - together with the rest of what llama.cpp's
tokenizer for that name does (`PRE_TOKENIZERS`):

| ``pre`` | split regex | ``ignore_merges`` | normalizer | checkpoints |
|---|---|---|---|---|
| ``gpt-2`` | `GPT2_REGEX` | false | none | GPT-2, tiny-llama |
| ``llama-bpe`` | `LLAMA3_REGEX` (case-insensitive contractions, digits in runs of 1-3) | true | none | Llama-3 / 3.x |
| ``qwen2`` | `QWEN2_REGEX` (as Llama-3's, single digits) | false | none or NFC | Qwen2 / Qwen2.5 |

``ignore_merges``: a word found whole in the vocabulary is one token, merges or not (llama.cpp does this for
``llama-bpe`` only). llama.cpp normalizes nothing: Qwen2's NFC changes only text that is not already in NFC
(decomposed accents), which llama.cpp tokenizes as written - as it does for llama.cpp's own conversion of Qwen2.
Anything else (WordPiece, SentencePiece, byte-fallback BPE, another split regex, a prefix space) is refused, naming
what was found: llama.cpp would split the text differently.

Where it comes from (`tokenizer_file`): ``base_folder/tokenizer.json``, or, for a zoo model, the zoo's own.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from torch import nn

__all__ = ["Vocabulary", "PreTokenizer", "PRE_TOKENIZERS", "read_vocabulary", "tokenizer_file", "chat_template"]

# The split regexes as tokenizer.json holds them (facts of the tokenizers: GPT-2's is the one the tokenizers
# library's ByteLevel pre-tokenizer applies; Llama-3's and Qwen2's are their checkpoints' Split patterns).
GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


@dataclass(frozen=True)
class PreTokenizer:
    """One of llama.cpp's built-in pre-tokenizers, as the tokenizer.json it reproduces describes it."""

    name: str                           # tokenizer.ggml.pre
    regex: str                          # the split regex, exactly as tokenizer.json writes it
    ignore_merges: bool                 # llama.cpp's BPE takes a word found whole in the vocabulary as one token
    normalizers: frozenset[str | None]  # tokenizer.json normalizer types (None: none) its text is tokenized under

    def describe(self) -> str:
        """What it is, for error messages."""
        normalizers = " or ".join(str(n) for n in sorted(self.normalizers, key=str))
        return (f"pre {self.name!r}: split regex {self.regex!r}, ignore_merges {self.ignore_merges}, "
                f"normalizer {normalizers}")


PRE_TOKENIZERS: dict[str, PreTokenizer] = {p.regex: p for p in (
    PreTokenizer("gpt-2", GPT2_REGEX, False, frozenset({None})),
    PreTokenizer("llama-bpe", LLAMA3_REGEX, True, frozenset({None})),
    PreTokenizer("qwen2", QWEN2_REGEX, False, frozenset({None, "NFC"})),
)}


@dataclass(frozen=True)
class Vocabulary:
    """A byte-level BPE tokenizer as GGUF stores it (``tokenizer.ggml.*``)."""

    tokens: list[str]   # every id of the model's vocabulary in id order ("[PAD<i>]" where the tokenizer has none)
    types: list[int]    # gguf.TokenType per token
    merges: list[str]   # "left right", in rank order
    add_bos: bool
    add_eos: bool
    source: Path
    pre: str = "gpt-2"  # llama.cpp's pre-tokenizer (`PRE_TOKENIZERS`)

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


def _steps(pre: dict) -> list[dict]:
    """tokenizer.json's ``pre_tokenizer`` as the list of pre-tokenizers it applies in turn."""
    return (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre] if pre else []


def _split_regex(pre: dict) -> str | None:
    """The regex tokenizer.json's ``pre_tokenizer`` splits text with before the byte-level mapping, when it is a
    byte-level BPE's: ``ByteLevel`` with its built-in regex (GPT-2's), or one ``Split`` (a regex, "Isolated", not
    inverted) then ``ByteLevel`` without its regex; neither adding a prefix space. None for anything else."""
    steps = _steps(pre)
    if not steps or steps[-1].get("type") != "ByteLevel" or steps[-1].get("add_prefix_space"):
        return None
    if len(steps) == 1:
        return GPT2_REGEX if steps[0].get("use_regex", True) else None
    split, pattern = steps[0], steps[0].get("pattern") or {}
    if (len(steps) == 2 and split.get("type") == "Split" and split.get("behavior") == "Isolated"
            and not split.get("invert") and isinstance(pattern.get("Regex"), str)
            and not steps[1].get("use_regex", True)):
        return pattern["Regex"]
    return None


def _describe(pre: dict) -> str:
    """tokenizer.json's ``pre_tokenizer`` in a few words, for error messages."""
    parts = []
    for s in _steps(pre):
        args = {k: v for k, v in s.items() if k in ("pattern", "behavior", "invert", "use_regex", "add_prefix_space")}
        parts.append(f"{s.get('type')}({', '.join(f'{k}={v!r}' for k, v in args.items())})")
    return " + ".join(parts) or "none"


def _supported() -> str:
    return "; ".join(p.describe() for p in PRE_TOKENIZERS.values())


def read_vocabulary(path: Path, vocab_size: int) -> Vocabulary:
    """The byte-level BPE in ``path`` (a tokenizer.json) for a model of ``vocab_size`` ids, with the llama.cpp
    pre-tokenizer its split regex is (`PRE_TOKENIZERS`); ValueError for any other tokenizer (llama.cpp would split
    the text differently)."""
    from gguf import TokenType

    spec = json.loads(Path(path).read_text(encoding="utf-8"))
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    normalizer = (spec.get("normalizer") or {}).get("type")
    regex = _split_regex(pre)
    byte_level = (model.get("type") == "BPE" and not model.get("byte_fallback") and not model.get("dropout")
                  and not model.get("continuing_subword_prefix") and not model.get("end_of_word_suffix"))
    if not byte_level or regex is None:
        raise ValueError(f"gguf export: the tokenizer {path} is not a GPT-2-style byte-level BPE (model "
                         f"{model.get('type')!r}, byte_fallback {model.get('byte_fallback')}, normalizer "
                         f"{normalizer!r}, pre-tokenizer {_describe(pre)}); this exporter writes byte-level BPE "
                         f"vocabularies (tokenizer.ggml.model 'gpt2') with the pre-tokenizers llama.cpp has built in: "
                         f"{_supported()}")
    scheme = PRE_TOKENIZERS.get(regex)
    if scheme is None:
        raise ValueError(f"gguf export: the tokenizer {path} splits text with the regex {regex!r} (pre-tokenizer "
                         f"{_describe(pre)}), which is none of the llama.cpp pre-tokenizers this exporter writes: "
                         f"{_supported()}; llama.cpp would split the text differently")
    ignore_merges = bool(model.get("ignore_merges", False))
    if ignore_merges != scheme.ignore_merges or normalizer not in scheme.normalizers:
        raise ValueError(f"gguf export: the tokenizer {path} has the split regex of llama.cpp's {scheme.name!r} "
                         f"pre-tokenizer but ignore_merges {ignore_merges} and normalizer {normalizer!r}; llama.cpp "
                         f"tokenizes as {scheme.describe()}: it would give other ids")
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
    return Vocabulary(tokens, [int(kind(i)) for i in range(vocab_size)], merges, add_bos, add_eos, Path(path),
                      scheme.name)


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
