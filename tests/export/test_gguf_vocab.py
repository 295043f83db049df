"""The GGUF vocabulary (`workbench.export.gguf_vocab`): byte-level BPE tokenizer.json files with GPT-2's, Llama-3's
and Qwen2's pre-tokenizers, written as tokenizer.ggml.* with llama.cpp's pre-tokenizer name, and - decisively -
llama.cpp's own tokenizer (llama-cpp-python), built from the file alone, gives exactly the ids of the `tokenizers`
library on texts where the pre-tokenizers disagree (contractions in capitals, digit runs, unicode, runs of spaces,
newlines, punctuation). A file written with a wrong pre name is seen to give other ids (so the check can fail), and
what llama.cpp would tokenize otherwise is refused.

The tokenizers are tiny byte-level BPEs trained here (a few hundred generated sentences, ~700 tokens), each with its
own pre-tokenizer as the real checkpoints' tokenizer.json have it: GPT-2's ``ByteLevel``; Llama-3's ``Split`` regex
then ``ByteLevel(use_regex=false)``, ``ignore_merges``, a bos added by the post-processor; Qwen2's regex, NFC, a
non-special added token.
"""
import dataclasses
import json
import random

import pytest
import torch

import workbench as wb
from workbench.export import gguf_vocab
from workbench.export.gguf_vocab import GPT2_REGEX, LLAMA3_REGEX, QWEN2_REGEX

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB = 720   # the models' vocabulary: the tokenizers' ids (< 705) and unused padding after them
# a word the Llama-3-style vocabulary holds whole although no merge makes it: ignore_merges decides its ids
WHOLE_WORD = " zyzzyva"

TEXTS = [
    "I'M sure you DON'T know, but we're fine; they'll go and she'd say it's HE'S or He'Ll.",
    "Call 1234567 or 555-0199 at 10:30pm; pi is 3.14159, the year 2024, then 99999999999.",
    "Unicode: naïve café, Größe, ĳ, 日本語のテキスト, Ωmega, emoji 🙂👍🏽 and ½ ⅻ ٣٤٥.",
    "multiple   spaces\tand\ttabs  \n\n  newlines\r\nend   ",
    "Punctuation!!! ... ??? (brackets) [x] {y} \"quotes\" — dashes – ‘curly’ ’s #hash @at $5.00",
    "\n\n   leading newlines and spaces, then trailing ones   \n",
    "code: def f(x):\n    return x**2 + 42  # comment\n\tx = [1,2,3]",
    f"the word{WHOLE_WORD}, again{WHOLE_WORD}!",
]


def _corpus(n: int = 400) -> list[str]:
    """Sentences with the same kinds of pieces as TEXTS (and others), so the trained merges span them."""
    rng = random.Random(0)
    words = ["the", "cat", "dog", "was", "here", "there", "little", "girl", "named", "Lily", "naïve", "café",
             "Größe", "日本語", "テキスト", "Ωmega", "return", "def", "code", "time", "upon", "once", "spaces", "sure",
             "know", "fine", "Call", "word", "again", "Unicode", "leading", "trailing", "newlines", "brackets",
             "quotes", "dashes", "curly", "emoji", "🙂", "½", "٣٤٥"]
    pieces = ["I'm", "I'M", "don't", "DON'T", "we're", "they'll", "she'd", "it's", "HE'S", "you've"]
    numbers = ["1234567", "2024", "555", "0199", "10", "30", "3.14159", "42", "99999", "123", "7"]
    marks = [",", ".", "!!!", "...", "?", " (", ")", " \"", "\"", " —", ";", ":", " #", " @", " $"]
    spaces = [" ", " ", " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", " \n"]
    corpus = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(6, 16)):
            parts.append(rng.choice(rng.choice([words, words, pieces, numbers, marks])))
            parts.append(rng.choice(spaces))
        corpus.append("".join(parts))
    return corpus


def _byte_level(text: str) -> str:
    """``text``'s bytes in GPT-2's byte-to-unicode alphabet (how byte-level BPE vocabularies store tokens)."""
    alphabet = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table, extra = {b: chr(b) for b in alphabet}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return "".join(table[b] for b in text.encode())


def _split(regex: str):
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _train(pre_tokenizer, specials: list[str], normalizer=None) -> dict:
    """A byte-level BPE trained on `_corpus` with ``pre_tokenizer``, as tokenizer.json's dict."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_corpus(), trainer)
    return json.loads(tokenizer.to_str())


def _gpt2() -> dict:
    from tokenizers import pre_tokenizers

    return _train(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), ["<|endoftext|>"])


def _llama3() -> dict:
    """As Meta-Llama-3's tokenizer.json: the Split regex, ByteLevel without regex, no normalizer, ignore_merges, a
    TemplateProcessing post-processor adding <|begin_of_text|>; plus `WHOLE_WORD` in the vocabulary, no merge to it."""
    from tokenizers import Tokenizer, processors

    spec = _train(_split(LLAMA3_REGEX), ["<|begin_of_text|>", "<|end_of_text|>"])
    spec["model"]["ignore_merges"] = True
    spec["model"]["vocab"][_byte_level(WHOLE_WORD)] = len(spec["model"]["vocab"])
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False),
                                                    processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
        special_tokens=[("<|begin_of_text|>", 0)])])
    return json.loads(tokenizer.to_str())


def _qwen2() -> dict:
    """As Qwen2's tokenizer.json: NFC, the Split regex, ByteLevel without regex, a non-special added token; and, as
    Qwen2's vocabulary (a Llama-3-like one), multi-digit tokens that its single-digit split never reaches."""
    from tokenizers import AddedToken, Tokenizer, normalizers

    spec = _train(_split(QWEN2_REGEX), ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], normalizers.NFC())
    vocab = spec["model"]["vocab"]
    for left, right in (("1", "2"), ("12", "3"), ("4", "5"), ("45", "6"), ("5", "5"), ("55", "5")):
        assert left + right not in vocab
        vocab[left + right] = len(vocab)
        spec["model"]["merges"].append([left, right])
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    return json.loads(tokenizer.to_str())


SCHEMES = {"gpt-2": (_gpt2, "LlamaForCausalLM"), "llama-bpe": (_llama3, "LlamaForCausalLM"),
           "qwen2": (_qwen2, "Qwen2ForCausalLM")}


@pytest.fixture(scope="module")
def specs():
    return {name: make() for name, (make, _) in SCHEMES.items()}


def _model(architecture: str, bos: int = 0):
    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False, bos_token_id=bos,
               eos_token_id=bos)
    torch.manual_seed(0)
    if architecture == "Qwen2ForCausalLM":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()


def _folder(tmp_path, spec: dict):
    folder = tmp_path / "base"
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return folder


def _export(tmp_path, name: str, spec: dict):
    base = _folder(tmp_path, spec)
    return base, wb.export(_model(SCHEMES[name][1]), tmp_path / "out", format="gguf", base_folder=base)


def _llama_cpp_ids(folder, texts) -> list[list[int]]:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by `make install`")
    del llama_cpp
    from workbench.export.llama_cpp import LlamaCpp

    with LlamaCpp(folder, threads=1) as runtime:
        return [runtime.tokenize(text) for text in texts]


def _reference_ids(base, texts) -> list[list[int]]:
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(base / "tokenizer.json"))
    return [reference.encode(text, add_special_tokens=False).ids for text in texts]


def _texts(name: str) -> list[str]:
    return TEXTS + (["a <tool_call> b<tool_call>c"] if name == "qwen2" else [])


# --- what is written --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SCHEMES)
def test_fields(tmp_path, specs, name):
    """tokenizer.ggml.*: model gpt2, the pre-tokenizer's llama.cpp name, tokens in id order then unused padding,
    special added tokens CONTROL and others USER_DEFINED, the merges in rank order, add_bos from the post-processor."""
    spec = specs[name]
    _, out = _export(tmp_path, name, spec)
    reader = gguf.GGUFReader(out / "model.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == name
    by_id = {i: t for t, i in spec["model"]["vocab"].items()} | {a["id"]: a["content"] for a in spec["added_tokens"]}
    n = len(by_id)
    assert sorted(by_id) == list(range(n)) and n < VOCAB
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert tokens == [by_id[i] for i in range(n)] + [f"[PAD{i}]" for i in range(n, VOCAB)]
    special = {a["id"] for a in spec["added_tokens"] if a["special"]}
    user = {a["id"] for a in spec["added_tokens"] if not a["special"]}
    assert types == [gguf.TokenType.CONTROL if i in special else gguf.TokenType.USER_DEFINED if i in user else
                     gguf.TokenType.NORMAL for i in range(n)] + [gguf.TokenType.UNUSED] * (VOCAB - n)
    assert len(user) == (name == "qwen2") and len(special) == {"gpt-2": 1, "llama-bpe": 2, "qwen2": 3}[name]
    assert fields["tokenizer.ggml.merges"] == [" ".join(m) for m in spec["model"]["merges"]]
    assert fields["tokenizer.ggml.add_bos_token"] is (name == "llama-bpe")
    assert fields["tokenizer.ggml.add_eos_token"] is False


# --- llama.cpp's tokenizer gives tokenizer.json's ids ----------------------------------------------------------------

@pytest.mark.parametrize("name", SCHEMES)
def test_llama_cpp_tokenizes_as_tokenizer_json(tmp_path, specs, name):
    base, out = _export(tmp_path, name, specs[name])
    texts = _texts(name)
    want = _reference_ids(base, texts)
    assert all(len(ids) > 3 for ids in want)
    assert _llama_cpp_ids(out, texts) == want


def test_qwen2_nfc_is_left_to_the_text(tmp_path, specs):
    """llama.cpp normalizes nothing: Qwen2's NFC gives the same ids on text already in NFC (all of TEXTS), while
    decomposed accents are tokenized as written - the ids of the same tokenizer.json without its normalizer. (As in
    llama.cpp's own conversion of Qwen2; the module docstring says so.)"""
    import unicodedata

    from tokenizers import Tokenizer

    assert all(unicodedata.is_normalized("NFC", t) for t in _texts("qwen2"))
    decomposed = ["cafe\u0301 A\u030a", unicodedata.normalize("NFD", TEXTS[2])]
    base, out = _export(tmp_path, "qwen2", specs["qwen2"])
    without = Tokenizer.from_str(json.dumps({**specs["qwen2"], "normalizer": None}))
    got = _llama_cpp_ids(out, decomposed)
    assert got == [without.encode(t, add_special_tokens=False).ids for t in decomposed]
    assert got != _reference_ids(base, decomposed)


def test_the_texts_tell_the_pre_tokenizers_apart(specs):
    """Every scheme's vocabulary, read with each other scheme's pre-tokenizer (and ignore_merges), gives other ids on
    some text - on the digit run for Llama-3 against GPT-2 and Qwen2: a wrong mapping would be seen."""
    from tokenizers import Tokenizer, pre_tokenizers

    pres = {"gpt-2": (pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False),
            "llama-bpe": (_split(LLAMA3_REGEX), True), "qwen2": (_split(QWEN2_REGEX), False)}
    digits = TEXTS[1]
    for name, spec in specs.items():
        own = Tokenizer.from_str(json.dumps(spec))
        for other, (pre, ignore_merges) in pres.items():
            if other == name:
                continue
            swapped = json.loads(json.dumps(spec))
            swapped["model"]["ignore_merges"] = ignore_merges
            tokenizer = Tokenizer.from_str(json.dumps(swapped))
            tokenizer.pre_tokenizer = pre
            differ = [t for t in _texts(name) if tokenizer.encode(t, add_special_tokens=False).ids
                      != own.encode(t, add_special_tokens=False).ids]
            assert differ, (name, other)
            if "llama-bpe" in (name, other):
                assert digits in differ, (name, other)


@pytest.mark.parametrize("name, written_as", [("llama-bpe", "gpt-2"), ("qwen2", "llama-bpe"), ("gpt-2", "qwen2")])
def test_a_wrong_pre_name_gives_other_ids(tmp_path, specs, monkeypatch, name, written_as):
    """The check above can fail: the same tokenizer.json written with another of llama.cpp's names (as a guess would)
    makes llama.cpp's ids differ from tokenizer.json's."""
    regex = {"gpt-2": GPT2_REGEX, "llama-bpe": LLAMA3_REGEX, "qwen2": QWEN2_REGEX}[name]
    monkeypatch.setitem(gguf_vocab.PRE_TOKENIZERS, regex,
                        dataclasses.replace(gguf_vocab.PRE_TOKENIZERS[regex], name=written_as))
    base, out = _export(tmp_path, name, specs[name])
    texts = _texts(name)
    got, want = _llama_cpp_ids(out, texts), _reference_ids(base, texts)
    assert got != want
    if "llama-bpe" in (name, written_as):
        assert got[1] != want[1]   # the digit run


# --- refused ----------------------------------------------------------------------------------------------------------

def _refused(tmp_path, spec: dict, architecture: str, match: str) -> str:
    """The message of the ValueError that export of a model with tokenizer.json ``spec`` raises, before writing."""
    base = _folder(tmp_path, spec)
    with pytest.raises(ValueError, match=match) as refused:
        wb.export(_model(architecture), tmp_path / "out", format="gguf", base_folder=base)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]   # nothing written
    return str(refused.value)


def test_an_unknown_split_regex_is_refused(tmp_path, specs):
    """A Split regex llama.cpp has no name for (here Llama-3's with digits in runs of 1-4) is refused, naming the
    regex found and the supported pre-tokenizers."""
    spec = json.loads(json.dumps(specs["llama-bpe"]))
    other = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}{1,4}")
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = other
    message = _refused(tmp_path, spec, "LlamaForCausalLM", "splits text with the regex .*which is none of the "
                                                           "llama.cpp pre-tokenizers this exporter writes")
    assert repr(other) in message
    assert all(f"pre {n!r}: split regex {r!r}" in message
               for n, r in (("gpt-2", GPT2_REGEX), ("llama-bpe", LLAMA3_REGEX), ("qwen2", QWEN2_REGEX)))


def _edited(spec: dict, edit) -> dict:
    spec = json.loads(json.dumps(spec))
    edit(spec)
    return spec


@pytest.mark.parametrize("name, edit, match", [
    ("llama-bpe", lambda s: s["model"].update(ignore_merges=False),
     "split regex of llama.cpp's 'llama-bpe' pre-tokenizer but ignore_merges False"),
    ("qwen2", lambda s: s["model"].update(ignore_merges=True), "'qwen2' pre-tokenizer but ignore_merges True"),
    ("qwen2", lambda s: s.update(normalizer={"type": "NFKC"}), "normalizer 'NFKC'; llama.cpp tokenizes as pre 'qwen2'"),
    ("llama-bpe", lambda s: s.update(normalizer={"type": "NFC"}),
     "normalizer 'NFC'; llama.cpp tokenizes as pre 'llama-bpe'"),
    ("llama-bpe", lambda s: s["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
     "is not a GPT-2-style byte-level BPE.*add_prefix_space=True"),
    ("llama-bpe", lambda s: s["pre_tokenizer"]["pretokenizers"][0].update(behavior="Removed"),
     "is not a GPT-2-style byte-level BPE.*behavior='Removed'"),
    ("gpt-2", lambda s: s["model"].update(byte_fallback=True), "a BPE with byte fallback but not a SentencePiece"),
])
def test_what_llama_cpp_would_tokenize_otherwise_is_refused(tmp_path, specs, name, edit, match):
    _refused(tmp_path, _edited(specs[name], edit), SCHEMES[name][1], match)


# --- SentencePiece-style BPEs (Llama-2, Mistral, TinyLlama, Gemma): llama.cpp's SPM tokenizer, with scores ------------

SPM_SPECIALS = ["<unk>", "<s>", "</s>"]
SPM_TEXTS = TEXTS + [" one leading space", "  two leading spaces", "a    four-space run and ▁ itself",
                     "unseen: ĳ ⅻ ж 👍🏽 ☃ — all bytes", "x\n\ny\r\n\tz"]


def _spm_layouts() -> dict:
    """name -> (normalizer, pre-tokenizer, decoder), as transformers' LlamaConverter (legacy, with and without the
    prefix space) and GemmaConverter build them."""
    from tokenizers import decoders, normalizers, pre_tokenizers

    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    return {"llama": (normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]), None,
                      decoders.Sequence(decode + [decoders.Strip(" ", 1, 0)])),
            "llama-no-prefix": (normalizers.Sequence([normalizers.Replace(" ", "▁")]), None,
                                decoders.Sequence(decode)),
            "gemma": (normalizers.Replace(" ", "▁"), pre_tokenizers.Split(" ", "merged_with_previous"),
                      decoders.Sequence(decode))}


def _spm_learned() -> list[str]:
    """The pieces of a BPE trained on `_corpus` split at SentencePiece's "▁" (creation order), without newlines and
    tabs (they are byte tokens in Llama-2's vocabulary), after Llama-2's own first pieces, runs of "▁"."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=420, show_progress=False))
    learned = sorted(trained.get_vocab(), key=trained.get_vocab().get)
    return ["▁▁", "▁▁▁", "▁▁▁▁"] + [t for t in learned if not set(t) & set("\n\r\t")]


def _sentencepiece(layout: str = "llama", learned: list[str] | None = None, merges=None) -> dict:
    """As a Llama-2 tokenizer.json (a SentencePiece BPE converted by transformers): <unk> <s> </s>, the 256 byte
    tokens, the learned pieces; the merges transformers' converter derives from a SentencePiece vocabulary (every
    split of a piece into two pieces, in the order of the pieces' scores, here minus their ids); byte fallback; the
    ``layout``'s normalizer / pre-tokenizer / decoder; a post-processor adding <s>. ``merges``: these instead."""
    from tokenizers import AddedToken, Tokenizer, models, processors
    from transformers.tokenization_utils_base import generate_merges

    tokens = SPM_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + (learned or _spm_learned())
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges is None:
        merges = generate_merges(vocab, {t: -float(i) for t, i in vocab.items()}, skip_tokens=SPM_SPECIALS)
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer, pre, tokenizer.decoder = _spm_layouts()[layout]
    if pre is not None:
        tokenizer.pre_tokenizer = pre
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPM_SPECIALS])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                             special_tokens=[("<s>", 1)])
    return json.loads(tokenizer.to_str())


@pytest.fixture(scope="module")
def spm():
    return {layout: _sentencepiece(layout) for layout in _spm_layouts()}


def _spm_export(tmp_path, spec: dict):
    base = _folder(tmp_path, spec)
    return base, wb.export(_model("LlamaForCausalLM", bos=1), tmp_path / "out", format="gguf", base_folder=base)


def test_sentencepiece_fields(tmp_path, spm):
    """tokenizer.ggml.*: model llama, no merges, tokens in id order then unused padding, a token's score minus the
    rank of its first merge (0 for tokens no merge makes), types (unk UNKNOWN, <s> </s> CONTROL, <0xNN> BYTE),
    the unk id, add_space_prefix and add_bos."""
    spec = spm["llama"]
    _, out = _spm_export(tmp_path, spec)
    fields = {k: f.contents() for k, f in gguf.GGUFReader(out / "model.gguf").fields.items()
              if k.startswith("tokenizer.")}
    assert fields["tokenizer.ggml.model"] == "llama"
    assert "tokenizer.ggml.merges" not in fields and "tokenizer.ggml.pre" not in fields
    vocab = spec["model"]["vocab"]
    n = len(vocab)
    by_id = sorted(vocab, key=vocab.get)
    assert fields["tokenizer.ggml.tokens"] == by_id + [f"[PAD{i}]" for i in range(n, VOCAB)]
    first: dict[str, int] = {}
    for rank, (left, right) in enumerate(spec["model"]["merges"]):
        first.setdefault(left + right, rank)
    assert len(first) > 200
    assert fields["tokenizer.ggml.scores"] == [-float(first.get(t, 0)) for t in by_id] + [0.0] * (VOCAB - n)
    T = gguf.TokenType
    assert fields["tokenizer.ggml.token_type"] == ([T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256
                                                   + [T.NORMAL] * (n - 259) + [T.UNUSED] * (VOCAB - n))
    assert fields["tokenizer.ggml.unknown_token_id"] == 0 and fields["tokenizer.ggml.bos_token_id"] == 1
    assert fields["tokenizer.ggml.add_space_prefix"] is True
    assert fields["tokenizer.ggml.add_bos_token"] is True and fields["tokenizer.ggml.add_eos_token"] is False


@pytest.mark.parametrize("layout, prefix", [("llama", True), ("llama-no-prefix", False), ("gemma", False)])
def test_llama_cpp_tokenizes_sentencepiece_as_tokenizer_json(tmp_path, spm, layout, prefix):
    """llama.cpp's SPM tokenizer gives exactly the tokenizers library's ids: leading, trailing and runs of spaces (the
    "▁▁" pieces), newlines and tabs (byte tokens here, as in Llama-2), digits, characters the vocabulary lacks (byte
    fallback, emoji included), a literal "▁"."""
    base, out = _spm_export(tmp_path, spm[layout])
    fields = gguf.GGUFReader(out / "model.gguf").fields
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is prefix
    want = _reference_ids(base, SPM_TEXTS)
    vocab = spm[layout]["model"]["vocab"]
    used = {i for ids in want for i in ids}
    assert all(ids for ids in want)
    assert {vocab["<0x0A>"], vocab["<0xF0>"], vocab["▁▁"], vocab["▁▁▁"]} <= used   # byte fallback, space runs
    assert _llama_cpp_ids(out, SPM_TEXTS) == want


def test_sentencepiece_scores_decide(tmp_path, spm, monkeypatch):
    """The check above can fail: one score for every token (as llama.cpp's own converter writes from tokenizer.json
    alone, -1000.0) makes llama.cpp join the leftmost pair that makes a token - other ids."""
    monkeypatch.setattr(gguf_vocab, "spm_scores", lambda *args, **kwargs: {})   # every score 0.0
    base, out = _spm_export(tmp_path, spm["llama"])
    got, want = _llama_cpp_ids(out, SPM_TEXTS), _reference_ids(base, SPM_TEXTS)
    assert got != want


def test_merges_llama_cpp_cannot_follow_are_refused(tmp_path, monkeypatch):
    """llama.cpp joins any two pieces that make a token, a BPE only its merges: with "bc" merged before "ab" and
    "abc" made from "ab" + "c" only, the BPE leaves "abc" as "a" "bc", llama.cpp (scores written regardless) joins
    them - refused. So is a byte-fallback BPE trained by the tokenizers library (only the merges training made)."""
    from tokenizers import Tokenizer, models, trainers

    spec = _sentencepiece(learned=["▁", "a", "b", "c", "bc", "ab", "abc"], merges=[("b", "c"), ("a", "b"), ("ab", "c")])
    message = _refused(tmp_path, spec, "LlamaForCausalLM", "merges llama.cpp's SPM tokenizer cannot follow with "
                                                           "scores: 'a' \\+ 'bc' makes the token 'abc' but is no merge")
    assert "joins any two pieces that make a token" in message

    def unchecked(vocab, merges, skip=()):
        first: dict[str, int] = {}
        for rank, (left, right) in enumerate(merges):
            first.setdefault(left + right, rank)
        return {t: -float(r) for t, r in first.items()}

    with monkeypatch.context() as patch:
        patch.setattr(gguf_vocab, "spm_scores", unchecked)
        base, out = _spm_export(tmp_path, spec)
        vocab = spec["model"]["vocab"]
        assert _reference_ids(base, ["abc"]) == [[vocab["▁"], vocab["a"], vocab["bc"]]]
        assert _llama_cpp_ids(out, ["abc"]) == [[vocab["▁"], vocab["abc"]]]

    trained = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    trained.normalizer, _, trained.decoder = _spm_layouts()["llama"]
    trained.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=700, show_progress=False, special_tokens=SPM_SPECIALS + [f"<0x{b:02X}>" for b in range(256)]))
    (tmp_path / "trained").mkdir()
    _refused(tmp_path / "trained", json.loads(trained.to_str()), "LlamaForCausalLM", "is no merge")


def test_a_metaspace_pre_tokenizer_is_refused(tmp_path, spm):
    """transformers' non-legacy Llama conversion (no normalizer, Metaspace(prepend_scheme="first", split=False))
    prepends no "▁" to a text starting with a space, llama.cpp does: other ids, so refused, naming what was found."""
    from tokenizers import Tokenizer, pre_tokenizers

    spec = _edited(spm["llama"], lambda s: s.update(normalizer=None))
    metaspace = Tokenizer.from_str(json.dumps(spec))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    legacy = Tokenizer.from_str(json.dumps(spm["llama"]))
    assert (metaspace.encode(" one leading space", add_special_tokens=False).ids
            != legacy.encode(" one leading space", add_special_tokens=False).ids)
    message = _refused(tmp_path, json.loads(metaspace.to_str()), "LlamaForCausalLM",
                       "a BPE with byte fallback but not a SentencePiece-style one")
    assert '"Metaspace"' in message and "'llama'" in message and "'gemma'" in message


def _moved(merges: list, token: str, to: int) -> list:
    """``merges`` with the merges making ``token`` taken out and put back: the first at rank ``to``, the others last."""
    making = [list(m) for m in merges if "".join(m) == token]
    rest = [list(m) for m in merges if "".join(m) != token]
    return rest[:to] + making[:1] + rest[to:] + making[1:]


@pytest.mark.parametrize("edit, match", [
    (lambda s: s["model"].update(ignore_merges=True), r"\('llama'\) but has ignore_merges True"),
    (lambda s: s["model"].update(dropout=0.1), "but has dropout 0.1"),
    (lambda s: s["model"]["vocab"].pop("<0xFF>"), "no byte token for <0xFF>"),
    (lambda s: s["model"].update(unk_token=None), "unk_token None not in the vocabulary"),
    (lambda s: s.update(normalizer={"type": "Sequence", "normalizers": [{"type": "NFKC"}, *s["normalizer"][
        "normalizers"]]}), "not a SentencePiece-style one.*NFKC"),
    (lambda s: s["decoder"]["decoders"].pop(), "not a SentencePiece-style one.*decoder"),
    (lambda s: s["model"].update(merges=_moved(s["model"]["merges"], "▁▁▁", 5)),
     "the merges making '▁▁▁' are not consecutive"),
])
def test_what_llama_cpp_would_tokenize_otherwise_is_refused_sentencepiece(tmp_path, spm, edit, match):
    _refused(tmp_path, _edited(spm["llama"], edit), "LlamaForCausalLM", match)
