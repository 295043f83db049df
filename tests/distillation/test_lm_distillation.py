"""LM distillation (`wb.distill.fit_lm`, `lm_kl`, `teacher_sequences`): the losses against their definitions, the
teacher's sequences against a cache-free re-run, and training on models the code was not written for (Hugging Face
GPT-2 and Llama from small random configs, the zoo's char-level tiny-lm, the real tiny-llama)."""
import copy

import numpy as np
import pytest
import torch

import workbench as wb
from workbench.distillation.lm import token_stream


def _kl(p_log, q_log):
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def test_lm_kl_matches_the_definitions_and_differs_by_direction():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 11, generator=g), 3 * torch.randn(2, 5, 11, generator=g)
    ls, lt = s.log_softmax(-1), t.log_softmax(-1)
    fwd, rev = wb.distill.lm_kl(s, t, "forward"), wb.distill.lm_kl(s, t, "reverse")
    assert torch.allclose(fwd, _kl(lt, ls).mean(), atol=1e-6)
    assert torch.allclose(rev, _kl(ls, lt).mean(), atol=1e-6)
    assert abs(float(fwd - rev)) > 0.1                          # asymmetric on these logits
    assert float(wb.distill.lm_kl(t, t, "reverse")) == pytest.approx(0.0, abs=1e-6)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[:, 2:] = True
    assert torch.allclose(wb.distill.lm_kl(s, t, mask=mask), _kl(lt, ls)[:, 2:].mean(), atol=1e-6)
    T = 3.0
    want = _kl((t / T).log_softmax(-1), (s / T).log_softmax(-1)).mean() * T * T
    assert torch.allclose(wb.distill.lm_kl(s, t, temperature=T), want, atol=1e-5)


def test_lm_kl_gradient_is_the_softmax_difference():
    """d KL(t || s) / d s_logits = softmax(s) - softmax(t) per position (divided by the positions averaged)."""
    s = torch.randn(4, 7, requires_grad=True)
    t = torch.randn(4, 7)
    wb.distill.lm_kl(s, t).backward()
    assert torch.allclose(s.grad, (s.softmax(-1) - t.softmax(-1)).detach() / 4, atol=1e-6)


def test_lm_kl_refuses_bad_input():
    with pytest.raises(ValueError, match="same vocabulary"):
        wb.distill.lm_kl(torch.randn(2, 3, 5), torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match="direction"):
        wb.distill.lm_kl(torch.randn(2, 5), torch.randn(2, 5), "backward")
    with pytest.raises(ValueError, match="temperature"):
        wb.distill.lm_kl(torch.randn(2, 5), torch.randn(2, 5), temperature=0)


def _random_lm(kind: str, seed: int, layers: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = GPT2Config(n_embd=32, n_layer=layers, n_head=4, vocab_size=96, n_positions=64, bos_token_id=0,
                         eos_token_id=0)
        return GPT2LMHeadModel(cfg).eval()
    cfg = LlamaConfig(hidden_size=32, intermediate_size=56, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def _task(vocab: int = 96, block: int = 16):
    """A CausalLM task on synthetic text: a repeating pattern with noise, so a teacher can be trained to it."""
    rng = np.random.default_rng(0)
    base = rng.integers(1, vocab, size=40)
    texts = [" ".join(str(int(v)) for v in np.roll(base, k) + rng.integers(0, 2, size=40)) for k in range(40)]
    return wb.tasks.CausalLM(texts, lambda s: [min(int(v), vocab - 1) for v in s.split()], block_size=block)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_teacher_sequences_with_the_kv_cache_equal_a_full_rerun(kind):
    teacher, task = _random_lm(kind, 0), _task()
    cached = wb.distill.teacher_sequences(teacher, task, 5, prompt_tokens=4, decoding="greedy", progress=False)
    assert cached.shape == (5, task.block_size + 1) and cached.dtype == torch.int64
    ids, _ = token_stream(task)
    starts = np.random.default_rng(0).integers(0, len(ids) - 4, size=5)
    assert torch.equal(cached[:, :4], torch.from_numpy(np.stack([ids[s:s + 4] for s in starts])))
    seq = cached[:, :4]
    with torch.no_grad():
        for _ in range(task.block_size + 1 - 4):
            seq = torch.cat([seq, teacher(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(cached, seq)
    a = wb.distill.teacher_sequences(teacher, task, 6, prompt_tokens=4, seed=3, progress=False)
    b = wb.distill.teacher_sequences(teacher, task, 6, prompt_tokens=4, seed=3, progress=False)
    c = wb.distill.teacher_sequences(teacher, task, 6, prompt_tokens=4, seed=4, progress=False)
    assert torch.equal(a, b) and not torch.equal(a, c)          # sampled, reproducible from the seed


def _trained_teacher(task, kind="llama"):
    teacher = _random_lm(kind, 0, layers=2)
    wb.distill.fit_lm(teacher, teacher, task, loss="forward_kl", alpha=0.0, steps=120, lr=1e-2, batch_size=16,
                      progress=False)                        # alpha=0: plain next-token training on the data
    return teacher


def _kl_to_teacher(student, teacher, task, direction):
    x = torch.from_numpy(np.stack([task.test_ids[i:i + task.block_size] for i in range(0, 48, 16)]))
    with torch.no_grad():
        return float(wb.distill.lm_kl(student(x).logits, teacher(x).logits, direction))


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "sequence"])
def test_fit_lm_moves_a_different_architecture_towards_the_teacher(loss):
    """A GPT-2 student learns from a Llama teacher: each objective lowers its divergence from the teacher on
    held-out windows; the student is trained in place and left in eval mode; the teacher is untouched."""
    task = _task()
    teacher = _trained_teacher(task)
    before_teacher = copy.deepcopy(teacher.state_dict())
    student = _random_lm("gpt2", 1, layers=1)
    kl0 = _kl_to_teacher(student, teacher, task, "forward")
    rkl0 = _kl_to_teacher(student, teacher, task, "reverse")
    hist = wb.distill.fit_lm(student, teacher, task, loss=loss, steps=60, lr=1e-2, batch_size=8, sequences=32,
                             prompt_tokens=4, progress=False)
    assert list(hist.columns) == ["step", "loss"] and len(hist) == 60 and np.isfinite(hist.loss).all()
    assert hist.loss.iloc[-10:].mean() < hist.loss.iloc[:10].mean()
    assert not student.training
    assert _kl_to_teacher(student, teacher, task, "forward") < 0.7 * kl0
    assert _kl_to_teacher(student, teacher, task, "reverse") < 0.7 * rkl0
    assert all(torch.equal(v, before_teacher[k]) for k, v in teacher.state_dict().items())


def test_fit_lm_on_the_zoo_char_model_without_a_kv_cache():
    """tiny-lm is a plain nn.Module returning a logits tensor: sequences come from re-running the prefix."""
    teacher = wb.models.load("tiny-lm")
    task = wb.tasks.load("tiny-lm")
    student = wb.distill.drop_layers(teacher, "h", [0])
    seqs = wb.distill.teacher_sequences(teacher, task, 2, prompt_tokens=120, progress=False)
    assert seqs.shape == (2, task.block_size + 1)
    x = torch.from_numpy(task.corpus.test[:2 * 128].reshape(2, 128))
    with torch.no_grad():
        kl0 = float(wb.distill.lm_kl(student(x), teacher(x)))
    wb.distill.fit_lm(student, teacher, task, loss="reverse_kl", steps=15, lr=2e-3, batch_size=4, progress=False)
    with torch.no_grad():
        assert float(wb.distill.lm_kl(student(x), teacher(x))) < kl0


def test_fit_lm_refuses_what_it_cannot_do():
    task = _task()
    teacher = _random_lm("llama", 0)
    other_vocab = wb.distill.drop_layers(_random_lm("gpt2", 1), "transformer.h", [0])
    other_vocab.resize_token_embeddings(100)
    with pytest.raises(ValueError, match="same vocabulary"):
        wb.distill.fit_lm(other_vocab, teacher, task, steps=1, progress=False)
    with pytest.raises(ValueError, match="loss must be one of"):
        wb.distill.fit_lm(_random_lm("gpt2", 1), teacher, task, loss="kl", steps=1, progress=False)
    with pytest.raises(TypeError, match="causal-LM task"):
        wb.distill.fit_lm(_random_lm("gpt2", 1), teacher, wb.tasks.load("digits"), steps=1, progress=False)
    with pytest.raises(ValueError, match="steps"):
        wb.distill.fit_lm(_random_lm("gpt2", 1), teacher, task, steps=0, progress=False)
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(d_model=32, d_kv=8, d_ff=48, num_layers=1, num_heads=4, vocab_size=96,
                                             decoder_start_token_id=0, pad_token_id=0))
    with pytest.raises(ValueError, match="the student \\(T5ForConditionalGeneration\\) cannot run as a causal LM"):
        wb.distill.fit_lm(t5, teacher, task, steps=1, progress=False)
    body = _random_lm("llama", 2).model                        # LlamaModel: hidden states, no LM head
    with pytest.raises(TypeError, match="LlamaModel.*no 'logits'"):
        wb.distill.fit_lm(body, teacher, task, steps=1, progress=False)


def test_fit_lm_stops_on_a_nan_loss_with_the_last_good_weights():
    task = _task()
    teacher = _random_lm("llama", 0)
    student = _random_lm("gpt2", 1, layers=1)
    with torch.no_grad():
        student.lm_head.weight[3, 0] = float("nan")          # tied: every forward is NaN from the first step
    before = copy.deepcopy(student.state_dict())
    with pytest.warns(RuntimeWarning, match="stopped at step 1"):
        hist = wb.distill.fit_lm(student, teacher, task, steps=5, progress=False)
    assert len(hist) == 0
    assert all(torch.equal(v, before[k]) or torch.isnan(v).any() for k, v in student.state_dict().items())


@pytest.mark.slow
def test_fit_lm_heals_a_layer_dropped_tiny_llama():
    """The real model: tiny-llama with two of its eight blocks dropped, healed by 30 steps of forward KL, gets
    back most of the held-out perplexity it lost (quick windows)."""
    teacher = wb.models.load("tiny-llama")
    task = wb.tasks.load("tiny-llama")
    student = wb.distill.drop_layers(teacher, "model.layers", [0, 1, 2, 3, 5, 7])
    ppl_t = task.evaluate(teacher, quick=True)["perplexity"]
    ppl_0 = task.evaluate(student, quick=True)["perplexity"]
    wb.distill.fit_lm(student, teacher, task, steps=30, lr=1e-3, progress=False)
    ppl_1 = task.evaluate(student, quick=True)["perplexity"]
    assert ppl_1 - ppl_t < 0.5 * (ppl_0 - ppl_t), (ppl_t, ppl_0, ppl_1)
