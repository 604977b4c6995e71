"""The Flower programs the ``fedcontrast flower`` commands run in the foreground (the SuperLink, ``flwr
run``, a site's SuperNode or node): their output passed through (:func:`_run_child`, :func:`shown`:
no colour codes in a file, Flower's INFO chatter only with ``--verbose``), and what ``flower
supernode`` reads in its SuperNode's output (:class:`_Attempt`: connected, retrying, given up; why it
ended, :func:`_superlink_ended`), said in fedcontrast's sentences. ``flower supernode``'s loop itself,
its starts again and its retries while the key is refused, is :func:`.flower._supernode`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

CONNECTED_MARKER = "SuperNode ID:"  # Flower's INFO line once the SuperLink accepted the SuperNode
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")  # colour and cursor codes
FLOWER_CHATTER = re.compile(r"^(DEBUG|INFO)\s*(\d[\d:,. -]*)?:")  # Flower's own INFO/DEBUG lines (flwr's format)
RUN_NOT_RUNNING = re.compile(r"Run ID (\d+) is not in `RUNNING` status")  # Flower's SuperNode, at INFO
FLOWER_RETRY = "Connection attempt failed, retrying"  # Flower's WARNING, at every attempt
FLOWER_RETRIED = "Connection successful after"  # its INFO line once the SuperLink answers again
FLOWER_GAVE_UP = "Giving up reconnection"  # its WARNING before the error it gives up on
FLOWER_TLS = "SSL/TLS handshake error detected"  # its ERROR before it gives up on a certificate
TRACEBACK_STARTS = ("Traceback (most recent call last)", "Exception in thread", "During handling of the above",
                    "The above exception was the direct cause")


def _stop_when_gone(worker: subprocess.Popen, name: str) -> threading.Event:
    """With ``--isolation process`` nothing but the worker takes the SuperNode's messages: if it
    fails (a crash, killed for memory), the SuperNode stops too, with one sentence, rather than leave
    the operator to a round timeout (a signal that stops the site's processes stops both anyway)."""

    def watch() -> None:
        code = worker.wait()
        if not stopping.is_set() and code not in (-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP):  # not a stop
            print(f"fedcontrast flower supernode: error: {name}'s worker stopped (exit code {code}); stopping its "
                  "SuperNode (see the lines above)", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)

    stopping = threading.Event()  # set when the SuperNode stops first: the worker is stopped on purpose
    threading.Thread(target=watch, daemon=True).start()
    return stopping


class _Attempt:
    """What ``flower supernode`` reads in the output of one start of its SuperNode (or node): whether
    it connected, and Flower's own lines said in fedcontrast's sentences instead (``flower``: Flower's
    SuperNode; the site's own node says them itself, flower/link.py)."""

    def __init__(self, args: argparse.Namespace, *, flower: bool, again: bool) -> None:
        self.args, self.flower, self.again = args, flower, again
        self.seen: list[str] = []
        self.connected = False
        self.waiting = False  # the SuperLink did not answer Flower's SuperNode's last call
        self.gave_up = False  # Flower's SuperNode gave up on its SuperLink

    def line(self, line: str) -> bool:
        """Reads one line; True when Flower's SuperNode is done though it goes on running (it gave up on
        its SuperLink: it logs the error and waits forever)."""
        self.seen.append(line)
        name, superlink = self.args.name, self.args.superlink
        if self.flower and self.connected and self.gave_up and line.startswith("ERROR"):
            return True  # the error it gave up on: said by _superlink_ended
        self.gave_up = self.gave_up or FLOWER_GAVE_UP in line
        if CONNECTED_MARKER in line:
            self.connected = True
            print(f"{name}: connected {'again ' if self.again else ''}to the SuperLink at {superlink}; waiting for the "
                  "operator's run", flush=True)
        if not self.flower:
            return False
        if self.connected and FLOWER_RETRY in line and not self.waiting:  # once, not Flower's line per attempt
            self.waiting = True
            print(f"{name}: the SuperLink at {superlink} does not answer; its SuperNode tries again for up to "
                  f"{self.args.wait:g} s (--wait)", flush=True)
        if FLOWER_RETRIED in line and self.waiting:
            self.waiting = False
            print(f"{name}: the SuperLink at {superlink} answers again", flush=True)
        ended = RUN_NOT_RUNNING.search(line)
        if ended:  # Flower's SuperNode drops the run's message, at INFO
            print(f"{name}: the run {ended.group(1)} ended at the operator: it was stopped before this site's answer "
                  "reached the SuperLink (the operator's console says why); waiting for the operator's next run",
                  flush=True)
        return False

    def show(self, line: str) -> bool:
        """Whether Flower's line is passed on: not its retries (said once), nor the error it gave up on
        (said by :func:`_superlink_ended`), nor, when it is started again after its SuperLink forgot it,
        its refusals before it is let in (said once)."""
        if self.connected and (FLOWER_GAVE_UP in line or FLOWER_TLS in line
                               or (self.gave_up and line.startswith("ERROR"))):
            return False  # said by _superlink_ended
        return (self.connected or not self.again) and FLOWER_RETRY not in line


def _forgotten(line: str) -> bool:
    """Whether a traceback of Flower's SuperNode ended on this line because its SuperLink no longer
    knows it (its heartbeat thread's 401): said in one sentence instead (:func:`_superlink_ended`)."""
    return "401 Unauthorized" in line


def _superlink_ended(args: argparse.Namespace, seen: list[str], code: int) -> tuple[str, bool]:
    """Why Flower's SuperNode, connected until then, ended by itself (not stopped by the site), in one
    sentence, and whether to start it again: its SuperLink forgot it (a restart, the next experiment's
    SuperLink), its SuperLink is another federation's (another CA), or it is gone."""
    from ..flower.link import identity_sentence

    text = "\n".join(seen)
    failed = next((line for line in seen if "certificate verify failed" in line.lower()), None)
    if failed is not None:
        return identity_sentence(args.superlink, args.ca, failed.strip(), connected_once=True), False
    if FLOWER_GAVE_UP in text:
        error = next((line for line in reversed(seen) if line.startswith("ERROR")), "").partition(":")[2].strip()
        return (f"its SuperNode gave up on the SuperLink at {args.superlink} ({error or 'no answer'}): it ended, or "
                f"did not answer for {args.wait:g} s; start this SuperNode again once the operator's SuperLink is up "
                "(or give a longer --wait)"), False
    # Flower's SuperNode ends itself (a SIGINT it sends itself, exit code 0) when the SuperLink answers 401
    if "401 Unauthorized" in text or "does not recognize this SuperNode" in text or code == 0:
        return (f"the SuperLink at {args.superlink} no longer knows this SuperNode (it restarted, or the next "
                "experiment's SuperLink took its place); starting it again with the same key"), True
    return f"its SuperNode ended (exit code {code}; see the lines above)", False


def shown(line: str, *, verbose: bool = False, terminal: bool = False) -> str | None:
    """A line of a Flower program as fedcontrast passes it on: None for Flower's own INFO/DEBUG chatter
    (unless ``verbose``), without colour codes unless it goes to a ``terminal``."""
    plain = ANSI.sub("", line)
    if not verbose and FLOWER_CHATTER.match(plain):
        return None
    return line if terminal else plain


def _run_child(command: list[str], env: dict[str, str], *, watch: list[str] | None = None, verbose: bool = False,
               on_line: Callable[[str], bool | None] | None = None, signalled: list[int] | None = None,
               hide_traceback: Callable[[str], bool] | None = None, show: Callable[[str], bool] | None = None) -> int:
    """Runs a Flower program in the foreground, its output passed through (:func:`shown`: Flower's
    INFO lines only when ``verbose``, no colour codes in a file; every line kept in ``watch`` and
    given to ``on_line``, colour codes removed, which ends the program by returning True),
    SIGTERM/SIGINT passed on (and noted in ``signalled``); its exit code. A traceback whose last line
    ``hide_traceback`` accepts is not passed on (the caller says it in one sentence), nor a line
    ``show`` says False of."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)

    def forward(signum, _frame):
        if signalled is not None:
            signalled.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)

    def pump() -> None:
        assert proc.stdout is not None
        terminal = sys.stdout.isatty()
        held: list[str] = []  # a traceback being read, passed on or not at its last line
        hiding = False  # the lines that continue a hidden traceback's last line ("For more information ...")

        def write(line: str) -> None:
            out = shown(line, verbose=verbose, terminal=terminal)
            if out is not None and (show is None or show(ANSI.sub("", line))):
                sys.stdout.write(out)
                sys.stdout.flush()

        for line in proc.stdout:
            plain = ANSI.sub("", line)
            if watch is not None:
                watch.append(plain)
            if on_line is not None and on_line(plain):  # the program is done, though it goes on running
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            if hide_traceback is not None:
                if hiding and plain.startswith("For more information"):
                    continue
                hiding = False
                if not held and plain.startswith(TRACEBACK_STARTS):
                    held.append(line)
                    continue
                if held:
                    held.append(line)
                    if plain[:1].isspace() or plain.startswith(TRACEBACK_STARTS):
                        continue
                    if hide_traceback(plain):  # the exception's line: the traceback's last
                        hiding = True
                    else:
                        for kept in held:
                            write(kept)
                    held.clear()
                    continue
            write(line)
        for kept in held:
            write(kept)

    # The output is read by a thread: helpers the program started may hold the pipe open after it exits.
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        with contextlib.suppress(ProcessLookupError):  # Flower's helpers it started (flower-superexec) go too
            os.killpg(proc.pid, signal.SIGTERM)
        reader.join(timeout=5)
