"""Every input the Flower operator and sites read is checked before use, and a reader's failure is one
sentence naming the file (issue 46): ``flower run --resume`` on an empty ``checkpoint.pt`` (was an
EOFError traceback), on a cut ``rounds.jsonl`` line (a JSONDecodeError), on a line of another run or
an altered second line of a round (silently read); ``flower supernode --key`` on a folder (an
IsADirectoryError)."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("flwr", reason="the Flower engine is the extra [flower] (its own environment)")

from fedcontrast.algorithms import Downlink
from fedcontrast.cli import main
from fedcontrast.config import RunConfig
from fedcontrast.flower import runs


def operator(tmp_path, capsys):
    """An operator's folder after `flower init` and both sites registered, and its run folder after 1
    of 2 rounds (a checkpoint, its progress and round 1's record)."""
    folder = tmp_path / "fed"
    assert main(["flower", "init", "--algorithm", "fedavg", "--sites", "hosp1,hosp2", "--input-shape", "1x8x8",
                 "--classes", "3", "--rounds", "2", str(folder)]) == 0
    (folder / "sites.json").write_text(json.dumps({s: {"node_id": i, "fingerprint": "SHA256:" + "0" * 64,
                                                       "public_key": "ecdsa-sha2-nistp384 AAAA"}
                                                   for i, s in enumerate(("hosp1", "hosp2"), 1)}))
    config = RunConfig.from_dict(json.loads((folder / "config.json").read_text()))
    out = folder / "run"
    out.mkdir()
    runs.save(out, config, "run-a", 1, Downlink({"w": torch.zeros(2)}), {}, [])
    record = {"round": 1, "run": "run-a", "time": 1.0, "sites": {"hosp1": {"weight": 5.0}}, "excluded": {}}
    (out / "rounds.jsonl").write_text(json.dumps(record) + "\n")
    capsys.readouterr()
    return folder, out, record


def refused(capsys, argv):
    """Runs the CLI; its exit code and standard error (asserted one line, no traceback)."""
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code != 0 and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_flower_run_resume_refuses_a_damaged_checkpoint_or_records_in_one_sentence(tmp_path, capsys):
    folder, out, record = operator(tmp_path, capsys)
    assert runs.check_run_folder(out, RunConfig.from_dict(json.loads((folder / "config.json").read_text())),
                                 resume=True) == "resume"  # the folder as made: resumable

    saved = (out / "checkpoint.pt").read_bytes()
    (out / "checkpoint.pt").write_bytes(b"")  # empty (a disk that filled up)
    err = refused(capsys, ["flower", "run", str(folder), "--resume"])
    assert f"cannot resume from {out / 'checkpoint.pt'}: it is not a readable checkpoint (EOFError" in err
    (out / "checkpoint.pt").write_bytes(saved[:len(saved) // 2])  # cut short
    assert f"cannot resume from {out / 'checkpoint.pt'}: it is not a readable checkpoint" in \
        refused(capsys, ["flower", "run", str(folder), "--resume"])
    torch.save({"rounds_done": 1}, out / "checkpoint.pt")  # not a Flower run's
    assert "it is not a checkpoint of a Flower run (no label, no rows, no downlink, no core)" in \
        refused(capsys, ["flower", "run", str(folder), "--resume"])
    (out / "checkpoint.pt").write_bytes(saved)

    line = json.dumps(record)
    cases = {
        line[:30] + "\n" + line + "\n": r"line 1 of \S*rounds.jsonl \(the run's round records\) is not a JSON record",
        json.dumps({**record, "run": "run-b"}) + "\n": r"line 1 of \S*rounds.jsonl .*is round 1 of another run "
                                                       r"\(run-b; this run is run-a\)",
        line + "\n" + json.dumps({**record, "excluded": {"hosp2": "x"}}) + "\n":
            r"line 2 of \S*rounds.jsonl .*is a second record of round 1 that differs from the first \(line 1\)",
    }
    import re

    for text, pattern in cases.items():
        (out / "rounds.jsonl").write_text(text)
        err = refused(capsys, ["flower", "run", str(folder), "--resume"])
        assert re.search(pattern, err), err
        assert (out / "rounds.jsonl").read_text() == text  # left as it was
    (out / "rounds.jsonl").write_text(line + "\n" + line + "\n" + json.dumps({**record, "round": 2}) + "\n")
    state = runs.load(out, torch.device("cpu"))  # an identical copy dropped, round 2 (not counted) too
    assert state["rounds_done"] == 1 and (out / "rounds.jsonl").read_text() == line + "\n"


def test_flower_supernode_refuses_a_key_that_is_a_folder_or_a_fifo_in_one_sentence(tmp_path, capsys):
    (tmp_path / "data" / "a").mkdir(parents=True)
    (tmp_path / "ca.crt").write_text("x")
    (tmp_path / "keydir").mkdir(mode=0o700)
    argv = ["flower", "supernode", "--superlink", "127.0.0.1:1", "--ca", str(tmp_path / "ca.crt"), "--name", "hosp1",
            "--data", str(tmp_path / "data"), "--workdir", str(tmp_path)]
    err = refused(capsys, [*argv, "--key", str(tmp_path / "keydir")])
    assert f"this site's private key (--key) {tmp_path / 'keydir'} is a folder, not a file" in err
    fifo = tmp_path / "fifo.key"
    os.mkfifo(fifo, 0o600)
    err = finishes(lambda: refused(capsys, [*argv, "--key", str(fifo)]), fifo)
    assert f"this site's private key (--key) {fifo} is a FIFO (named pipe), not a regular file" in err


def finishes(call, fifo, seconds=60):
    """``call()``'s result, asserting it returned within ``seconds`` rather than block on ``fifo`` for
    ever (a reader stuck on it is then let go: a writer opens it and closes it, an end of file)."""
    import threading

    result, failed = [], []

    def target():
        try:
            result.append(call())
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the test's thread
            failed.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        thread.join(5)
        pytest.fail(f"reading {fifo} blocked for {seconds} s instead of refusing it")
    if failed:
        raise failed[0]
    return result[0]
