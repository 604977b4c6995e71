"""The simulator end to end: learning, determinism, resume, outputs, every registered plugin."""

import csv
import json
import subprocess
import sys

import pytest

from fedcontrast.algorithms import available_algorithms
from fedcontrast.cli import main
from fedcontrast.errors import CheckpointError, ConfigError
from fedcontrast.sim import run_simulation


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("algorithm,settings", [("fedavg", {}), ("moon", {"mu": 1.0}), ("fedsiam_da", {})])
def test_learns_well_above_chance(tmp_path, tiny_config, algorithm, settings):
    # LeNet under SGD sits on a plateau for its first ~100 steps; these settings give it ~250, and the
    # last rounds still move by ±0.05 on these 3 small synthetic sites (measured at 2 threads, rounds
    # counted from 1: final 0.745 FedAvg, 0.625 MOON, 0.78 FedSiam-DA; at lr 0.02 MOON ended at 0.55
    # after 0.61 — too close to a 0.6 bar).
    config = tiny_config.replace(algorithm=algorithm, clients=3, rounds=8, image_size=28,
                                 hyperparameters={algorithm: settings},
                                 training={"local_epochs": 2, "batch_size": 16, "lr": 0.03})
    summary = run_simulation(config, tmp_path / "run")
    assert summary["final_accuracy"] > 0.5  # 10 classes: chance is 0.1
    assert summary["accuracy_curve"][-1] > summary["accuracy_curve"][0] + 0.3


def test_outputs_are_written(tmp_path, tiny_config):
    run = tmp_path / "run"
    config = tiny_config.replace(target_accuracy=0.11)
    summary = run_simulation(config, run)
    for name in ("metrics.csv", "summary.json", "accuracy.png", "config.yaml", "checkpoint.pt"):
        assert (run / name).exists(), name
    assert any((run / "tensorboard").iterdir())
    rows = read_csv(run / "metrics.csv")
    assert {r["site"] for r in rows} == {"site_0", "site_1", "global"}
    assert len([r for r in rows if r["site"] == "global"]) == 2
    site_rows = [r for r in rows if r["site"] != "global"]
    assert all(int(r["bytes_uploaded"]) > 0 and int(r["bytes_downloaded"]) > 0 for r in site_rows)
    assert json.loads((run / "summary.json").read_text())["rounds_to_target"] == summary["rounds_to_target"]
    assert (run / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_same_seed_gives_identical_metrics(tmp_path, tiny_config):
    config = tiny_config.replace(algorithm="moon")
    run_simulation(config, tmp_path / "a")
    run_simulation(config, tmp_path / "b")
    assert read_csv(tmp_path / "a" / "metrics.csv") == read_csv(tmp_path / "b" / "metrics.csv")
    run_simulation(config.replace(seed=1), tmp_path / "c")
    assert read_csv(tmp_path / "c" / "metrics.csv") != read_csv(tmp_path / "a" / "metrics.csv")


@pytest.mark.parametrize("algorithm", ["moon", "fedprox"])
def test_resume_after_kill_equals_uninterrupted_run(tmp_path, tiny_config, algorithm):
    config = tiny_config.replace(algorithm=algorithm, rounds=3, sample_fraction=0.5, clients=3)
    full = run_simulation(config, tmp_path / "full")
    run_simulation(config, tmp_path / "killed", stop_after=1)  # as if killed after round 1
    # A half-written round after the checkpoint must not survive the resume.
    with open(tmp_path / "killed" / "metrics.csv", "a") as f:
        f.write("2,site_0,train,1,9.9,0.0,0,0,{}\n")
    resumed = run_simulation(config, tmp_path / "killed", resume=True)
    assert read_csv(tmp_path / "full" / "metrics.csv") == read_csv(tmp_path / "killed" / "metrics.csv")
    assert resumed["accuracy_curve"] == full["accuracy_curve"]


def test_existing_run_is_not_overwritten(tmp_path, tiny_config):
    run_simulation(tiny_config, tmp_path / "run")
    before = (tmp_path / "run" / "metrics.csv").read_bytes()
    with pytest.raises(ConfigError, match="--resume"):
        run_simulation(tiny_config, tmp_path / "run")
    assert (tmp_path / "run" / "metrics.csv").read_bytes() == before


def test_corrupt_checkpoint_is_reported_and_kept(tmp_path, tiny_config):
    run = tmp_path / "run"
    run_simulation(tiny_config, run, stop_after=1)
    (run / "checkpoint.pt").write_bytes(b"not a checkpoint")
    metrics = (run / "metrics.csv").read_bytes()
    with pytest.raises(CheckpointError, match="corrupt"):
        run_simulation(tiny_config, run, resume=True)
    assert (run / "checkpoint.pt").read_bytes() == b"not a checkpoint"
    assert (run / "metrics.csv").read_bytes() == metrics


def test_resume_without_checkpoint_is_refused_and_keeps_the_results(tmp_path, tiny_config):
    run = tmp_path / "run"
    run_simulation(tiny_config, run, stop_after=1)
    (run / "checkpoint.pt").unlink()
    before = {n: (run / n).read_bytes() for n in ("metrics.csv", "summary.json", "accuracy.png")}
    with pytest.raises(CheckpointError, match=r"holds results \(metrics.csv, summary.json, accuracy.png\) but no "
                                              r"checkpoint.pt.*another --name.*--overwrite"):
        run_simulation(tiny_config, run, resume=True)
    assert {n: (run / n).read_bytes() for n in before} == before
    assert not (run / "checkpoint.pt").exists()


# Runs the command line with a file size limit: a write past it fails with EFBIG, as on a full disk.
LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
from fedcontrast.cli import main
sys.exit(main(sys.argv[2:]))
"""
CLI_TINY = ["--dataset", "synthetic", "--image-size", "16", "--clients", "2", "--local-epochs", "1",
            "--min-samples", "5", "--public-fraction", "0", "--quiet", "--name", "r",
            "--lr-schedule", "constant"]  # a constant rate: a run goes on with more --rounds


def test_full_disk_ends_with_one_sentence_and_the_run_resumes(tmp_path):
    args = [*CLI_TINY, "--runs-dir", str(tmp_path)]
    run = tmp_path / "r"
    assert main(["simulate", *args, "--rounds", "1"]) == 0
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert len(before["checkpoint.pt"]) > 200_000  # the limit below stops the checkpoint, not the small files
    proc = subprocess.run([sys.executable, "-c", LIMITED, "100000", "simulate", *args, "--rounds", "2", "--resume"],
                          capture_output=True, text=True, timeout=300)
    err = proc.stderr.strip()
    assert proc.returncode == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"could not write {run / 'checkpoint.pt'}: no space left on device" in err and "--resume" in err
    files = [p for p in run.rglob("*") if p.is_file()]
    assert not [p for p in files if p.name.endswith(".tmp") or p.stat().st_size == 0]
    for name in ("checkpoint.pt", "metrics.csv", "summary.json"):  # round 1's results, untouched
        assert (run / name).read_bytes() == before[name], name
    assert main(["simulate", *args, "--rounds", "2", "--resume"]) == 0  # space again: it goes on
    assert json.loads((run / "summary.json").read_text())["rounds_completed"] == 2


def test_resume_with_other_settings_is_refused(tmp_path, tiny_config):
    run_simulation(tiny_config, tmp_path / "run", stop_after=1)
    with pytest.raises(CheckpointError, match="beta"):
        run_simulation(tiny_config.replace(beta=5.0), tmp_path / "run", resume=True)


@pytest.mark.parametrize("algorithm", available_algorithms())
def test_contract_every_registered_algorithm_runs_two_sites_two_rounds(tmp_path, tiny_config, algorithm):
    summary = run_simulation(tiny_config.replace(algorithm=algorithm), tmp_path / algorithm)
    assert summary["rounds_completed"] == 2
    rows = read_csv(tmp_path / algorithm / "metrics.csv")
    assert {r["site"] for r in rows if r["site"] != "global"} == {"site_0", "site_1"}
    assert 0.0 <= summary["final_accuracy"] <= 1.0


def test_local_models_are_evaluated_on_each_sites_own_distribution(tmp_path, tiny_config):
    # FedSiam-DA asks for it; any weight-uploading plugin can have it; FedPCL has no local model.
    summary = run_simulation(tiny_config.replace(algorithm="fedsiam_da"), tmp_path / "siam")
    local = summary["final_metrics"]
    assert 0.0 <= local["local_accuracy"] <= 1.0 and local["local_accuracy_std"] >= 0.0
    assert 0.0 <= local["local_balanced_accuracy"] <= 1.0
    assert {"xi_site_0", "xi_site_1", "dual_fallback"} <= set(local)
    assert "local_accuracy" not in run_simulation(tiny_config, tmp_path / "avg")["final_metrics"]
    forced = run_simulation(tiny_config, tmp_path / "avg-local", local_evaluation=True)
    assert "local_accuracy" in forced["final_metrics"]
    with pytest.raises(ConfigError, match="no model weights"):
        run_simulation(tiny_config.replace(algorithm="fedpcl"), tmp_path / "pcl", local_evaluation=True)
