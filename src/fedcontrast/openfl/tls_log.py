"""The aggregator's account of the TLS connections it refuses.

gRPC's TLS library refuses a site's handshake before any Python code sees the connection; all it
leaves is a line on the process's standard error such as ``Handshake failed with fatal error
SSL_ERROR_SSL: error:1000007d:...:CERTIFICATE_VERIFY_FAILED``, with neither the peer nor the meaning.
:class:`HandshakeLog` reads those lines (and, with gRPC's ``handshaker`` trace on, the peer address of
each connection) and turns each refusal into one sentence: who connected, and what was wrong, in the
operator's terms. The certificate itself cannot be named here — the TLS library rejects it without
handing it over — so the sentence says where it is named: the site's own log and ``fedcontrast
doctor`` at the site (see :func:`fedcontrast.deploy.certificates.check_aggregator_certificate`). Certificates
this aggregator signed for the plan's sites are checked at start-up instead
(:func:`fedcontrast.openfl.enrolment.check_enrolled_certificates`).

:class:`StderrTap` routes file descriptor 2 through :class:`HandshakeLog`: every other line passes
through unchanged, in order; the tap is removed (and drained) at exit, so nothing written to standard
error is lost.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from urllib.parse import unquote

logger = logging.getLogger("fedcontrast.aggregator")

# A gRPC C-core log line: severity, date, time, thread id, source file:line, message.
GRPC_LINE = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+(\d+) ([\w./-]+):\d+\] (.*)$")
PEER = re.compile(r"endpoint_peer_address=([^,}\s]+)")
MANAGER = re.compile(r"handshake_manager (0x[0-9a-f]+)")
FATAL = re.compile(r"Handshake failed with fatal error [A-Z_]+: error:[0-9a-fA-F]+:([^:]*):[^:]*:([A-Z0-9_]+)")
SERVER_NAME = re.compile(r"No match found for server name: (\S+?)\.?$")
CLOSED = "Handshake read failed"
ABSL_NOTICE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"

# A signature that does not verify: the certificate names the federation's CA as its issuer, but another CA
# of that name signed it (fx workspace certify gives every CA the same name; fedcontrast's CAs carry the
# federation's name, which two experiments of one federation share), or the site's key is not the
# certificate's. Which error the TLS library reports first depends on the two keys, not on the mistake: checked
# with the federation CA's RSA key, another CA's signature fails as BLOCK_TYPE_IS_NOT_01 (its padding), but as
# DATA_TOO_LARGE_FOR_MODULUS whenever the signature, read as a number, is not below that key's modulus (about 7 % of
# pairs of CA keys of one size, drawn anew with every CA), and as DATA_LEN_NOT_EQUAL_TO_MOD_LEN for a key of another
# size; ECDSA reports BAD_SIGNATURE, another key type WRONG_PUBLIC_KEY_TYPE. So every error of the RSA or ECDSA
# code, and each of these reasons, is this one cause.
FORGED = ("the certificate it presented names the federation's CA ({chain}) as its issuer, but that CA's signature "
          "does not verify: another CA of the same name signed it (e.g. another workspace's CA of this federation's "
          "name, or one `fx workspace certify` made: it names them all alike), or it does not match the site's key")
# What each refusal means, as the operator should read it ({chain}: the federation's CA file).
CAUSES = {
    "CERTIFICATE_VERIFY_FAILED": "the certificate it presented does not verify against the federation's CA in "
                                 "{chain} (it is signed by another CA, or it is expired or not yet valid)",
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "it presented no certificate (its plan or client does not use mutual TLS: "
                                         "network.settings.require_client_auth must be true at the site too)",
    "WRONG_VERSION_NUMBER": "it does not speak TLS (its plan has network.settings.use_tls: false, or it is not an "
                            "OpenFL collaborator)",
    "HTTP_REQUEST": "it sent a plain HTTP request, not TLS (not an OpenFL collaborator)",
    "TLSV1_ALERT_UNKNOWN_CA": "it does not trust this aggregator's certificate (it holds another federation's "
                              "cert_chain.crt)",
    "SSLV3_ALERT_BAD_CERTIFICATE": "it rejected this aggregator's certificate",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "it found this aggregator's certificate expired (check both machines' clocks)",
    "TLSV1_ALERT_DECRYPT_ERROR": "its certificate does not match the key it signed with",
    "FORGED": FORGED,
}
SIGNATURE_LIBRARIES = ("RSA routines", "ECDSA routines")
FORGED_REASONS = frozenset({
    "BLOCK_TYPE_IS_NOT_01", "BAD_FIXED_HEADER_DECRYPT", "NULL_BEFORE_BLOCK_MISSING", "BAD_PAD_BYTE_COUNT",
    "PADDING_CHECK_FAILED", "DATA_TOO_LARGE_FOR_MODULUS", "DATA_LEN_NOT_EQUAL_TO_MOD_LEN",  # RSA PKCS #1 v1.5
    "FIRST_OCTET_INVALID", "LAST_OCTET_INVALID", "SLEN_CHECK_FAILED", "SLEN_RECOVERY_FAILED",  # RSA-PSS
    "BAD_SIGNATURE", "WRONG_PUBLIC_KEY_TYPE",
})
CLOSED_CAUSE = ("it closed the connection during the TLS handshake: usually a site that does not trust this "
                "aggregator's certificate (another federation's cert_chain.crt, or a certificate for another name), "
                "or a port check")
WHERE_NAMED = "the site's own log names the certificate and the cause (`fedcontrast doctor --name SITE` at the site)"


def refusal_code(library: str, reason: str) -> str:
    """The cause a fatal handshake error stands for: ``FORGED`` for every way the TLS library reports a
    signature that does not verify (see :data:`FORGED_REASONS`), else the library's reason as is."""
    return "FORGED" if library in SIGNATURE_LIBRARIES or reason in FORGED_REASONS else reason


@dataclass
class HandshakeLog:
    """Reads gRPC's log lines; :meth:`feed` says whether a line is passed on, and queues the
    sentences for refused connections in :attr:`messages`. The first refusal of each kind from a
    host is reported at once, repeats at most every ``repeat_s`` seconds with their count."""

    chain: str = "cert/cert_chain.crt"
    quiet_info: bool = True  # gRPC's I lines are ours (the trace we turned on), not the operator's
    repeat_s: float = 60.0
    enrolled_problems: list[str] = field(default_factory=list)  # certificates signed here that sites cannot use
    clock: Callable[[], float] = time.monotonic
    messages: list[tuple[int, str, str | None]] = field(default_factory=list)  # level, sentence, peer host
    refused: int = 0
    _peer_of_thread: dict[str, str] = field(default_factory=dict)
    _peer_of_manager: dict[str, str] = field(default_factory=dict)
    _reported: dict[tuple[str, str], list] = field(default_factory=dict)  # (host, cause) → [last time, unreported]

    def feed(self, line: str) -> bool:
        """Take one line of standard error (without its newline); True if it is to be shown as is."""
        if line.startswith(ABSL_NOTICE):
            return False
        match = GRPC_LINE.match(line)
        if match is None:
            return True
        severity, thread, _source, text = match.groups()
        peer = PEER.search(text)
        manager = MANAGER.search(text)
        if peer is not None:
            self._peer_of_thread[thread] = peer.group(1)
            if manager is not None:
                self._peer_of_manager[manager.group(1)] = peer.group(1)
        fatal = FATAL.search(text)
        if severity == "E" and fatal is not None:
            self._refuse(self._peer_of_thread.get(thread), refusal_code(*fatal.groups()))
            return False
        name = SERVER_NAME.search(text)
        if severity == "E" and name is not None:
            self._refuse(self._peer_of_thread.get(thread), "SERVER_NAME", name.group(1))
            return False
        if (manager is not None and CLOSED in text and "handshaking complete" in text
                and "Ssl handshake failed" not in text):
            self._refuse(self._peer_of_manager.get(manager.group(1)), "CLOSED")
            return False
        if self.quiet_info and (severity == "I" or "is not suitable for production" in text):
            return False  # the info level and trace were turned on here, for the lines above
        return True

    def _refuse(self, peer: str | None, code: str, detail: str = "") -> None:
        self.refused += 1
        host, port = split_peer(peer)
        key = (host or "?", code)
        now = self.clock()
        seen = self._reported.get(key)
        if seen is not None:
            seen[1] += 1
            if now - seen[0] < self.repeat_s:
                return
            repeats, seen[0], seen[1] = seen[1], now, 0
        else:
            self._reported[key], repeats = [now, 0], 0
        if code == "SERVER_NAME":
            cause = (f"it asked for the aggregator by the name {detail}, which this aggregator's certificate does not "
                     "name (the site's plan or hosts file names the aggregator differently)")
        elif code == "CLOSED":
            cause = CLOSED_CAUSE
        else:
            cause = CAUSES.get(code, f"the TLS library reports {code}").format(chain=self.chain)
        who = f"from {host}" + (f" (port {port})" if port else "") if host else "(peer address unknown)"
        again = f" [{repeats} more since the last report]" if repeats else ""
        text = f"refused a TLS connection {who}: {cause}; nothing from it was accepted; {WHERE_NAMED}{again}"
        if code == "CERTIFICATE_VERIFY_FAILED" and self.enrolled_problems:
            text += f". Certificates signed here that sites cannot use: {'; '.join(self.enrolled_problems)}"
        level = logging.INFO if code == "CLOSED" else logging.WARNING
        self.messages.append((level, text, host))


def split_peer(peer: str | None) -> tuple[str | None, str | None]:
    """``ipv4:10.0.0.3:5123`` → (``10.0.0.3``, ``5123``); ``ipv6:[::1]:5123`` → (``::1``, ``5123``)."""
    if not peer:
        return None, None
    peer = unquote(peer)  # gRPC writes an IPv6 peer as ipv6:%5B::1%5D:5123
    address = peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return host, rest.lstrip(":") or None
    host, _, port = address.rpartition(":")
    return (host, port) if host else (address, None)


def enable_handshake_trace(environ: MutableMapping[str, str] | None = None) -> bool:
    """Turn on gRPC's ``handshaker`` trace (which names each connection's peer) unless the operator
    set gRPC's logging; True if gRPC's info lines are then ours to hide. gRPC reads these variables
    when it creates its first channel or server, after ``import grpc``."""
    environ = os.environ if environ is None else environ
    if "GRPC_VERBOSITY" in environ or "GRPC_TRACE" in environ:
        return False
    environ["GRPC_VERBOSITY"], environ["GRPC_TRACE"] = "INFO", "handshaker"
    return True


class StderrTap:
    """Route file descriptor 2 through a :class:`HandshakeLog` (see the module docstring)."""

    def __init__(self, log: HandshakeLog) -> None:
        self.log = log
        self._saved: int | None = None
        self._reader: threading.Thread | None = None
        self._emitter: threading.Thread | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._names: dict[str, str | None] = {}

    def start(self) -> StderrTap:
        sys.stderr.flush()
        read_end, write_end = os.pipe()
        self._saved = os.dup(2)
        os.dup2(write_end, 2)
        os.close(write_end)
        self._reader = threading.Thread(target=self._pump, args=(read_end,), name="fedcontrast-stderr", daemon=True)
        self._reader.start()
        # Sentences are logged from their own thread: a log handler writing to fd 2 must not wait on the reader.
        self._emitter = threading.Thread(target=self._emit, name="fedcontrast-tls-log", daemon=True)
        self._emitter.start()
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Put standard error back and pass on what is still in the pipe."""
        if self._saved is None:
            return
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(self._saved, 2)  # closes the pipe's only writer: the reader sees its end
        os.close(self._saved)
        self._saved = None
        if self._reader is not None:
            self._reader.join(timeout=5)
        self._queue.put(None)  # the emitter logs what the reader found last, then ends
        if self._emitter is not None:
            self._emitter.join(timeout=10)

    def _pump(self, read_end: int) -> None:
        if self._saved is None:  # stopped before this thread began
            return
        out = os.dup(self._saved)  # the real standard error, still open after stop()
        pending = b""

        def show(data: bytes) -> None:
            nonlocal out
            if out < 0:
                return
            try:
                while data:
                    data = data[os.write(out, data):]
            except OSError:  # the real standard error is gone (a closed terminal): keep draining, show nothing
                os.close(out)
                out = -1

        try:
            while True:
                chunk = os.read(read_end, 65536)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                shown = [line for line in lines if self._keep(line)]
                if shown:
                    show(b"".join(line + b"\n" for line in shown))
                if pending and pending[:1] not in (b"I", b"W", b"E", b"F"):  # not a gRPC line's start (nor absl's)
                    show(pending)  # a prompt or a partial line: show it now
                    pending = b""
            if pending and self._keep(pending):
                show(pending)
        finally:
            os.close(read_end)
            if out >= 0:
                os.close(out)

    def _keep(self, line: bytes) -> bool:
        try:
            keep = self.log.feed(line.decode("utf-8", "replace"))
        except Exception:  # never lose a line to a parsing mistake
            return True
        while self.log.messages:
            self._queue.put(self.log.messages.pop(0))
        return keep

    def _emit(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._log(item)

    def _log(self, item: tuple[int, str, str | None]) -> None:
        """Log one sentence, with the peer's host name where its address has one (looked up here, off
        the reader's thread: a slow name service must not hold up standard error)."""
        level, text, host = item
        if host is not None:
            if host not in self._names:
                try:
                    self._names[host] = socket.gethostbyaddr(host)[0]
                except (OSError, UnicodeError):
                    self._names[host] = None
            name = self._names[host]
            if name and name != host:
                text = text.replace(f"from {host}", f"from {host} ({name})", 1)
        logger.log(level, text)

