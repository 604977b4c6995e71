"""A site's long-lived worker: the process that holds its data, the plugin and torch between
rounds, answering the ClientApp processes Flower starts for every message (:mod:`.client_app`) over
a Unix socket in the site's folder, authenticated by a random key only the site's own processes can
read (mode 600). ``fedcontrast flower supernode`` starts it beside the SuperNode and stops it with it.
With ``--runtime-api`` (the default of ``fedcontrast flower supernode``: ``--isolation process``) no
ClientApp process is started at all: the worker takes the SuperNode's tasks itself
(:mod:`.runner`).

    python -m fedcontrast.flower.worker --runtime-api 127.0.0.1:PORT [--threads N]
    python -m fedcontrast.flower.worker --socket PATH --key KEYFILE [--threads N]
"""

from __future__ import annotations

import argparse
import os
from multiprocessing.connection import Listener
from pathlib import Path


def serve(socket_path: str, key_path: str) -> None:
    from .site_app import (  # imported before the first message: torch, the plugins
        answer,
        refusal,
    )

    key = Path(key_path).read_bytes()
    if os.path.exists(socket_path):
        os.unlink(socket_path)  # left by a worker that was killed
    with Listener(socket_path, family="AF_UNIX", authkey=key) as listener:
        os.chmod(socket_path, 0o600)
        while True:
            try:
                conn = listener.accept()
            except (OSError, EOFError):
                continue  # a client that did not know the key, or went away
            with conn:
                try:
                    request = conn.recv()
                except (OSError, EOFError):
                    continue
                try:  # a refusal or a failure is the site's reply (site_app.answer)
                    conn.send(("ok", *answer(**request)))
                except Exception as exc:  # noqa: BLE001 - the ClientApp names it to the operator
                    conn.send(("error", refusal(exc)))


def quiet_flower() -> None:
    """Flower's logger in this process (its output goes straight to the SuperNode's terminal or log
    file): its own handler at WARNING (FLWR_LOG_LEVEL overrides), without colour codes, and not passed
    on to the root logger as well (each of its lines would appear twice)."""
    import contextlib
    import logging

    with contextlib.suppress(ImportError):
        import flwr.common.logger  # noqa: F401  # its handler, added at import
    flwr = logging.getLogger("flwr")
    flwr.propagate = False
    for handler in flwr.handlers:
        if not os.environ.get("FLWR_LOG_LEVEL"):
            handler.setLevel(logging.WARNING)
        if hasattr(handler, "colored"):
            handler.colored = False


def main() -> None:
    parser = argparse.ArgumentParser(description="a Flower site's long-lived worker")
    parser.add_argument("--socket")
    parser.add_argument("--key")
    parser.add_argument("--threads", type=int, help="torch threads (default: the cores this process may use)")
    parser.add_argument("--runtime-api", metavar="HOST:PORT",
                        help="take the tasks of the SuperNode whose Runtime API is here (started with --isolation "
                             "process) and run each in this process (flower/runner.py), instead of answering the "
                             "ClientApp processes Flower starts")
    args = parser.parse_args()
    if not args.runtime_api and not (args.socket and args.key):
        parser.error("give --runtime-api, or --socket and --key")
    import logging

    from ..threads import apply_threads

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the site's round lines on its terminal
    quiet_flower()
    apply_threads(args.threads)
    try:
        if args.runtime_api:
            from .runner import serve_runtime

            serve_runtime(args.runtime_api)
        else:
            serve(args.socket, args.key)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
