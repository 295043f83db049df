"""Knowledge distillation (`wb.distill`): losses, a trainer with early stopping, embedding distillation for
sentence encoders, language-model distillation (token-level forward / reverse KL, sequence-level), and layer
dropping as a student initialisation."""
from workbench.distillation.lm import fit_lm, lm_kl, teacher_sequences
from workbench.distillation.losses import Projection, embedding_loss, feature_loss, kd_loss
from workbench.distillation.trainer import drop_layers, fit, fit_embeddings

__all__ = ["kd_loss", "embedding_loss", "feature_loss", "Projection", "fit", "fit_embeddings", "drop_layers", "fit_lm",
           "lm_kl", "teacher_sequences"]
