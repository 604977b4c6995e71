"""User-facing errors.

Every error a user can cause with bad input (unknown names, bad settings, missing files, corrupt
checkpoints) is a :class:`FedContrastError`. The command line prints its message as one sentence and
exits with code 2; anything else is a bug and keeps its traceback.
"""


class FedContrastError(Exception):
    """Base class of errors caused by the user's input, reported without a traceback."""


class ConfigError(FedContrastError, ValueError):
    """An invalid setting: a hyper-parameter out of range, an unknown option."""


class UnknownNameError(ConfigError, KeyError):
    """An unknown algorithm, data set, model or partition name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DataError(FedContrastError):
    """Missing or unusable data: absent files, too few samples for the requested split."""


class CheckpointError(FedContrastError):
    """A checkpoint that cannot be read or does not match the run."""


class OutputError(FedContrastError):
    """A result file that could not be written (a full disk, a file size limit, no permission)."""


class SiteRefusal(FedContrastError):
    """A site refuses the plan, or cannot take part under it: its policy refuses the plan, its data or
    settings cannot be used. The message is one sentence with no engine's prefix; each engine reports
    it its own way (OpenFL's collaborator exits with it, a Flower site answers the operator with it)."""
