"""A party never hangs on what it reads (issue 46): an alias-expansion bomb in a package's plan hung
`site join` for ever; a FIFO where a workspace file belongs (plan/plan.yaml, plan/cols.yaml,
plan/data.yaml, the CA chain, the site's policy) hung `fx collaborator start`. Each is now refused in
one sentence naming the file, before anything is opened."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from fedcontrast.cli import main
from fedcontrast.errors import FedContrastError
from fedcontrast.openfl.guard import guard_collaborator_start
from fedcontrast.openfl.plan import build_plan, create_workspace

from ..test_bounded_inputs import billion_laughs, within
from .conftest import small_config
from .test_deploy import deployment, images
from .test_package_trust import write_package


def test_site_join_refuses_a_plan_that_is_an_alias_expansion_bomb_at_once(tmp_path, capsys):
    plan = yaml.safe_dump(build_plan(deployment()), sort_keys=False) + billion_laughs()  # keys a … i added
    package = write_package(tmp_path / "fed.zip", build_plan(deployment()))
    with zipfile.ZipFile(package) as z:
        entries = {name: z.read(name) for name in z.namelist() if name != "plan/plan.yaml"}
    with zipfile.ZipFile(package, "w") as z:
        z.writestr("plan/plan.yaml", plan)
        for name, data in entries.items():
            z.writestr(name, data)
    data = images(tmp_path / "data", {"neg": 3, "pos": 3})
    capsys.readouterr()
    code = within(60, main, ["site", "join", str(package), "--name", "hosp1", "--data", str(data), "--into",
                             str(tmp_path / "site")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err == (f"fedcontrast: error: the plan in {package} is refused, nothing of it was used: it expands to more "
                   "than 200,000 values through its aliases (an alias-expansion bomb?); replace it")
    assert not (tmp_path / "site" / "fed").exists()


@pytest.mark.parametrize("where", ["plan/plan.yaml", "plan/cols.yaml", "plan/data.yaml", "cert/cert_chain.crt",
                                   "site_policy.yaml"])
def test_a_fifo_in_the_workspace_is_refused_at_collaborator_start_without_blocking(tmp_path, monkeypatch, where):
    monkeypatch.delenv("FEDCONTRAST_SITE_POLICY", raising=False)
    ws = create_workspace(tmp_path / "fed", small_config())
    fifo = ws / where
    fifo.parent.mkdir(parents=True, exist_ok=True)
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    with pytest.raises(FedContrastError) as info:
        within(60, guard_collaborator_start, ["fx", "collaborator", "start", "-n", "site_0"], ws, fifo=fifo)
    assert str(info.value) == (f"workspace file {fifo} is a FIFO (named pipe), not a regular file: nothing was read "
                               "from it (reading it could block for ever); put the file itself there")


def test_raw_fx_collaborator_start_refuses_a_fifo_plan_in_one_sentence(tmp_path):
    ws = create_workspace(tmp_path / "fed", small_config())
    plan = ws / "plan" / "plan.yaml"
    plan.unlink()
    os.mkfifo(plan)
    fx = Path(sys.executable).with_name("fx")
    try:
        proc = subprocess.run([str(fx), "collaborator", "start", "-n", "site_0"], cwd=ws, capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail("fx collaborator start blocked on a FIFO plan/plan.yaml")
    err = proc.stderr.strip()
    assert proc.returncode == 1 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err == (f"fedcontrast collaborator: error: workspace file {plan} is a FIFO (named pipe), not a regular "
                   "file: nothing was read from it (reading it could block for ever); put the file itself there")
