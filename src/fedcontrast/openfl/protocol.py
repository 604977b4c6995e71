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


FAILURE_SENTENCE_BYTES = 1000  # a failed task's sentence travels in its failure metric, one value per UTF-8 byte


def failure_values(sentence: str):
    """A failed task's sentence as the values of its failure metric (float32, one per byte: what
    OpenFL's lossless pipeline carries exactly), so that the aggregator can say it too."""
    import numpy as np

    data = sentence.encode()[:FAILURE_SENTENCE_BYTES]
    return np.frombuffer(data, dtype=np.uint8).astype(np.float32) if data else np.zeros(1, np.float32)


def failure_sentence(named_tensors, codec) -> str | None:
    """The sentence the failure metric among ``named_tensors`` carries (None: no failure metric; a
    pointer to the site's log when it carries none, e.g. an older collaborator's single 1.0)."""
    import numpy as np
    from openfl.utilities import TensorKey

    named_tensor = next((t for t in named_tensors if t.name == FAILURE_METRIC), None)
    if named_tensor is None:
        return None
    unsaid = "the reason is in that site's own log"
    try:
        metadata = [{"int_to_float": p.int_to_float, "int_list": p.int_list, "bool_list": p.bool_list}
                    for p in named_tensor.transformer_metadata]
        key = TensorKey(named_tensor.name, "aggregator", named_tensor.round_number, named_tensor.report,
                        tuple(named_tensor.tags))
        _, values = codec.decompress(key, data=named_tensor.data_bytes, transformer_metadata=metadata,
                                     require_lossless=True)
        codes = [int(v) for v in np.asarray(values, dtype=np.float64).ravel()]
        if len(codes) < 2 or not all(0 < c < 256 for c in codes):
            return unsaid
        return bytes(codes).decode(errors="replace").strip() or unsaid
    except Exception:  # noqa: BLE001 - the sentence is a courtesy: the failure itself is known without it
        return unsaid
