"""Lesson 30's exercises: worked solutions (``_solution_*``), their checks (``check_*``) and what only they use."""
from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
import torch.nn.functional as F

from workbench.teach import Feedback, as_number, check
from workbench.teach.distillation.figures import entropy

__all__ = ["check_restoring_factor", "check_entropies", "check_kd_loss"]


# --- exercise checks -----------------------------------------------------------------------------------

def _tensor(answer) -> torch.Tensor | None:
    try:
        return torch.as_tensor(answer.detach() if isinstance(answer, torch.Tensor) else answer).double()
    except (TypeError, ValueError, RuntimeError):
        return None


# Each exercise has a worked solution (``_solution_*``, as a learner writes it in the cell), shown behind the
# feedback's "Show solution" toggle and run by the regression suite (``wb.teach.use_solutions``).

def _solution_entropies(logits, temperatures):
    entropies = []
    for t in temperatures:
        p = torch.softmax(logits / t, dim=-1)                  # the soft targets at T = t
        entropies.append(float(-(p * p.log2()).sum()))         # bits: log base 2
    return entropies


def _solution_kd_loss(student_logits, teacher_logits, labels, alpha, temperature):
    log_p_student = torch.log_softmax(student_logits / temperature, dim=-1)    # both softened by the same T
    log_p_teacher = torch.log_softmax(teacher_logits / temperature, dim=-1)
    kl = (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(dim=-1).mean()   # KL(teacher || student)
    hard = torch.nn.functional.cross_entropy(student_logits, labels)
    return float((1 - alpha) * hard + alpha * temperature ** 2 * kl)   # T^2 keeps the soft gradients in scale


def _solution_restoring_factor(gradients, temperature):
    norms = gradients["gradient norm (KL alone)"]               # indexed by T, T = 1 first
    return norms.iloc[0] / norms.loc[temperature]


def _kd_variant(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, alpha: float, T: float, *,
                factor: float | None = None, reverse: bool = False, reduction: str = "batchmean",
                soften_student: bool = True, soften_teacher: bool = True, probabilities: bool = False,
                swap_weights: bool = False) -> float:
    """The KD loss, or one of its usual slips (keywords), in float64."""
    s, t = student.detach().double(), teacher.detach().double()
    log_s = torch.log_softmax(s / (T if soften_student else 1.0), dim=-1)
    log_t = torch.log_softmax(t / (T if soften_teacher else 1.0), dim=-1)
    if probabilities:                      # F.kl_div(p_student, p_teacher): probabilities where it wants logs
        pointwise = log_t.exp() * (log_t - log_s.exp())
    elif reverse:
        pointwise = log_s.exp() * (log_s - log_t)
    else:
        pointwise = log_t.exp() * (log_t - log_s)
    kl = {"batchmean": pointwise.sum() / s.shape[0], "mean": pointwise.mean(), "sum": pointwise.sum()}[reduction]
    soft = float(kl) * (T * T if factor is None else factor)
    hard = float(F.cross_entropy(s, labels))
    w_soft, w_hard = (1 - alpha, alpha) if swap_weights else (alpha, 1 - alpha)
    return w_hard * hard + w_soft * soft


def check_kd_loss(answer, student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                  alpha: float, temperature: float) -> Feedback:
    """Exercise: the knowledge-distillation loss of a batch, as `wb.distill.kd_loss` computes it: (1 - alpha) times
    the cross-entropy with the labels plus alpha T^2 times KL(teacher(T) || student(T)), each averaged over the
    batch."""
    from workbench.distillation.losses import kd_loss

    solution = functools.partial(_solution_kd_loss, student_logits, teacher_logits, labels, alpha, temperature)
    with torch.no_grad():
        expected = float(kd_loss(student_logits.detach().float(), teacher_logits.detach().float(), labels, alpha,
                                 temperature))
    T = float(temperature)
    args = (student_logits, teacher_logits, labels, alpha, T)
    mistakes = [
        (_kd_variant(*args, factor=1.0), f"the soft term is multiplied by T² = {T * T:g}: softened distributions "
                                         f"give gradients about 1/T² as large (section 2), and the factor puts "
                                         f"them back next to the hard-label term"),
        (_kd_variant(*args, factor=T), f"the factor is T² = {T * T:g}, not T: the gradient loses one 1/T from the "
                                       f"softened logits and another from the softened difference"),
        (_kd_variant(*args, reverse=True), "the KL divergence runs from the teacher to the student, "
                                           "KL(p_teacher || p_student) = sum p_teacher (log p_teacher - log "
                                           "p_student): the teacher's probabilities weigh the terms"),
        (_kd_variant(*args, reduction="mean"), f"that KL is averaged over every class too (reduction='mean'); sum "
                                               f"over the {student_logits.shape[-1]} classes and average over the "
                                               f"batch (reduction='batchmean')"),
        (_kd_variant(*args, reduction="sum"), "the KL term is summed over the batch; average it over the examples, "
                                              "as the cross-entropy is"),
        (_kd_variant(*args, soften_student=False), "the student's logits are divided by T too: both distributions "
                                                   "are compared at the same temperature"),
        (_kd_variant(*args, soften_teacher=False), "the teacher's logits are divided by T too: the soft targets are "
                                                   "the teacher's softmax at T"),
        (_kd_variant(*args, probabilities=True), "F.kl_div(input, target) expects log-probabilities as its input: "
                                                 "pass log_softmax(student / T), not the probabilities"),
        (_kd_variant(*args, swap_weights=True), f"alpha = {alpha:g} weighs the soft term and 1 - alpha the "
                                                f"hard-label cross-entropy, not the other way round"),
    ]
    hint = ("two averages over the batch: the cross-entropy with the labels at T = 1, and the soft term of the "
            "introduction, a KL divergence between the teacher's and the student's softmax at T, with section 2's "
            "factor; weigh them 1 - alpha and alpha")
    return check(f"KD loss at T = {T:g}, alpha = {alpha:g}", answer, expected, hint=hint, rtol=1e-4, atol=1e-7,
                 mistakes=mistakes, solution=solution)


def check_restoring_factor(answer, gradients, temperature: float) -> Feedback:
    """Exercise: from the measured `soft_gradient_norms` table, the factor that brings the KL gradient at
    ``temperature`` back to its T = 1 norm (T² is only the high-temperature limit of it)."""
    solution = functools.partial(_solution_restoring_factor, gradients, temperature)
    norm = gradients["gradient norm (KL alone)"]
    expected = float(norm.iloc[0]) / float(norm.loc[temperature])
    name = f"the factor restoring the T = 1 gradient at T = {temperature:g}"
    hint = "divide the gradient norm at T = 1 by the norm at this T (column 'gradient norm (KL alone)')"
    fb = check(name, answer, expected, hint=hint, rtol=1e-4, solution=solution)
    value = as_number(answer)
    if fb.status == "failed" and value is not None:
        known = [(float(temperature) ** 2, f"T² = {temperature ** 2:g} is Hinton's high-temperature limit; at this T "
                                           f"the logits are not small against T, so measure it from the table"),
                 (1 / expected, "that is the shrink the other way round: norm at T over norm at T = 1"),
                 (float(temperature), "T undoes only one of the two 1/T factors, and only in the limit")]
        for known_value, why in known:
            if math.isclose(value, known_value, rel_tol=1e-4):
                return check(name, answer, expected, hint=why, rtol=1e-4, solution=solution)
    return fb


def check_entropies(answer, logits: torch.Tensor, temperatures: Sequence[float]) -> Feedback:
    """Exercise: the entropy in bits of softmax(logits / T) for each T in ``temperatures`` (a list or tensor)."""
    solution = functools.partial(_solution_entropies, logits, temperatures)
    z = logits.detach().double()
    expected = [float(entropy(torch.softmax(z / T, dim=-1))) for T in temperatures]
    name = "entropies of the soft targets"
    hint = "for each T: the soft targets at T, then their entropy in bits (logarithms in base 2)"
    fb = check(name, answer, expected, hint=hint, rtol=1e-4, atol=1e-6, solution=solution)
    got = _tensor(answer)
    if fb.status == "failed" and got is not None and got.shape == (len(expected),):
        exp = torch.tensor(expected, dtype=torch.double)
        plain = float(entropy(torch.softmax(z, dim=-1)))
        known = [(exp * math.log(2), "those are nats (natural log): use log2 for bits"),
                 (torch.full_like(exp, plain), "every value is the T = 1 entropy: divide the logits by each T"),
                 (-exp, "entropy is minus the sum of p log p: mind the sign")]
        for value, why in known:
            if torch.allclose(got, value, rtol=1e-4, atol=1e-6):
                return check(name, answer, expected, hint=why, rtol=1e-4, atol=1e-6, solution=solution)
    return fb
