"""The vocabulary of a GGUF file: a Hugging Face BPE (``tokenizer.json``), byte-level or SentencePiece-style, as
``tokenizer.ggml.*``.

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
Anything else (WordPiece, Unigram, another split regex, a prefix space) is refused, naming what was found: llama.cpp
would split the text differently.

A SentencePiece-style BPE (Llama-2, Mistral-7B, TinyLlama, Gemma: model ``BPE`` with ``byte_fallback``, ``<0x00>`` ..
``<0xFF>`` byte tokens, spaces written as ``▁`` by the normalizer) is written as ``tokenizer.ggml.model = "llama"``,
llama.cpp's SPM tokenizer (`SentencePieceVocabulary`): tokens, a score per token, token types (``<0xNN>`` BYTE, the
unk token UNKNOWN, special added tokens CONTROL, other added tokens USER_DEFINED), the unk id and
``add_space_prefix``. llama.cpp's SPM tokenizer ignores merges: it starts from the text's characters (spaces as ``▁``,
one prepended if ``add_space_prefix``) and repeatedly joins the adjacent pair whose concatenation is a token with the
highest score (the leftmost among equals), then writes symbols that are no token as their bytes' ``<0xNN>``. The
tokenizers library's BPE joins the adjacent pair with the lowest merge rank (the leftmost among equals). So the score
of a token is minus the rank of the first merge that makes it (tokens no merge makes: 0.0, never compared), and the
two agree where the merges are what transformers derives from a SentencePiece vocabulary (`spm_scores` checks,
refusing otherwise):

- complete: every split of a token into two tokens (or single characters) is a merge - llama.cpp joins any such
  pair, a BPE only its merges (a BPE trained by the tokenizers library is not: refused);
- grouped: the merges making one token are consecutive in rank order - a token has one score.

Then both join the same pairs in the same order but for one case, not checked: where pairs making one token by
different merges are pending at once, llama.cpp joins the leftmost first, the BPE the lower-ranked; this changes
the result only where such pairs overlap (``x + y == y + z``, a periodic token such as ``▁▁▁``, which the BPE's own
leftmost-first merging does not reach for runs of one character) or a merge with the new token reaches the other
pair. (llama.cpp's own converter, from tokenizer.json alone, writes -1000.0 for every
score: its SPM tokenizer then joins the leftmost pair that makes a token, which is not the BPE's tokenization.)

The layouts recognised (`SPM_LAYOUTS`), exactly as tokenizer.json writes them, all with no pre-tokenizer (Gemma's
``Split(" ", MergedWithPrevious)`` sees no space left after its normalizer: no pre-tokenizer either):

| layout | normalizer | decoder | ``add_space_prefix`` | checkpoints |
|---|---|---|---|---|
| ``llama`` | ``Prepend("▁")``, ``Replace(" ", "▁")`` | D, ``Strip(" ", 1, 0)`` | true | Llama-2, Mistral, TinyLlama |
| ``llama-no-prefix`` | ``Replace(" ", "▁")`` in a Sequence | D | false | ``add_prefix_space=False`` |
| ``gemma`` | ``Replace(" ", "▁")`` | D | false | Gemma |

(D: ``Replace("▁", " ")``, ``ByteFallback``, ``Fuse``.)

Refused, naming what was found: a ``Metaspace`` pre-tokenizer (``legacy=False`` conversions: it prepends no ``▁`` to
a text that starts with a space, llama.cpp does), other normalizers, pre-tokenizers or decoders, ``ignore_merges``,
dropout, affixes, no unk token, a byte without its ``<0xNN>`` token (Gemma's ``\t`` for ``<0x09>`` is the byte
itself: llama.cpp takes it too). The scores come from tokenizer.json alone; tokenizer.model is not read (its
SentencePiece scores give SentencePiece's tokenization, the tokenizers library's may differ).

Where it comes from (`tokenizer_file`): ``base_folder/tokenizer.json``, or, for a zoo model, the zoo's own.
"""
from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import nn

__all__ = ["Vocabulary", "PreTokenizer", "PRE_TOKENIZERS", "SentencePieceVocabulary", "SpmLayout", "SPM_LAYOUTS",
           "spm_scores", "read_vocabulary", "tokenizer_file", "chat_template"]

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
        _add_ends(writer, config, len(self.tokens), self.add_bos, self.add_eos, chat_template)


def _add_ends(writer, config, n_tokens: int, add_bos: bool, add_eos: bool, chat_template: str | None) -> None:
    """What every vocabulary records: the bos / eos / padding ids of ``config``, whether to add bos / eos, the chat
    template."""
    for attr, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                      ("pad_token_id", writer.add_pad_token_id)):
        value = getattr(config, attr, None)
        value = value[0] if isinstance(value, (list, tuple)) and value else value   # several eos: the first
        if isinstance(value, int):
            if not 0 <= value < n_tokens:
                raise ValueError(f"gguf export: config.{attr} = {value} is outside the vocabulary "
                                 f"({n_tokens} tokens)")
            add(value)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    if chat_template:
        writer.add_chat_template(chat_template)


SPACE = "\u2581"   # "▁": how SentencePiece writes a space
_SPACE_TO_MARK = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
_MARK_TO_SPACE = {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}
_DECODE = [_MARK_TO_SPACE, {"type": "ByteFallback"}, {"type": "Fuse"}]


@dataclass(frozen=True)
class SpmLayout:
    """How a SentencePiece-style tokenizer.json writes spaces as ``▁``: its normalizer, pre-tokenizer and decoder,
    exactly as tokenizer.json holds them, and the llama.cpp ``add_space_prefix`` that tokenizes the same way."""

    name: str
    normalizer: dict | None
    pre_tokenizers: tuple[dict | None, ...]   # any of these
    decoder: dict
    add_space_prefix: bool


_GEMMA_SPLIT = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}
SPM_LAYOUTS: tuple[SpmLayout, ...] = (
    SpmLayout("llama", {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, _SPACE_TO_MARK]},
              (None,), {"type": "Sequence", "decoders": _DECODE + [
                  {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}, True),
    SpmLayout("llama-no-prefix", {"type": "Sequence", "normalizers": [_SPACE_TO_MARK]}, (None,),
              {"type": "Sequence", "decoders": _DECODE}, False),
    SpmLayout("gemma", _SPACE_TO_MARK, (None, _GEMMA_SPLIT), {"type": "Sequence", "decoders": _DECODE}, False),
)


@dataclass(frozen=True)
class SentencePieceVocabulary:
    """A SentencePiece-style byte-fallback BPE as GGUF stores it for llama.cpp's SPM tokenizer (``tokenizer.ggml.*``
    with ``model = "llama"``)."""

    tokens: list[str]    # every id of the model's vocabulary in id order ("[PAD<i>]" where the tokenizer has none)
    scores: list[float]  # `spm_scores`
    types: list[int]     # gguf.TokenType per token
    unk: int
    add_space_prefix: bool
    add_bos: bool
    add_eos: bool
    source: Path
    layout: str          # `SpmLayout.name`

    def add_to(self, writer, config, chat_template: str | None = None) -> None:
        """Record the vocabulary in a `gguf.GGUFWriter`, with the bos / eos / padding ids of the model's ``config``."""
        writer.add_tokenizer_model("llama")
        writer.add_token_list(self.tokens)
        writer.add_token_scores(self.scores)
        writer.add_token_types(self.types)
        writer.add_unk_token_id(self.unk)
        writer.add_add_space_prefix(self.add_space_prefix)
        _add_ends(writer, config, len(self.tokens), self.add_bos, self.add_eos, chat_template)


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


def read_vocabulary(path: Path, vocab_size: int) -> Vocabulary | SentencePieceVocabulary:
    """The BPE in ``path`` (a tokenizer.json) for a model of ``vocab_size`` ids: a byte-level one with the llama.cpp
    pre-tokenizer its split regex is (`PRE_TOKENIZERS`), or a SentencePiece-style one with byte fallback
    (`SPM_LAYOUTS`); ValueError for any other tokenizer (llama.cpp would split the text differently)."""
    from gguf import TokenType

    spec = json.loads(Path(path).read_text(encoding="utf-8"))
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        return _read_sentencepiece(Path(path), spec, vocab_size)
    normalizer = (spec.get("normalizer") or {}).get("type")
    regex = _split_regex(pre)
    byte_level = (model.get("type") == "BPE" and not model.get("byte_fallback") and not model.get("dropout")
                  and not model.get("continuing_subword_prefix") and not model.get("end_of_word_suffix"))
    if not byte_level or regex is None:
        raise ValueError(f"gguf export: the tokenizer {path} is not a GPT-2-style byte-level BPE (model "
                         f"{model.get('type')!r}, byte_fallback {model.get('byte_fallback')}, normalizer "
                         f"{normalizer!r}, pre-tokenizer {_describe(pre)}); this exporter writes byte-level BPE "
                         f"vocabularies (tokenizer.ggml.model 'gpt2') with the pre-tokenizers llama.cpp has built in: "
                         f"{_supported()}; or SentencePiece-style BPEs with byte_fallback (tokenizer.ggml.model "
                         f"'llama'): {_spm_supported()}")
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
    ids, added, tokens = _tokens(path, spec, vocab_size)

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


def _tokens(path: Path, spec: dict, vocab_size: int) -> tuple[dict[int, str], dict[int, dict], list[str]]:
    """(id -> token, id -> added token's entry, every id's token in id order with "[PAD<i>]" for ids it lacks)."""
    ids = {i: t for t, i in spec["model"]["vocab"].items()}          # id -> token
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    ids.update({i: a["content"] for i, a in added.items()})
    if max(ids) >= vocab_size:
        raise ValueError(f"gguf export: the tokenizer {path} has ids up to {max(ids)}, the model's vocabulary only "
                         f"{vocab_size}: not this model's tokenizer")
    return ids, added, [ids.get(i, f"[PAD{i}]") for i in range(vocab_size)]


def spm_scores(vocab: Collection[str], merges: Sequence[tuple[str, str]],
               skip: Collection[str] = ()) -> dict[str, float]:
    """The score of each token a merge makes, for llama.cpp's SPM tokenizer to tokenize as the BPE of ``merges``
    (rank order) over ``vocab`` does: minus the rank of the token's first merge. ValueError where no scores do (the
    merges are not complete and grouped: the module docstring). ``skip``: tokens the BPE never meets inside a
    text (added tokens, split off before it), with the tokens containing them."""
    if len(merges) > 2 ** 24:
        raise ValueError(f"{len(merges)} merges: a float32 score holds ranks up to 2**24 exactly")
    first: dict[str, int] = {}   # token -> rank of its first merge
    for rank, (left, right) in enumerate(merges):
        token = left + right
        if token in first and merges[rank - 1][0] + merges[rank - 1][1] != token:
            raise ValueError(f"the merges making {token!r} are not consecutive (ranks {first[token]} and {rank}, "
                             f"others between): llama.cpp gives a token one score")
        first.setdefault(token, rank)
    pairs, known, skipped = set(merges), set(vocab), set(skip)
    for token in known - skipped:
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            pieces = (left in known or len(left) == 1) and (right in known or len(right) == 1)
            if pieces and (left, right) not in pairs and left not in skipped and right not in skipped:
                raise ValueError(f"{left!r} + {right!r} makes the token {token!r} but is no merge: llama.cpp's SPM "
                                 f"tokenizer joins any two pieces that make a token, the BPE only its merges")
    return {token: -float(rank) for token, rank in first.items()}


def _spm_supported() -> str:
    return "; ".join(f"{layout.name!r} (normalizer {json.dumps(layout.normalizer, ensure_ascii=False)}, "
                     f"pre-tokenizer {' or '.join(json.dumps(p) for p in layout.pre_tokenizers)}, decoder "
                     f"{json.dumps(layout.decoder, ensure_ascii=False)})" for layout in SPM_LAYOUTS)


def _read_sentencepiece(path: Path, spec: dict, vocab_size: int) -> SentencePieceVocabulary:
    """`read_vocabulary` for a BPE with byte fallback: a SentencePiece-style vocabulary for llama.cpp's SPM
    tokenizer, with `spm_scores`; ValueError for anything the module docstring does not list."""
    import re

    from gguf import TokenType

    model = spec["model"]
    normalizer, pre, decoder = spec.get("normalizer"), spec.get("pre_tokenizer"), spec.get("decoder")
    layout = next((lay for lay in SPM_LAYOUTS if normalizer == lay.normalizer and pre in lay.pre_tokenizers
                   and decoder == lay.decoder), None)
    if layout is None:
        found = ", ".join(f"{what} {json.dumps(part, ensure_ascii=False)}" for what, part in
                          (("normalizer", normalizer), ("pre-tokenizer", pre), ("decoder", decoder)))
        raise ValueError(f"gguf export: the tokenizer {path} is a BPE with byte fallback but not a SentencePiece-style "
                         f"one this exporter writes for llama.cpp's SPM tokenizer ({found}); llama.cpp writes spaces "
                         f"as '\u2581', prepending one or not (add_space_prefix), and nothing else - the layouts it "
                         f"tokenizes as: {_spm_supported()}")
    vocab: dict[str, int] = model["vocab"]
    problems = [f"{key} {model[key]!r}" for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix",
                                                     "ignore_merges") if model.get(key)]
    if model.get("unk_token") not in vocab:
        problems.append(f"unk_token {model.get('unk_token')!r} not in the vocabulary (llama.cpp needs an unknown id)")
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab and not (b < 0x80 and chr(b) in vocab)]
    if missing:
        problems.append(f"no byte token for {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    if problems:
        raise ValueError(f"gguf export: the tokenizer {path} is a SentencePiece-style BPE ({layout.name!r}) but has "
                         f"{'; '.join(problems)}: llama.cpp's SPM tokenizer would give other ids")
    ids, added, tokens = _tokens(path, spec, vocab_size)
    pairs = [m.split(" ") if isinstance(m, str) else m for m in model.get("merges", [])]
    merges = [(left, right) for left, right in pairs]
    try:
        scores = spm_scores(vocab, merges, {a["content"] for a in added.values()})
    except ValueError as e:
        raise ValueError(f"gguf export: the tokenizer {path} is a SentencePiece-style BPE ({layout.name!r}) whose "
                         f"merges llama.cpp's SPM tokenizer cannot follow with scores: {e}") from None
    unk = vocab[model["unk_token"]]

    def kind(i: int) -> int:
        if i not in ids:
            return TokenType.UNUSED
        if i == unk:
            return TokenType.UNKNOWN
        if i in added:
            return TokenType.CONTROL if added[i].get("special") else TokenType.USER_DEFINED
        return TokenType.BYTE if re.fullmatch(r"<0x[0-9A-F]{2}>", ids[i]) else TokenType.NORMAL

    add_bos, add_eos = _template_ends(spec.get("post_processor") or {})
    return SentencePieceVocabulary(tokens, [scores.get(t, 0.0) if i in ids else 0.0 for i, t in enumerate(tokens)],
                                   [int(kind(i)) for i in range(vocab_size)], unk, layout.add_space_prefix, add_bos,
                                   add_eos, path, layout.name)


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
