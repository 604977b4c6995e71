"""The operator's terminal on a Flower deployment: ``flwr run --stream`` shows what the ServerApp prints."""

from __future__ import annotations


def say(text: str) -> None:
    """A progress line on the operator's terminal."""
    print(f"fedcontrast: {text}", flush=True)
