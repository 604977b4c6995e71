"""The ``ClientApp`` of a Flower deployment: a light shell that imports neither torch nor the
plugins. Flower starts a fresh ClientApp process for every message; the site's work
(:func:`.site_app.handle`) runs in the site's long-lived worker (:mod:`.worker`, started by
``fedcontrast flower supernode`` and named in the node configuration as ``worker``), so a site pays
for its imports and for reading its folder once, not every round. A SuperNode started by hand,
without a worker, runs the same function in the ClientApp process itself.

Records cross as plain data (arrays as numpy, config values as Python values); the site's state
comes from and goes back to the SuperNode's ``context.state``.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

from .packing import pack_arrays, unpack_arrays

REFUSAL_RECORD = "refusal"  # as site_app.REFUSAL_RECORD (this shell imports no torch): a refused or failed site
STATE_RECORD = "fedcontrast"  # context.state[STATE_RECORD]["state"]: the site's state, torch.save bytes
WORKER_WAIT_S = 120.0  # how long a message waits for a worker that is still starting
STANDBY_MESSAGE = "query.standby"  # the ServerApp's standby between two messages (server_app.FlowerServer.standby)
STANDBY_MAX_S = 60.0  # the longest hold a standby message may ask for
LONG_LIVED = False  # True in the site's runner (flower/runner.py) and node (flower/node.py): one process answers
# every message of the site
STANDBY = False  # True in the site's runner: its SuperNode sleeps 3 s when idle, so the ServerApp may send it standbys


def node_settings(context) -> dict[str, str]:
    """The node configuration's fedcontrast keys, checked: one sentence for a missing one."""
    nc = {k: str(v) for k, v in dict(context.node_config).items()}
    missing = [k for k in ("site-name", "data", "workdir") if not nc.get(k, "").strip()]
    if missing:
        raise ValueError(f"this SuperNode was started without {', '.join(missing)} in its --node-config; start it "
                         "with `fedcontrast flower supernode --name SITE --data FOLDER`")
    return nc


def plain_content(msg) -> dict[str, Any]:
    from flwr.app import ArrayRecord

    out: dict[str, Any] = {}
    for name, record in msg.content.items():
        if isinstance(record, ArrayRecord):
            out[name] = unpack_arrays(record)
        else:
            out[name] = dict(record.items())
    return out


def ask_worker(settings: dict[str, str], request: dict[str, Any]) -> tuple[dict[str, Any], bytes | None]:
    """The site's worker answers ``request`` (waits for a worker still starting)."""
    address, key = settings["worker"], Path(settings["worker-key"]).read_bytes()
    deadline = time.monotonic() + WORKER_WAIT_S
    while True:
        try:
            conn = Client(address, family="AF_UNIX", authkey=key)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"this site's worker ({address}) is not running; restart `fedcontrast flower "
                                   "supernode`") from None
            time.sleep(0.2)
    with conn:
        conn.send(request)
        status, *answer = conn.recv()
    if status != "ok":
        raise RuntimeError(answer[0])
    return answer[0], answer[1]


def refusal_message(msg, site: str, kind: str, sentence: str):
    """A reply holding one sentence: the site ``refused`` or ``failed`` (server_app reads and names it)."""
    from flwr.app import ConfigRecord, Message, RecordDict

    return Message(content=RecordDict({REFUSAL_RECORD: ConfigRecord({"kind": kind, "site": site,
                                                                     "sentence": sentence})}), reply_to=msg)


def standby(msg, context):
    """A standby message (sent only to a site whose start-up reply said it runs every message in one
    long-lived process): held for the seconds the ServerApp asks, so that the site's SuperNode, which
    takes its next message at once after a reply but sleeps 3 s after finding none, is still busy when
    the next round's message is queued. Touches nothing of the site."""
    from flwr.app import ConfigRecord, Message, RecordDict

    hold = min(max(0.0, float(msg.content["standby"]["hold"])), STANDBY_MAX_S)
    time.sleep(hold)
    return Message(content=RecordDict({"standby": ConfigRecord({"held": hold})}), reply_to=msg)


def handler(msg, context):
    """Every message type: the site's answer as Flower records; a refusal or a failure as a reply
    holding one sentence (the ``refusal`` record), never a ClientApp that stops without replying."""
    from flwr.app import ConfigRecord, Message, RecordDict

    name = dict(context.node_config).get("site-name", "this site")
    try:
        settings = node_settings(context)
        if LONG_LIVED:  # the site's runner: its secure-aggregation secrets stay in this process (flower/secure.py)
            settings["runner"] = "true"
        record = context.state.config_records.get(STATE_RECORD)
        message_type = msg.metadata.message_type
        request: dict[str, Any] = {"kind": "secagg" if message_type == "query.secagg" else message_type.split(".")[0],
                   "run_id": int(msg.metadata.run_id),
                   "run_config": str(context.run_config["fedcontrast-config"]), "settings": settings,
                   "content": plain_content(msg), "state": bytes(record["state"]) if record is not None else None}
        if settings.get("worker"):
            reply, state = ask_worker(settings, request)
        else:
            from .site_app import answer

            reply, state = answer(**request)  # a refusal is a reply too
    except Exception as exc:  # noqa: BLE001 - every failure reaches the operator as one sentence, in a reply
        print(f"fedcontrast flower site: error: site {name} failed: {exc}", flush=True)
        reply, state = {REFUSAL_RECORD: {"kind": "failed", "site": name, "sentence": str(exc)}}, None
    if STANDBY and msg.metadata.message_type == "query" and "site" in reply:  # the ServerApp may send it standbys
        reply["site"] = {**reply["site"], "standby": 1}
    if state is not None:
        context.state[STATE_RECORD] = ConfigRecord({"state": state})
    records = {k: pack_arrays(v) if k == "uploads" else ConfigRecord(v) for k, v in reply.items()}
    return Message(content=RecordDict(records), reply_to=msg)


def client_app():
    """The ClientApp of every plugin, for a deployment."""
    from flwr.clientapp import ClientApp

    app = ClientApp()
    app.query()(handler)
    app.query("secagg")(handler)  # the steps of a round's secure aggregation (flower/secure.py)
    app.query("standby")(standby)  # STANDBY_MESSAGE: between two messages, for a long-lived runner
    app.train()(handler)
    app.evaluate()(handler)
    return app


client = client_app()  # the component the Flower App names: fedcontrast.flower.client_app:client
