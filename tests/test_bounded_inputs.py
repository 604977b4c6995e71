"""Every file a party reads is checked for its kind and size before it is opened, and every YAML
document is bounded (issue 46): an alias-expansion bomb ("billion laughs"), a document that contains
itself, one nested too deeply or a file too large is refused in one sentence naming it, without expanding
it; a FIFO, a device or a socket where a file belongs is refused without blocking."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from fedcontrast import yamlio
from fedcontrast.errors import ConfigError
from fedcontrast.yamlio import (
    MAX_YAML_BYTES,
    check_regular_file,
    load_yaml_file,
    loads_yaml,
    read_bytes,
    read_text,
)

REPO = Path(__file__).resolve().parents[1]


def billion_laughs(levels: int = 9) -> str:
    """The classic alias-expansion bomb: 9 levels of 9 aliases each, 9⁹ (387 million) strings expanded."""
    text = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    previous = "a"
    for name in "bcdefghijklmnop"[:levels - 1]:
        text += f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]\n"
        previous = name
    return text


def within(seconds, call, *args, fifo=None):
    """``call(*args)``, run in a thread that must finish within ``seconds`` (a regression fails the test
    instead of hanging it); what it raised is raised here. A reader left blocked on ``fifo`` is let go."""
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = call(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        pytest.fail(f"{getattr(call, '__name__', call)} did not finish within {seconds} s (it hangs)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def test_an_alias_expansion_bomb_is_refused_in_one_sentence_at_once(tmp_path, monkeypatch):
    listed = []  # the nodes whose children the size check listed
    children = yamlio._children
    monkeypatch.setattr(yamlio, "_children", lambda node: listed.append(node) or children(node))
    with pytest.raises(ConfigError) as info:
        within(30, loads_yaml, billion_laughs(), "plan x.yaml")
    # its 28 distinct nodes (a mapping, 9 keys, 9 lists, 9 strings), each listed at most twice: not 9⁹ expanded
    assert 0 < len(listed) <= 2 * 28 and len({id(node) for node in listed}) <= 28
    assert str(info.value) == ("plan x.yaml is refused, nothing of it was used: it expands to more than 200,000 values "
                               "through its aliases (an alias-expansion bomb?); replace it")
    path = tmp_path / "plan.yaml"
    path.write_text(billion_laughs())
    with pytest.raises(ConfigError, match=rf"plan {path} is refused, nothing of it was used: it expands to more"):
        within(30, load_yaml_file, path, "plan")
    merged = "a0: &a0 {k: 1}\n" + "".join(f"a{i}: &a{i} {{<<: [*a{i - 1}, *a{i - 1}], k{i}: 1}}\n"
                                          for i in range(1, 40))
    with pytest.raises(ConfigError, match="expands to more than 200,000 values"):  # a bomb of merge keys
        within(30, loads_yaml, merged, "policy")


def test_a_document_that_contains_itself_or_is_nested_too_deeply_is_refused():
    with pytest.raises(ConfigError, match=r"^plan: .*|an alias on line 1 refers to a value that contains it"):
        within(30, loads_yaml, "a: &a [1, *a]\n", "plan")
    with pytest.raises(ConfigError, match="is nested too deeply to be a file fedcontrast wrote"):
        within(30, loads_yaml, "[" * 50_000, "plan")


def test_a_yaml_file_too_large_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "huge.yaml"
    with open(path, "wb") as f:  # sparse: nothing is written, and nothing may be read
        f.truncate(MAX_YAML_BYTES + 1)
    with pytest.raises(ConfigError, match=rf"site policy {path} is {MAX_YAML_BYTES + 1:,} bytes, more than the "
                                          rf"{MAX_YAML_BYTES:,} read here"):
        within(30, load_yaml_file, path, "site policy")
    with pytest.raises(ConfigError, match=r"is 1,048,577 characters long, more than the 1,048,576 a YAML file"):
        loads_yaml("#" * (MAX_YAML_BYTES + 1), "--set")


def test_the_generated_plans_and_their_anchors_still_read():
    plans = sorted((REPO / "plan").glob("*.yaml")) + sorted((REPO / "workspaces").glob("*/plan/plan.yaml"))
    plans = [p for p in plans if "*id001" in p.read_text()]  # the run configuration shared through an anchor
    assert len(plans) >= 8
    for path in plans:
        plan = load_yaml_file(path, "plan")
        assert isinstance(plan, dict) and plan["data_loader"]["settings"]["run_config"]["algorithm"], path


def test_a_fifo_a_device_or_a_socket_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "plan.yaml"
    os.mkfifo(fifo)
    for reader in (read_bytes, read_text, load_yaml_file):
        with pytest.raises(ConfigError, match=rf"plan {fifo} is a FIFO \(named pipe\), not a regular file: nothing "
                                              r"was read from it"):
            within(30, reader, fifo, "plan", fifo=fifo)
    with pytest.raises(ConfigError, match=r"plan /dev/zero is a character device, not a regular file"):
        within(30, read_bytes, "/dev/zero", "plan")
    path = tmp_path / "s.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(path))
        with pytest.raises(ConfigError, match=r"a socket, not a regular file"):
            within(30, read_bytes, path, "certificate")
    finally:
        server.close()
    with pytest.raises(ConfigError, match=rf"data file {tmp_path} is a folder, not a file"):
        read_text(tmp_path, "data file")
    link = tmp_path / "gone.yaml"
    link.symlink_to(tmp_path / "nothing")
    with pytest.raises(ConfigError, match=r"is not a regular file \(a link to nothing\)"):
        check_regular_file(link, "plan")
    big = tmp_path / "big.crt"
    with open(big, "wb") as f:
        f.truncate(10)
    with pytest.raises(ConfigError, match=r"certificate .*big.crt is 10 bytes, more than the 5 read here"):
        read_bytes(big, "certificate", limit=5)


def test_the_records_reader_refuses_a_fifo_without_blocking(tmp_path):
    from fedcontrast.jsonl import read_jsonl

    fifo = tmp_path / "rounds.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is a FIFO"):
        within(30, read_jsonl, fifo, "the run's round records", fifo=fifo)
