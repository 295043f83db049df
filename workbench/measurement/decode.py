"""Generation speed of a causal LM: ``tokens_per_second(model, task_or_prompt, new_tokens=64)``.

Greedy, batch 1, exactly ``new_tokens`` new tokens (no early stop at an end-of-text token), by one of the paths of
`DecodePath`, picked per model and recorded in the result:

- **compiled** (default for Hugging Face causal LMs that support a static KV cache): gpt-fast's decode loop. The
  prompt runs eagerly through the model into a `transformers.StaticCache` (its tensors are allocated once, so
  every decode step has the same shapes), then each token is one call of the decode step - the model's forward on
  one token, the end-of-text logits masked, argmax - compiled once per model by ``torch.compile`` (inductor;
  `workbench_kernels.ops` keeps the workbench's CPU kernels in the graph as custom ops, and its `DenseGemvPass`
  runs fp32 Linears - a head left in fp32 - on the kernels' dense GEMV, its `DecodeAttentionPass` the attention of
  the one new position on the kernels' decode attention; grouped-query attention reads the cache's key / value heads
  as they are, see `_sdpa_gqa`; inductor's C++ wrapper calls the step's kernels and ops; on a GPU the step is
  captured as a CUDA graph and replayed, one launch a token). No ``generate``: its
  per-token Python (logits processors, stopping criteria, cache bookkeeping) costs more than a small model's
  forward. The tokens are ``generate``'s: the loop applies what ``generate(min_new_tokens=n)`` applies - the
  end-of-text tokens masked, argmax (tests: identical on tiny-llama, fp32, int8 and int4 weight-only). A model
  whose compile with the C++ wrapper (on a GPU: with CUDA graphs) fails, or whose compiled step's logits are not the
  eager step's (`_LeanDecoder._check`), is compiled with inductor's Python wrapper instead, and where that fails too
  falls back to the eager loop; each with a warning that names the reason.
- **static-cache**: the same loop with the decode step eager (``compile=False``, or after a failed compile).
- **generate**: Hugging Face ``generate`` with its KV cache, for Hugging Face models the loop cannot take (no static
  cache support, an encoder-decoder, a generation config that asks for logits processors: `lean_unsupported` says
  why).
- **forward**: other causal LMs - the zoo's TinyLM: ``model(ids) -> (B, T, vocab)`` logits - run their forward over
  the whole context, cut to ``model.cfg.block_size``, for each new token.

Compiled steps are cached per model (and thread count, which inductor's kernels are built for), so repeated timing
calls compile once; every timing function runs one untimed warm-up first, so compile time is never timed as decode.

Each timed run of `tokens_per_second` is one whole generation (prefill of the prompt + decode); the prefill
alone is timed separately (generation of one token), so the decode rate excludes it:
``decode_tokens_per_s = (new_tokens - 1) / (median total - median prefill)``.
The prompt is a string (tokenised with ``tokenizer``, by default the task's or tiny-llama's), a (1, T) tensor of
ids, or a task with ``prompt`` and ``tokenizer`` attributes (`workbench.tasks.llama.TinyLlamaTask`).
A model that cannot ``generate`` (not a Hugging Face ``GenerationMixin``) gets a TypeError there.

Two entry points: `tokens_per_second` (Hugging Face models, prefill and decode rates separately, used by the
tiny-llama task and its tests) and `tokens_per_s` (any causal LM, one number). `wb.measure(...,
generate_tokens=n)` records `tokens_per_s` as ``Metrics.tokens_per_s``; `workbench.benchmarks.kernels_cpu` compares
paths with `greedy`.
"""
from __future__ import annotations

import contextlib
import enum
import itertools
import os
import statistics
import time
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from workbench.measurement.latency import num_threads

__all__ = ["DecodePath", "DecodeSpeed", "greedy", "is_causal_lm", "lean_unsupported", "prompt_ids", "tokens_per_s",
           "tokens_per_second", "vocab_size"]


class DecodePath(enum.Enum):
    """How `greedy` generates (see the module docstring)."""
    COMPILED = "compiled"           # static KV cache, the decode step compiled by torch.compile
    STATIC_CACHE = "static-cache"   # static KV cache, the decode step eager
    GENERATE = "generate"           # Hugging Face generate
    FORWARD = "forward"             # no KV cache: the forward over the whole context for each token


@dataclass(frozen=True)
class DecodeSpeed:
    tokens_per_s: float          # new tokens / median wall time of a whole generation
    decode_tokens_per_s: float   # tokens after the first / (median total - median prefill)
    prefill_ms: float            # median time of a generation of one token
    new_tokens: int
    prompt_tokens: int
    runs: int
    threads: int
    path: DecodePath = DecodePath.GENERATE   # the path that ran


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
                      repeats: int = 3, threads: int | None = None, compile: bool = True) -> DecodeSpeed:
    """Greedy batch-1 generation speed of ``model`` with its KV cache (see the module docstring). ``compile``:
    whether the decode step of the static-cache loop is compiled (models that take that loop)."""
    from workbench.tasks.base import eval_mode, model_device

    if not callable(getattr(model, "generate", None)):
        raise TypeError(f"{type(model).__name__} has no generate(); tokens_per_second needs a Hugging Face causal "
                        f"LM (e.g. wb.models.load('tiny-llama'), compressed or not)")
    if not isinstance(new_tokens, int) or new_tokens < 2:
        raise ValueError(f"new_tokens must be an int >= 2, got {new_tokens!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    ids = prompt_ids(task_or_prompt, tokenizer).to(model_device(model))   # (1, T)
    cuda = ids.device.type == "cuda"

    with num_threads(threads) as used, eval_mode(model), torch.inference_mode():
        generate = _generator(model, compile)

        def run(n: int) -> float:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = generate(ids, n)
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            if out.shape[1] != ids.shape[1] + n:
                raise RuntimeError(f"{type(model).__name__} generated {out.shape[1] - ids.shape[1]} new tokens, "
                                   f"expected {n}")
            return elapsed

        run(new_tokens)                                        # warm-up (compile, allocations, cache set-up)
        totals, prefills = [], []
        for _ in range(repeats):                               # interleaved, so drift hits both alike
            prefills.append(run(1))
            totals.append(run(new_tokens))
    total, prefill = statistics.median(totals), statistics.median(prefills)
    return DecodeSpeed(tokens_per_s=new_tokens / total,
                       decode_tokens_per_s=(new_tokens - 1) / max(total - prefill, 1e-9),
                       prefill_ms=prefill * 1e3, new_tokens=new_tokens, prompt_tokens=int(ids.shape[1]),
                       runs=repeats, threads=int(used), path=_path(model, compile))


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


def lean_unsupported(model: Any) -> str | None:   # (Any: a Hugging Face model's attributes)
    """Why `greedy` cannot run ``model`` by its static-cache loop (None: it can)."""
    if not (hasattr(model, "generate") and hasattr(model, "config")):
        return f"{type(model).__name__} is not a Hugging Face causal LM"
    if getattr(model.config, "is_encoder_decoder", False):
        return f"{type(model).__name__} is an encoder-decoder"
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"{type(model).__name__} does not support a static KV cache in transformers"
    extra = sorted(set(model.generation_config.to_diff_dict()) - _NEUTRAL_GENERATION_KEYS)
    if extra:
        return (f"its generation config sets {extra}, which generate may apply as logits processors; the loop "
                f"applies none")
    return None


# keys of a generation config that change nothing in greedy decoding of exactly n tokens (the sampling ones are
# ignored with do_sample=False; the lengths are given per call)
_NEUTRAL_GENERATION_KEYS = frozenset({
    "bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "use_cache", "output_attentions",
    "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate", "_from_model_config",
    "transformers_version", "max_length", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p",
    "typical_p", "min_p", "num_beams", "num_return_sequences", "cache_implementation"})
# inductor's settings for the decode step: no size / stride / alignment checks of each input and each custom op's
# output in the wrapper (~270 calls a token on tiny-llama, ~0.3 ms of a 3 ms token; dynamo's guards have checked
# the inputs, and the ops' fake implementations give the outputs' shapes). The step is compiled with inductor's C++
# wrapper (the calls of a step's kernels and ops from C++, not Python: tiny-llama int4 cpu-int8 1.83 -> 1.52 ms a
# step, fp32 3.12 -> 2.72 ms, one thread; the cold compile about as long), its Python wrapper where that fails
_INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}


def _inductor_options(cpu: bool = True) -> dict:
    """`_INDUCTOR_OPTIONS`, and for a model on the CPU the fp32 Linears at one row on the dense GEMV of the CPU
    kernels and attention of the one query position on their decode attention (`workbench_kernels.ops.DecodeStepPass`)
    where those are built."""
    options = dict(_INDUCTOR_OPTIONS)
    if not cpu:
        return options
    try:
        from workbench_kernels.ops import DecodeStepPass
    except RuntimeError:   # the C++ kernels cannot be built here: PyTorch's GEMM and attention
        return options
    options["post_grad_custom_post_pass"] = DecodeStepPass()
    return options


# the static cache's length is a multiple of this, so prompts and lengths within one bucket share a compiled step
_CACHE_BUCKET = 128
# After a generation's first compiled step, the others run with dynamo's guards skipped
# (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``: only the guards that tell this code object's compiled
# entries apart, e.g. two cache buckets, are checked). Within one loop nothing a guard reads changes - the same model
# (its `_fingerprint`, compared before the loop), cache object, token and position shapes, eos ids and grad mode;
# the first step, guarded, picks or compiles the entry, and a model whose step read a Python value that changes from
# token to token would have recompiled every token, which the first call's check of the compiled logits against the
# eager ones (run the same way) refuses. tiny-llama int4 cpu-int8: 1.06x faster a token at 1 thread, 1.05x at 2
# (21 interleaved rounds in one process, the same tokens).
_SKIP_GUARDS = True


class _LeanDecoder:
    """The static-cache greedy loop of one model (see the module docstring): its caches, one per length bucket,
    and its decode step, compiled on first use or eager."""

    def __init__(self, model: Any, compile: bool):   # (Any: a Hugging Face model's attributes)
        # (no reference to the model: decoders live in a WeakKeyDictionary keyed by it; it is passed to each call)
        self.name, self.config = type(model).__name__, model.config
        self.compile, self.checked = compile, False
        eos = model.generation_config.eos_token_id
        self.eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.caches: dict[int, Any] = {}
        self.step: Callable = _decode_step
        # (way, compiled step, whether it replays CUDA graphs), tried in turn on first use
        self.candidates: list[tuple[str, Callable, bool]] = []
        self.fingerprint: tuple | None = None   # the model's `_fingerprint` this decoder was made for (`_decoder`)
        self.graphs = False   # whether the step replays CUDA graphs (its outputs are then cloned before the next step)
        if compile:
            from workbench_kernels.isa import inductor_cache_per_capability

            inductor_cache_per_capability()   # (a capped ATen capability: a cache of its own)
            cuda = any(p.is_cuda for p in itertools.chain(model.parameters(), model.buffers()))
            # on a GPU the step is captured in a CUDA graph (cudagraph trees) and replayed: one launch a token instead
            # of one per kernel and op, whose host time - the Triton kernels' Python launchers above all - would
            # otherwise be the token's time; on the CPU inductor's C++ wrapper calls the kernels
            python = ("the Python wrapper", {"cpp_wrapper": False}, False)
            ways = ((("CUDA graphs", {"triton.cudagraphs": True, "cpp_wrapper": False}, True), python) if cuda
                    else (("the C++ wrapper", {"cpp_wrapper": True}, False), python))
            for way, extra, graphs in ways:
                # a fresh code object per model (and way): dynamo keeps compiled code per code object, up to its
                # recompile limit (8), after which it runs eagerly - so no model's step evicts another's. Without
                # dynamo's guards on the model's modules, checked every token (tiny-llama int4: ~0.2 ms of a 1.4 ms
                # token): `_decoder` compares the model's `_fingerprint` once per generation instead
                code = _decode_step.__code__.replace()
                step = torch.compile(types.FunctionType(code, _decode_step.__globals__, "decode_step"),
                                     fullgraph=True, dynamic=False,
                                     options={**_inductor_options(not cuda), **extra,
                                              "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
                self.candidates.append((way, step, graphs))
            self.step, self.graphs = self.candidates[0][1], self.candidates[0][2]

    @property
    def path(self) -> DecodePath:
        return DecodePath.COMPILED if self.compile else DecodePath.STATIC_CACHE

    def _cache(self, length: int):
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

        size = -(-length // _CACHE_BUCKET) * _CACHE_BUCKET
        cache = self.caches.get(size)
        if cache is None:
            cache = self.caches[size] = StaticCache(config=self.config, max_cache_len=size)
            # a sliding-window (or chunked) layer whose window holds the whole cache attends as a full layer does (the
            # mask is the causal one); as such a layer it keeps a Python int of its length, which a traced step reads,
            # so dynamo would guard on it and recompile every token until its limit (then: the eager step)
            cache.layers = [StaticLayer(max_cache_len=size) if type(layer) is StaticSlidingWindowLayer and
                            layer.max_cache_len >= size else layer for layer in cache.layers]
        else:
            cache.reset()
        return cache

    def __call__(self, model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
        if self.compile and not self.checked and new_tokens > 1:
            # the first call that decodes compiles - with inductor's C++ wrapper, else its Python wrapper - and the
            # compiled step's logits must be the eager step's
            failed = []
            for wrapper, step, graphs in self.candidates:
                self.graphs = graphs
                try:
                    out, logits = self._run(model, prompt, new_tokens, step, keep=True)
                    self._check(model, prompt, out, logits)
                except Exception as e:  # noqa: BLE001 - any compile failure: the next way, saying why
                    failed.append(f"with {wrapper}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
                    if _in_tracing(e):   # dynamo's, before any wrapper: the other wrapper would fail the same way
                        break
                    continue
                if failed:
                    warnings.warn(f"workbench.measurement.decode: torch.compile of {self.name}'s decode step "
                                  f"failed ({failed[0]}); its step runs with {wrapper} instead (more time a token)",
                                  RuntimeWarning, stacklevel=3)
                self.step, self.checked, self.candidates = step, True, []
                # the model as the step was traced: layers build state on their first forward (a weight-only
                # layer's packed CPU weight), which the fingerprint taken before this first call did not see - the
                # next generation would otherwise compile the step again
                self.fingerprint = _fingerprint(model)
                return out
            warnings.warn(f"workbench.measurement.decode: torch.compile of {self.name}'s decode step failed "
                          f"({'; '.join(failed)}); decoding with the eager step instead", RuntimeWarning, stacklevel=3)
            self.compile, self.step, self.candidates, self.graphs = False, _decode_step, [], False
        return self._run(model, prompt, new_tokens, self.step)[0]

    def _run(self, model: nn.Module, prompt: torch.Tensor, new_tokens: int, step: Callable,
             keep: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(prompt and new tokens (1, T + new_tokens), where ``keep`` the masked fp32 logits of the first
        `_CHECK_STEPS` decode steps)."""
        T = prompt.shape[1]
        cache = self._cache(T + new_tokens)
        # prefill, eager (one call per prompt length; generate's logits: the last position's, in fp32)
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        tok = _masked_argmax(logits.float(), self.eos)                          # (1, 1)
        out, kept, pos = [prompt, tok], [], torch.tensor([T], device=prompt.device)
        with contextlib.ExitStack() as stack:
            if step is not _decode_step:
                stack.enter_context(_sdpa_gqa())
            for i in range(new_tokens - 1):
                if self.graphs:   # a new step: the graph's outputs of the last replay may be overwritten
                    torch.compiler.cudagraph_mark_step_begin()
                if i == 1 and step is not _decode_step and _SKIP_GUARDS:   # (see _SKIP_GUARDS)
                    stack.enter_context(torch.compiler.set_stance("default", skip_guard_eval_unsafe=True))
                tok, logits = step(model, tok, pos, cache, self.eos)
                if self.graphs:   # (the replay's outputs live in the graph's memory, rewritten by the next one)
                    tok = tok.clone()
                    logits = logits.clone() if keep and len(kept) < _CHECK_STEPS else logits
                out.append(tok)
                if keep and len(kept) < _CHECK_STEPS:
                    kept.append(logits)
                pos += 1
        return torch.cat(out, dim=1), kept                                      # (1, T + new_tokens)

    def _check(self, model: nn.Module, prompt: torch.Tensor, out: torch.Tensor, logits: list[torch.Tensor]) -> None:
        """The eager step, fed the compiled loop's tokens, gives its logits within `_CHECK_RTOL` of their largest
        magnitude (eight units of rounding of the model's least precise float tensors where that is more, and
        `_CHECK_RTOL_ROUNDED` with layers that round their inputs: ``rounds_activations``), and
        each compiled token is an argmax of the eager logits within that tolerance. (Not the tokens themselves:
        the compiled step sums in another order - inductor's fusions, the dense GEMV, grouped-query attention -
        and a random-init model's near-ties then pick another token, after which the texts part.)"""
        T = prompt.shape[1]
        cache = self._cache(out.shape[1])   # (the compiled run's bucket: no second cache)
        model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        # (a model with bf16 / fp16 tensors - cast layers, fp16 scales - computes some of it at their rounding)
        eps = max((torch.finfo(t.dtype).eps for t in itertools.chain(model.parameters(), model.buffers())
                   if t.dtype.is_floating_point), default=0.0)
        rtol = max(_CHECK_RTOL, 8 * eps)
        if any(getattr(m, "rounds_activations", False) for m in model.modules()):
            # (layers that round their inputs to a grid: an input a hair apart in the compiled step rounds one
            # step apart, and the caches part - llama-480m with cpu-int8 layers: 2e-3 of the largest logit at
            # the first step, 2e-2 at the 15th)
            rtol = max(rtol, _CHECK_RTOL_ROUNDED)
        pos = torch.tensor([T], device=prompt.device)
        for i, compiled in enumerate(logits):
            _, eager = _decode_step(model, out[:, T + i:T + i + 1], pos, cache, self.eos)
            finite = torch.isfinite(eager)
            tol = rtol * float(eager[finite].abs().max())
            if not torch.equal(finite, torch.isfinite(compiled)) or float((compiled - eager)[finite].abs().max()) > tol:
                raise RuntimeError(f"the compiled decode step's logits differ from the eager step's at new token "
                                   f"{i + 2}: max |difference| {float((compiled - eager)[finite].abs().max()):.3g}, "
                                   f"tolerance {tol:.3g}")
            if float(eager[0, out[0, T + i + 1]]) < float(eager.max()) - tol:
                raise RuntimeError(f"the compiled decode step's token {i + 2} is not an argmax of the eager "
                                   f"step's logits")
            pos += 1


def _in_tracing(e: Exception) -> bool:
    """Whether ``e`` is dynamo's failure to trace the step (or its recompile limit), not inductor's or the check's."""
    from torch._dynamo import exc

    return isinstance(e, (exc.Unsupported, exc.FailOnRecompileLimitHit, exc.UserError, exc.TorchRuntimeError))


# `_LeanDecoder._check`'s tolerance, relative to the largest |logit|: fp32 sums in another order differ by far less
# (llama-480m, 8 steps: 1.5e-6 fp32, 1.0e-6 int8 / int4 g32 with an int8 head); a wrong graph by far more
_CHECK_RTOL = 1e-3
_CHECK_RTOL_ROUNDED = 0.1
_CHECK_STEPS = 32   # decode steps checked (their logits kept: vocabulary x 4 bytes each)


# transformers' sdpa attention gives PyTorch's sdpa each key / value head repeated for its query heads - in a compiled
# step a copy of the whole cache, every layer and token (llama-480m: 2 MB a layer, ~0.7 ms of a 40 ms int4 token;
# eager decoding packs the query heads instead) - unless this switch of transformers' tells it to pass enable_gqa
# (PyTorch's CPU flash attention takes grouped heads and the mask as they are). It is read when the step is traced
# and guarded on (a compiled step records the value), so it is set around every compiled decoding loop, and only there.
_GQA_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"


@contextlib.contextmanager
def _sdpa_gqa():
    old = os.environ.get(_GQA_SWITCH)
    os.environ[_GQA_SWITCH] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ[_GQA_SWITCH]
        else:
            os.environ[_GQA_SWITCH] = old


def _masked_argmax(logits: torch.Tensor, eos: list[int]) -> torch.Tensor:  # (1, vocab) -> (1, 1)
    # generate(min_new_tokens=n) masks the end-of-text tokens until n tokens are out: every token here
    if eos:
        logits[:, eos] = -float("inf")
    return logits.argmax(-1, keepdim=True)


def _decode_step(model: nn.Module, tok: torch.Tensor, pos: torch.Tensor, cache,
                 eos: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One greedy token: ``tok`` (1, 1) at position ``pos`` (1,) through the model into ``cache`` -> the next token
    (1, 1) and its masked fp32 logits (1, vocab)."""
    logits = model(input_ids=tok, past_key_values=cache, cache_position=pos, position_ids=pos.unsqueeze(0),
                   use_cache=True).logits[:, -1].float()                       # (1, vocab)
    return _masked_argmax(logits, eos), logits


_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> {(compile, threads): _LeanDecoder}


def _decoder(model: nn.Module, compile: bool) -> _LeanDecoder:
    """The model's decoder; a new one (compiled anew) when the model's `_fingerprint` is not the one its compiled
    step was made for."""
    key = (bool(compile), torch.get_num_threads())   # inductor's CPU kernels are built for the thread count
    per_model = _DECODERS.setdefault(model, {})
    fingerprint = _fingerprint(model) if compile else None
    decoder = per_model.get(key)
    if decoder is None or decoder.fingerprint != fingerprint:
        decoder = per_model[key] = _LeanDecoder(model, bool(compile))
        decoder.fingerprint = fingerprint
    return decoder


_PLAIN = (str, int, float, bool, type(None), enum.Enum, torch.dtype, torch.device)


def _fingerprint(model: nn.Module) -> tuple:
    """What dynamo's guards on the model's modules check, which the compiled step is built without (they would run
    every token): the module tree (names, types, identities) and, per module, each attribute - plain values by value,
    tensors (parameters and buffers included) by identity, shape, dtype, device and whether they need gradients,
    containers (hook dictionaries, module lists) by identity and length, anything else by identity. A parameter
    changed in place keeps the fingerprint, and needs none: the compiled step reads parameters as inputs."""
    def entry(value):
        if isinstance(value, _PLAIN):
            return value
        if isinstance(value, torch.Tensor):
            return id(value), tuple(value.shape), value.dtype, value.device, value.requires_grad
        if isinstance(value, dict):
            return id(value), tuple((k, entry(v)) for k, v in value.items()) if len(value) < 64 else len(value)
        if isinstance(value, (list, tuple, set)):
            return id(value), len(value)
        return id(value)

    return tuple((name, type(module), id(module), tuple((k, entry(v)) for k, v in vars(module).items()
                                                           if k != "_modules"))
                 for name, module in model.named_modules(remove_duplicate=False))


def _path(model: nn.Module, compile: bool) -> DecodePath:
    if lean_unsupported(model) is None:   # (the decoder that ran, or what a new one takes: none is made here)
        decoder = _DECODERS.get(model, {}).get((bool(compile), torch.get_num_threads()))
        return decoder.path if decoder is not None else (DecodePath.COMPILED if compile else DecodePath.STATIC_CACHE)
    return DecodePath.GENERATE if hasattr(model, "generate") else DecodePath.FORWARD


def _generator(model: Any, compile: bool) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """``(prompt (1, T), n) -> (1, T + n)`` ids by ``model``'s path (see the module docstring)."""
    if lean_unsupported(model) is None:
        decoder = _decoder(model, compile)
        return lambda ids, n: decoder(model, ids, n)
    if hasattr(model, "generate") and hasattr(model, "config"):
        return lambda ids, n: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                             min_new_tokens=n, do_sample=False, use_cache=True, pad_token_id=0)
    block = getattr(getattr(model, "cfg", None), "block_size", None)

    def forward(ids: torch.Tensor, n: int) -> torch.Tensor:
        for _ in range(n):
            logits = model(ids if block is None else ids[:, -block:])          # (1, T, vocab)
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return ids
    return forward


def greedy(model: nn.Module, prompt: torch.Tensor, new_tokens: int, *, compile: bool = True) -> torch.Tensor:
    """``prompt`` (1, T) int64 followed by ``new_tokens`` greedily chosen tokens: (1, T + new_tokens), by the
    model's path (see the module docstring; ``compile``: whether the static-cache loop's step is compiled)."""
    with torch.inference_mode():
        return _generator(model, compile)(prompt, new_tokens)


def tokens_per_s(model: nn.Module, new_tokens: int = 16, prompt_tokens: int = 8, runs: int = 3,
                 seed: int = 0, *, compile: bool = True) -> float:
    """Median tokens per second of `greedy` generation over ``runs`` timed runs (after one warm-up run, which
    compiles where the path does), batch 1, from a random prompt of ``prompt_tokens`` tokens."""
    if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or new_tokens < 1:
        raise ValueError(f"new_tokens must be a positive int, got {new_tokens!r}")
    from workbench.tasks.base import model_device

    device = model_device(model)   # (CPU for a model without parameters, e.g. llama.cpp behind LlamaCppModel)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, vocab_size(model), (1, prompt_tokens), generator=gen).to(device)
    times = []
    with torch.inference_mode():
        generate = _generator(model, compile)
        for i in range(runs + 1):
            t0 = time.perf_counter()
            out = generate(prompt, new_tokens)
            if out.is_cuda:   # (the GPU's work is asynchronous: the run ends when it is done)
                torch.cuda.synchronize(out.device)
            if i:
                times.append(time.perf_counter() - t0)
    if out.shape[1] != prompt_tokens + new_tokens:
        raise RuntimeError(f"{type(model).__name__} generated {out.shape[1] - prompt_tokens} tokens, "
                           f"{new_tokens} were asked for")
    return new_tokens / statistics.median(times)
