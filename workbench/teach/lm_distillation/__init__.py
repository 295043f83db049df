"""Lab 31, distilling language models: which divergence, and whose samples.

A classifier's distillation (lesson 30) compares two distributions per example; a language model's compares two
next-token distributions at every position. Three objectives (`wb.distill.fit_lm`):

- forward KL, KL(teacher || student) = sum p_t (log p_t - log p_s): the teacher's probabilities weigh the
  log-ratio, so the student is punished wherever the teacher has mass it lacks - *mode-covering*;
- reverse KL, KL(student || teacher) = sum p_s (log p_s - log p_t): the student's probabilities weigh it, so mass
  the student puts where the teacher has little is punished, and ignoring a teacher mode is cheap -
  *mode-seeking* (MiniLLM, Gu et al. 2024, optimises it on the student's own samples);
- sequence-level (Kim & Rush 2016): the teacher writes continuations and the student learns them by
  cross-entropy - the teacher's knowledge as data.

The lab: the two divergences on a toy (a Gaussian student, a two-mode teacher); both written by hand, with the
gradient of the forward one; then a tiny-llama with two of its eight blocks dropped, healed on the same budget by
plain fine-tuning on the data and by each objective, measured on held-out text.
"""
from workbench.teach.lm_distillation.checks import (
    check_forward_kl,
    check_kl_gradient,
    check_most_peaked,
    check_reverse_kl,
    check_sequence_loss,
    check_toy_fit,
)
from workbench.teach.lm_distillation.figures import (
    GRID,
    MUS,
    OBJECTIVES,
    SIGMAS,
    continuation,
    divergences,
    gaussian,
    heal,
    heal_figure,
    held_out_windows,
    toy_figure,
    toy_search,
    toy_teacher,
)

__all__ = ["GRID", "MUS", "SIGMAS", "OBJECTIVES", "toy_teacher", "gaussian", "toy_search", "toy_figure",
           "held_out_windows", "divergences", "heal", "heal_figure", "continuation", "check_forward_kl",
           "check_reverse_kl", "check_toy_fit", "check_kl_gradient", "check_sequence_loss", "check_most_peaked"]
