"""Token generation speed of causal language models: greedy batch-1 decoding, timed.

Hugging Face models (anything with ``generate`` and a ``config``) run ``generate`` with their KV cache; other
causal LMs (the zoo's TinyLM: ``model(ids) -> (B, T, vocab)`` logits) run their forward over the whole context
(cut to ``model.cfg.block_size`` when there is one) for each new token - what that model can do without a cache.
`wb.measure(..., generate_tokens=n)` records the result as ``Metrics.tokens_per_s``; `kernels.bench_cpu` compares
paths with it.
"""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn

__all__ = ["greedy", "is_causal_lm", "tokens_per_s", "vocab_size"]


def vocab_size(model: nn.Module) -> int:
    """The vocabulary of a causal LM: ``config.vocab_size`` (Hugging Face) or its first embedding's rows."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if size:
        return int(size)
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise ValueError(f"{type(model).__name__} has no config.vocab_size and no nn.Embedding: not a causal LM")
    return emb.num_embeddings


def is_causal_lm(model: nn.Module) -> bool:
    """A Hugging Face model with ``generate``, or a module with an embedding whose output for (1, T) token ids is
    (1, T, vocab) logits (checked on two tokens)."""
    if hasattr(model, "generate") and hasattr(model, "config"):
        return True
    try:
        vocab = vocab_size(model)
        device = next(model.parameters()).device
        with torch.inference_mode():
            out = model(torch.ones(1, 2, dtype=torch.long, device=device))
    except Exception:  # not callable on token ids: not a causal LM (the answer, not an error)
        return False
    return isinstance(out, torch.Tensor) and tuple(out.shape) == (1, 2, vocab)


def greedy(model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``prompt`` (1, T) int64 followed by ``new_tokens`` greedily chosen tokens: (1, T + new_tokens)."""
    if hasattr(model, "generate") and hasattr(model, "config"):
        return model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              use_cache=True, pad_token_id=0)
    block = getattr(getattr(model, "cfg", None), "block_size", None)
    ids = prompt
    for _ in range(new_tokens):
        logits = model(ids if block is None else ids[:, -block:])             # (1, T, vocab)
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def tokens_per_s(model: nn.Module, new_tokens: int = 16, prompt_tokens: int = 8, runs: int = 3,
                 seed: int = 0) -> float:
    """Median tokens per second of `greedy` generation over ``runs`` timed runs (after one warm-up run), batch 1,
    from a random prompt of ``prompt_tokens`` tokens."""
    if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or new_tokens < 1:
        raise ValueError(f"new_tokens must be a positive int, got {new_tokens!r}")
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, vocab_size(model), (1, prompt_tokens), generator=gen).to(device)
    times = []
    with torch.inference_mode():
        for i in range(runs + 1):
            t0 = time.perf_counter()
            out = greedy(model, prompt, new_tokens)
            if i:
                times.append(time.perf_counter() - t0)
    if out.shape[1] != prompt_tokens + new_tokens:
        raise RuntimeError(f"{type(model).__name__} generated {out.shape[1] - prompt_tokens} tokens, "
                           f"{new_tokens} were asked for")
    return new_tokens / statistics.median(times)
