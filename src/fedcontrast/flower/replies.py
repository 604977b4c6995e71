"""The ServerApp's pull of the sites' replies, as Flower's own grid does it
(``flwr.superlink.grid.http_grid.HttpGrid.pull_messages``: the replies' headers, then their objects,
then a receipt), but with a short retry for an object not yet there.

A site sends a reply's header first and its objects just after (0.1–0.2 s on a busy host). The
ServerApp asks for replies every :data:`.server_app.REPLY_POLL_S`, so it often gets a header whose
objects are still on their way, and Flower's pull then waits 1 s (``PULL_INITIAL_BACKOFF``) before
asking again: measured, 0.9 s of each round on localhost. Here the first retry comes after
:data:`FIRST_RETRY_S`, doubling up to :data:`RETRY_CAP_S`. A grid that is not Flower's HTTP grid (a
test's) is asked with its own ``pull_messages``.

A reply that holds a site's refusal or failure (its ClientApp's record, or Flower's own error reply)
is read as one sentence naming the site (:func:`_refused`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from .client_app import REFUSAL_RECORD

FIRST_RETRY_S, RETRY_CAP_S = 0.02, 1.0


def pull_replies(grid: Any, message_ids: Iterable[str]) -> list[Any]:
    ids = list(message_ids)
    client = getattr(grid, "_runtime_client", None)
    if client is None or getattr(grid, "_run", None) is None:
        return list(grid.pull_messages(ids))
    from flwr.app import Error, Message, Metadata
    from flwr.app.message import make_message
    from flwr.common.constant import ErrorCode
    from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest
    from flwr.supercore.constant import SYSTEM_MESSAGE_TYPE
    from flwr.supercore.date import now
    from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
    from flwr.supercore.inflatable.inflatable_protobuf_utils import make_pull_object_fn_protobuf
    from flwr.supercore.inflatable.inflatable_utils import ObjectPullError, inflate_object_from_contents, pull_objects

    run_id = grid._run.run_id
    res = client.PullMessages(PullAppMessagesRequest(message_ids=ids))
    replies = []
    for proto, tree in zip(res.messages_list, res.message_object_trees, strict=True):
        message_id = proto.metadata.message_id
        try:
            contents = pull_objects([t.object_id for t in iterate_object_tree(tree)],
                                    make_pull_object_fn_protobuf(pull_object_protobuf=client.PullObject,
                                                                 node=grid.node, run_id=run_id),
                                    initial_backoff=FIRST_RETRY_S, backoff_cap=RETRY_CAP_S)
        except ObjectPullError as exc:  # as Flower's grid: an error reply (the ServerApp names the site)
            replies.append(make_message(
                metadata=Metadata(run_id=run_id, message_id="", src_node_id=grid.node.node_id,
                                  dst_node_id=grid.node.node_id, message_type=SYSTEM_MESSAGE_TYPE, group_id="", ttl=0,
                                  reply_to_message_id=proto.metadata.reply_to_message_id, created_at=now().timestamp()),
                error=Error(code=ErrorCode.MESSAGE_UNAVAILABLE,
                            reason=f"the site's reply could not be fetched from the SuperLink: {exc}")))
            continue
        client.ConfirmMessageReceived(ConfirmMessageReceivedRequest(node=grid.node, run_id=run_id,
                                                                    message_object_id=message_id))
        message = inflate_object_from_contents(message_id, contents)
        assert isinstance(message, Message)
        message.metadata.__dict__["_message_id"] = message_id
        replies.append(message)
    return replies


def _refused(reply, site: str) -> str | None:
    """A reply's refusal or failure as one sentence naming the site (None: a reply to use)."""
    if reply.has_error():  # Flower's own error reply (a ClientApp that raised, or stopped)
        return _reason(reply.error.reason, site)
    if REFUSAL_RECORD not in reply.content:
        return None
    record = reply.content[REFUSAL_RECORD]
    kind = "refused" if str(record.get("kind", "failed")) == "refused" else "failed"
    return f"site {site} {kind}: {str(record.get('sentence', '')).strip() or 'no reason given'}"


def _reason(reason: str, site: str) -> str:
    """A ClientApp's error as Flower reports it, down to the site's own sentence."""
    text = str(reason).strip()
    marker = f"site {site}:"
    if marker in text:
        text = text[text.index(marker):].splitlines()[0]
        return re.split(r"""['"]>|['"]\)""", text)[0].rstrip(". ")
    if "stopped responding" in text or "attempting to load `ClientApp`" in text:  # no sentence of the site's came
        return (f"site {site} failed: its ClientApp stopped before it could reply ({text.splitlines()[-1]}): the site "
                "refused code in the operator's app bundle, or its process crashed; the reason is in that site's log")
    return f"site {site} failed: {text.splitlines()[-1] if text else 'no reason given'}"
