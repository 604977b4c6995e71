"""The ``fedcontrast`` command line: simulate, compare, partition, audit, algorithms.

Errors caused by the user's input print one sentence and exit with code 2 (no traceback).
One module per command group (runs, federation, sites, audit), each registering its
sub-commands; ``app`` assembles the parser and holds ``main``.
"""

from .app import build_parser, main
from .common import config_from_args
from .sites import site_start_command

__all__ = ["build_parser", "config_from_args", "main", "site_start_command"]
