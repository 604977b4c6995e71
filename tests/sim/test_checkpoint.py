"""A checkpoint that lacks what a resume reads is refused in one sentence naming the file, and kept;
the rows of the finished rounds live beside it, a line per round, and a resume reads only those the
checkpoint counts."""

import csv
import json

import pytest
import torch

from fedcontrast.cli import main
from fedcontrast.errors import CheckpointError
from fedcontrast.outputs import GLOBAL_SITE, SummaryTally, build_summary
from fedcontrast.sim import run_simulation
from fedcontrast.sim.checkpoint import ROWS_FILE, load_checkpoint


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def rows_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def without_run(path):
    """The lines of a rows file without the run id each names (two runs' rows, compared)."""
    return [{k: v for k, v in line.items() if k != "run"} for line in rows_lines(path)]


@pytest.mark.parametrize("drop", ["federation", "elapsed", "federation.site_states.site_1",
                                  "federation.downlink.global"])
def test_checkpoint_missing_keys_is_refused_naming_the_file(tmp_path, tiny_config, drop):
    run = tmp_path / "run"
    run_simulation(tiny_config, run, stop_after=1)
    path = run / "checkpoint.pt"
    data = torch.load(path, weights_only=True)
    *parents, last = drop.split(".")
    node = data
    for key in parents:
        node = node[key]
    del node[last]
    torch.save(data, path)
    saved = path.read_bytes()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert f"checkpoint {path} is incomplete (no {drop})" in str(info.value)
    assert path.read_bytes() == saved


def test_resume_from_an_incomplete_checkpoint_is_one_sentence(tmp_path, capsys):
    argv = ["simulate", "--dataset", "synthetic", "--image-size", "16", "--clients", "2", "--rounds", "2",
            "--local-epochs", "1", "--min-samples", "5", "--public-fraction", "0", "--quiet", "--algorithm", "fedavg",
            "--runs-dir", str(tmp_path), "--name", "r"]
    assert main([*argv, "--rounds", "1"]) == 0
    path = tmp_path / "r" / "checkpoint.pt"
    data = torch.load(path, weights_only=True)
    del data["federation"]["server_state"]
    torch.save(data, path)
    metrics = (tmp_path / "r" / "metrics.csv").read_text()
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"checkpoint {path} is incomplete (no federation.server_state)" in err
    assert (tmp_path / "r" / "metrics.csv").read_text() == metrics


def test_the_checkpoint_holds_no_rows_and_each_round_adds_one_line_beside_it(tmp_path, tiny_config):
    run = tmp_path / "run"
    run_simulation(tiny_config.replace(rounds=3), run)
    data = torch.load(run / "checkpoint.pt", weights_only=True)
    assert data["format"] == 2 and "rows" not in data  # a round's checkpoint does not grow with the run's rows
    assert data["federation"]["upload_digests"] == {}  # nor with the digests of earlier uploads
    lines = [json.loads(line) for line in (run / ROWS_FILE).read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2, 3]
    from_lines = [{k: str(v) for k, v in row.items()} for line in lines for row in line["rows"]]
    assert from_lines == read_csv(run / "metrics.csv")


def test_the_digests_a_resume_reads_beside_the_checkpoint_are_those_the_screen_held(tmp_path, tiny_config):
    from fedcontrast.sim import Federation
    from fedcontrast.sim.checkpoint import checkpoint_rows
    from fedcontrast.sim.ray_executor import Threads

    config = tiny_config.replace(rounds=3, clients=3)
    run_simulation(config, tmp_path / "run", stop_after=2)
    path = tmp_path / "run" / "checkpoint.pt"
    rows, digests = checkpoint_rows(path, load_checkpoint(path))
    threads = json.loads((tmp_path / "run" / "summary.json").read_text())["threads_per_site"]
    with Threads(threads):  # the same rounds again, by hand, at the run's threads: the same uploads
        federation = Federation(config)
        for r in (1, 2):
            federation.run_round(r)
    assert digests == federation.screen.digests and sorted(digests) == ["site_0", "site_1", "site_2"]
    assert all(sorted(seen.values()) == [1, 2] for seen in digests.values())
    assert [row["round"] for row in rows] == sorted(row["round"] for row in rows) and rows[-1]["round"] == 2


def test_a_round_written_beside_a_checkpoint_that_does_not_count_it_is_dropped_on_resume(tmp_path, tiny_config):
    config = tiny_config.replace(rounds=3)
    run_simulation(config, tmp_path / "full")
    killed = tmp_path / "killed"
    run_simulation(config, killed, stop_after=1)
    run = torch.load(killed / "checkpoint.pt", weights_only=True)["run"]  # the run's id, on each of its lines
    with open(killed / ROWS_FILE, "a") as f:  # killed after round 2's rows, before its checkpoint: and mid-line
        f.write(json.dumps({"round": 2, "run": run, "rows": [{"round": 2, "site": "site_0"}]}) + "\n"
                + '{"round": 3, "ro')
    run_simulation(config, killed, resume=True)
    assert read_csv(killed / "metrics.csv") == read_csv(tmp_path / "full" / "metrics.csv")
    assert without_run(killed / ROWS_FILE) == without_run(tmp_path / "full" / ROWS_FILE)  # each run its own id
    assert {line["run"] for line in rows_lines(killed / ROWS_FILE)} == {run}
    assert json.loads((killed / "summary.json").read_text())["accuracy_curve"] == \
        json.loads((tmp_path / "full" / "summary.json").read_text())["accuracy_curve"]


def test_a_counted_round_missing_beside_the_checkpoint_is_refused_in_one_sentence_and_kept(tmp_path, tiny_config):
    run = tmp_path / "run"
    constant = tiny_config.replace(training={"lr_schedule": "constant"})  # resumable with more rounds
    run_simulation(constant.replace(rounds=2), run, stop_after=2)
    lines = (run / ROWS_FILE).read_text().splitlines()
    (run / ROWS_FILE).write_text(lines[1] + "\n")  # round 1's line lost
    saved = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(CheckpointError) as info:
        run_simulation(constant.replace(rounds=3), run, resume=True)
    assert str(info.value) == (f"checkpoint {run / 'checkpoint.pt'} is incomplete (no rows of round 1 in "
                               f"{run / ROWS_FILE}); it was left untouched: start a new run with another --name")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == saved


def test_a_format_1_checkpoint_with_its_rows_inside_still_resumes(tmp_path, tiny_config):
    config = tiny_config.replace(rounds=3)
    run_simulation(config, tmp_path / "full")
    old = tmp_path / "old"
    run_simulation(config, old, stop_after=1)
    data = torch.load(old / "checkpoint.pt", weights_only=True)
    line = json.loads((old / ROWS_FILE).read_text().splitlines()[0])
    data["federation"]["upload_digests"] = {site: {digest: 1} for site, digest in line["digests"].items()}
    torch.save({**data, "format": 1, "rows": line["rows"]}, old / "checkpoint.pt")  # as format 1 was written
    (old / ROWS_FILE).unlink()
    run_simulation(config, old, resume=True)
    assert read_csv(old / "metrics.csv") == read_csv(tmp_path / "full" / "metrics.csv")
    assert without_run(old / ROWS_FILE) == without_run(tmp_path / "full" / ROWS_FILE)  # digests of round 1 too


def test_summary_kept_round_by_round_equals_the_summary_counted_by_hand():
    rows = []
    for r in (1, 2, 3):
        for site in ("a", "b"):
            for task, sent in (("train", 100 * r), ("prototypes", 7)):
                rows.append({"round": r, "site": site, "task": task, "bytes_uploaded": sent + (site == "b")})
        rows.append({"round": r, "site": GLOBAL_SITE, "accuracy": [0.5, 0.7, 0.6][r - 1],
                     "extra": json.dumps({"round_seen": r, "val_accuracy": [0.4, 0.5, 0.9][r - 1]})})
    tally = SummaryTally()
    for r in (1, 2, 3):
        tally.add([row for row in rows if row["round"] == r])
    config = {"algorithm": "fedavg", "dataset": "digits", "target_accuracy": 0.65}
    kept = tally.summary(config=config, wall_time_s=1.5, rounds_total=4)
    # by hand: 6 (round, site) pairs, each its train bytes + 7, plus 1 for site b
    per_pair = sum(100 * r + 7 + extra for r in (1, 2, 3) for extra in (0, 2)) / 6
    assert kept["bytes_uploaded_per_site_per_round"] == per_pair
    # the best round is the validation curve's (round 3), never the test curve's (round 2)
    assert kept["accuracy_curve"] == [0.5, 0.7, 0.6] and kept["best_round"] == 3 and kept["rounds_to_target"] == 2
    assert kept["best_accuracy"] == 0.6 and kept["val_accuracy_curve"] == [0.4, 0.5, 0.9]
    assert kept["final_metrics"] == {"round_seen": 3, "val_accuracy": 0.9} and kept["rounds_completed"] == 3
    assert kept == build_summary(rows, config=config, wall_time_s=1.5, rounds_total=4)


def test_a_checkpoint_written_in_the_background_is_whole_after_join_and_its_failure_is_raised_there(tmp_path):
    from fedcontrast.errors import OutputError
    from fedcontrast.sim.checkpoint import CheckpointWriter

    writer = CheckpointWriter(background=True)
    payload = {"config": {}, "rounds_done": 1, "elapsed": 0.5, "federation": {"x": torch.arange(10_000)}}
    writer.save(tmp_path / "a.pt", payload)
    writer.save(tmp_path / "b.pt", {**payload, "rounds_done": 2})  # waits for the first
    writer.join()
    assert torch.load(tmp_path / "a.pt", weights_only=True)["rounds_done"] == 1
    assert torch.equal(torch.load(tmp_path / "b.pt", weights_only=True)["federation"]["x"], torch.arange(10_000))
    missing = tmp_path / "no such folder" / "c.pt"
    writer.save(missing, payload)  # fails in its thread: said at the join, in the caller's thread
    with pytest.raises(OutputError, match=f"could not write {missing}"):
        writer.join()
    writer.join()  # said once
    assert not missing.parent.exists() and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("damage", ["missing", "not a record"])
def test_a_missing_or_damaged_file_of_rows_is_refused_in_one_sentence_and_kept(tmp_path, tiny_config, damage):
    run = tmp_path / "run"
    run_simulation(tiny_config.replace(rounds=2), run, stop_after=1)
    rows = run / ROWS_FILE
    if damage == "missing":
        rows.unlink()
        said = (f"checkpoint {run / 'checkpoint.pt'} is incomplete: {rows}, which holds the metrics rows of its "
                "rounds, is missing; it was left untouched: start a new run with another --name")
    else:
        line = json.loads(rows.read_text())
        rows.write_text(json.dumps({**line, "digests": ["not", "a", "mapping"]}) + "\n")
        said = (f"cannot resume from {run / 'checkpoint.pt'}: line 1 of {rows} is not a round's record (round, rows, "
                "digests); the file is damaged and was left untouched")
    saved = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(CheckpointError) as info:
        run_simulation(tiny_config.replace(rounds=2), run, resume=True)
    assert str(info.value) == said
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == saved


def test_every_line_of_the_rows_is_bound_to_its_run_and_round_on_resume(tmp_path, tiny_config):
    """Issue 46: a line of another run, or an altered second line of a round, silently replaced that
    round's records on resume. Each line now names its run; such a line is refused in one sentence
    naming the file and the line, and nothing is changed; an identical duplicate is dropped."""
    import shutil

    config = tiny_config.replace(rounds=3)
    base = tmp_path / "base"
    run_simulation(config, base, stop_after=2)
    run = torch.load(base / "checkpoint.pt", weights_only=True)["run"]
    lines = (base / ROWS_FILE).read_text().splitlines()
    assert [json.loads(line)["run"] for line in lines] == [run, run]
    first = json.loads(lines[0])

    def variant(name, text):
        folder = tmp_path / name
        shutil.copytree(base, folder)
        (folder / ROWS_FILE).write_text(text)
        return folder

    foreign = json.dumps({**first, "run": "0123456789ab"})  # round 1, as another run wrote it
    altered = json.dumps({**first, "rows": [{**row, "accuracy": 0.99} for row in first["rows"]]})
    cases = {
        "other_run": ("\n".join([foreign, lines[1]]) + "\n",
                      r"line 1 of .*checkpoint.rows.jsonl \(metrics rows of the finished rounds\) is round 1 of "
                      r"another run \(0123456789ab; this run is " + run + r"\)"),
        "altered_copy": ("\n".join([*lines, altered]) + "\n",
                         r"line 3 of .*checkpoint.rows.jsonl \(metrics rows of the finished rounds\) is a second "
                         r"record of round 1 that differs from the first \(line 1\)"),
        "no_run": ("\n".join([lines[0], json.dumps({k: v for k, v in json.loads(lines[1]).items() if k != "run"})])
                   + "\n", r"line 2 of .*checkpoint.rows.jsonl .*round 2, names no run"),
    }
    for name, (text, pattern) in cases.items():
        folder = variant(name, text)
        saved = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
        with pytest.raises(CheckpointError, match=r"cannot resume from .*checkpoint.pt: " + pattern):
            run_simulation(config, folder, resume=True)
        assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == saved, name  # left untouched

    same = variant("identical_copy", "\n".join([*lines, lines[0]]) + "\n")  # the same line twice: dropped
    run_simulation(config, same, resume=True)
    assert [(line["round"], line["run"]) for line in rows_lines(same / ROWS_FILE)] == [(1, run), (2, run), (3, run)]
