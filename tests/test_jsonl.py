"""Round records survive a crash in the middle of a write: the cut line is left out (and cut off
before the next record is appended); a damaged line elsewhere is one sentence."""

import json

import pytest

from fedcontrast.errors import ConfigError
from fedcontrast.jsonl import append_jsonl, read_jsonl


def test_a_last_line_cut_by_a_crash_is_left_out_and_cut_before_the_next_append(tmp_path):
    path = tmp_path / "rounds.jsonl"
    assert read_jsonl(path) == []
    append_jsonl(path, {"round": 1, "sites": {"a": 0.5}})
    with open(path, "a") as f:
        f.write('{"round": 2, "sites": {"a"')  # the crash
    assert read_jsonl(path) == [{"round": 1, "sites": {"a": 0.5}}]
    append_jsonl(path, {"round": 2, "sites": {"a": 0.6}})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"round": 1, "sites": {"a": 0.5}}, {"round": 2, "sites": {"a": 0.6}}]
    path.write_text('{"round": 1}\n{"round": 2, "si\n{"round": 3}\n')
    with pytest.raises(ConfigError, match=r"line 2 of .*rounds.jsonl \(records\) is not a JSON record"):
        read_jsonl(path)


def test_a_first_line_cut_by_a_crash_leaves_an_empty_file_for_the_next_record(tmp_path):
    path = tmp_path / "rounds.jsonl"
    path.write_text('{"round": 1, "si')
    assert read_jsonl(path) == []
    append_jsonl(path, {"round": 1})
    assert path.read_text() == '{"round": 1}\n'
