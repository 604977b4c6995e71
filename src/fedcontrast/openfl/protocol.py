"""What the aggregator and the collaborators of the OpenFL engine agree on: the codes and words a
stopped federation is told with, and the size allowances of an upload."""

FAILURE_SLEEP_CODE = 97  # sent in GetTasksResponse.sleep_time with quit: "the federation failed"
FAILURE_EXIT_CODE = 3
STOPPED = "the aggregator stopped the federation: "  # the details of the ABORTED status every site is answered with
STOP_GRACE_S = 3.0  # after the last site was told why the federation stopped, the reason is still served this long
WAITING_NOTICE_S = 60.0  # how often the aggregator names the sites that have not connected yet
FAILURE_METRIC = "fedcontrast_task_failed"  # a collaborator's last word: its task failed (reason: its own log)

UPLOAD_MARGIN = 1 << 20  # bytes allowed around the declared packed upload: header, names, metrics
# gRPC refuses a message over its max_receive_message_length before Python sees it: the sender would
# learn why, the aggregator nothing (the round would wait out its timeout). Its limit is set one of
# OpenFL's upload messages (2 MiB chunks, utils.proto_to_datastream) above the bound, so that every
# message of an over-bound upload reaches _bounded_stream, which names the sender and the size.
MESSAGE_ALLOWANCE = (2 << 20) + (64 << 10)


class FederationStopped(Exception):
    """Raised to the aggregator's gRPC server by a call that came after the federation stopped; its
    message is the one sentence the caller is answered with (an ABORTED status)."""
# The details of an ABORTED status refusing one site's secure-aggregation message (it was dropped from
# the round, or the round is over): that site stops with the sentence, the federation goes on.
SECAGG_REFUSED = "the aggregator refused this site's secure-aggregation message: "


COLLABORATOR_ERROR = "fedcontrast collaborator: error: "  # how a collaborator's last line begins


class CollaboratorStopped(SystemExit):
    """Ends ``fx collaborator start`` with one line (``fedcontrast collaborator: error: SENTENCE``)
    and a non-zero code; :func:`stopped` makes one from a sentence."""


def stopped(sentence: object) -> CollaboratorStopped:
    """The collaborator's end with ``sentence`` (e.g. a :class:`~fedcontrast.errors.SiteRefusal`)."""
    return CollaboratorStopped(f"{COLLABORATOR_ERROR}{sentence}")
