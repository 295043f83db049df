"""minilm: sentence-embedding fidelity and quality on gensim's bundled text (no downloads).

Metrics (primary first):

- ``fidelity``: mean cosine similarity between the model's embeddings and the fp32 MiniLM's embeddings
  of lee_background documents 150-299 (``quick``: 150-181). Documents 0-149 are the calibration slice.
  The fp32 reference embeddings are computed once per process from the zoo model.
- ``wordsim353`` / ``simlex999``: Spearman correlation of cosine similarity with human scores.
- ``lee``: Pearson correlation with the Lee 50-document human similarity matrix (upper triangle).
- ``pang_lee``: 5-fold logistic-regression accuracy on the 200 Pang-Lee polarity sentences.

The fp32 model reproduces 0.729 / 0.446 / 0.656 / 0.730 on these sets (tests check it).
"""
from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from workbench.tasks import data
from workbench.tasks.base import MetricSpec, Task, check_count, check_model, eval_mode, model_device

__all__ = ["SentenceTask", "encode"]

CALIBRATION_DOCS = range(0, 150)
EVAL_DOCS = range(150, 300)
QUICK_EVAL_DOCS = range(150, 182)


def _batches(texts, max_length: int, batch_size: int):
    """Tokenised batches, longest first (little padding); yields (indices, input_ids, attention_mask)."""
    from workbench.models.minilm import tokenizer

    tok = tokenizer()
    order = np.argsort([-len(t) for t in texts], kind="stable")
    for i in range(0, len(texts), batch_size):
        idx = order[i:i + batch_size]
        enc = tok([texts[j] for j in idx], padding=True, truncation=True, max_length=max_length,
                  return_tensors="pt")
        yield idx, enc["input_ids"], enc["attention_mask"]


def encode(model: nn.Module, texts, max_length: int | None = None, batch_size: int = 32) -> torch.Tensor:
    """Sentence embeddings (N, H) in fp32, in the order of ``texts``."""
    from workbench.models.minilm import MAX_SEQ_LENGTH

    device = model_device(model)
    out: torch.Tensor | None = None
    with torch.inference_mode():
        for idx, ids, mask in _batches(list(texts), max_length or MAX_SEQ_LENGTH, batch_size):
            emb = model(ids.to(device), mask.to(device))
            if emb.ndim != 2 or emb.shape[0] != len(idx):
                raise ValueError(f"a sentence encoder must return (batch, dim) embeddings, got shape "
                                 f"{tuple(emb.shape)}")
            emb = emb.float().cpu()
            if out is None:
                out = torch.empty(len(texts), emb.shape[1])
            out[torch.as_tensor(idx)] = emb
    assert out is not None
    return out


@functools.cache
def _reference(docs: tuple[int, ...]) -> torch.Tensor:
    from workbench.models import load

    texts = data.lee_background()
    return encode(load("minilm"), [texts[i] for i in docs])


class SentenceTask(Task):
    name = "minilm"
    metrics = (
        MetricSpec("fidelity", True, "mean cosine similarity to fp32 MiniLM embeddings of held-out documents"),
        MetricSpec("wordsim353", True, "Spearman correlation with WordSim353 human scores"),
        MetricSpec("simlex999", True, "Spearman correlation with SimLex-999 human scores"),
        MetricSpec("lee", True, "Pearson correlation with the Lee 50-document human similarities"),
        MetricSpec("pang_lee", True, "5-fold logistic-regression accuracy on Pang-Lee polarity"),
    )
    default_batch_size = 8
    latency_seq_len = 128

    def fidelity(self, model: nn.Module, quick: bool = False) -> float:
        return float(self._cosines(model, quick).mean())

    def _cosines(self, model: nn.Module, quick: bool) -> torch.Tensor:
        """Cosine similarity of each held-out document's embedding to the fp32 model's, (docs,)."""
        docs = tuple(QUICK_EVAL_DOCS if quick else EVAL_DOCS)
        texts = data.lee_background()
        emb = encode(model, [texts[i] for i in docs])
        ref = _reference(docs)
        return torch.nn.functional.cosine_similarity(emb, ref, dim=-1).double()

    def evaluate(self, model: nn.Module, quick: bool = False) -> dict[str, float]:
        return self.evaluate_with_error(model, quick)[0]

    def evaluate_with_error(self, model: nn.Module, quick: bool = False) -> tuple[dict[str, float], dict[str, float]]:
        """The metrics; ``fidelity`` with its 95 % half-width from the spread over documents (the word-pair
        and document benchmarks are fixed, whole data sets: no error is stated for them)."""
        from workbench.measurement.sampling import mean_halfwidth

        check_model(model)
        with eval_mode(model):
            cos = self._cosines(model, quick)
            return self._evaluate(model, quick, float(cos.mean())), {"fidelity": mean_halfwidth(cos.numpy())}

    def _evaluate(self, model: nn.Module, quick: bool, fidelity: float) -> dict[str, float]:
        out = {"fidelity": fidelity}
        if quick:
            return out
        from scipy.stats import pearsonr, spearmanr
        from sklearn.linear_model import LogisticRegression
        from sklearn.model_selection import cross_val_score

        for name, filename in (("wordsim353", "wordsim353.tsv"), ("simlex999", "simlex999.txt")):
            a, b, human = data.word_pairs(filename)
            words = sorted(set(a) | set(b))
            emb = encode(model, words, batch_size=128)
            pos = {w: i for i, w in enumerate(words)}
            cos = (emb[[pos[w] for w in a]] * emb[[pos[w] for w in b]]).sum(-1).numpy()
            out[name] = float(spearmanr(cos, human).statistic)
        docs, human = data.lee_documents()
        emb = encode(model, docs)
        sims = (emb @ emb.T).numpy()
        iu = np.triu_indices(len(docs), 1)
        out["lee"] = float(pearsonr(sims[iu], human[iu]).statistic)
        texts, labels = data.pang_lee()
        emb = encode(model, texts).numpy()
        out["pang_lee"] = float(cross_val_score(LogisticRegression(max_iter=1000), emb, labels, cv=5).mean())
        return out

    def calibration(self, n: int, batch_size: int | None = None) -> list[tuple[torch.Tensor, ...]]:
        """``n`` calibration documents (lee_background 0-149), truncated to 128 tokens."""
        check_count(n, len(CALIBRATION_DOCS), "minilm calibration")
        texts = data.lee_background()
        docs = [texts[i] for i in CALIBRATION_DOCS[:n]]
        return [(ids, mask) for _, ids, mask in _batches(docs, self.latency_seq_len, batch_size or 8)]

    def example_inputs(self, batch_size: int | None = None) -> tuple[torch.Tensor, ...]:
        """``batch_size`` held-out documents of exactly 128 tokens (every document is longer)."""
        bs = batch_size or self.default_batch_size
        texts = data.lee_background()
        docs = [texts[EVAL_DOCS[i % len(EVAL_DOCS)]] for i in range(bs)]
        from workbench.models.minilm import tokenizer

        enc = tokenizer()(docs, padding="max_length", truncation=True, max_length=self.latency_seq_len,
                          return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"]
