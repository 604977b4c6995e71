"""A site as its own Flower node: one long-lived process connects to the SuperLink's Fleet API with
Flower's own client (``flwr.supernode.fleet_http_client``: TLS against the federation's CA,
SuperNode authentication with the site's key, Flower's heartbeats; :mod:`.link`) and answers each
message in that process, with no ``flower-supernode`` and no ClientApp process. A SuperLink that
restarts, or the next experiment's SuperLink at the same address, is connected to again with the
same key; one that ended or is not this federation's any more ends the node with one sentence; a
run the operator stopped while the site answered is one sentence, and the node waits for the next.

Why: Flower's SuperNode sleeps a fixed 3 s whenever it finds no message, looks for a ClientApp's
reply in fixed 0.5 s steps, and hands every message and the site's context across its Runtime API to
the process that runs it; each of these waits is paid in every round. This node asks the SuperLink
for a message every :data:`POLL_BUSY_S` while a round is likely under way (within :data:`BUSY_S` of
its last reply) and every :data:`POLL_IDLE_S` otherwise, and keeps the site's context in memory.

What runs is the ClientApp this site installed (:data:`fedcontrast.flower.client_app.client`); an
operator's app bundle that carries code, or names another ClientApp, is refused with one sentence in
the reply (:func:`.runner.bundle_problem`), as under the other isolation modes.

    python -m fedcontrast.flower.node --superlink HOST:PORT --root-certificates CA.pem \\
        --auth-supernode-private-key KEY --node-config 'site-name="hosp1" data="..." ...' [--threads N]
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from .replies import FIRST_RETRY_S, RETRY_CAP_S
from .trace import trace

logger = logging.getLogger("fedcontrast.flower.node")

# Between two PullMessages while no message waits: the next message of a round usually comes within a
# few seconds of this site's reply (the other sites' training, the ServerApp's aggregation).
POLL_BUSY_S, POLL_IDLE_S, BUSY_S = 0.1, 1.0, 30.0
PARENT_CHECK_S = 1.0
CONNECTED_LINE = "INFO :      SuperNode ID:"  # as Flower's SuperNode says it (cli/flower.py watches for it)


class Node:
    """The site's node: :meth:`serve` takes messages until :attr:`stop` is set."""

    def __init__(self, node_config: dict[str, Any]) -> None:
        self.node_config = node_config
        self.stop = threading.Event()
        self.contexts: dict[int, Any] = {}  # run id -> the site's Flower context (kept in memory)
        self.refusals: dict[int, str | None] = {}  # run id -> why its bundle is refused, or None
        self.busy = False  # answering a message

    def _context(self, run_id: int, node_id: int, get_run, get_fab):
        from flwr.app import Context, RecordDict
        from flwr.common.config import get_fused_config_from_fab

        from .runner import bundle_problem

        if run_id not in self.contexts:
            run = get_run(run_id)
            fab = get_fab(run.fab_hash, run_id)
            problem = self.refusals[run_id] = bundle_problem(fab.content)  # a refused bundle is not read further
            self.contexts[run_id] = Context(run_id=run_id, node_id=node_id, node_config=self.node_config,
                                            state=RecordDict(), series_id=run.series_id,
                                            run_config={} if problem else get_fused_config_from_fab(fab.content, run))
        return self.contexts[run_id]

    def answer(self, message, context_of):
        """The reply to one message: the site's answer, a refusal of the bundle, or Flower's error reply."""
        from flwr.app import Error, Message
        from flwr.common.constant import ErrorCode

        from .link import Forgotten, LinkEnded
        from .runner import answer_or_refuse

        try:
            context = context_of()
            return answer_or_refuse(message, context, self.refusals.get(int(message.metadata.run_id)))
        except (Forgotten, LinkEnded):  # the SuperLink's end or change, not this message's: the node says it
            raise
        except Exception as exc:  # noqa: BLE001 - Flower's error reply, as flwr-clientapp sends it
            logger.exception("the ClientApp task failed")
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(exc)}:<'{exc}'>"),
                           reply_to=message)

    def handle(self, recv, conn) -> None:
        """Pull one message's objects, answer it, push the reply (as Flower's SuperNode and
        ``flwr-clientapp`` do between them); a run that the operator stopped meanwhile is said in one
        sentence (:meth:`run_ended`)."""
        from flwr.supercore.run import RunNotRunningException

        header, _tree = recv
        try:
            self._handle(recv, conn)
        except RunNotRunningException:  # Flower's, a BaseException: it used to end the site with a traceback
            self.run_ended(int(header.metadata.run_id), str(header.metadata.message_type))

    def run_ended(self, run_id: int, kind: str) -> None:
        """The operator's run ``run_id`` ended while this site answered its ``kind`` message (stopped
        by the ServerApp: a peer refused or failed, a timeout, the operator): one sentence, and the
        node waits for the next run."""
        self.contexts.pop(run_id, None)
        self.refusals.pop(run_id, None)
        who = str(self.node_config.get("site-name"))
        print(f"{who}: the run {run_id} ended at the operator: it was stopped before this site's answer to its "
              f"{kind} message reached the SuperLink (the operator's console says why); waiting for the operator's "
              "next run", flush=True)

    def _handle(self, recv, conn) -> None:
        from flwr.app import Message
        from flwr.supercore.inflatable.inflatable_object import (
            get_all_nested_objects,
            get_object_tree,
            no_object_id_recompute,
        )
        from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree, push_objects

        node_id, _receive, send, get_run, get_fab, pull_object, push_object, confirm = conn
        header, tree = recv
        run_id = int(header.metadata.run_id)
        started = time.monotonic()
        who = str(self.node_config.get("site-name"))
        trace(who, "received", kind=header.metadata.message_type)
        message = pull_and_inflate_object_from_tree(tree, lambda object_id: pull_object(run_id, object_id),
                                                    lambda object_id: confirm(run_id, object_id), return_type=Message,
                                                    initial_backoff=FIRST_RETRY_S, backoff_cap=RETRY_CAP_S)
        message.metadata.__dict__["_message_id"] = tree.object_id  # a deflated message lacks its own id
        trace(who, "pulled")
        reply = self.answer(message, lambda: self._context(run_id, node_id, get_run, get_fab))
        trace(who, "answered")
        reply.metadata.__dict__["_message_id"] = reply.object_id
        with no_object_id_recompute():
            reply_tree = get_object_tree(reply)
            to_push, session = send(reply, reply_tree, time.monotonic() - started)
            push_objects(get_all_nested_objects(reply),
                         lambda object_id, content: push_object(run_id, session, object_id, content),
                         object_ids_to_push=to_push)
        trace(who, "pushed")

    def serve(self, conn) -> None:
        """Takes messages until :attr:`stop` is set. The SuperLink's end or change
        (:class:`.link.Forgotten`, :class:`.link.LinkEnded`) ends it for :func:`main` to say."""
        from flwr.supercore.run import RunNotRunningException

        from .link import Forgotten, LinkEnded

        receive = conn[1]
        last = 0.0
        while not self.stop.is_set():
            try:
                recv = receive()
            except RunNotRunningException:  # no message of a stopped run: asked again
                recv = None
            if recv is None:
                self.stop.wait(POLL_BUSY_S if time.monotonic() - last < BUSY_S else POLL_IDLE_S)
                continue
            self.busy = True
            try:
                self.handle(recv, conn)
            except (Forgotten, LinkEnded):
                raise
            except Exception:  # noqa: BLE001 - a message that could not be pulled or answered: the next one
                logger.exception("a message could not be answered")
            finally:
                self.busy = False
            last = time.monotonic()

    def on_signal(self, *_) -> None:
        """SIGTERM/SIGINT: a message being answered is finished first (its reply sent); otherwise the
        node leaves the SuperLink at once."""
        self.stop.set()
        if not self.busy:
            raise KeyboardInterrupt


def _leave_with_parent(parent: int) -> None:
    """The node stops when the process that started it (``fedcontrast flower supernode``) is gone, even
    killed without a word: a site whose command was stopped answers no more messages."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os.kill(os.getpid(), signal.SIGTERM)


def load_key(path: str):
    """The site's SuperNode key (an OpenSSH EC private key, as ``fedcontrast flower site-key`` writes it)."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key

    key = load_ssh_private_key(Path(path).expanduser().read_bytes(), None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise SystemExit(f"fedcontrast flower node: error: {path} is not an EC private key (the site's SuperNode key)")
    return key, key.public_key()


def main() -> None:
    parser = argparse.ArgumentParser(description="a Flower site as its own node (no flower-supernode)")
    parser.add_argument("--superlink", required=True, metavar="HOST:PORT")
    parser.add_argument("--root-certificates", required=True, metavar="CA.pem")
    parser.add_argument("--auth-supernode-private-key", required=True, metavar="KEY")
    parser.add_argument("--node-config", required=True)
    parser.add_argument("--max-wait-time", type=float, default=600.0,
                        help="seconds to keep trying to reach the SuperLink (default 600)")
    parser.add_argument("--threads", type=int, help="torch threads (default: the cores this process may use)")
    args = parser.parse_args()

    from flwr.common.config import parse_config_args

    from ..threads import apply_threads
    from . import client_app, site_app  # noqa: F401  # torch and the plugins, before the first message
    from .link import Link
    from .worker import quiet_flower

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the site's round lines on its terminal
    quiet_flower()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per poll in the site's log
    apply_threads(args.threads)
    client_app.LONG_LIVED = True  # one process answers every message: secure-aggregation secrets stay here
    node = Node(dict(parse_config_args([args.node_config])))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, node.on_signal)
    threading.Thread(target=_leave_with_parent, args=(os.getppid(),), daemon=True).start()
    site = str(node.node_config.get("site-name"))
    link = Link(args.superlink, args.root_certificates, load_key(args.auth_supernode_private_key),
                wait=args.max_wait_time, site=site)
    try:
        raise SystemExit(keep_serving(node, link))
    except KeyboardInterrupt:
        pass


def keep_serving(node: Node, link) -> int:
    """Serves the SuperLink until the node is stopped (0), across the SuperLink's restarts and the next
    experiment's SuperLink at the same address (connecting again with the same key); 1, with one
    sentence, when the SuperLink ended or is not this federation's any more (:mod:`.link`)."""
    from .link import Forgotten, LinkEnded

    again = False
    while not node.stop.is_set():
        try:
            with link.session(again=again) as conn:
                if again:
                    print(f"{link.site}: connected again to the SuperLink at {link.address} (SuperNode {conn[0]}); "
                          "waiting for the operator's run", flush=True)
                else:
                    print(f"{CONNECTED_LINE} {conn[0]}", flush=True)
                node.serve(conn)
        except Forgotten:
            print(f"{link.site}: the SuperLink at {link.address} no longer knows this SuperNode (it restarted, or the "
                  "next experiment's SuperLink took its place); connecting again with the same key", flush=True)
            again = True
        except LinkEnded as ended:
            print(f"fedcontrast flower supernode: error: {link.site}: {ended}", flush=True)
            return 1
    return 0


if __name__ == "__main__":
    main()
