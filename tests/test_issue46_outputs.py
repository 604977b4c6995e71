"""Issue 46, item 1 and parts of 2–3 (no Flower, no OpenFL process): each site's outputs per run (its
run's id in the path and in every row, a ``latest`` link), ``doctor`` naming a table whose rows come
from several runs, old layouts read with one sentence; a one-site figure labelled as such;
``seconds_per_round`` after ``--resume``; ``audit`` and ``doctor`` on every party's folder."""

from __future__ import annotations

import csv
import json
import os

import pytest

from fedcontrast.cli import main
from fedcontrast.config import RunConfig
from fedcontrast.flower import site_app
from fedcontrast.site.report import LATEST, SiteReport, format_row, mixed_runs, read_rows

from .test_flower_site import downlink, plan, settings

SITES = ("hosp1", "hosp2")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from fedcontrast.data.folders import write_site_folders

    root = tmp_path_factory.mktemp("issue46_site")
    return write_site_folders(RunConfig(dataset="digits", clients=2, sites=SITES, seed=0), root / "data")


@pytest.fixture(autouse=True)
def fresh_runtimes():
    site_app._RUNTIMES.clear()
    cwd = os.getcwd()
    yield
    site_app._RUNTIMES.clear()
    os.chdir(cwd)  # a runtime works in its site's folder


def flower_run(folders, tmp_path, flower_run_id: int, label: str, rounds: int) -> None:
    """One experiment at hosp1 as the operator's ServerApp drives it: its start-up, then round 1."""
    config = plan("fedavg").replace(rounds=rounds)
    text, s = json.dumps(config.to_dict()), settings(folders, tmp_path)
    site_app.handle("query", flower_run_id, text, s, {"task": {"run": label}}, None)
    site_app.handle("train", flower_run_id, text, s, {"task": {"round": 1, "run": label},
                                                      "received": downlink(config)}, None)


def doctor(folder, capsys, *args):
    code = main(["doctor", str(folder), *args])
    out, err = capsys.readouterr()
    return code, out, err


# --- item 1: a site's outputs per run -------------------------------------------------------------
def test_two_flower_experiments_keep_their_own_folders_rows_and_round_counts(folders, tmp_path, capsys):
    flower_run(folders, tmp_path, 101, "aaaa1111", rounds=4)  # the first experiment: 4 rounds
    flower_run(folders, tmp_path, 202, "bbbb2222", rounds=5)  # the next one, in the same --workdir: 5 rounds
    site = tmp_path / "hosp1" / "site_report" / "hosp1"
    first, second = read_rows(site / "aaaa1111"), read_rows(site / "bbbb2222")
    assert [r["round"] for r in first] == [0, 1] == [r["round"] for r in second]  # neither holds the other's rows
    assert {(r["run"], r["rounds"]) for r in first} == {("aaaa1111", 4)}
    assert {(r["run"], r["rounds"]) for r in second} == {("bbbb2222", 5)}  # its own count, not the first's
    assert format_row(second[-1], "hosp1").startswith("hosp1, round 1/5 ")
    assert os.readlink(site / LATEST) == "bbbb2222" and read_rows(site) == second  # latest: the run written last
    with open(site / "bbbb2222" / "rounds.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert table and all(row["run"] == "bbbb2222" and row["rounds"] == "5" for row in table)
    info = json.loads((site / "bbbb2222" / "run.json").read_text())
    assert info["run"] == "bbbb2222" and info["site"] == "hosp1" and info["engine"] == "flower"
    assert mixed_runs(site / "aaaa1111") is None and mixed_runs(site / "bbbb2222") is None
    code, out, _ = doctor(tmp_path / "hosp1", capsys)
    assert code == 0 and "OK    report: hosp1: run bbbb2222: its report reaches round 1 of 5" in out
    assert "holds 2 runs (aaaa1111, bbbb2222); shown: bbbb2222, the latest" in out
    assert main(["report", str(tmp_path / "hosp1")]) == 0
    out = capsys.readouterr().out
    assert "hosp1, round 1/5 " in out and "round 1/4" not in out


def test_doctor_names_a_site_table_holding_rows_of_several_runs(tmp_path, capsys):
    work = tmp_path / "work"
    # the layout from before per-run folders, as the new user found it: rows of two experiments, no run label
    old = work / "site_report" / "hosp1"
    old.mkdir(parents=True)
    (old / "rounds.jsonl").write_text("".join(json.dumps({"round": r, "rounds": n, "accuracy": 0.5}) + "\n"
                                              for r, n in ((1, 4), (2, 4), (3, 4), (4, 5), (5, 5))))
    code, out, err = doctor(work, capsys)
    assert code == 1 and "Traceback" not in err
    failed = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert len(failed) == 1 and failed[0].startswith(
        f"FAIL  report: hosp1: {old / 'rounds.jsonl'} holds rows of at least 2 runs (rows planning 4 and 5 rounds, "
        "with no run label): its rounds.csv mixes experiments")
    # a table of the new layout whose rows name two runs (a file copied over another)
    report = SiteReport(tmp_path / "w2" / "site_report" / "hosp1", "hosp1", 2, None, run="r1")
    report.trained(1, "train", {"loss": 1.0}, 10, 10, {})
    rows = (report.folder / "rounds.jsonl").read_text() + json.dumps({"round": 2, "rounds": 2, "run": "r0"}) + "\n"
    (report.folder / "rounds.jsonl").write_text(rows)
    assert mixed_runs(report.folder) == f"{report.folder / 'rounds.jsonl'} holds rows of 2 runs (r0, r1)"
    code, out, _ = doctor(tmp_path / "w2", capsys)
    assert code == 1 and "FAIL  report: hosp1: " in out and "holds rows of 2 runs (r0, r1)" in out


def test_a_report_from_before_per_run_folders_is_read_with_one_sentence(tmp_path, capsys):
    old = tmp_path / "work" / "site_report" / "hosp1"
    old.mkdir(parents=True)
    (old / "rounds.jsonl").write_text(json.dumps({"round": 1, "rounds": 2, "accuracy": 0.9}) + "\n")
    code, out, err = doctor(tmp_path / "work", capsys)
    assert code == 0 and err == ""
    warned = [line for line in out.splitlines() if line.startswith("WARN  report:")]
    assert len(warned) == 1 and "is a report from before reports were kept per run: its rows carry no run label" \
        in warned[0]
    assert main(["report", str(tmp_path / "work")]) == 0
    out = capsys.readouterr().out
    assert "hosp1, round 1/2 (model after round 1): held-out accuracy 0.9000" in out
    assert "is a report from before reports were kept per run" in out
    # a site that runs again there writes its own run folder beside the old table, and latest points at it
    report = SiteReport(old, "hosp1", 3, None, run="new")
    report.evaluated(0, {"accuracy": 0.1}, 5, 0)
    assert os.readlink(old / LATEST) == "new" and (old / "rounds.jsonl").is_file()
    assert [r["run"] for r in read_rows(old)] == ["new"]  # the latest run's rows, not the old table's
    assert main(["report", str(tmp_path / "work")]) == 0
    out = capsys.readouterr().out
    assert "hosp1, round 0/3 (initial model): held-out accuracy 0.1000" in out and "round 1/2" not in out
    assert "is a report from before reports were kept per run" in out and "shown: new, the latest" in out


def test_an_openfl_site_keeps_each_federation_in_its_own_folder(tmp_path):
    pytest.importorskip("openfl")
    from .openfl.test_site_report import BASE, run_rounds

    first = RunConfig(algorithm="fedavg", **{**BASE, "rounds": 1})
    run_rounds(first, tmp_path / "local_state" / "sites", [0, 1])
    second = first.replace(rounds=2)  # the next experiment in the same workspace: another plan
    runner, _ = run_rounds(second, tmp_path / "local_state" / "sites2", [0])
    site = tmp_path / "local_state" / "site_report" / "site_0"
    runs = sorted(p.name for p in site.iterdir() if p.name != LATEST)
    assert len(runs) == 2 and os.readlink(site / LATEST) == runner.run_id()
    assert {(r["run"], r["rounds"]) for r in read_rows(site)} == {(runner.run_id(), 2)}
    runner.federation_id = "fed_moon_1a2b3c4d"  # set by fedcontrast's collaborator: OpenFL's federation id
    assert runner.run_id() == "fed_moon_1a2b3c4d"


# --- item 2: labelled and right figures ----------------------------------------------------------
def test_a_figure_over_one_site_says_so():
    from fedcontrast.cli.runs import accuracy_line
    from fedcontrast.outputs import SummaryTally, metric_row

    tally = SummaryTally()
    tally.add([metric_row(1, "site_0", "train", 10, {"accuracy": 0.5}),
               metric_row(1, "global", "evaluate", 20, {"accuracy": 0.6})])
    summary = tally.summary(config={"algorithm": "fedavg", "dataset": "digits"}, wall_time_s=1.0, rounds_total=1)
    assert summary["final_train_sites"] == 1
    assert "the sites' training 0.5000 (1 site);" in accuracy_line(summary)
    tally.add([metric_row(2, "site_0", "train", 10, {"accuracy": 0.5}), metric_row(2, "site_1", "train", 10,
                                                                                   {"accuracy": 0.7}),
               metric_row(2, "global", "evaluate", 20, {"accuracy": 0.6})])
    two = tally.summary(config={"algorithm": "fedavg", "dataset": "digits"}, wall_time_s=1.0, rounds_total=2)
    assert "(1 site)" not in accuracy_line(two) and "the sites' training 0.6000;" in accuracy_line(two)


def test_report_on_a_one_site_flower_run_labels_its_mean(tmp_path, capsys):
    from fedcontrast.outputs import metric_row, write_metrics_csv

    run = tmp_path / "run"
    run.mkdir()
    write_metrics_csv(run / "metrics.csv", [metric_row(1, "hosp1", "evaluate", 50, {"accuracy": 0.9}),
                                            metric_row(1, "global", "evaluate", 50, {"accuracy": 0.9})])
    (run / "progress.json").write_text(json.dumps({"rounds_done": 1, "rounds": 1, "label": "x"}))
    (run / "summary.json").write_text(json.dumps({"final_accuracy": 0.9, "rounds_completed": 1, "rounds_planned": 1}))
    (run / "outcome.json").write_text(json.dumps({"status": "finished", "final_accuracy": 0.9}))
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "round 1/1: sites' held-out accuracy of the final model 0.9000 (1 site: hosp1 0.9000)" in out
    assert "finished: 1 of 1 rounds; the sites' held-out accuracy of the final model 0.9000 (1 site)" in out


def test_seconds_per_round_after_resume_counts_every_round_once(tmp_path):
    from fedcontrast.sim import run_simulation

    config = RunConfig(algorithm="fedavg", dataset="synthetic", image_size=16, clients=2, rounds=3, min_samples=5,
                       projection_dim=32, training={"local_epochs": 1, "batch_size": 32})
    run_simulation(config, tmp_path / "run", stop_after=1)
    summary = run_simulation(config, tmp_path / "run", resume=True)
    assert summary["rounds_completed"] == 3
    # the rounds' own time over the 3 rounds, across both parts (the checkpoint keeps the first part's)
    assert summary["seconds_per_round"] == pytest.approx(summary["wall_time_s"] / 3, abs=2e-3)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["seconds_per_round"] == \
        summary["seconds_per_round"]


# --- item 3: every party's folder -----------------------------------------------------------------
def test_audit_reads_a_flower_operators_folder_its_run_folder_and_a_sites_workdir(folders, tmp_path, capsys):
    assert main(["flower", "init", "--algorithm", "fedavg", "--sites", "hosp1,hosp2", "--input-shape", "1x32x32",
                 "--classes", "10", "--rounds", "2", str(tmp_path / "fed")]) == 0
    capsys.readouterr()
    assert main(["audit", str(tmp_path / "fed")]) == 0
    out = capsys.readouterr().out
    assert "fedavg" in out and "hosp1" in out and "hosp2" in out and "(Flower operator's folder)" in out
    (tmp_path / "fed" / "run").mkdir()
    (tmp_path / "fed" / "run" / "progress.json").write_text(json.dumps({"rounds_done": 0, "rounds": 2}))
    assert main(["audit", str(tmp_path / "fed" / "run")]) == 0
    assert "(Flower operator's folder)" in capsys.readouterr().out
    assert main(["audit", str(tmp_path / "fed"), "--site", "hosp1"]) == 2
    assert "holds no site's data; audit the site's work folder" in capsys.readouterr().err
    flower_run(folders, tmp_path, 303, "cccc3333", rounds=2)  # a site's --workdir after its first round
    assert main(["audit", str(tmp_path / "hosp1"), "--json"]) == 0
    audited = json.loads(capsys.readouterr().out)
    [site] = audited["sites"]
    assert site["name"] == "hosp1" and site["samples"] and "counted from its data" in site["samples_note"]
    assert audited["here"] == ["hosp1"] and audited["tls"] and audited["client_auth"]


def test_doctor_checks_the_openfl_operators_workspace_as_the_operators(tmp_path, capsys):
    pytest.importorskip("openfl")
    from fedcontrast.openfl.pki import certify_workspace
    from fedcontrast.openfl.plan import create_workspace

    from .test_flower_site import plan as flower_plan

    ws = create_workspace(tmp_path / "fed_moon", flower_plan("fedavg"), log=lambda m: None)  # cross-silo: no data
    code, out, err = doctor(ws, capsys)
    assert code == 0 and err == "", err
    lines = out.splitlines()
    assert lines[0].startswith(f"OK    role: {ws} is the operator's workspace")
    assert any(line.startswith("WARN  CA: no certificate authority") for line in lines)
    assert any(line.startswith("WARN  sites: signed: none; not yet: hosp1, hosp2") for line in lines)
    assert any(line.startswith("OK    data: no site's data here") for line in lines)
    assert not any("certificate: cert/client" in line for line in lines)  # never a site's checks
    certify_workspace(ws, "fed_moon")  # the CA, without the aggregator's certificate yet
    code, out, err = doctor(ws, capsys)
    assert code == 1 and "OK    CA: CN=fed_moon fedcontrast CA" in out
    assert "FAIL  aggregator certificate: cert/server/agg_localhost.crt or its key is missing" in out
    assert "before starting the aggregator" in err


def test_openfls_final_line_labels_a_mean_over_one_site(tmp_path, monkeypatch, capsys):
    pytest.importorskip("openfl")
    from fedcontrast.openfl import launch
    from fedcontrast.openfl.plan import create_workspace

    ws = tmp_path / "runs" / "one" / "workspace"
    create_workspace(ws, RunConfig(algorithm="fedavg", dataset="digits", clients=1), log=lambda m: None)
    (ws / "save" / "init.pbuf").write_bytes(b"")  # set up already: the federation is resumed
    summary = {"final_accuracy": None, "final_site_accuracy_mean": 0.9, "final_site_accuracy": {"site_0": 0.9},
               "final_model": None, "final_downlink": "save/final_downlink.pt", "why_null": {},
               "final_val_accuracy": None, "best_round": None, "best_accuracy": None, "rounds_completed": 1}
    monkeypatch.setattr(launch, "run_federation", lambda *a, **k: None)
    monkeypatch.setattr(launch, "export_results", lambda *a, **k: summary)
    assert main(["federation", "--runs-dir", str(tmp_path / "runs"), "--name", "one", "--collaborators", "1",
                 "--resume"]) == 0
    out = capsys.readouterr().out
    assert "at the sites 0.9000 (1 site: its own held-out data, no mean)" in out
    summary["final_site_accuracy"] = {"site_0": 0.8, "site_1": 1.0}
    assert main(["federation", "--runs-dir", str(tmp_path / "runs"), "--name", "one", "--collaborators", "1",
                 "--resume"]) == 0
    assert "at the sites 0.9000 (weighted mean of their own held-out data)" in capsys.readouterr().out
