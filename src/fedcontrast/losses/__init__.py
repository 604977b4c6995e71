"""Loss functions: pure functions of tensors, one paper each."""

from .contrastive import (
    check_temperature,
    global_class_contrastive_loss,
    info_nce,
    moon_contrastive_loss,
    moon_loss_from_difference,
    moon_reference_difference,
)
from .distillation import ensemble_similarity, esd_loss, similarity_matrix
from .prototype import fedpcl_loss, prototype_contrastive_loss
from .proximal import proximal_term
from .siamese import history_loss, negative_cosine, stop_gradient_loss
from .simclr import nt_xent

__all__ = ["check_temperature", "global_class_contrastive_loss", "info_nce", "moon_contrastive_loss",
           "moon_loss_from_difference", "moon_reference_difference", "proximal_term", "fedpcl_loss",
           "prototype_contrastive_loss", "ensemble_similarity", "esd_loss", "similarity_matrix", "nt_xent",
           "history_loss", "negative_cosine", "stop_gradient_loss"]
