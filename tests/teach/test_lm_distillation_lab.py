"""Lab 31 (LM distillation): every checker passes its worked solution and rejects plausible wrong
implementations with the hint written for that mistake; the toy shows the two divergences' different fits."""
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from workbench.teach import lm_distillation as L
from workbench.teach.lm_distillation import checks as C


def _logits(seed, shape=(3, 5, 17), scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


S, T = _logits(0), _logits(1, scale=3.0)


def _kl(a, b):
    return float((a.exp() * (a - b)).sum(-1).mean())


def test_toy_fits_cover_and_seek():
    p = L.toy_teacher()
    search = L.toy_search(p)
    wide = search.loc[search.forward_kl.idxmin()]
    narrow = search.loc[search.reverse_kl.idxmin()]
    assert wide.sigma > 1.5 and -1.5 < wide.mu < 1.0                  # spread over both modes
    assert narrow.sigma < 0.6 and abs(narrow.mu - (-1.8)) < 0.15     # on the heavier mode
    assert L.toy_figure(p, search).data


def test_forward_and_reverse_kl():
    assert C.check_forward_kl(C._solution_forward_kl(S, T), S, T).passed
    assert C.check_reverse_kl(C._solution_reverse_kl(S, T), S, T).passed
    ls, lt = S.log_softmax(-1), T.log_softmax(-1)
    swapped = C.check_forward_kl(_kl(ls, lt), S, T)
    assert swapped.status == "failed" and "other direction" in swapped.hint
    vocab_mean = C.check_reverse_kl(float((ls.exp() * (ls - lt)).mean()), S, T)
    assert vocab_mean.status == "failed" and "vocabulary entries" in vocab_mean.hint
    batchmean = C.check_forward_kl(float(F.kl_div(ls, lt, reduction="batchmean", log_target=True)), S, T)
    assert batchmean.status == "failed" and "batchmean" in batchmean.hint


def test_toy_fit():
    p = L.toy_teacher()
    assert C.check_toy_fit(C._solution_toy_fit(p, L.GRID, L.MUS, L.SIGMAS), p).passed
    search = L.toy_search(p)
    wide = search.loc[search.forward_kl.idxmin()]
    wrong = C.check_toy_fit((wide.mu, wide.sigma), p)
    assert wrong.status == "failed" and "forward-KL fit" in wrong.hint
    other = search[search.mu > 0.5]
    local = other.loc[other.reverse_kl.idxmin()]
    stuck = C.check_toy_fit((local.mu, local.sigma), p)
    assert stuck.status == "failed" and "local minimum" in stuck.hint


def test_kl_gradient():
    s, t = _logits(2, (6, 9)), _logits(3, (6, 9), 2.0)
    assert C.check_kl_gradient(C._solution_kl_gradient(s, t), s, t).passed
    assert C.check_kl_gradient(C._solution_kl_gradient(s.double(), t.double()), s, t).passed
    wrong = C.check_kl_gradient(t.softmax(-1) - s.softmax(-1), s, t)      # sign and scale wrong
    assert wrong.status == "failed"
    sign = C.check_kl_gradient((t.softmax(-1) - s.softmax(-1)) / 6, s, t)
    assert sign.status == "failed" and "sign" in sign.hint
    scale = C.check_kl_gradient(s.softmax(-1) - t.softmax(-1), s, t)
    assert scale.status == "failed" and "divided by 6" in scale.hint


def test_sequence_loss():
    seqs = torch.randint(0, 17, (3, 6), generator=torch.Generator().manual_seed(4))
    z = _logits(5, (3, 5, 17))
    assert C.check_sequence_loss(C._solution_sequence_loss(z, seqs, 2), z, seqs, 2).passed
    ce = F.cross_entropy(z.transpose(1, 2), seqs[:, 1:], reduction="none")
    with_prompt = C.check_sequence_loss(float(ce.mean()), z, seqs, 2)
    assert with_prompt.status == "failed" and "prompt" in with_prompt.hint
    off = C.check_sequence_loss(float(ce[:, 2:].mean()), z, seqs, 2)
    assert off.status == "failed" and "off by one" in off.hint


def test_most_peaked_is_read_from_the_measurement():
    table = pd.DataFrame({"student entropy": [4.6, 4.5, 4.7]}, index=["forward KL", "reverse KL", "sequence-level"])
    assert C.check_most_peaked(C._solution_most_peaked(table), table).passed
    wrong = C.check_most_peaked("forward KL", table)
    assert wrong.status == "failed" and "4.500" in wrong.hint


@pytest.mark.slow
def test_heal_measures_every_objective_on_the_same_budget():
    import workbench as wb

    teacher, task = wb.models.load("tiny-llama"), wb.tasks.load("tiny-llama")
    table, histories = L.heal(teacher, task, [0, 1, 2, 3, 5, 7], steps=4, batch_size=2, sequences=4, windows=2,
                              progress=False)
    assert list(table.index) == list(L.OBJECTIVES.values()) and set(histories) == set(table.index)
    assert all(len(h) == 4 for h in histories.values())
    assert table.attrs["teacher_ppl"] < table.attrs["dropped_ppl"]
    assert (table["KL(teacher||student)"] > 0).all() and L.heal_figure(table).data
    before = teacher.model.layers[4].mlp.down_proj.weight.clone()
    assert len(teacher.model.layers) == 8 and torch.equal(teacher.model.layers[4].mlp.down_proj.weight, before)
