"""Lab 31's exercises: the worked solutions (``_solution_*``) and the checks that compare a learner's answer with
the package's and name the usual slips."""
from __future__ import annotations

import functools

import pandas as pd
import torch
import torch.nn.functional as F

from workbench.teach import Feedback, check
from workbench.teach.lm_distillation.figures import GRID, MUS, SIGMAS, toy_search

__all__ = ["check_forward_kl", "check_reverse_kl", "check_toy_fit", "check_kl_gradient", "check_sequence_loss",
           "check_most_peaked"]


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per position from log-probabilities, (...)."""
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def _logs(student_logits, teacher_logits):
    return student_logits.detach().double().log_softmax(-1), teacher_logits.detach().double().log_softmax(-1)


# Worked solutions, as a learner writes them in the cell (shown behind "Show solution", run with solutions=True).

def _solution_forward_kl(s_logits, t_logits):
    log_s = torch.log_softmax(s_logits, dim=-1)                        # (B, T, V)
    log_t = torch.log_softmax(t_logits, dim=-1)
    per_position = (log_t.exp() * (log_t - log_s)).sum(dim=-1)        # KL(teacher || student) at each position
    return float(per_position.mean())


def _solution_reverse_kl(s_logits, t_logits):
    log_s = torch.log_softmax(s_logits, dim=-1)
    log_t = torch.log_softmax(t_logits, dim=-1)
    per_position = (log_s.exp() * (log_s - log_t)).sum(dim=-1)        # KL(student || teacher): the student weighs
    return float(per_position.mean())


def _solution_toy_fit(p, grid, mus, sigmas):
    best, best_kl = None, float("inf")
    for mu in mus.tolist():
        for sigma in sigmas.tolist():
            q = torch.softmax(-0.5 * ((grid - mu) / sigma) ** 2, dim=-1)
            kl = float((q * (q.log() - p.log())).sum())                 # reverse KL: q weighs the log-ratio
            if kl < best_kl:
                best, best_kl = (mu, sigma), kl
    return best


def _solution_kl_gradient(s0, t0):
    n = s0.shape[0]                                                    # the loss averages n positions
    return (torch.softmax(s0, dim=-1) - torch.softmax(t0, dim=-1)) / n


def _solution_sequence_loss(seq_logits, seqs, prompt_tokens):
    targets = seqs[:, 1:]                                              # position i predicts token i + 1
    ce = torch.nn.functional.cross_entropy(seq_logits.transpose(1, 2), targets, reduction="none")   # (n, T)
    return float(ce[:, prompt_tokens - 1:].mean())                     # only the tokens the teacher wrote


def _solution_most_peaked(table):
    return table["student entropy"].idxmin()


# Checks.

def _kl_mistakes(s, t, forward: bool):
    log_s, log_t = _logs(s, t)
    other = _kl(log_s, log_t) if forward else _kl(log_t, log_s)
    a, b = (log_t, log_s) if forward else (log_s, log_t)
    weigh = "teacher's" if forward else "student's"
    ratio = "log p_teacher - log p_student" if forward else "log p_student - log p_teacher"
    return [
        (float(other.mean()), f"that is the other direction: here the {weigh} probabilities weigh the log-ratio, "
                              f"{ratio}"),
        (float((a.exp() * (a - b)).mean()), f"that KL is averaged over the {s.shape[-1]} vocabulary entries too: "
                                            f"sum over the vocabulary, then average over the positions"),
        (float(_kl(a, b).sum()), "that is the sum over all positions; average them"),
        (float(_kl(a, b).sum() / s.shape[0]), "F.kl_div's reduction='batchmean' divides by the first dimension "
                                             "only; average over every position (batch x tokens)"),
        (float((a.exp() * (a.exp() - b.exp())).sum(-1).mean()), "take logarithms of the probabilities (log_softmax), "
                                                                 "not the probabilities themselves, in the ratio"),
    ]


def check_forward_kl(answer, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> Feedback:
    """Exercise: the token-level forward KL, KL(teacher || student), between next-token distributions given as
    logits (B, T, V): summed over the vocabulary, averaged over the B x T positions (`wb.distill.lm_kl`)."""
    from workbench.distillation import lm_kl

    solution = functools.partial(_solution_forward_kl, student_logits.detach(), teacher_logits.detach())
    expected = float(lm_kl(student_logits.detach().double(), teacher_logits.detach().double(), "forward"))
    hint = ("log_softmax both logits; at each position sum p_teacher * (log p_teacher - log p_student) over the "
            "vocabulary; average the positions")
    return check("forward KL(teacher || student)", answer, expected, hint=hint, rtol=1e-4, atol=1e-7,
                 mistakes=_kl_mistakes(student_logits, teacher_logits, True), solution=solution)


def check_reverse_kl(answer, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> Feedback:
    """Exercise: the token-level reverse KL, KL(student || teacher), same shapes and averaging as the forward one."""
    from workbench.distillation import lm_kl

    solution = functools.partial(_solution_reverse_kl, student_logits.detach(), teacher_logits.detach())
    expected = float(lm_kl(student_logits.detach().double(), teacher_logits.detach().double(), "reverse"))
    hint = ("the same sum with the roles swapped: p_student * (log p_student - log p_teacher), summed over the "
            "vocabulary, averaged over the positions")
    return check("reverse KL(student || teacher)", answer, expected, hint=hint, rtol=1e-4, atol=1e-7,
                 mistakes=_kl_mistakes(student_logits, teacher_logits, False), solution=solution)


def check_toy_fit(answer, p: torch.Tensor, grid: torch.Tensor = GRID, mus: torch.Tensor = MUS,
                  sigmas: torch.Tensor = SIGMAS) -> Feedback:
    """Exercise: the (mu, sigma) of the grid whose Gaussian student q minimises the reverse KL(q || p)."""
    solution = functools.partial(_solution_toy_fit, p, grid, mus, sigmas)
    search = toy_search(p, grid, mus, sigmas)
    best = search.loc[search["reverse_kl"].idxmin()]
    wide = search.loc[search["forward_kl"].idxmin()]
    expected = [float(best.mu), float(best.sigma)]
    try:
        got = [float(v) for v in answer] if answer is not ... and answer is not None else answer
    except (TypeError, ValueError):
        got = answer
    mistakes = [([float(wide.mu), float(wide.sigma)], "that is the forward-KL fit (it spreads over both modes); "
                                                       "the reverse KL weighs log(q / p) by the student's q")]
    other = search[(search.mu - best.mu).abs() > 1.5]
    if len(other):
        second = other.loc[other["reverse_kl"].idxmin()]
        mistakes.append(([float(second.mu), float(second.sigma)],
                         f"that sits on the other mode, a local minimum: reverse KL {second.reverse_kl:.3f} there "
                         f"against {best.reverse_kl:.3f} on the heavier one - search the whole grid"))
    hint = ("for every mu in mus and sigma in sigmas: q = softmax(-(grid - mu)² / (2 sigma²)); "
            "sum q (log q - log p); keep the pair with the smallest value")
    return check("the reverse-KL Gaussian of the toy", got, expected, hint=hint, rtol=1e-6, atol=1e-6,
                 mistakes=mistakes, solution=solution)


def check_kl_gradient(answer, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> Feedback:
    """Exercise: written by hand, the gradient of the forward KL averaged over the N positions of (N, V) logits
    with respect to the student's logits: (softmax(student) - softmax(teacher)) / N, checked against autograd."""
    from workbench.distillation import lm_kl

    s = student_logits.detach().double().requires_grad_(True)
    lm_kl(s, teacher_logits.detach().double(), "forward").backward()
    expected = s.grad.detach()
    solution = functools.partial(_solution_kl_gradient, student_logits.detach().double(),
                                 teacher_logits.detach().double())
    n = student_logits.shape[0]
    ps, pt = F.softmax(s.detach(), -1), F.softmax(teacher_logits.detach().double(), -1)
    kl_r = (ps * (ps.log() - pt.log())).sum(-1, keepdim=True)
    mistakes = [(-expected, "the sign: raising a logit where the student already has more mass than the teacher "
                            "increases the loss, so that gradient entry is positive (p_student - p_teacher)"),
                (expected * n, f"the loss averages {n} positions, so each position's gradient is divided by {n}"),
                (ps * (ps.log() - pt.log() - kl_r) / n, "that is the reverse KL's gradient; this loss is the forward "
                                                        "KL(teacher || student)")]
    hint = ("d/dz of sum p_t (log p_t - log softmax(z)) is softmax(z) - p_t for one position; the loss averages "
            "the positions")
    def measure(a):
        return torch.as_tensor(a).detach().double()

    return check("the forward-KL gradient by hand", answer, expected, hint=hint, rtol=1e-4, atol=1e-7,
                 mistakes=mistakes, solution=solution, measure=measure)


def check_sequence_loss(answer, student_logits: torch.Tensor, sequences: torch.Tensor,
                        prompt_tokens: int) -> Feedback:
    """Exercise: the sequence-level distillation loss - the student's next-token cross-entropy (logits (n, T, V)
    on ``sequences[:, :-1]``) on the tokens the teacher wrote, i.e. the targets ``sequences[:, 1:]`` after the
    ``prompt_tokens``-token prompt, averaged."""
    z = student_logits.detach().double()
    ce = F.cross_entropy(z.transpose(1, 2), sequences[:, 1:], reduction="none")        # (n, T)
    P = int(prompt_tokens)
    expected = float(ce[:, P - 1:].mean())
    solution = functools.partial(_solution_sequence_loss, student_logits.detach(), sequences, P)
    unshifted = F.cross_entropy(z.transpose(1, 2), sequences[:, :-1], reduction="none")
    mistakes = [(float(ce.mean()), "the prompt's tokens are real data, not the teacher's: leave them out"),
                (float(ce[:, P:].mean()), f"off by one: logits at position {P - 1} (the last prompt token) "
                                          f"predict the first token the teacher wrote"),
                (float(unshifted[:, P - 1:].mean()), "shift the targets: the logits at position i predict token i + 1 "
                                                      "(sequences[:, 1:])")]
    hint = (f"cross-entropy of the logits against sequences[:, 1:] at every position, then the mean over positions "
            f"{P - 1} .. T - 1 (those whose target the teacher wrote)")
    return check("sequence-level loss", answer, expected, hint=hint, rtol=1e-5, atol=1e-8, mistakes=mistakes,
                 solution=solution)


def check_most_peaked(answer, table: pd.DataFrame) -> Feedback:
    """Exercise: read the measurement - which objective left the student with the lowest mean entropy (the most
    peaked next-token distributions) in *this* run."""
    solution = functools.partial(_solution_most_peaked, table)
    expected = str(table["student entropy"].idxmin())
    others = ", ".join(f"{k} {v:.3f}" for k, v in table["student entropy"].items())
    hint = f"the row with the smallest 'student entropy' (measured: {others})"
    return check("the most peaked student", answer, expected, hint=hint, solution=solution)
