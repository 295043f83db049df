"""Lesson 30, knowledge distillation: a small student learns from a large teacher's softened outputs.

The teacher's logits ``z`` become soft targets at temperature ``T``::

    p_i(T) = exp(z_i / T) / sum_j exp(z_j / T)

T = 1 is the ordinary softmax; a higher T flattens it and reveals how the teacher ranks the *wrong* classes
("this 3 looks a bit like an 8") - information a one-hot label does not carry. The student minimises
(`wb.distill.kd_loss`, Hinton et al. 2015)::

    L = (1 - alpha) * CE(student, labels) + alpha * T^2 * KL(p_teacher(T) || p_student(T))

The gradient of the KL term with respect to the student's logits is ``(p_student(T) - p_teacher(T)) / T``, and
for large T the difference of the two soft distributions itself shrinks like 1/T, so the term's gradients shrink
like 1/T^2: the factor T^2 puts them back on the scale of the hard-label term, whatever T is.

In `figures`: soft targets and their entropy, the lesson's student and example choice, the KD-vs-hard-labels
experiment (`compare_kd`, which trains with `wb.distill.fit`) and its figures; in `checks`: the exercise checks.
Both are re-exported here.
"""
from workbench.teach.distillation.checks import check_entropies, check_kd_loss, check_restoring_factor
from workbench.teach.distillation.figures import (
           compare_kd,
           entropy,
           kd_figure,
           logit_spread,
           pick_example,
           soft_gradient_norms,
           soft_targets,
           student,
           t_squared_figure,
           t_squared_table,
           temperature_figure,
)

__all__ = ["soft_targets", "entropy", "pick_example", "student", "soft_gradient_norms", "logit_spread",
           "t_squared_table", "t_squared_figure", "check_restoring_factor", "check_entropies", "compare_kd",
           "temperature_figure", "kd_figure", "check_kd_loss"]
