"""Issue 37 (Flower rounds as fast as OpenFL's): the site as its own Flower node (flower/node.py) and
the ServerApp's pull of the replies (flower/replies.py), against a Fleet/ServerAppIo stand-in that
holds a message's objects back for a moment, as the SuperLink does while the sender still pushes them
(Flower's own pull then waits 1 s before asking again)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("flwr", reason="the Flower engine is the extra [flower] (its own environment)")

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.serde import message_to_proto
from flwr.proto.message_pb2 import PullObjectResponse
from flwr.supercore.inflatable import inflatable_utils
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

from fedcontrast.flower import node as node_module
from fedcontrast.flower.client_app import REFUSAL_RECORD
from fedcontrast.flower.node import Node
from fedcontrast.flower.replies import pull_replies

from .test_flower_runner import fab
from .test_flower_server import task_identity  # noqa: F401  # the fixture (autouse)

RUN_ID = 1  # as the task identity the fixture sets


def outgoing(message_type: str = "train") -> Message:
    msg = Message(RecordDict({"task": ConfigRecord({"round": 1})}), dst_node_id=11, message_type=message_type)
    msg.metadata.__dict__["_message_id"] = msg.object_id
    return msg


class Store:
    """The objects of a message as the SuperLink holds them; each is unavailable for ``late`` asks."""

    def __init__(self, msg: Message, late: int = 2) -> None:
        self.contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(msg).items()}
        self.asks: dict[str, int] = {}
        self.late = late

    def get(self, object_id: str) -> bytes:
        self.asks[object_id] = self.asks.get(object_id, 0) + 1
        if self.asks[object_id] <= self.late:
            raise ObjectUnavailableError(object_id)
        return self.contents[object_id]


@pytest.fixture
def retry_waits(monkeypatch):
    """The waits (seconds) Flower's object pull asks for before it asks again for an object not yet
    there: what the code chose, whatever the machine's load."""
    waits: list[float] = []

    class Recorded(threading.Event):  # the pull's stop event, whose wait is its backoff
        def wait(self, timeout=None):
            waits.append(timeout)
            return super().wait(timeout)

    monkeypatch.setattr(inflatable_utils, "threading", SimpleNamespace(Event=Recorded, Lock=threading.Lock))
    return waits


def test_the_node_answers_a_message_whose_objects_come_late_without_flowers_1_s_wait(tmp_path, retry_waits):
    msg = outgoing()
    store = Store(msg)
    sent: dict = {}
    confirmed: list = []

    def send(reply, tree, runtime):  # the SuperLink asks for the reply's own object (the rest it has)
        sent.update(reply=reply, tree=tree)
        return {tree.object_id}, "session"

    conn = (11, None, send,
            lambda run_id: SimpleNamespace(fab_hash="h", series_id=0, run_id=run_id, fab_id="", fab_version="",
                                           override_config={}),
            lambda fab_hash, run_id: SimpleNamespace(content=fab(**{"evil.py": "import os"})),
            lambda run_id, oid: store.get(oid),
            lambda run_id, session, oid, content: sent.setdefault("pushed", []).append(oid),
            lambda run_id, oid: confirmed.append(oid))
    node = Node({"site-name": "hosp1"})
    node.handle((msg, get_object_tree(msg)), conn)
    # two retries per object, each after a few hundredths of a second; Flower's default: ≥ 0.8 s, then ≥ 1.6 s
    assert len(retry_waits) == 2 * len(store.contents) and max(retry_waits) < 0.1, retry_waits
    assert confirmed == [msg.object_id]
    reply = sent["reply"]
    refusal = dict(reply.content[REFUSAL_RECORD])  # the bundle carries code: one sentence, nothing run
    assert refusal["site"] == "hosp1" and refusal["kind"] == "refused"
    assert "carries code (evil.py)" in refusal["sentence"]
    assert reply.metadata.reply_to_message_id == msg.object_id
    assert sent["pushed"] == [reply.object_id]  # what the SuperLink asked for, the reply's own id


def test_a_failing_site_answers_with_flowers_error_reply_not_silence():
    node = Node({"site-name": "hosp1"})
    node.refusals[RUN_ID] = None
    msg = outgoing()

    def broken():
        raise OSError("the SuperLink's run is gone")

    reply = node.answer(msg, broken)
    assert reply.has_error() and "the SuperLink's run is gone" in reply.error.reason


class RuntimeClient:
    """The ServerAppIo calls the ServerApp's grid makes: the replies' headers, then their objects."""

    def __init__(self, replies: list[Message]) -> None:
        self.replies = replies
        self.stores = {m.object_id: Store(m) for m in replies}
        self.confirmed: list[str] = []

    def PullMessages(self, request):  # noqa: N802 - Flower's name
        chosen = [m for m in self.replies if m.metadata.reply_to_message_id in set(request.message_ids)]
        return SimpleNamespace(messages_list=[message_to_proto(m) for m in chosen],
                               message_object_trees=[get_object_tree(m) for m in chosen])

    def PullObject(self, request):  # noqa: N802
        for store in self.stores.values():
            if request.object_id in store.contents:
                try:
                    return PullObjectResponse(object_found=True, object_available=True,
                                              object_content=store.get(request.object_id))
                except ObjectUnavailableError:
                    return PullObjectResponse(object_found=True, object_available=False)
        return PullObjectResponse(object_found=False)

    def ConfirmMessageReceived(self, request):  # noqa: N802
        self.confirmed.append(request.message_object_id)


def test_the_serverapp_pulls_replies_whose_objects_come_late_without_flowers_1_s_wait(retry_waits):
    sent = {site: outgoing() for site in ("hosp1", "hosp2")}
    replies = []
    for site, msg in sent.items():
        reply = Message(RecordDict({"site": ConfigRecord({"name": site})}), reply_to=msg)
        reply.metadata.__dict__["_message_id"] = reply.object_id
        replies.append(reply)
    client = RuntimeClient(replies)
    from flwr.proto.node_pb2 import Node as NodeProto

    grid = SimpleNamespace(_runtime_client=client, _run=SimpleNamespace(run_id=RUN_ID), node=NodeProto(node_id=1))
    got = pull_replies(grid, [m.object_id for m in sent.values()])
    objects = sum(len(store.contents) for store in client.stores.values())
    assert len(retry_waits) == 2 * objects and max(retry_waits) < 0.1, retry_waits  # as the node's pull above
    assert sorted(str(m.content["site"]["name"]) for m in got) == ["hosp1", "hosp2"]
    assert sorted(m.metadata.reply_to_message_id for m in got) == sorted(m.object_id for m in sent.values())
    assert sorted(client.confirmed) == sorted(r.object_id for r in replies)


def test_a_test_grid_is_asked_with_its_own_pull():
    class Plain:
        def pull_messages(self, ids):
            return [f"reply to {i}" for i in ids]

    assert pull_replies(Plain(), ["a", "b"]) == ["reply to a", "reply to b"]


def test_the_node_leaves_when_the_command_that_started_it_is_gone(monkeypatch):
    parents = iter([100, 100, 1])  # the wrapper, then (killed) the process adopted by init
    killed = []
    monkeypatch.setattr(node_module.os, "getppid", lambda: next(parents))
    monkeypatch.setattr(node_module.os, "kill", lambda pid, sig: killed.append(sig))
    monkeypatch.setattr(node_module, "PARENT_CHECK_S", 0.0)
    node_module._leave_with_parent(100)
    assert killed == [node_module.signal.SIGTERM]

