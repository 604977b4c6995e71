"""The command line: bad input gets one sentence and exit code 2; good input produces the outputs."""

import subprocess
import sys

import pytest
import yaml

from fedcontrast.cli import main

TINY = ["--dataset", "synthetic", "--image-size", "16", "--clients", "2", "--rounds", "1",
        "--local-epochs", "1", "--min-samples", "5", "--public-fraction", "0", "--quiet"]


@pytest.mark.parametrize("argv,fragment", [
    (["simulate", "--algorithm", "nope"], "unknown algorithm 'nope'; known algorithms: fedavg"),
    (["simulate", "--dataset", "imagenet"], "unknown data set"),
    (["simulate", "--beta", "0"], "beta must be"),
    (["simulate", "--beta", "-1"], "beta must be"),
    (["simulate", "--dataset", "synthetic", "--clients", "5000"], "5000"),
    (["simulate", "--dataset", "cifar10", "--data-root", "/nonexistent/cifar"], "/nonexistent/cifar"),
    (["simulate", "--set", "mu=-3"], "mu"),
    (["simulate", "--set", "moon.tau=1"], "no setting"),
    (["simulate", "--set", "mu=["], "--set 'mu=[' is not valid YAML"),
    (["simulate", "--set", "temperature=1.0e-320"], "temperature must be a finite number ≥ 0.0001"),
    (["simulate", "--robustness", "max_samples={site_0: 9"], "--robustness 'max_samples={site_0: 9' is not valid YAML"),
    (["simulate", "--robustness", "max_samples={site_0: 1, site_0: 2}"], "the key 'site_0' is given twice"),
    (["simulate", "--lr", "0"], "lr"),
    (["simulate", "--config", "/nonexistent.yaml"], "does not exist"),
    (["compare", "--algorithms", "fedavg", "moon:mu"], "name:key=value"),
    (["compare", "--algorithms", "fedavg", "moon:mu=-1"], "mu"),
    (["simulate", "--dataset", "fedprox_synthetic", "--partition", "iid"], "partition iid does not apply"),
    (["simulate", "--dataset-setting", "alpha=1"],
     "dataset_settings apply to fashion_mnist, fedprox_synthetic, mnist, not digits"),
    (["partition", "--dataset", "fedprox_synthetic", "--dataset-setting", "alpha"], "--dataset-setting expects"),
])
def test_bad_input_exits_2_with_one_sentence(tmp_path, capsys, argv, fragment):
    code = main(argv + ["--runs-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert fragment in err
    assert len(err.splitlines()) == 1
    assert "Traceback" not in err


def test_unknown_yaml_key(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("algorithm: moon\nrounds: 2\nroundz: 3\n")
    assert main(["simulate", "--config", str(cfg), "--runs-dir", str(tmp_path)]) == 2
    assert "roundz" in capsys.readouterr().err


def test_simulate_then_resume_and_compare(tmp_path, capsys):
    runs = ["--runs-dir", str(tmp_path)]
    assert main(["simulate", "--algorithm", "moon", "--name", "c", *TINY, *runs]) == 0
    assert (tmp_path / "c" / "metrics.csv").exists()
    assert main(["simulate", "--algorithm", "moon", "--name", "c", *TINY, *runs]) == 2  # exists
    capsys.readouterr()
    # the default cosine schedule spans the planned rounds: more of them would change the rounds already run
    assert main(["simulate", "--algorithm", "moon", "--name", "c", "--resume", *TINY, "--rounds", "2", *runs]) == 2
    assert "follows a cosine schedule over 1 round," in capsys.readouterr().err
    constant = ["--lr-schedule", "constant"]  # a constant rate: a finished run takes more rounds
    assert main(["simulate", "--algorithm", "moon", "--name", "r", *TINY, *constant, *runs]) == 0
    assert main(["simulate", "--algorithm", "moon", "--name", "r", "--resume", *TINY, *constant, "--rounds", "2",
                 *runs]) == 0
    capsys.readouterr()
    assert main(["compare", "--algorithms", "fedavg", "moon", "moon:mu=0.5", "--seeds", "0", "1", "--name", "cmp",
                 *TINY, *runs]) == 0
    out = capsys.readouterr().out
    assert "| fedavg |" in out and "| moon |" in out and "| moon:mu=0.5 |" in out
    from fedcontrast.cli.app import build_parser
    from fedcontrast.cli.common import config_from_args
    from fedcontrast.sim.compare import run_comparison

    labels: list[str] = []  # each run's header: which of how many, the time left (finished runs reused)
    base = config_from_args(build_parser().parse_args(["compare", "--algorithms", "fedavg", *TINY]),
                            default_algorithm_for_set=False)
    run_comparison(base, ["fedavg", "moon"], [0, 1], tmp_path / "cmp", progress_factory=labels.append)
    assert labels[0] == "fedavg seed 0 (run 1 of 4)" and labels[1].startswith("fedavg seed 1 (run 2 of 4; about ")
    assert labels[3].startswith("moon seed 1 (run 4 of 4; about ") and labels[3].endswith(" left)")
    import yaml
    assert yaml.safe_load((tmp_path / "cmp" / "moon-mu0.5-s1" / "config.yaml").read_text())[
        "hyperparameters"]["moon"]["mu"] == 0.5
    assert (tmp_path / "cmp" / "compare.png").exists() and (tmp_path / "cmp" / "compare.csv").exists()


def test_partition_command_prints_table_and_writes_report(tmp_path, capsys):
    assert main(["partition", "--clients", "4", "--beta", "0.3", "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "total" in out
    assert (tmp_path / "p" / "partition.csv").exists() and (tmp_path / "p" / "partition.png").exists()


def test_partition_of_a_generator_with_its_own_sites(tmp_path, capsys):
    assert main(["partition", "--dataset", "fedprox_synthetic", "--clients", "150", "--dataset-setting", "beta=0.5",
                 "--dataset-setting", "max_site_samples=80", "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "150 sites" in out and "samples per site: min" in out and "classes per site: min" in out
    assert "more than 100 sites" in out  # the table is in the CSV
    assert len((tmp_path / "p" / "partition.csv").read_text().splitlines()) == 151


def test_simulate_help_lists_every_registered_data_set(capsys):
    from fedcontrast.config.datasets import DATASET_NAMES

    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(f"{name}:" in help_text for name in DATASET_NAMES)
    assert "--dataset-setting KEY=VALUE" in help_text


def test_process_exit_code_and_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fedcontrast", "simulate", "--algorithm", "nope",
                           "--runs-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "unknown algorithm" in proc.stderr


def test_local_eval_linear_probe_and_probe_command(tmp_path, capsys):
    import torch

    assert main(["simulate", *TINY, "--algorithm", "fedavg", "--local-eval", "--linear-probe",
                 "--runs-dir", str(tmp_path), "--name", "r"]) == 0
    out = capsys.readouterr().out
    assert "sites' local models:" in out and "linear probe of the global encoder:" in out
    # The probe command on a saved state_dict (what a federation exports as save/final_model.pt).
    from fedcontrast.config import RunConfig
    from fedcontrast.construction import initial_model

    config = RunConfig(dataset="synthetic", image_size=16, public_fraction=0.0)
    model = initial_model(config, in_channels=1, image_size=16, num_classes=10)
    torch.save(model.state_dict(), tmp_path / "m.pt")
    probe = ["probe", "--dataset", "synthetic", "--image-size", "16", "--public-fraction", "0"]
    assert main(probe + [str(tmp_path / "m.pt")]) == 0
    assert "test accuracy" in capsys.readouterr().out
    assert main(probe + [str(tmp_path / "missing.pt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(probe + ["--model", "resnet18", str(tmp_path / "m.pt")]) == 2
    assert "is not a resnet18 state_dict" in capsys.readouterr().err
    # FedPCL has no global model to probe: one sentence, exit 2.
    assert main(["simulate", *TINY[:-3], "--public-fraction", "0.2", "--quiet", "--algorithm", "fedpcl",
                 "--linear-probe", "--runs-dir", str(tmp_path), "--name", "p"]) == 2
    assert "no global model" in capsys.readouterr().err


def one_sentence(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("privacy", [None, {"representations": {"noise_multiplier": 2.0}}])
def test_simulate_fedpcl_prints_its_summary_and_exits_0(tmp_path, capsys, privacy):
    # FedPCL reports its sites' local accuracy without a balanced one: the summary used to raise KeyError.
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"privacy": privacy, "hyperparameters": {
        "fedpcl": {"projection_hidden": [16], "pretrain_epochs": 1}}}))
    assert main(["simulate", "--config", str(config), *TINY[:-3], "--public-fraction", "0.2", "--quiet",
                 "--algorithm", "fedpcl", "--projection-dim", "32", "--runs-dir", str(tmp_path), "--name", "p"]) == 0
    out = capsys.readouterr().out
    assert "final test accuracy" in out
    assert "sites' local models:" in out and "on their own label distributions" in out
    assert "balanced" not in out


def test_plan_write_refuses_to_overwrite_without_force(tmp_path, capsys):
    assert main(["plan", "write", str(tmp_path / "plan"), "--collaborators", "2"]) == 0
    capsys.readouterr()
    edited = tmp_path / "plan" / "moon.yaml"
    edited.write_text("# my edits\n")
    assert main(["plan", "write", str(tmp_path / "plan")]) == 2
    err = one_sentence(capsys)
    assert "already exists" in err and "--force" in err and "another folder" in err
    assert edited.read_text() == "# my edits\n"  # untouched
    assert main(["plan", "write", str(tmp_path / "plan"), "--force"]) == 0
    assert edited.read_text() != "# my edits\n"
    capsys.readouterr()
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep\n")
    assert main(["plan", "write", str(a_file)]) == 2
    assert "is a file, not a folder" in one_sentence(capsys)
    assert a_file.read_text() == "keep\n"


def test_pki_on_a_folder_that_is_not_a_workspace(tmp_path, capsys):
    assert main(["pki", str(tmp_path)]) == 2
    err = one_sentence(capsys)
    assert f"{tmp_path} is not a workspace" in err and "fedcontrast workspace create" in err
    assert not (tmp_path / "cert").exists()


@pytest.mark.parametrize("command", [["federation", "--collaborators", "2"], ["workspace", "create", "--collaborators",
                                                                             "2"]])
@pytest.mark.parametrize("port", ["99999", "0", "-1"])
def test_port_outside_1_to_65535_is_refused(tmp_path, capsys, command, port):
    target = [] if command[0] == "federation" else [str(tmp_path / "ws")]
    runs = ["--runs-dir", str(tmp_path)] if command[0] == "federation" else []
    assert main([*command, "--port", port, *runs, *target]) == 2
    assert f"--port must be a TCP port from 1 to 65535, got {port}" in one_sentence(capsys)
    assert not any(tmp_path.iterdir())  # nothing written
