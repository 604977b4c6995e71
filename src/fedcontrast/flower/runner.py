"""A site's ClientApp runner: the site's long-lived worker (:mod:`.worker`) takes the SuperNode's
tasks itself and runs each in its own process, instead of Flower starting a ``flower-superexec``
that starts a fresh ``flwr-clientapp`` process for every message (~1.3 s of imports each).

``fedcontrast flower supernode`` starts the SuperNode with ``--isolation process`` (Flower's mode for
a ClientApp process started outside the SuperNode) and the worker with ``--runtime-api``: the worker
polls the SuperNode's Runtime API on this host for a task (``AcquireTask``, as Flower's SuperExec
does) and runs it with the functions ``flwr-clientapp`` itself uses
(``flwr.supernode.runtime.run_clientapp``: ``pull_task_input``, ``push_message``,
``push_task_output``), in-process, without the exit and signal handling a one-task process has.

What runs is the ClientApp this site installed (:data:`fedcontrast.flower.client_app.client`):
nothing of the operator's app bundle is imported. A bundle that carries code, or names another
ClientApp, is refused with one sentence in the reply (the operator names it), as a site's
``flwr-clientapp`` process refuses it (``_fedcontrast_fx_guard``).
"""

from __future__ import annotations

import io
import logging
import time
import zipfile

logger = logging.getLogger("fedcontrast.flower.runner")

# Between two AcquireTask calls while no task waits (Flower's SuperExec: 1 s; fedcontrast sets 0.2 s):
# a SuperNode takes its next message right after our reply (it looks for the reply every 0.5 s), so
# a task is likely within BUSY_S of the last one; otherwise, idle, its 3 s sleep dominates anyway.
POLL_BUSY_S, POLL_IDLE_S, BUSY_S = 0.1, 0.5, 2.0
RETRY_S = 1.0  # after the SuperNode's Runtime API did not answer (not up yet, or restarting)
CLIENTAPP = "fedcontrast.flower.client_app:client"  # the only ClientApp a site runs
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyd", ".so", ".pth", ".dll", ".dylib", ".pyx", ".ipynb")


def bundle_problem(content: bytes) -> str | None:
    """Why the operator's app bundle (a FAB, zip bytes) is refused, or None: it may hold no code and
    must name fedcontrast's installed ClientApp."""
    import importlib
    import sys

    toml = importlib.import_module("tomllib" if sys.version_info >= (3, 11) else "tomli")  # tomli: flwr's own
    try:
        with zipfile.ZipFile(io.BytesIO(content)) as fab:
            names = fab.namelist()
            code = [n for n in names if n.lower().endswith(CODE_SUFFIXES)]
            if code:
                return (f"the operator's Flower app bundle carries code ({', '.join(sorted(code)[:3])}): this site "
                        "runs only the fedcontrast it installed itself; nothing of the bundle was run")
            project = toml.loads(fab.read("pyproject.toml").decode("utf-8"))
    except (zipfile.BadZipFile, KeyError, UnicodeDecodeError, toml.TOMLDecodeError) as exc:
        return f"the operator's Flower app bundle cannot be read ({type(exc).__name__}: {exc})"
    named = project.get("tool", {}).get("flwr", {}).get("app", {}).get("components", {}).get("clientapp")
    if named != CLIENTAPP:
        return (f"the operator's Flower app bundle names the ClientApp {named!r}; this site runs only "
                f"{CLIENTAPP} (the fedcontrast it installed)")
    return None


def answer_or_refuse(message, context, problem: str | None):
    """The site's reply to ``message``: its installed ClientApp's answer, or, when the operator's
    bundle is refused (``problem``, :func:`bundle_problem`), one sentence naming why (the ServerApp
    names the site and the reason); the site's terminal says it too."""
    from .client_app import client as app
    from .client_app import refusal_message

    if problem is None:
        return app(message=message, context=context)
    name = str(dict(context.node_config).get("site-name", "this site"))
    print(f"fedcontrast flower site: error: site {name} refused: {problem}", flush=True)
    return refusal_message(message, name, "refused", problem)


def _client(address: str, component: str, token: str | None = None, *, retry: bool = True):
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    interceptors = [RuntimeVersionHttpInterceptor(component_name=component)]
    if token is not None:
        interceptors.append(RuntimeTokenHttpInterceptor(token))
    invoker = None
    if retry:  # a task's calls: the SuperNode on this host; beyond 30 s the task is lost and the next is taken
        invoker = make_simple_http_retry_invoker()
        invoker.max_time = 30.0
    return RuntimeHttpClient.from_server_address(server_address=address, insecure=True, root_certificates=None,
                                                 interceptors=interceptors, retry_invoker=invoker)


def run_task(address: str, token: str) -> None:
    """One task of the SuperNode (one message), as ``flwr-clientapp`` runs it, in this process."""
    from flwr.app import Context, Error, Message
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

    from .client_app import STANDBY_MESSAGE

    client = _client(address, "flwr-clientapp", token)
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    message: Message | None = None
    context: Context | None = None
    reply: Message | None = None
    status, details = SubStatus.FAILED, "ClientApp task failed"
    unchanged = False  # a standby: the site's context goes back as it came (not sent again)
    try:
        heartbeat.start()
        message, context, _run, fab = pull_task_input(client)
        unchanged = message.metadata.message_type == STANDBY_MESSAGE
        reply = answer_or_refuse(message, context, bundle_problem(fab.content))
        status, details = SubStatus.COMPLETED, ""
    except Exception as exc:  # noqa: BLE001 - Flower's error reply, as flwr-clientapp sends it
        logger.exception("the ClientApp task failed")
        details = f"{type(exc)}:<'{exc}'>"
        if message is not None:
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
            push_task_output(client=client, context=None if unchanged else context, sub_status=status,
                             details=details)
        finally:
            if heartbeat.is_running:
                heartbeat.stop()
            client.close()


def serve_runtime(address: str, *, stop=None) -> None:
    """Takes this site's SuperNode's tasks at ``address`` (its Runtime API on this host) one after
    another, until ``stop`` (a ``threading.Event``) is set; survives a SuperNode that is not up yet or
    restarts."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.run import RunNotRunningException

    from . import client_app, site_app  # noqa: F401  # torch and the plugins, before the first message

    client_app.LONG_LIVED = True  # one process answers every message: secure-aggregation secrets stay here
    client_app.STANDBY = True  # its start-up reply says so: the ServerApp may send it standby messages
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per poll in the site's log
    client = None
    last_task = 0.0
    while stop is None or not stop.is_set():
        try:
            if client is None:
                client = _client(address, "SuperExec", retry=False)  # polled again below, quietly
            res = client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value]))
        except Exception:  # noqa: BLE001 - the SuperNode not up yet, or restarting: asked again
            if client is not None:
                client.close()
            client = None
            time.sleep(RETRY_S)
            continue
        if res.HasField("task") and res.token:
            try:
                run_task(address, res.token)
            except RunNotRunningException:  # Flower's (a BaseException): the task is no longer the SuperNode's
                logger.warning("a task ended at the SuperNode (its run was stopped, or the SuperNode restarted) "
                               "before its reply was handed over; taking the next")
            except Exception:  # noqa: BLE001 - its reply or output could not reach the SuperNode: the next task
                logger.exception("a task's reply could not be handed to the SuperNode")
            last_task = time.monotonic()
            continue  # the next message may be waiting already
        time.sleep(POLL_BUSY_S if time.monotonic() - last_task < BUSY_S else POLL_IDLE_S)
