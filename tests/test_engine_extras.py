"""The core depends on no federation engine: with OpenFL absent (an install extra), the simulator
runs, and a command that needs OpenFL says how to install it in one sentence, writing nothing."""

import subprocess
import sys

BLOCK_OPENFL = ("import sys; sys.modules['openfl'] = None; from fedcontrast.cli import main; "
                "sys.exit(main(sys.argv[1:]))")


def run(tmp_path, *argv):
    return subprocess.run([sys.executable, "-c", BLOCK_OPENFL, *argv], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)


def test_without_openfl_the_simulator_runs_and_fx_commands_say_how_to_install_it(tmp_path):
    done = run(tmp_path, "simulate", "--dataset", "synthetic", "--image-size", "16", "--clients", "2", "--rounds", "1",
               "--local-epochs", "1", "--min-samples", "5", "--runs-dir", str(tmp_path / "runs"), "--name", "sim",
               "--quiet")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "runs" / "sim" / "metrics.csv").is_file()
    refused = run(tmp_path, "federation", "--runs-dir", str(tmp_path / "runs"), "--rounds", "1")
    assert refused.returncode == 2
    assert refused.stderr.strip() == ("fedcontrast: error: this command runs OpenFL, which is not installed in this "
                                      "environment: pip install -e \".[openfl]\" "
                                      "(or pip install 'fedcontrast[openfl]')")
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["sim"]  # nothing written for the federation
    report = run(tmp_path, "report", str(tmp_path / "runs" / "sim"))  # a run folder: read without OpenFL
    assert report.returncode == 0 and "finished: 1 of 1 rounds" in report.stdout, report.stderr[-2000:]
    (tmp_path / "ws" / "plan").mkdir(parents=True)
    (tmp_path / "ws" / "plan" / "plan.yaml").write_text("{}\n")
    report = run(tmp_path, "report", str(tmp_path / "ws"))  # an OpenFL workspace: its report imports the OpenFL glue
    assert report.returncode == 2 and "pip install -e \".[openfl]\"" in report.stderr
    assert "Traceback" not in report.stderr
