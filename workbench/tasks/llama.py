"""tiny-llama: held-out perplexity of a token-level causal LM on English documents (``wb.tasks.load("tiny-llama")``).

The documents are `workbench.tasks.data.english_documents` (gensim's lee_background news and Python's
``pydoc_data`` topics; every tenth document held out). Each split is tokenised with the shipped byte-level
BPE, documents separated by the end-of-text token, and perplexity = exp(mean next-token cross-entropy) over
non-overlapping 128-token windows of the held-out stream (lower is better; ``quick`` scores the first 16
windows). Calibration windows come from the training stream. Generation speed is measured separately by
`workbench.measurement.decode.tokens_per_second` on `TinyLlamaTask.prompt`.
"""
from __future__ import annotations

import numpy as np

from workbench.tasks import data
from workbench.tasks.base import MetricSpec
from workbench.tasks.causal_lm import CausalLM, tokenize

__all__ = ["TinyLlamaTask"]


class TinyLlamaTask(CausalLM):
    """See the module docstring. ``tokenizer`` defaults to the shipped one."""

    metrics = (MetricSpec("perplexity", False, "token-level perplexity of the held-out documents "
                                               "(lower is better)"),)
    quick_windows = 16

    def __init__(self, tokenizer=None, block_size: int = 128):
        if tokenizer is None:
            from workbench.models.llama import tokenizer as shipped

            tokenizer = shipped()
        self.tokenizer = tokenizer
        self.name, self.block_size, self.seed = "tiny-llama", block_size, 0
        text = data.english_documents()
        eos = tokenizer.eos_token or ""
        self.train_ids = self._stream(text.train, eos)
        self.test_ids = self._stream(text.test, eos)
        self.eval_windows = (len(self.test_ids) - 1) // block_size
        self.prompt = text.test[0][:200]   # a held-out news opening, for generation speed

    def _stream(self, docs, eos: str) -> np.ndarray:
        return tokenize([doc + eos for doc in docs], self.tokenizer)
