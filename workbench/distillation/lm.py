"""Distilling language models: token-level forward / reverse KL and sequence-level distillation.

    history = wb.distill.fit_lm(student, teacher, task, loss="reverse_kl", steps=200)

``task`` is a causal-LM task (``tiny-llama``, ``tiny-lm`` or ``wb.tasks.CausalLM`` on the user's text): its
training token stream gives the windows; the held-out text is never seen. Three objectives, each the teacher's
knowledge in a different form:

- ``"forward_kl"`` - word-level distillation (Hinton et al. 2015; Kim & Rush 2016 "word-level KD"):
  KL(teacher || student) summed over the vocabulary at each position of a data window, averaged over positions.
  Mode-covering: the student is penalised wherever the teacher puts mass and it does not.
- ``"reverse_kl"`` - KL(student || teacher) on the same windows (the objective MiniLLM, Gu et al. 2024, optimises
  on the student's own samples; here it is taken token by token on data windows, as GKD's off-policy variant does).
  Mode-seeking: the student is penalised where *it* puts mass the teacher does not, and may drop the teacher's
  minor modes.
- ``"sequence"`` - sequence-level distillation (Kim & Rush 2016): the teacher writes ``sequences`` continuations
  of prompts taken from the training stream (`teacher_sequences`, sampled or greedy, generated once), and the
  student learns them by next-token cross-entropy on the generated tokens.

``alpha`` mixes the distillation term with the data's own next-token cross-entropy:
``(1 - alpha) * CE(data) + alpha * distillation`` (``alpha=0`` is plain fine-tuning on the data, the baseline with
the same budget). The optimizer is AdamW with a one-cycle schedule, gradients clipped at 1 (`training.optimizer_step`);
the student is trained in place (pass a copy to keep the original), shows a tqdm bar, can be interrupted (it keeps
the last finished step and is left in eval mode) and stops with a warning on a NaN/Inf loss (nothing applied from
that step). Models are called as ``model(ids)`` with ids (B, T) and must return (B, T, vocab) logits: a tensor, a
tuple or a Hugging Face output with ``logits``.
"""
from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from workbench.distillation.losses import check_kd_args
from workbench.measurement.latency import threads_option
from workbench.tasks import inputs as I
from workbench.training import one_cycle, optimizer_step

__all__ = ["LM_LOSSES", "lm_kl", "teacher_sequences", "fit_lm", "token_stream"]

LM_LOSSES = ("forward_kl", "reverse_kl", "sequence")


def lm_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, direction: str = "forward",
          temperature: float = 1.0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Token-level KL divergence between next-token distributions, (..., V) logits: summed over the vocabulary,
    averaged over positions (those where ``mask`` is true, if given). ``direction="forward"``: KL(teacher ||
    student); ``"reverse"``: KL(student || teacher). Softmax at ``temperature``, scaled by T² as in `kd_loss`
    (Hinton's factor keeps the gradient scale near T = 1's; it is exact only for logit gaps well below T). The
    teacher's logits are detached."""
    check_kd_args(1.0, temperature)
    if direction not in ("forward", "reverse"):
        raise ValueError(f"direction must be 'forward' or 'reverse', got {direction!r}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"the student's logits have shape {tuple(student_logits.shape)} but the teacher's have "
                         f"{tuple(teacher_logits.shape)}; they must match (same vocabulary, same positions)")
    T = float(temperature)
    log_s = F.log_softmax(student_logits.float() / T, dim=-1)
    log_t = F.log_softmax(teacher_logits.detach().float() / T, dim=-1)
    if direction == "forward":
        per_token = (log_t.exp() * (log_t - log_s)).sum(-1)
    else:
        per_token = (log_s.exp() * (log_s - log_t)).sum(-1)
    if mask is not None:
        mask = mask.to(per_token.device, torch.bool).expand_as(per_token)
        if not mask.any():
            raise ValueError("the mask selects no position")
        per_token = per_token[mask]
    return per_token.mean() * T * T


def token_stream(task) -> tuple[np.ndarray, int]:
    """The training token stream and window length of a causal-LM task (``CausalLM``, ``tiny-llama``,
    ``tiny-lm``)."""
    ids = getattr(task, "train_ids", None)
    if ids is None and hasattr(task, "corpus"):
        ids = getattr(task.corpus, "train", None)
    block = getattr(task, "block_size", None)
    if ids is None or block is None:
        raise TypeError(f"LM distillation needs a causal-LM task with a training token stream (tiny-llama, tiny-lm, "
                        f"wb.tasks.CausalLM), got {task!r:.80}")
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) < block + 2:
        raise ValueError(f"the task's training stream has {len(ids)} tokens, fewer than one window of {block} + 1")
    return ids, int(block)


def _logits(model: nn.Module, ids: torch.Tensor, who: str) -> torch.Tensor:
    out = model(ids)
    if isinstance(out, Mapping) and "logits" not in out:
        raise TypeError(f"the {who} ({type(model).__name__}) returns {sorted(out)[:4]} but no 'logits': LM "
                        f"distillation needs a language-model head's next-token logits (e.g. LlamaForCausalLM, not "
                        f"LlamaModel)")
    out = I.output_tensor(out, who, prefer=("logits",))
    if out.ndim != 3 or tuple(out.shape[:2]) != tuple(ids.shape):
        raise ValueError(f"the {who} must return (batch, tokens, vocab) logits for ids of shape {tuple(ids.shape)}, "
                         f"got {tuple(out.shape)}")
    return out


def _windows(ids: np.ndarray, starts: np.ndarray, length: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([ids[s:s + length] for s in starts]))


def _sample_next(logits: torch.Tensor, greedy: bool, generator: torch.Generator) -> torch.Tensor:
    if greedy:
        return logits.argmax(-1)
    probs = F.softmax(logits.float(), dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


@torch.inference_mode()
def teacher_sequences(teacher: nn.Module, task, n: int, *, prompt_tokens: int = 16, decoding: str = "sample",
                      seed: int = 0, batch_size: int = 32, progress: bool = True) -> torch.Tensor:
    """``n`` sequences of ``block_size + 1`` tokens: a ``prompt_tokens`` prompt from the task's training stream
    (seeded choice of windows) continued by the teacher, token by token - sampled from its full distribution
    (``decoding="sample"``) or its most likely token (``"greedy"``). Returns (n, block_size + 1) int64 on the
    CPU. The end-of-text token is drawn like any other and the teacher goes on past it, as the training stream
    runs on into the next document. Models taking ``past_key_values`` (Hugging Face causal LMs) decode with their
    KV cache; others are re-run on the growing prefix."""
    from workbench.tasks.base import eval_mode, model_device

    ids, block = token_stream(task)
    if decoding not in ("sample", "greedy"):
        raise ValueError(f"decoding must be 'sample' or 'greedy', got {decoding!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n (sequences) must be a positive int, got {n!r}")
    if not isinstance(prompt_tokens, int) or not 1 <= prompt_tokens <= block:
        raise ValueError(f"prompt_tokens must be an int in [1, {block}], got {prompt_tokens!r}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(ids) - prompt_tokens, size=n)
    prompts = _windows(ids, starts, prompt_tokens)                           # (n, P)
    device = model_device(teacher)
    gen = torch.Generator().manual_seed(seed)
    new = block + 1 - prompt_tokens
    cached = "past_key_values" in inspect.signature(teacher.forward).parameters   # Hugging Face causal LMs
    out = []
    with eval_mode(teacher):
        for i in tqdm(range(0, n, batch_size), desc="teacher sequences", disable=not progress, leave=False):
            seq = prompts[i:i + batch_size].to(device)
            if cached:
                res = teacher(input_ids=seq, use_cache=True)
                for _ in range(new):
                    nxt = _sample_next(res.logits[:, -1], decoding == "greedy", gen)         # (b,)
                    seq = torch.cat([seq, nxt[:, None]], dim=1)
                    if seq.shape[1] <= block:
                        res = teacher(input_ids=nxt[:, None], past_key_values=res.past_key_values, use_cache=True)
            else:
                for _ in range(new):
                    logits = _logits(teacher, seq[:, -block:], "teacher")[:, -1]
                    seq = torch.cat([seq, _sample_next(logits, decoding == "greedy", gen)[:, None]], dim=1)
            if seq.shape[1] != block + 1:
                raise RuntimeError(f"the teacher generated {seq.shape[1] - prompt_tokens} tokens, expected {new}")
            out.append(seq.cpu())
    return torch.cat(out)


@threads_option
def fit_lm(student: nn.Module, teacher: nn.Module, task, *, loss: str = "forward_kl", steps: int = 200,
           lr: float = 1e-3, batch_size: int = 8, alpha: float = 1.0, temperature: float = 1.0, seed: int = 0,
           weight_decay: float = 0.0, sequences: int = 256, prompt_tokens: int = 16, decoding: str = "sample",
           progress: bool = True, workers: int = 1, strategy: str = "ddp"):
    """See the module docstring. ``steps`` optimizer steps on batches of ``batch_size`` windows of the task's
    block size. For ``loss="sequence"``: ``sequences`` teacher continuations of ``prompt_tokens``-token prompts
    (``decoding`` "sample" or "greedy"), generated once before training. ``workers``: data-parallel processes
    sharing each global batch, replicating the student (``strategy="ddp"``) or sharding it (``"fsdp"``,
    `workbench.distributed`); every worker holds the teacher. Returns a DataFrame (step, loss) of the training
    loss every step."""
    import pandas as pd

    from workbench import distributed
    from workbench.tasks.base import check_model, model_device

    if loss not in LM_LOSSES:
        raise ValueError(f"loss must be one of {LM_LOSSES}, got {loss!r}")
    check_kd_args(alpha, temperature)
    distributed.check_strategy(strategy)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr!r}")
    if distributed.check_workers(workers) > 1 and not distributed.is_worker():
        distributed.check_batch_size(batch_size, workers)
        token_stream(task)                               # a task it cannot train on is refused before spawning
        return distributed.launch(fit_lm, student, (teacher, task), dict(
            loss=loss, steps=steps, lr=lr, batch_size=batch_size, alpha=alpha, temperature=temperature, seed=seed,
            weight_decay=weight_decay, sequences=sequences, prompt_tokens=prompt_tokens, decoding=decoding,
            progress=progress), workers, strategy=strategy)
    check_model(student)
    check_model(teacher)
    ids, block = token_stream(task)
    device = model_device(student)
    probe = torch.from_numpy(ids[:block][None])
    shapes = {}
    with torch.no_grad():
        for who, model in (("student", student), ("teacher", teacher)):
            try:
                shapes[who] = tuple(_logits(model.eval(), probe.to(model_device(model)), who).shape)
            except (TypeError, ValueError) as e:   # e.g. an encoder-decoder that wants decoder inputs
                raise type(e)(f"the {who} ({type(model).__name__}) cannot run as a causal LM, model(ids) with ids "
                              f"(1, {block}) giving next-token logits: {e}") from e
    s_shape, t_shape = shapes["student"], shapes["teacher"]
    if s_shape != t_shape:
        raise ValueError(f"the student's logits are {s_shape} per window but the teacher's are {t_shape}: LM "
                         f"distillation needs the same vocabulary")
    if int(ids.max()) >= s_shape[-1]:
        raise ValueError(f"token id {int(ids.max())} of the task is outside the models' vocabulary of {s_shape[-1]}")
    seqs = None
    if loss == "sequence":   # (every worker writes the same sequences: the same seed and teacher)
        seqs = teacher_sequences(teacher, task, sequences, prompt_tokens=prompt_tokens, decoding=decoding,
                                 seed=seed, progress=progress and not distributed.is_worker())
    g = torch.Generator().manual_seed(seed)
    if not any(p.requires_grad for p in student.parameters()):
        raise ValueError("the student has no trainable parameters")
    net, where = distributed.prepare(student)      # (before the optimizer: FSDP replaces the parameters)
    params = [p for p in student.parameters() if p.requires_grad]
    opt, sched = one_cycle(params, lr=lr, weight_decay=weight_decay, total_steps=steps)
    gen_mask = torch.arange(block) >= prompt_tokens - 1            # targets the teacher wrote, not the prompt
    weight = 1.0

    def batch_loss() -> torch.Tensor:
        # every worker draws the same global batch from ``g`` and computes on its share (weight: its part of the
        # global mean), so one process and N workers take the same steps
        nonlocal weight
        total = torch.zeros((), device=device)
        if loss != "sequence" or alpha < 1:
            starts = torch.randint(0, len(ids) - block - 1, (batch_size,), generator=g)
            starts, weight = distributed.shard(starts, where)
            w = _windows(ids, starts.numpy(), block + 1).to(device)  # (b, T + 1)
            s_logits = _logits(net, w[:, :-1], "student")            # (b, T, V)
            if alpha < 1:
                ce = F.cross_entropy(s_logits.float().transpose(1, 2), w[:, 1:])
                total = total + (1 - alpha) * ce
            if loss != "sequence" and alpha > 0:
                with torch.no_grad():
                    t_logits = _logits(teacher, w[:, :-1].to(model_device(teacher)), "teacher").to(device)
                direction = "forward" if loss == "forward_kl" else "reverse"
                total = total + alpha * lm_kl(s_logits, t_logits, direction, temperature)
        if loss == "sequence" and alpha > 0:
            rows = torch.randint(0, len(seqs), (batch_size,), generator=g)
            rows, weight = distributed.shard(rows, where)
            w = seqs[rows].to(device)                                # (b, T + 1)
            s_logits = _logits(net, w[:, :-1], "student")
            ce = F.cross_entropy(s_logits.float().transpose(1, 2), w[:, 1:], reduction="none")   # (B, T)
            total = total + alpha * ce[:, gen_mask.to(device)].mean()
        return total

    history = []
    teacher.eval()
    student.train()
    try:
        for step in tqdm(range(1, steps + 1), desc=f"distill ({loss})", disable=not progress or where[0] > 0,
                         leave=False):
            try:
                batch = batch_loss()
                value = optimizer_step(batch, opt, sched, weight=weight, where=where, clip=1.0, params=params)
            except FloatingPointError as e:
                warnings.warn(f"LM distillation stopped at step {step}: {e}; the student keeps step {step - 1}'s "
                              f"weights", RuntimeWarning, stacklevel=2)
                break
            history.append({"step": step, "loss": value})
    finally:
        student.eval()
    return pd.DataFrame(history, columns=["step", "loss"])

