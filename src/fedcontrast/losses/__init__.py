"""Loss functions: pure functions of tensors, one paper each."""

from .contrastive import check_temperature, info_nce, moon_contrastive_loss
from .proximal import proximal_term

__all__ = ["check_temperature", "info_nce", "moon_contrastive_loss", "proximal_term"]
