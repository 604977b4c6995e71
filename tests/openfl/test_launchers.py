"""The start-up guard fires whatever launches OpenFL's collaborator (issue 34): ``fx``, a link to
``fx`` under another name, ``python -m openfl.interface.cli``, ``python -S`` with site-packages on
``PYTHONPATH``, and a program that builds the collaborator with OpenFL's ``Plan`` itself. Each time
the operator's module named in the plan is never imported (it would write a marker file at import)."""

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedcontrast.openfl.plan import create_workspace

from .conftest import small_config
from .test_package_trust import EVIL, evil_plan

SRC = Path(__file__).resolve().parents[2] / "src"


def evil_workspace(tmp_path: Path, *, module_outside: bool = False) -> tuple[Path, dict]:
    """A site's workspace whose plan names the operator's own data loader; its module in the workspace's
    ``src/`` (or, ``module_outside``, in a folder put on ``PYTHONPATH``: then only the plan names it)."""
    ws = create_workspace(tmp_path / "fed", small_config())
    plan = evil_plan(yaml.safe_load((ws / "plan" / "plan.yaml").read_text()))
    env = {**os.environ, "PYTHONPATH": ""}
    if module_outside:
        outside = tmp_path / "outside"
        (outside / "src").mkdir(parents=True)
        (outside / "src" / "evil.py").write_text(EVIL.replace('Path("EVIL_RAN")', f'Path({str(ws / "EVIL_RAN")!r})'))
        env["PYTHONPATH"] = str(outside)
    else:
        (ws / "src" / "evil.py").write_text(EVIL)
    (ws / "plan" / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    return ws, env


def launchers(tmp_path: Path) -> dict[str, list[str]]:
    fx = Path(sys.executable).with_name("fx")
    renamed = tmp_path / "bin" / "openfl-cli"
    renamed.parent.mkdir(exist_ok=True)
    renamed.symlink_to(fx)
    return {"fx": [str(fx)], "renamed link": [str(renamed)],
            "python -m": [sys.executable, "-m", "openfl.interface.cli"],
            "python -S": [sys.executable, "-S", "-m", "openfl.interface.cli"]}


@pytest.mark.parametrize("launcher", ["fx", "renamed link", "python -m", "python -S"])
def test_every_launcher_refuses_the_operators_module_before_importing_it(tmp_path, launcher):
    ws, env = evil_workspace(tmp_path, module_outside=launcher == "python -S")
    command = launchers(tmp_path)[launcher]
    if launcher == "python -S":  # no .pth file runs: site-packages (and the editable install's src) on PYTHONPATH
        env["PYTHONPATH"] = os.pathsep.join([*site.getsitepackages(), str(SRC), env["PYTHONPATH"]])
    proc = subprocess.run([*command, "collaborator", "start", "-n", "site_0"], cwd=ws, capture_output=True, text=True,
                          timeout=180, env=env)
    err = proc.stderr.strip()
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert len(err.splitlines()) == 1 and err.startswith("fedcontrast collaborator: error: this workspace is refused "
                                                         "before anything runs"), err
    assert "data_loader.template names 'src.evil.EvilLoader'" in err
    assert not (ws / "EVIL_RAN").exists()  # the operator's module was never imported


def test_a_program_building_the_collaborator_itself_is_refused_before_the_module_is_imported(tmp_path):
    ws, env = evil_workspace(tmp_path, module_outside=True)
    program = ("from pathlib import Path\nfrom openfl.federated import Plan\n"
               "from fedcontrast.deploy.trust import PackageRefused\n"
               "plan = Plan.parse(plan_config_path=Path('plan/plan.yaml'), data_config_path=Path('plan/data.yaml'))\n"
               "try:\n    plan.get_collaborator('site_0')\n"
               "except PackageRefused as exc:\n    print('REFUSED', exc)\n")
    proc = subprocess.run([sys.executable, "-c", program], cwd=ws, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("REFUSED this workspace is refused before anything runs"), \
        proc.stdout + proc.stderr[-3000:]
    assert "data_loader.template names 'src.evil.EvilLoader'" in proc.stdout
    assert not (ws / "EVIL_RAN").exists()


def test_doctor_says_which_launchers_are_checked_first(tmp_path, monkeypatch):
    from fedcontrast.config import RunConfig
    from fedcontrast.openfl.doctor import check_code

    ws = create_workspace(tmp_path / "fed", small_config())
    plan = yaml.safe_load((ws / "plan" / "plan.yaml").read_text())
    config = RunConfig.from_dict(plan["task_runner"]["settings"]["run_config"])
    check = check_code(ws, plan, config)
    assert check.status == "OK", check.line()
    covered = check.message.split("checked first whatever starts the site: ")[1]
    for launcher in ("fx", "a link to fx under another name", "python -m openfl.interface.cli",
                     "python -S with site-packages on PYTHONPATH"):
        assert launcher in covered.split(" (not: ")[0]
    assert "(not: python -S without this environment" in covered
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # torch's entry points off: -S is not covered
    assert "(not: python -S with site-packages on PYTHONPATH" in check_code(ws, plan, config).message
