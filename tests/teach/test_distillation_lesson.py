"""Lesson 30 (distillation): soft targets and the T² argument hold numerically, the KD experiment runs through
wb.distill.fit, the exercise checks pass the right answer and explain typical mistakes, the figures build."""
import math

import pytest
import torch

import workbench as wb
from workbench.teach import distillation as L

LOGITS = torch.tensor([-1.6, -5.9, -3.5, 2.8, -3.2, -2.2, -5.0, 2.3, 0.7, 1.5])


@pytest.fixture(autouse=True)
def _fresh_results():
    wb.teach.reset()
    yield
    wb.teach.reset()


def test_soft_targets_flatten_with_temperature():
    ents = [float(L.entropy(L.soft_targets(LOGITS, T))) for T in (0.5, 1, 2, 4, 8, 100)]
    assert ents == sorted(ents) and ents[-1] == pytest.approx(math.log2(10), abs=0.01)
    assert torch.allclose(L.soft_targets(LOGITS, 1), torch.softmax(LOGITS, -1))
    with pytest.raises(ValueError, match="temperature"):
        L.soft_targets(LOGITS, 0)


def test_t_squared_keeps_the_gradient_scale():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(64, 10, generator=g), 3 * torch.randn(64, 10, generator=g)
    table = L.soft_gradient_norms(student, teacher, (1, 4, 16, 64))
    alone, scaled = table["gradient norm (KL alone)"], table["gradient norm (T² × KL)"]
    assert alone.is_monotonic_decreasing
    assert alone[16] / alone[64] == pytest.approx(16, rel=0.05)                   # 1/T² for large T
    assert scaled[64] / scaled[16] == pytest.approx(1, rel=0.05)                   # the factor undoes it


def test_student_is_seeded_and_small():
    a, b = L.student((16, 8), seed=3), L.student((16, 8), seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(L.student((16, 8), seed=4).fc1.weight, a.fc1.weight)
    assert sum(p.numel() for p in a.parameters()) == 64 * 16 + 16 + 16 * 8 + 8 + 8 * 10 + 10


def test_pick_example_is_correct_with_a_runner_up(digits_task):
    teacher = wb.models.load("digits-cnn")
    i = L.pick_example(teacher, digits_task)
    x = torch.from_numpy(digits_task.split.x_test[i : i + 1])
    with torch.no_grad():
        p = torch.softmax(teacher(x), -1)[0]
    assert int(p.argmax()) == int(digits_task.split.y_test[i]) and float(p.topk(2).values[1]) > 0.05


def test_compare_kd_runs_both_methods(digits_task):
    teacher = wb.models.load("digits-mlp")
    table, histories, students = L.compare_kd(teacher, digits_task, seeds=[0], hidden=(8, 8), epochs=2)
    assert list(table["method"]) == ["hard labels", "KD"] and table["accuracy"].between(0, 1).all()
    assert set(histories) == set(students) == {("hard labels", 0), ("KD", 0)}
    assert len(histories[("KD", 0)]) == 2
    fig = L.kd_figure(table, histories, teacher_accuracy=0.97)
    assert {t.type for t in fig.data} == {"scatter", "bar"}
    assert fig.layout.yaxis2.title.text.startswith("test accuracy")
    assert fig.layout.xaxis.title.text == "epoch"


def _batch():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(32, 10, generator=g), 5 * torch.randn(32, 10, generator=g)
    return student, teacher, torch.randint(0, 10, (32,), generator=g)


def _kd_by_hand(s, t, y, alpha, T, *, factor=None, reverse=False, batch_mean=True, soft_student=True):
    """The KD loss with F.kl_div, as a learner writes it; the keywords make the plausible slips."""
    import torch.nn.functional as F

    log_s = F.log_softmax(s / (T if soft_student else 1), dim=-1)
    log_t = F.log_softmax(t / T, dim=-1)
    a, b = (log_t, log_s) if reverse else (log_s, log_t)
    kl = F.kl_div(a, b, reduction="batchmean" if batch_mean else "mean", log_target=True)
    return float((1 - alpha) * F.cross_entropy(s, y) + alpha * (T * T if factor is None else factor) * kl)


def test_check_kd_loss_passes_the_loss_kd_loss_computes():
    s, t, y = _batch()
    right = _kd_by_hand(s, t, y, 0.9, 4.0)
    assert right == pytest.approx(float(wb.distill.kd_loss(s, t, y, alpha=0.9, temperature=4.0)), rel=1e-5)
    assert L.check_kd_loss(right, s, t, y, 0.9, 4.0).passed
    assert L.check_kd_loss(torch.tensor(right), s, t, y, 0.9, 4.0).passed
    assert L.check_kd_loss(..., s, t, y, 0.9, 4.0).status == "not attempted"
    wb.teach.use_solutions(True)
    try:
        worked = L.check_kd_loss(..., s, t, y, 0.9, 4.0)
    finally:
        wb.teach.use_solutions(False)
    assert worked.passed and worked.from_solution


def test_check_kd_loss_names_the_temperature_and_kl_slips():
    s, t, y = _batch()
    fb = L.check_kd_loss(_kd_by_hand(s, t, y, 0.9, 4.0, factor=1.0), s, t, y, 0.9, 4.0)        # no T²
    assert fb.status == "failed" and "multiplied by T² = 16" in fb.hint and "expected" in fb.message
    assert "not T" in L.check_kd_loss(_kd_by_hand(s, t, y, 0.9, 4.0, factor=4.0), s, t, y, 0.9, 4.0).hint
    assert "from the teacher to the student" in L.check_kd_loss(_kd_by_hand(s, t, y, 0.9, 4.0, reverse=True),
                                                                 s, t, y, 0.9, 4.0).hint
    with pytest.warns(UserWarning, match="batchmean"):                     # torch warns about this slip too
        per_element = _kd_by_hand(s, t, y, 0.9, 4.0, batch_mean=False)
    assert "batchmean" in L.check_kd_loss(per_element, s, t, y, 0.9, 4.0).hint
    assert "student's logits are divided by T" in L.check_kd_loss(_kd_by_hand(s, t, y, 0.9, 4.0, soft_student=False),
                                                                   s, t, y, 0.9, 4.0).hint
    assert "not the other way round" in L.check_kd_loss(_kd_by_hand(s, t, y, 0.1, 4.0), s, t, y, 0.9, 4.0).hint


def test_temperature_figure_builds():
    image = torch.rand(64)
    fig = L.temperature_figure(LOGITS, (1, 2, 4, 8), image=image, label=3)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [b.name for b in bars] == ["T = 1", "T = 2", "T = 4", "T = 8"] and len(bars[0].y) == 10
    assert fig.data[0].type == "heatmap" and "label 3" in fig.layout.annotations[0].text
    assert fig.layout.xaxis2.title.text == "class" and fig.layout.yaxis3.title.text == "entropy (bits)"
    assert len(L.temperature_figure(LOGITS).data) == 6                      # no image: 4 bars + 2 entropy traces
