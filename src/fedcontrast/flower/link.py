"""The site node's connection to the SuperLink (:mod:`.node`): Flower's Fleet API over HTTPS, as
``flwr.supernode.fleet_http_connection`` makes it (TLS against the federation's CA, the site's
SuperNode key, Flower's heartbeats), except for what happens when the SuperLink ends or changes.

Flower's connection ends its process when the SuperLink answers 401 (it sends itself SIGINT): that is
what a restarted SuperLink, or the next experiment's SuperLink at the same address, answers a node it
does not know, so every site's node used to stop, silently or with a traceback from the heartbeat
thread. Here:

- the SuperLink no longer knows this node (401: a restart, or the next experiment's SuperLink, as
  docs/flower.md's ``--pki-from`` steps start it): :class:`Forgotten`; the node says so in one
  sentence and connects again with the same key, waiting up to ``wait`` seconds for the operator to
  register it there (``flower register DIR --carried``);
- the SuperLink does not answer (stopped, restarting): one sentence, then the same calls again for
  up to ``wait`` seconds (``--wait``), then :class:`LinkEnded`;
- its certificate is not signed by the CA this site holds (a new CA: another federation): the TLS
  failure is never retried; :class:`LinkEnded` says so, naming both CAs;
- a run the operator stopped (403: "the run status does not allow this"): Flower's
  ``RunNotRunningException``, which :class:`.node.Node` turns into one sentence.

Every :class:`LinkEnded` is one sentence, which the node prints before it exits with code 1.
"""

from __future__ import annotations

import importlib
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REGISTER_RETRY_S = 5.0  # between two activations while the SuperLink does not know this site's key yet
RETRY_MAX_S = 5.0  # the longest wait between two calls to a SuperLink that does not answer (Flower's: 20 s): a
# restarted SuperLink, or the next experiment's, has its sites back within seconds
RETRYABLE_STATUS = (502, 503, 504)


class LinkEnded(Exception):
    """This node cannot go on with the SuperLink; the message is the one sentence the site is told."""


class Forgotten(Exception):
    """The SuperLink no longer knows this node (it restarted, or the next experiment's SuperLink took
    its place): the node connects again with the same key."""


def _httpx() -> Any:
    return importlib.import_module("httpx")  # Flower's dependency: only in its environment


def flower_detail(exc: Any) -> str:
    """What the SuperLink said in an HTTP error: Flower's public message, else the status line."""
    from flwr.supercore.error import FlowerError

    response = getattr(exc, "response", None)
    error = FlowerError.from_json(response.text) if response is not None else None
    if error is not None and error.message:
        return str(error.message).rstrip(".")
    return f"HTTP {response.status_code}" if response is not None else str(exc)


def _is_tls(exc: BaseException) -> bool:
    """Whether the TLS handshake failed on the SuperLink's certificate (never fixed by retrying; a
    connection cut mid-call, also reported by the SSL layer, is retried)."""
    return "certificate" in str(exc).lower()


def _ca_name(ca: str) -> str:
    try:
        from cryptography import x509

        return x509.load_pem_x509_certificate(Path(ca).expanduser().read_bytes()).subject.rfc4514_string()
    except Exception:  # noqa: BLE001 - a name for the sentence only
        return "?"


def presented_issuer(address: str, timeout: float = 3.0) -> str | None:
    """Who issued the certificate the server at ``address`` presents (not checked: only named), or None."""
    import socket

    from cryptography import x509

    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as raw, \
                context.wrap_socket(raw, server_hostname=host) as tls:
            der = tls.getpeercert(binary_form=True)
        return x509.load_der_x509_certificate(der).issuer.rfc4514_string() if der else None
    except Exception:  # noqa: BLE001 - a name for the sentence only
        return None


def identity_sentence(address: str, ca: str, failure: str, *, connected_once: bool) -> str:
    """The sentence for a SuperLink whose certificate this site's CA does not accept (``failure``,
    the TLS error): who issued what it presents, and the CA this site holds."""
    issuer = presented_issuer(address)
    held = _ca_name(ca)
    what = (f"a certificate issued by {issuer}, not by the federation's CA this site holds ({held}, {ca})"
            if issuer and issuer != held
            else f"a certificate this site's CA ({held}, {ca}) does not accept ({failure})")
    return (f"the SuperLink at {address} {'now ' if connected_once else ''}presents {what}: it is not the SuperLink "
            "of this site's federation (a new CA?); this site stops: compare the CA's fingerprint with the operator's "
            "and start its SuperNode again with the ca.crt the operator sends")


def _reason(exc: BaseException) -> str:
    text = str(exc)
    if "refused" in text.lower():
        return "connection refused: it stopped, or is restarting"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Link:
    """One site's connection to the SuperLink at ``address``; :meth:`session` yields the callbacks
    :class:`.node.Node` uses (those of Flower's ``http_request_response``). ``client``, ``say``,
    ``sleep`` and ``clock`` are for tests."""

    def __init__(self, address: str, ca: str, keys: tuple[Any, Any], *, wait: float, site: str,
                 client: Any = None, say: Callable[[str], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> None:
        self.address, self.ca, self.keys, self.wait, self.site = address, ca, keys, float(wait), site
        self.client = client
        self.say = say or (lambda line: print(line, flush=True))
        self.sleep, self.clock = sleep, clock
        self.node: Any = None  # Flower's Node of this session
        self.connected_once = False  # a session was up: a later failure is the SuperLink's end or change
        self.forgotten = threading.Event()  # set by the heartbeat when the SuperLink no longer knows this node
        self.waiting = False  # the SuperLink did not answer the last call

    # --- calls ----------------------------------------------------------------------------------
    def _client(self) -> Any:
        if self.client is None:
            from flwr.supercore.interceptors.http.runtime_version import RuntimeVersionHttpInterceptor
            from flwr.supernode.fleet_http_client import FleetHttpClient
            from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor

            self.client = FleetHttpClient.from_server_address(
                self.address, False, str(Path(self.ca).expanduser()),
                interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperNode"),
                              NodeAuthHttpInterceptor(*self.keys)])
        return self.client

    def identity_changed(self, exc: BaseException) -> str:
        """The sentence for a TLS failure: what the SuperLink presents, and the CA this site holds."""
        return identity_sentence(self.address, self.ca, str(exc), connected_once=self.connected_once)

    def gone(self, exc: BaseException) -> str:
        """The sentence for a SuperLink that did not answer within ``wait`` seconds."""
        if self.connected_once:
            return (f"the SuperLink at {self.address} has not answered for {self.wait:g} s ({_reason(exc)}): it "
                    "ended; start this SuperNode again once the operator's SuperLink is up (or give a longer --wait)")
        return (f"the SuperLink at {self.address} did not answer within {self.wait:g} s ({_reason(exc)}): it is not "
                "started yet, or the address is wrong")

    def _should_give_up(self, exc: Exception) -> bool:
        httpx = _httpx()
        if isinstance(exc, httpx.HTTPStatusError):
            status = exc.response.status_code
            if status in (401, 403):
                self.waiting = False  # it answers: what it said is the node's next sentence
            if status == 401:
                raise Forgotten(flower_detail(exc))
            if status == 403:
                from flwr.supercore.error import ApiErrorCode, FlowerError
                from flwr.supercore.run import RunNotRunningException

                error = FlowerError.from_json(exc.response.text)
                if error is not None and error.code == ApiErrorCode.RUNTIME_CONNECTOR_NOT_AVAILABLE:
                    return True
                raise RunNotRunningException(flower_detail(exc))
            return status not in RETRYABLE_STATUS
        if _is_tls(exc):
            raise LinkEnded(self.identity_changed(exc))
        return False

    def _backoff(self, state: Any) -> None:
        if not self.waiting and isinstance(state.exception, _httpx().TransportError):
            self.waiting = True
            self.say(f"{self.site}: the SuperLink at {self.address} does not answer ({_reason(state.exception)}); "
                     f"trying again for up to {self.wait:g} s (--wait)")

    def _success(self, _state: Any) -> None:
        if self.waiting:
            self.waiting = False
            self.say(f"{self.site}: the SuperLink at {self.address} answers again")

    def call(self, method: str, request: Any) -> Any:
        """``method`` of the Fleet API, retried as the module says; the SuperLink's end or change raised
        as :class:`LinkEnded`, :class:`Forgotten` or ``RunNotRunningException``."""
        from flwr.supercore.retry import RetryInvoker, exponential

        httpx = _httpx()
        invoker = RetryInvoker(lambda: exponential(max_delay=RETRY_MAX_S), (httpx.TransportError,
                                                                                 httpx.HTTPStatusError),
                               max_tries=None, max_time=self.wait, on_backoff=self._backoff, on_success=self._success,
                               should_giveup=self._should_give_up, wait_function=self.sleep)
        try:
            return invoker.invoke(getattr(self._client(), method), request)
        except httpx.TransportError as exc:
            raise LinkEnded(self.gone(exc)) from None

    # --- the session ----------------------------------------------------------------------------
    def activate(self, *, again: bool) -> int:
        """Activates this node (its key registered at the SuperLink); its node id. ``again``: after the
        SuperLink forgot it: a key not registered (yet) is asked again for up to ``wait`` seconds."""
        from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL
        from flwr.proto.fleet_pb2 import ActivateNodeRequest
        from flwr.proto.node_pb2 import Node
        from flwr.supercore.primitives.asymmetric import public_key_to_bytes

        httpx = _httpx()
        request = ActivateNodeRequest(public_key=public_key_to_bytes(self.keys[1]),
                                      heartbeat_interval=HEARTBEAT_DEFAULT_INTERVAL)
        deadline, told = self.clock() + self.wait, False
        while True:
            try:
                response = self.call("ActivateNode", request)
                break
            except Forgotten as exc:  # a signed request refused: the signature's time, or its key
                raise LinkEnded(f"the SuperLink at {self.address} refused this SuperNode's signed request ({exc}): "
                                "check this machine's clock") from None
            except httpx.HTTPStatusError as exc:
                detail = flower_detail(exc)
                if not again:  # at start: `fedcontrast flower supernode` names the key (--retry-refused)
                    raise LinkEnded(f"the SuperLink at {self.address} refused this SuperNode: {detail}") from None
                if self.clock() >= deadline:
                    raise LinkEnded(f"the SuperLink at {self.address} has not let this site's key in within "
                                    f"{self.wait:g} s: the operator has not registered it there (`fedcontrast flower "
                                    "register DIR --carried`); start this SuperNode again once it has") from None
                if not told:
                    told = True
                    self.say(f"{self.site}: the SuperLink at {self.address} does not let this site's key in yet "
                             f"({detail}); asking again for up to {self.wait:g} s while the operator registers it "
                             "(`fedcontrast flower register DIR --carried`)")
                self.sleep(REGISTER_RETRY_S)
        self.node = Node(node_id=response.node_id)
        return int(response.node_id)

    def _beat(self) -> bool:
        """One heartbeat (Flower's ``HeartbeatSender`` retries a False): never raises, never signals."""
        from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL
        from flwr.proto.heartbeat_pb2 import SendNodeHeartbeatRequest

        httpx = _httpx()
        if self.node is None:
            return False
        try:
            response = self._client().SendNodeHeartbeat(
                SendNodeHeartbeatRequest(node=self.node, heartbeat_interval=HEARTBEAT_DEFAULT_INTERVAL))
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code == 401:
                self.forgotten.set()  # the node's next call says so
                return True
            return False
        except Exception:  # noqa: BLE001 - unreachable, or a TLS failure: the node's own calls say which
            return False
        if not response.success:
            self.forgotten.set()
        return True

    @contextmanager
    def session(self, *, again: bool = False) -> Iterator[tuple]:
        """Activated, with heartbeats: the callbacks of Flower's ``http_request_response`` (node id,
        receive, send, get_run, get_fab, pull_object, push_object, confirm_message_received)."""
        from flwr.supercore.heartbeat import HeartbeatSender

        self.forgotten.clear()
        node_id = self.activate(again=again)
        self.connected_once = True
        heartbeat = HeartbeatSender(self._beat)
        heartbeat.start()
        left = False  # the SuperLink forgot this node, or ended: nothing to deactivate
        try:
            yield (node_id, self.receive, self.send, self.get_run, self.get_fab, self.pull_object, self.push_object,
                   self.confirm)
        except (Forgotten, LinkEnded):
            left = True
            raise
        finally:
            if heartbeat.is_running:
                heartbeat.stop()
            if not left:
                self._deactivate()
            self.node = None

    def _deactivate(self) -> None:
        from flwr.proto.fleet_pb2 import DeactivateNodeRequest

        try:
            self._client().DeactivateNode(DeactivateNodeRequest(node_id=self.node.node_id))
        except Exception:  # noqa: BLE001 - leaving: the SuperLink notices the missing heartbeats anyway
            pass

    # --- the callbacks --------------------------------------------------------------------------
    def receive(self) -> Any:
        from flwr.common.serde import message_from_proto
        from flwr.proto.fleet_pb2 import PullMessagesRequest

        if self.forgotten.is_set():
            raise Forgotten("its heartbeat was refused")
        response = self.call("PullMessages", PullMessagesRequest(node=self.node))
        if not response.messages_list:
            return None
        return message_from_proto(response.messages_list[0]), response.message_object_trees[0]

    def send(self, message: Any, object_tree: Any, clientapp_runtime: float) -> tuple[set[str], str]:
        from flwr.app.message import remove_content_from_message
        from flwr.common.serde import message_to_proto
        from flwr.proto.fleet_pb2 import PushMessagesRequest

        if message.has_content():
            message = remove_content_from_message(message)
        response = self.call("PushMessages", PushMessagesRequest(
            node=self.node, messages_list=[message_to_proto(message)], message_object_trees=[object_tree],
            clientapp_runtime_list=[clientapp_runtime]))
        return set(response.objects_to_push), response.session_id

    def get_run(self, run_id: int) -> Any:
        from flwr.common.serde import run_from_proto
        from flwr.proto.run_pb2 import GetRunRequest

        return run_from_proto(self.call("GetRun", GetRunRequest(node=self.node, run_id=run_id)).run)

    def get_fab(self, fab_hash: str, run_id: int) -> Any:
        from flwr.common.serde import fab_from_proto
        from flwr.proto.fab_pb2 import GetFabRequest

        return fab_from_proto(self.call("GetFab", GetFabRequest(node=self.node, hash_str=fab_hash, run_id=run_id)).fab)

    def pull_object(self, run_id: int, object_id: str) -> bytes:
        from flwr.supercore.inflatable.inflatable_protobuf_utils import make_pull_object_fn_protobuf

        return make_pull_object_fn_protobuf(lambda r: self.call("PullObject", r), self.node, run_id)(object_id)

    def push_object(self, run_id: int, session_id: str, object_id: str, contents: bytes) -> None:
        from flwr.supercore.inflatable.inflatable_protobuf_utils import make_push_object_fn_protobuf

        make_push_object_fn_protobuf(lambda r: self.call("PushObject", r), self.node, run_id,
                                     session_id)(object_id, contents)

    def confirm(self, run_id: int, object_id: str) -> None:
        from flwr.supercore.inflatable.inflatable_protobuf_utils import make_confirm_message_received_fn_protobuf

        make_confirm_message_received_fn_protobuf(lambda r: self.call("ConfirmMessageReceived", r), self.node,
                                                  run_id)(object_id)
