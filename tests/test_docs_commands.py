"""The docs agree with the code: every ``fedcontrast ...`` command that README.md and docs/*.md show
(in code blocks, and in the prose's code spans) is a command whose ``--help`` exits 0 and lists every
``--option`` the docs give it; and statements the docs make about the engines hold in the code.
In-process through the CLI's ``main``: seconds, no subprocess."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from pathlib import Path

import pytest

from fedcontrast.cli import main
from fedcontrast.cli.app import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _subcommand(parser: argparse.ArgumentParser, tokens: list[str]) -> tuple[str, ...]:
    """The sub-command words at the start of ``tokens`` (``site roster`` of ``site roster a.pub``)."""
    words: list[str] = []
    for token in tokens:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or token not in subs[0].choices:
            break
        words.append(token)
        parser = subs[0].choices[token]
    return tuple(words)


def _commands_in(text: str) -> list[str]:
    """The ``fedcontrast`` command lines of a Markdown text: code blocks' lines (continued lines joined,
    comments dropped, ``a | b`` split) and code spans in the prose."""
    found = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.strip()
            if line.startswith("#"):
                continue
            for part in re.split(r"\s(?:\||&&|;)\s", line.split(" #")[0]):
                match = re.search(r"(?:^|\s|/)fedcontrast\s+(.*)$", part.strip())
                if match:
                    found.append(match.group(1))
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for span in re.findall(r"`fedcontrast ([^`]*)`", prose):
        for part in re.split(r"\s(?:\||&&|;)\s", span):
            found.append(part.removeprefix("fedcontrast ").strip())
    return found


LOG_LINE = re.compile(r"^([\w.-]+\s+){0,4}[\w.-]+:(\s|$)")  # "collaborator: error: ...", a message quoted


def documented() -> tuple[dict[tuple[str, ...], dict[str, set[str]]], list[str]]:
    """Each documented sub-command → {--option: the files that use it with that command}; and the
    documented commands that are no fedcontrast command."""
    parser = build_parser()
    out: dict[tuple[str, ...], dict[str, set[str]]] = {}
    unknown = []
    for path in DOCS:
        for command in _commands_in(path.read_text(encoding="utf-8")):
            tokens = command.split()
            if not tokens or LOG_LINE.match(command):  # a log line's prefix ("fedcontrast collaborator: ...")
                continue
            words = _subcommand(parser, tokens)
            if not words:
                unknown.append(f"{path.name}: `fedcontrast {command}`")
                continue
            options = out.setdefault(words, {})
            for option in OPTION.findall(command):
                options.setdefault(option, set()).add(path.name)
    return out, unknown


COMMANDS, UNKNOWN = documented()


def _help(words: tuple[str, ...]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main([*words, "--help"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue()


def test_the_docs_show_the_commands_of_every_party():
    assert not UNKNOWN, f"the docs show commands fedcontrast does not have: {UNKNOWN}"
    assert len(COMMANDS) >= 25  # the extraction works: the simulator's, OpenFL's and Flower's commands
    for words in [("simulate",), ("workspace", "create"), ("doctor",), ("audit",), ("report",), ("flower", "init"),
                  ("flower", "supernode"), ("flower", "run"), ("site", "roster"), ("site", "join")]:
        assert words in COMMANDS, words


@pytest.mark.parametrize("words", sorted(COMMANDS), ids=lambda w: " ".join(w))
def test_each_documented_command_has_help_listing_every_option_the_docs_give_it(words):
    code, text = _help(words)
    assert code == 0, f"`fedcontrast {' '.join(words)} --help` exited {code}"
    missing = {option: sorted(files) for option, files in COMMANDS[words].items() if option not in text}
    assert not missing, f"`fedcontrast {' '.join(words)}`'s help lacks options the docs use: {missing}"


def test_what_the_docs_say_of_the_engines_holds():
    """Statements a new user took at their word (issue 46): Flower has min_sites; its deployment is
    built; compare runs on the sequential and Ray executors only; audit and doctor read every party's folder."""
    privacy = (ROOT / "docs" / "privacy.md").read_text(encoding="utf-8")
    usage = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    flower = (ROOT / "docs" / "flower.md").read_text(encoding="utf-8")
    assert "--min-sites" in _help(("flower", "run"))[1] and "--min-sites" in _help(("flower", "init"))[1]
    assert "no `min_sites` on Flower" not in privacy and "OpenFL's `min_sites`" not in privacy
    assert "`flower init --min-sites K`" in privacy
    assert "The Flower deployment is built and tested" in usage and "not built" not in usage
    from fedcontrast.config import RunConfig
    from fedcontrast.errors import ConfigError
    from fedcontrast.sim.ray_executor import make_executor

    with pytest.raises(ConfigError, match="compare runs on the sequential or ray executor"):
        make_executor(RunConfig(executor={"kind": "flower"}))
    assert "`compare --executor flower` runs" not in flower and "`compare --executor flower` is refused" in usage
    audit = _help(("audit",))[1]
    assert "Flower folder" in audit
