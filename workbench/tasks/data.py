"""Offline datasets: every byte comes from an installed package, never from a download.

- digits: scikit-learn's bundled 8x8 digits, split once with a fixed seed.
- mnist1d: generated locally and deterministically by ``mnist1d.data.make_dataset``.
- text: gensim's test corpus (``gensim/test/test_data``): lee_background.cor, lee.cor with its human
  similarity matrix, WordSim353, SimLex-999 and the Pang-Lee polarity sentences.
- English documents for tiny-llama (`english_documents`): the 300 lee_background news documents and the
  topics of Python's own documentation in ``pydoc_data.topics`` (help() texts, one document per topic, in
  key order; the topics differ between Python versions, so the corpus belongs to this venv's Python 3.11).
  Every tenth document of each source (index % 10 == 9) is held out, and nothing held out is seen by the
  tokenizer or the model in training (training copies of a held-out document - lee_background repeats a few
  stories - are dropped).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Split", "digits", "mnist1d", "gensim_data_dir", "lee_background", "char_corpus",
           "word_pairs", "lee_documents", "pang_lee",
           "EnglishText", "english_documents"]

SEED = 0


@dataclass(frozen=True)
class Split:
    """Arrays of one classification dataset: training (calibration comes from here) and test."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


@functools.lru_cache(maxsize=None)
def digits() -> Split:
    """scikit-learn digits, pixels scaled to [0, 1], stratified 70/30 split with seed 0."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)  # (1797, 64)
    y = d.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.3, random_state=SEED, stratify=y)
    return Split(xtr, ytr, xte, yte)


@functools.lru_cache(maxsize=None)
def mnist1d() -> Split:
    """mnist1d with its default arguments (4000 train / 1000 test), generated locally."""
    from mnist1d.data import get_dataset_args, make_dataset

    d = make_dataset(get_dataset_args())
    return Split(d["x"].astype(np.float32), d["y"].astype(np.int64),
                 d["x_test"].astype(np.float32), d["y_test"].astype(np.int64))


def gensim_data_dir() -> Path:
    import gensim

    path = Path(os.path.dirname(gensim.__file__)) / "test" / "test_data"
    if not (path / "lee_background.cor").is_file():
        raise FileNotFoundError(f"gensim's test data was not found under {path}; reinstall gensim")
    return path


@functools.lru_cache(maxsize=None)
def lee_background() -> tuple[str, ...]:
    """The 300 news documents of lee_background.cor."""
    text = (gensim_data_dir() / "lee_background.cor").read_text(encoding="latin-1")
    return tuple(line.strip() for line in text.splitlines() if line.strip())


@dataclass(frozen=True)
class CharCorpus:
    vocab: str
    train: np.ndarray  # (N_train,) int64 character ids
    test: np.ndarray   # (N_test,)  int64, the held-out tail of the text

    def encode(self, text: str) -> np.ndarray:
        index = {c: i for i, c in enumerate(self.vocab)}
        try:
            return np.array([index[c] for c in text], dtype=np.int64)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tiny-lm vocabulary") from None

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)


@dataclass(frozen=True)
class EnglishText:
    """Documents for training (tokenizer and model) and the held-out documents for perplexity."""

    train: tuple[str, ...]
    test: tuple[str, ...]


@functools.lru_cache(maxsize=None)
def english_documents(held_out_every: int = 10) -> EnglishText:
    """lee_background (300 documents) then pydoc_data's topics (sorted by key); see the module docstring."""
    from pydoc_data.topics import topics

    train: list[str] = []
    test: list[str] = []
    for source in (lee_background(), tuple(topics[k].strip() for k in sorted(topics))):
        for i, doc in enumerate(source):
            (test if i % held_out_every == held_out_every - 1 else train).append(doc)
    held_out = set(test)   # lee_background repeats some stories: a copy of a held-out one is not trained on
    return EnglishText(tuple(d for d in train if d not in held_out), tuple(test))


@functools.lru_cache(maxsize=None)
def char_corpus(test_fraction: float = 0.1) -> CharCorpus:
    """lee_background.cor as characters: the first 90 % for training, the last 10 % held out."""
    text = (gensim_data_dir() / "lee_background.cor").read_text(encoding="latin-1")
    vocab = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocab)}
    ids = np.array([index[c] for c in text], dtype=np.int64)
    cut = int(len(ids) * (1 - test_fraction))
    return CharCorpus(vocab, ids[:cut], ids[cut:])


@functools.lru_cache(maxsize=None)
def word_pairs(filename: str) -> tuple[tuple[str, ...], tuple[str, ...], np.ndarray]:
    """(words_a, words_b, human scores) of wordsim353.tsv or simlex999.txt."""
    a, b, s = [], [], []
    for line in (gensim_data_dir() / filename).read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        w1, w2, score = line.split("\t")[:3]
        a.append(w1)
        b.append(w2)
        s.append(float(score))
    return tuple(a), tuple(b), np.array(s)


@functools.lru_cache(maxsize=None)
def lee_documents() -> tuple[tuple[str, ...], np.ndarray]:
    """The 50 lee.cor documents and their 50x50 human similarity matrix."""
    d = gensim_data_dir()
    docs = tuple(line.strip() for line in (d / "lee.cor").read_text(encoding="latin-1").splitlines()
                 if line.strip())
    sims = np.loadtxt(d / "similarities0-1.txt")
    if sims.shape != (len(docs), len(docs)):
        raise ValueError(f"lee similarity matrix has shape {sims.shape}, expected {(len(docs),) * 2}")
    return docs, sims


@functools.lru_cache(maxsize=None)
def pang_lee() -> tuple[tuple[str, ...], np.ndarray]:
    """The 200 Pang-Lee sentences and their labels (1 = positive)."""
    texts, labels = [], []
    for line in (gensim_data_dir() / "pang_lee_polarity.cor").read_text(encoding="latin-1").splitlines():
        if not line.strip():
            continue
        label, text = line.split(" ", 1)
        labels.append(1 if label == "__label__pos" else 0)
        texts.append(text.strip())
    return tuple(texts), np.array(labels, dtype=np.int64)
