"""Shared by the benchmark scripts: write one section of benchmarks/RESULTS.md, keep the others."""

from __future__ import annotations

import platform
import re
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")
HEADER = ("# Benchmark results\n\nEach section is written by the script it names; rerun the command to "
          "refresh it. Timings are wall-clock on the machine described in the section.\n")


def machine() -> str:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only"
    return (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, {device}, "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def write_section(name: str, body: str) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    block = f"<!-- begin {name} -->\n{body.rstrip()}\n<!-- end {name} -->"
    pattern = re.compile(rf"<!-- begin {re.escape(name)} -->.*?<!-- end {re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    RESULTS.write_text(text)
