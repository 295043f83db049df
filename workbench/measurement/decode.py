"""Generation speed of a causal LM: ``tokens_per_second(model, task_or_prompt, new_tokens=64)``.

Hugging Face ``generate`` with its KV cache, batch 1, greedy, exactly ``new_tokens`` new tokens (no early stop
at an end-of-text token). Each timed run is one whole ``generate`` call (prefill of the prompt + decode); the
prefill alone is timed separately (``generate`` of one token), so the decode rate excludes it:
``decode_tokens_per_s = (new_tokens - 1) / (median total - median prefill)``. One untimed warm-up run first.
The prompt is a string (tokenised with ``tokenizer``, by default the task's or tiny-llama's), a (1, T) tensor of
ids, or a task with ``prompt`` and ``tokenizer`` attributes (`workbench.tasks.llama.TinyLlamaTask`).
A model that cannot ``generate`` (not a Hugging Face ``GenerationMixin``) gets a TypeError.

Two entry points: `tokens_per_second` (Hugging Face models, prefill and decode rates separately, used by the
tiny-llama task and its tests) and `tokens_per_s` (any causal LM, one number: Hugging Face models through
``generate``; other causal LMs - the zoo's TinyLM: ``model(ids) -> (B, T, vocab)`` logits - run their forward over
the whole context, cut to ``model.cfg.block_size``, for each new token). `wb.measure(..., generate_tokens=n)`
records `tokens_per_s` as ``Metrics.tokens_per_s``; `workbench.kernels.bench_cpu` compares paths with it.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workbench.measurement.latency import num_threads

__all__ = ["DecodeSpeed", "greedy", "is_causal_lm", "prompt_ids", "tokens_per_s", "tokens_per_second", "vocab_size"]


@dataclass(frozen=True)
class DecodeSpeed:
    tokens_per_s: float          # new tokens / median wall time of a whole generate call
    decode_tokens_per_s: float   # tokens after the first / (median total - median prefill)
    prefill_ms: float            # median time of generate(max_new_tokens=1)
    new_tokens: int
    prompt_tokens: int
    runs: int
    threads: int


def prompt_ids(task_or_prompt: Any, tokenizer=None) -> torch.Tensor:
    """The (1, T) int64 prompt for ``task_or_prompt`` (see the module docstring)."""
    if isinstance(task_or_prompt, torch.Tensor):
        ids = task_or_prompt.reshape(1, -1) if task_or_prompt.ndim == 1 else task_or_prompt
        if ids.ndim != 2 or ids.shape[0] != 1 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"a prompt tensor must hold integer ids of shape (1, T), got {ids.dtype} "
                             f"{tuple(task_or_prompt.shape)}")
        return ids.long()
    if isinstance(task_or_prompt, str):
        text = task_or_prompt
    elif hasattr(task_or_prompt, "prompt"):
        text = task_or_prompt.prompt
        tokenizer = tokenizer or getattr(task_or_prompt, "tokenizer", None)
    else:
        raise TypeError(f"task_or_prompt must be a str, a (1, T) tensor of ids or a task with a prompt, got "
                        f"{type(task_or_prompt).__name__}")
    if tokenizer is None:
        from workbench.models.llama import tokenizer as shipped

        tokenizer = shipped()
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty after tokenisation")
    return ids


def tokens_per_second(model: nn.Module, task_or_prompt: Any, new_tokens: int = 64, *, tokenizer=None,
                      repeats: int = 3, threads: int | None = None) -> DecodeSpeed:
    """Greedy batch-1 generation speed of ``model`` with its KV cache (see the module docstring)."""
    from workbench.tasks.base import eval_mode, model_device

    if not callable(getattr(model, "generate", None)):
        raise TypeError(f"{type(model).__name__} has no generate(); tokens_per_second needs a Hugging Face causal "
                        f"LM (e.g. wb.models.load('tiny-llama'), compressed or not)")
    if not isinstance(new_tokens, int) or new_tokens < 2:
        raise ValueError(f"new_tokens must be an int >= 2, got {new_tokens!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    ids = prompt_ids(task_or_prompt, tokenizer).to(model_device(model))   # (1, T)
    mask = torch.ones_like(ids)
    cuda = ids.device.type == "cuda"

    def run(n: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             use_cache=True, pad_token_id=0)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        if out.shape[1] != ids.shape[1] + n:
            raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} new tokens, expected {n}")
        return elapsed

    with num_threads(threads) as used, eval_mode(model), torch.inference_mode():
        run(new_tokens)                                        # warm-up (allocations, cache set-up)
        totals, prefills = [], []
        for _ in range(repeats):                               # interleaved, so drift hits both alike
            prefills.append(run(1))
            totals.append(run(new_tokens))
    total, prefill = statistics.median(totals), statistics.median(prefills)
    return DecodeSpeed(tokens_per_s=new_tokens / total,
                       decode_tokens_per_s=(new_tokens - 1) / max(total - prefill, 1e-9),
                       prefill_ms=prefill * 1e3, new_tokens=new_tokens, prompt_tokens=int(ids.shape[1]),
                       runs=repeats, threads=int(used))


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
    except Exception:  # noqa: BLE001 - not callable on token ids: not a causal LM (the answer, not an error)
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
    from workbench.tasks.base import model_device

    device = model_device(model)   # (CPU for a model without parameters, e.g. llama.cpp behind LlamaCppModel)
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
