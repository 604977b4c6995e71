"""Issue 46: no site's node crashes or ends silently because of another party or an operator's restart.

The node's loop (flower/node.py) and its connection (flower/link.py) against a stand-in of the
SuperLink's Fleet API that answers as Flower 1.42's does: 403 for a call of a run the ServerApp
stopped (Flower's retry raises ``RunNotRunningException``, a BaseException), 401 for a node it does
not know (a restarted SuperLink, or the next experiment's), 412 for a key not registered yet, a
refused connection while it is down, a certificate error when it is another federation's. The real
SuperLink switch of docs/flower.md's ``--pki-from`` steps is in test_flower_relink.py."""

from __future__ import annotations

import json
import socket
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("flwr", reason="the Flower engine is the extra [flower] (its own environment)")

import httpx
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.proto.fleet_pb2 import ActivateNodeResponse, PullMessagesResponse
from flwr.proto.heartbeat_pb2 import SendNodeHeartbeatResponse
from flwr.supercore.inflatable.inflatable_object import get_object_tree
from flwr.supercore.run import RunNotRunningException

from fedcontrast.flower.link import Link
from fedcontrast.flower.node import Node, keep_serving

from .test_flower_node import Store, outgoing
from .test_flower_runner import fab
from .test_flower_server import task_identity  # noqa: F401  # the fixture (autouse)


def http_error(status: int, code: int = 0, message: str = "") -> httpx.HTTPStatusError:
    """An HTTP error as the SuperLink's Fleet API sends it (Flower's JSON error body)."""
    request = httpx.Request("POST", "https://superlink.example:9092/v1/fleet/x")
    body = json.dumps({"detail": message, "code": code}) if message else ""
    response = httpx.Response(status, request=request, text=body)
    return httpx.HTTPStatusError(f"{status}", request=request, response=response)


def closed_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed


class Fleet:
    """The SuperLink's Fleet API, scripted: each method takes its next answer from a list (an
    exception is raised; the last answer repeats)."""

    def __init__(self, **script) -> None:
        self.script = {k: list(v) for k, v in script.items()}
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def _next(self, method: str):
        with self.lock:
            self.calls.append(method)
            answers = self.script[method]
            answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if callable(answer) and not isinstance(answer, type):
            answer = answer()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def __getattr__(self, method: str):
        if method[:1].isupper():
            return lambda request: self._next(method)
        raise AttributeError(method)


def keys():
    private = ec.generate_private_key(ec.SECP384R1())
    return private, private.public_key()


def link(fleet: Fleet, said: list[str], *, wait: float = 600.0, address: str = "superlink.example:9092") -> Link:
    return Link(address, "ca.crt", keys(), wait=wait, site="hosp1", client=fleet, say=said.append,
                sleep=lambda s: None)


BEAT = SendNodeHeartbeatResponse(success=True)
NOTHING = PullMessagesResponse()


def test_a_run_stopped_while_the_site_answers_is_one_sentence_and_the_node_answers_the_next(capsys):
    """A peer refused: the ServerApp stops the run while this healthy site answers; Flower's Fleet
    API answers its reply with 403, which Flower's retry raises as RunNotRunningException. It used
    to escape the node's loop (a BaseException) and end the site with a traceback."""
    node = Node({"site-name": "hosp1"})
    first, second = outgoing(), outgoing("evaluate")
    stores = {m.object_id: Store(m, late=0) for m in (first, second)}
    queue = [(first, get_object_tree(first)), (second, get_object_tree(second))]
    sent: list = []

    def receive():
        if not queue:
            node.stop.set()
            return None
        return queue.pop(0)

    def send(reply, tree, runtime):
        if not sent:
            sent.append("refused")
            raise RunNotRunningException("The current run status does not allow this Fleet API operation")
        sent.append(reply)
        return set(), "session"

    def pull(run_id, oid):
        return next(s.get(oid) for s in stores.values() if oid in s.contents)

    conn = (11, receive, send,
            lambda run_id: SimpleNamespace(fab_hash="h", series_id=0, run_id=run_id, fab_id="", fab_version="",
                                           override_config={}),
            lambda fab_hash, run_id: SimpleNamespace(content=fab(**{"evil.py": "import os"})),
            pull, lambda *a: None, lambda run_id, oid: None)
    node.serve(conn)  # returns: the node goes on to the next message, then stops as asked
    out = capsys.readouterr()
    assert ("hosp1: the run 1 ended at the operator: it was stopped before this site's answer to its train message "
            "reached the SuperLink (the operator's console says why); waiting for the operator's next run") in out.out
    assert "Traceback" not in out.out + out.err
    assert len(sent) == 2 and sent[1].metadata.reply_to_message_id == second.object_id  # the next one answered


def test_a_run_stopped_before_the_site_read_it_is_one_sentence_too(capsys):
    node = Node({"site-name": "hosp1"})
    msg = outgoing()

    def gone(*_):
        raise RunNotRunningException("Run is finished")

    conn = (11, None, None, gone, gone, gone, gone, gone)
    node.handle((msg, get_object_tree(msg)), conn)
    assert "hosp1: the run 1 ended at the operator:" in capsys.readouterr().out


def test_the_superlinks_403_for_a_stopped_run_is_raised_as_flowers_run_not_running():
    """What the node turns into its sentence above: the SuperLink's answer to any call of a stopped run."""
    fleet = Fleet(PushMessages=[http_error(403, 0, "The current run status does not allow this Fleet API operation.")])
    with pytest.raises(RunNotRunningException):
        link(fleet, []).call("PushMessages", None)
    assert fleet.calls == ["PushMessages"]  # not retried


def test_the_next_experiments_superlink_is_connected_to_again_with_the_same_key(capsys):
    """docs/flower.md's --pki-from steps: the operator stops the SuperLink and starts the next
    experiment's at the same address, with a certificate of the same CA, then registers the carried
    keys. The node's calls are refused (down), then answered 401 (a node it does not know), then its
    activation 412 (the key not registered yet), then it is let in. Flower's connection signalled
    itself SIGINT at the 401 (the node exited silently) or raised it in its heartbeat thread."""
    down = httpx.ConnectError("[Errno 111] Connection refused")
    node = Node({"site-name": "hosp1"})
    polls = iter([NOTHING, down, down, http_error(401, message="Invalid SuperNode authentication"), NOTHING])

    def pull():
        answer = next(polls, None)
        if answer is None:
            node.stop.set()
            return NOTHING
        return answer

    fleet = Fleet(ActivateNode=[ActivateNodeResponse(node_id=7),
                                http_error(412, 6, "Failed to activate SuperNode."),
                                ActivateNodeResponse(node_id=8)],
                  PullMessages=[pull], SendNodeHeartbeat=[BEAT], DeactivateNode=[None])
    said: list[str] = []
    assert keep_serving(node, link(fleet, said)) == 0
    out = capsys.readouterr().out
    assert "SuperNode ID: 7" in out
    assert ("hosp1: the SuperLink at superlink.example:9092 no longer knows this SuperNode (it restarted, or the next "
            "experiment's SuperLink took its place); connecting again with the same key") in out
    assert ("hosp1: connected again to the SuperLink at superlink.example:9092 (SuperNode 8); waiting for the "
            "operator's run") in out
    assert said == [
        "hosp1: the SuperLink at superlink.example:9092 does not answer (connection refused: it stopped, or is "
        "restarting); trying again for up to 600 s (--wait)",
        "hosp1: the SuperLink at superlink.example:9092 does not let this site's key in yet (Failed to activate "
        "SuperNode); asking again for up to 600 s while the operator registers it (`fedcontrast flower register DIR "
        "--carried`)"]
    assert fleet.calls.count("ActivateNode") == 3 and fleet.calls[-1] == "DeactivateNode"  # left when stopped


def test_a_superlink_of_another_ca_ends_the_node_with_one_sentence(capsys):
    """The operator started a SuperLink whose certificate the site's pinned CA does not sign (a new
    CA): never retried; one sentence naming the CA the site holds, exit code 1."""
    node = Node({"site-name": "hosp1"})
    other_ca = httpx.ConnectError("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local "
                                  "issuer certificate (_ssl.c:1006)")
    fleet = Fleet(ActivateNode=[ActivateNodeResponse(node_id=7)], PullMessages=[NOTHING, other_ca],
                  SendNodeHeartbeat=[BEAT], DeactivateNode=[None])
    address = closed_address()
    assert keep_serving(node, link(fleet, [], address=address)) == 1
    out = capsys.readouterr().out
    assert (f"fedcontrast flower supernode: error: hosp1: the SuperLink at {address} now presents a certificate this "
            "site's CA (?, ca.crt) does not accept ([SSL: CERTIFICATE_VERIFY_FAILED]") in out
    assert "it is not the SuperLink of this site's federation (a new CA?); this site stops" in out
    assert fleet.calls.count("PullMessages") == 2  # not retried
    assert "DeactivateNode" not in fleet.calls


def test_a_superlink_that_stays_down_ends_the_node_after_its_wait(capsys):
    node = Node({"site-name": "hosp1"})
    down = httpx.ConnectError("[Errno 111] Connection refused")
    fleet = Fleet(ActivateNode=[ActivateNodeResponse(node_id=7)], PullMessages=[NOTHING, down],
                  SendNodeHeartbeat=[BEAT], DeactivateNode=[None])
    said: list[str] = []
    assert keep_serving(node, link(fleet, said, wait=0.2)) == 1
    out = capsys.readouterr().out
    assert ("fedcontrast flower supernode: error: hosp1: the SuperLink at superlink.example:9092 has not answered for "
            "0.2 s (connection refused: it stopped, or is restarting): it ended; start this SuperNode again once the "
            "operator's SuperLink is up (or give a longer --wait)") in out
    assert len(said) == 1  # one line when it stopped answering, not one per attempt


def test_a_key_the_superlink_refuses_at_start_is_left_to_the_supernode_command():
    """At start a refused key ends the node at once, with Flower's words, which `fedcontrast flower
    supernode` recognises (it retries for --retry-refused, then names the key)."""
    from fedcontrast.cli.flower import REFUSED_MARKERS
    from fedcontrast.flower.link import LinkEnded

    fleet = Fleet(ActivateNode=[http_error(412, 6, "Failed to activate SuperNode.")])
    with pytest.raises(LinkEnded) as info:
        with link(fleet, []).session():
            pass
    assert any(m in str(info.value) for m in REFUSED_MARKERS)


# --- `fedcontrast flower supernode --isolation process|subprocess`: Flower's own SuperNode ----------------
# Its connection ends its process at a 401 (a SIGINT it sends itself, exit code 0; sometimes a traceback of
# its heartbeat thread first), and hangs after giving up on a certificate. The command reads its output.

FLOWER_401 = ["Exception in thread Thread-2 (_run):\n", "Traceback (most recent call last):\n",
              '  File "flwr/supercore/heartbeat.py", line 98, in _run\n',
              "    self._retry_invoker.invoke(self._heartbeat)\n",
              "httpx.HTTPStatusError: Client error '401 Unauthorized' for url "
              "'https://localhost:9092/v1/fleet/send-node-heartbeat'\n",
              "For more information check: https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/401\n"]


def supernode_args(**kw):
    from argparse import Namespace

    return Namespace(**({"name": "hosp1", "superlink": "localhost:9092", "ca": "ca.crt", "key": "hosp1.key",
                         "wait": 600.0, "retry_refused": 90.0, "verbose": False} | kw))


def scripted(monkeypatch, attempts):
    """Each start of Flower's SuperNode: its lines, then its exit code (or "signalled": the site stopped it)."""
    from fedcontrast.cli import flower as cli

    monkeypatch.setattr(cli, "REFUSED_RETRY_S", 0.0)
    shown: list[str] = []
    script = iter(attempts)

    def run_child(command, env, *, on_line=None, signalled=None, hide_traceback=None, show=None, **_):
        lines, code = next(script)
        for line in lines:
            on_line(line)
            if show is None or show(line):
                shown.append(line)
        if code == "signalled":
            signalled.append(15)
            return 0
        return code

    monkeypatch.setattr(cli, "_run_child", run_child)
    return shown


def test_flowers_supernode_that_its_superlink_forgot_is_started_again(monkeypatch, capsys):
    from fedcontrast.cli.flower import _supernode

    retries = ["WARNING :   Connection attempt failed, retrying in 0.29 seconds"] * 4
    refused = ["ERROR :     Exit Code: 300", "Failed to initialize the connection to the SuperLink.",
               "[code: 6] Failed to activate SuperNode."]
    shown = scripted(monkeypatch, [
        (["INFO :      SuperNode ID: 5", *retries], 0),  # the 401: Flower ended itself, exit code 0
        (refused, 1), (refused, 1),  # the next experiment's SuperLink: the key not registered yet
        (["INFO :      SuperNode ID: 6",
          "INFO :      Run ID 42 is not in `RUNNING` status. Ignoring reply message 9f3."], "signalled")])
    assert _supernode(supernode_args(), ["flower-supernode"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "hosp1: connected to the SuperLink at localhost:9092; waiting for the operator's run",
        "hosp1: the SuperLink at localhost:9092 does not answer; its SuperNode tries again for up to 600 s (--wait)",
        "hosp1: the SuperLink at localhost:9092 no longer knows this SuperNode (it restarted, or the next experiment's "
        "SuperLink took its place); starting it again with the same key",
        "hosp1: the SuperLink at localhost:9092 does not let this site's key in yet; asking again for up to 600 s "
        "while the operator registers it (`fedcontrast flower register DIR --carried`)",
        "hosp1: connected again to the SuperLink at localhost:9092; waiting for the operator's run",
        "hosp1: the run 42 ended at the operator: it was stopped before this site's answer reached the SuperLink (the "
        "operator's console says why); waiting for the operator's next run"]
    assert not any("retrying" in line or "Exit Code" in line for line in shown)  # said once, in fedcontrast's words


def test_flowers_supernode_facing_another_ca_ends_with_one_sentence(monkeypatch, capsys):
    from fedcontrast.cli.flower import _supernode

    address = closed_address()
    scripted(monkeypatch, [(["INFO :      SuperNode ID: 5", "ERROR :     SSL/TLS handshake error detected.",
                             "WARNING :   Giving up reconnection after 6.34 seconds and 5 tries.",
                             "ERROR :     [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get "
                             "local issuer certificate (_ssl.c:1006)"], 0)])
    assert _supernode(supernode_args(superlink=address), ["flower-supernode"]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith(f"fedcontrast flower supernode: error: hosp1: the SuperLink at {address} "
                                           "now presents a certificate this site's CA (?, ca.crt) does not accept")
    assert "Traceback" not in out and "Giving up" not in out


def test_flowers_supernode_that_gave_up_is_ended_by_the_command():
    """Flower's SuperNode logs the error it gave up on and then waits forever: the command ends it."""
    from fedcontrast.cli.flower import _Attempt

    attempt = _Attempt(supernode_args(), flower=True, again=False)
    assert not attempt.line("INFO :      SuperNode ID: 5")
    assert not attempt.line("WARNING :   Giving up reconnection after 600.1 seconds and 40 tries.")
    assert attempt.line("ERROR :     [Errno 111] Connection refused")  # done: the command stops it


def test_a_traceback_of_flowers_heartbeat_401_is_not_passed_on(capsys):
    import sys

    from fedcontrast.cli.flower import _forgotten, _run_child

    other = ["Traceback (most recent call last):\n", '  File "x.py", line 1, in <module>\n', "ValueError: boom\n"]
    text = "".join(["before\n", *FLOWER_401, *other, "after\n"])
    program = f"import sys; sys.stdout.write({text!r})"
    assert _run_child([sys.executable, "-c", program], {}, hide_traceback=_forgotten) == 0
    assert capsys.readouterr().out == "".join(["before\n", *other, "after\n"])  # only the 401's traceback left out
