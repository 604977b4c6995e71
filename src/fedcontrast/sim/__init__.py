"""The in-process simulator: the same plugin calls as the OpenFL and Flower glue, in one process."""

from .federation import Federation, derive_seed
from .simulator import run_simulation

__all__ = ["Federation", "derive_seed", "run_simulation"]
