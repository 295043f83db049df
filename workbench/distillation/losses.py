"""Distillation losses (pure functions).

- `kd_loss`: (1 - alpha) * CE(student, labels) + alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))
  (Hinton et al. 2015; the T^2 keeps the soft-target gradients on the scale of the hard ones).
- `embedding_loss`: 1 - cosine similarity (default) or MSE between student and teacher embeddings.
- `feature_loss`: MSE between intermediate features, through a learned projection when widths differ
  (`Projection`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["kd_loss", "embedding_loss", "feature_loss", "Projection", "check_kd_args"]


def check_kd_args(alpha: float, temperature: float) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature T must be > 0, got {temperature!r}")


def _check_shapes(student: torch.Tensor, teacher: torch.Tensor, what: str) -> None:
    if student.shape != teacher.shape:
        raise ValueError(f"{what}: the student's output has shape {tuple(student.shape)} but the teacher's has "
                         f"{tuple(teacher.shape)}; they must match")


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor | None,
            alpha: float = 0.5, temperature: float = 4.0) -> torch.Tensor:
    check_kd_args(alpha, temperature)
    _check_shapes(student_logits, teacher_logits, "logit distillation")
    T = float(temperature)
    soft = F.kl_div(F.log_softmax(student_logits / T, dim=-1), F.log_softmax(teacher_logits.detach() / T, dim=-1),
                    reduction="batchmean", log_target=True) * T * T
    if alpha == 1.0 or labels is None:
        if labels is None and alpha != 1.0:
            raise ValueError("labels are needed unless alpha == 1 (pure distillation)")
        return soft
    return (1 - alpha) * F.cross_entropy(student_logits, labels) + alpha * soft


def embedding_loss(student: torch.Tensor, teacher: torch.Tensor, kind: str = "cosine") -> torch.Tensor:
    _check_shapes(student, teacher, "embedding distillation")
    if kind == "cosine":
        return (1 - F.cosine_similarity(student, teacher.detach(), dim=-1)).mean()
    if kind == "mse":
        return F.mse_loss(student, teacher.detach())
    raise ValueError(f"embedding loss kind must be 'cosine' or 'mse', got {kind!r}")


class Projection(nn.Linear):
    """Maps student features (width ``d_s``) to the teacher's width ``d_t``; trained with the student."""

    def __init__(self, d_student: int, d_teacher: int):
        super().__init__(d_student, d_teacher, bias=False)


def feature_loss(student_feat: torch.Tensor, teacher_feat: torch.Tensor,
                 projection: nn.Module | None = None) -> torch.Tensor:
    s = projection(student_feat) if projection is not None else student_feat
    _check_shapes(s, teacher_feat, "feature distillation (add a Projection when the widths differ)")
    return F.mse_loss(s, teacher_feat.detach())
