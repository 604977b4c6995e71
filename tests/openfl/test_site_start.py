"""`fedcontrast site start`: a site's pre-flight (its plan, its plan/data.yaml line, cols.yaml, its
certificate and key), then `fx collaborator start -n NAME` in the same process (os.execv), so the
process id, signals and exit code are fx's. Each refusal is one sentence, exit code 2, and fx never starts."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedcontrast.cli import main
from fedcontrast.lab.deployment import executable
from fedcontrast.openfl.pki import fx_executable, issue_for_key, write_certificate
from fedcontrast.openfl.plan import create_workspace

from .conftest import free_port, small_config
from .test_tls_diagnostics import FakeAggregator, issue, make_ca, write


class Exec(Exception):
    """Raised by the stand-in for os.execv: what would have replaced the process, and where."""


@pytest.fixture
def site_ws(tmp_path, pki):
    """A site's workspace (site_0 and site_1 in the plan and cols.yaml, a line each in data.yaml) with
    site_0's certificate and key and the CA chain in place (no aggregator listens at the plan's address)."""
    ws = create_workspace(tmp_path / "ws", small_config(), port=free_port(), log=lambda m: None)
    (ws / "cert" / "client").mkdir(parents=True)
    for suffix in ("crt", "key"):
        shutil.copyfile(pki["cert"] / "client" / f"col_site_0.{suffix}",
                        ws / "cert" / "client" / f"col_site_0.{suffix}")
    shutil.copyfile(pki["cert"] / "cert_chain.crt", ws / "cert" / "cert_chain.crt")
    return ws


@pytest.fixture
def execv(monkeypatch):
    """os.execv replaced: the calls it got (argv and working directory); the test's cwd is restored."""
    calls = []
    monkeypatch.chdir(os.getcwd())

    def fake(path, argv):
        calls.append({"path": path, "argv": list(argv), "cwd": Path.cwd()})
        raise Exec()

    monkeypatch.setattr(os, "execv", fake)
    return calls


def refused(capsys, execv, *args):
    code = main(["site", "start", *args])
    err = capsys.readouterr().err
    assert code == 2 and not execv, (code, execv)
    assert err.startswith("fedcontrast: error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err.removeprefix("fedcontrast: error: ").strip()


def test_a_good_workspace_execs_fx_collaborator_start_in_the_workspace(site_ws, execv, capsys):
    with pytest.raises(Exec):
        main(["site", "start", str(site_ws), "--name", "site_0"])
    assert len(execv) == 1
    assert execv[0]["argv"] == [fx_executable(), "collaborator", "start", "-n", "site_0"]
    assert execv[0]["path"] == fx_executable() and Path(execv[0]["path"]).is_absolute()
    assert execv[0]["cwd"] == site_ws.resolve()
    assert "passed the checks; running fx collaborator start -n site_0" in capsys.readouterr().err


def test_plan_and_data_config_are_passed_to_fx_and_checked(site_ws, execv, monkeypatch):
    (site_ws / "plan" / "data_site0.yaml").write_text("site_0,shard:0\n")
    monkeypatch.chdir(site_ws)  # WORKSPACE defaults to here
    with pytest.raises(Exec):
        main(["site", "start", "--name", "site_0", "-p", "plan/plan.yaml", "--data_config", "plan/data_site0.yaml"])
    with pytest.raises(Exec):
        main(["site", "start", "--name", "site_0", "--", "-d", "plan/data_site0.yaml"])
    fx = fx_executable()
    assert execv[0]["argv"] == [fx, "collaborator", "start", "-n", "site_0", "-p", "plan/plan.yaml",
                                "-d", "plan/data_site0.yaml"]
    assert execv[1]["argv"] == [fx, "collaborator", "start", "-n", "site_0", "-d", "plan/data_site0.yaml"]
    assert execv[0]["cwd"] == execv[1]["cwd"] == site_ws.resolve()


def test_a_name_without_a_data_line_is_refused_naming_the_file_and_its_names(site_ws, execv, capsys):
    (site_ws / "plan" / "data.yaml").write_text("# comment\nsite_0,shard:0\nsite_1,shard:1\n")
    message = refused(capsys, execv, str(site_ws), "--name", "hosp9")
    assert message.startswith(f"{site_ws / 'plan' / 'data.yaml'} has no line for hosp9 (it names site_0, site_1)")
    (site_ws / "plan" / "data.yaml").write_text("# no site yet\n")
    assert "(it names no site)" in refused(capsys, execv, str(site_ws), "--name", "hosp9")
    (site_ws / "plan" / "data.yaml").write_text("site_0 ,shard:0\n")  # fx's name is "site_0 ", not site_0
    assert "(it names site_0 )" in refused(capsys, execv, str(site_ws), "--name", "site_0")
    (site_ws / "plan" / "data.yaml").write_text("# comment\n\nsite_0,shard:0\n  # not a comment to fx\n")
    message = refused(capsys, execv, str(site_ws), "--name", "site_0")
    assert message.startswith(f"line 4 of {site_ws / 'plan' / 'data.yaml'} is not NAME,PATH ('  # not a comment "
                              "to fx'); OpenFL would stop on it")


def test_a_name_not_in_cols_yaml_is_refused_naming_the_file_and_its_names(site_ws, execv, capsys):
    (site_ws / "plan" / "data.yaml").write_text("site_0,shard:0\nsite_2,shard:1\n")
    message = refused(capsys, execv, str(site_ws), "--name", "site_2")
    assert message.startswith(f"site_2 is not among the collaborators of {site_ws / 'plan' / 'cols.yaml'} "
                              "(site_0, site_1)")


def test_a_missing_certificate_or_key_is_refused_under_tls_and_not_checked_without(site_ws, execv, capsys):
    crt = site_ws / "cert" / "client" / "col_site_0.crt"
    crt.unlink()
    message = refused(capsys, execv, str(site_ws), "--name", "site_0")
    assert message.startswith(f"{crt} is missing, and the plan uses TLS: install the certificate the operator signed "
                              "with `fedcontrast site import-cert agg_to_col_site_0_signed_cert.zip")
    (site_ws / "cert" / "cert_chain.crt").unlink()
    message = refused(capsys, execv, str(site_ws), "--name", "site_0")
    assert message.startswith(f"{crt} and {site_ws / 'cert' / 'cert_chain.crt'} are missing, and the plan uses TLS")
    message = refused(capsys, execv, str(site_ws), "--name", "site_1")  # neither its key nor its certificate
    assert "col_site_1.crt and " in message and "col_site_1.key are missing" in message
    assert "`fedcontrast site join" in message and "`fedcontrast site import-cert" in message
    plan = yaml.safe_load((site_ws / "plan" / "plan.yaml").read_text())
    plan["network"]["settings"]["use_tls"] = False
    plan["data_loader"]["settings"]["network"]["use_tls"] = False  # the plan's copies agree (a consistent plan)
    (site_ws / "plan" / "plan.yaml").write_text(yaml.safe_dump(plan))
    message = refused(capsys, execv, str(site_ws), "--name", "site_1")  # TLS off: refused unless the policy allows it
    assert "turns TLS off (network.settings.use_tls: false)" in message and "require_tls: false" in message
    (site_ws / "site_policy.yaml").write_text("require_tls: false\n")
    with pytest.raises(Exec):  # allowed by the site's policy: no certificate is needed then
        main(["site", "start", str(site_ws), "--name", "site_1"])
    assert execv[0]["argv"][-2:] == ["-n", "site_1"]


def test_a_folder_that_is_no_workspace_is_refused(tmp_path, execv, capsys):
    message = refused(capsys, execv, str(tmp_path), "--name", "site_0")
    assert message.startswith(f"{tmp_path} is not a workspace: {tmp_path / 'plan' / 'plan.yaml'} does not exist")
    message = refused(capsys, execv, str(tmp_path / "absent"), "--name", "site_0")
    assert message.startswith(f"{tmp_path / 'absent'} is not a folder")


def test_the_command_exits_2_with_one_sentence_and_no_fx(site_ws):
    (site_ws / "plan" / "data.yaml").write_text("site_0,shard:0\n")
    done = subprocess.run([executable("fedcontrast"), "site", "start", str(site_ws), "--name", "site_1"],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"fedcontrast: error: {site_ws / 'plan' / 'data.yaml'} has no line for site_1 (it names "
                           "site_0): start the site named there, or add the line site_1,PATH_TO_ITS_IMAGES with "
                           "`fedcontrast site join`\n")
    # fx itself would have parsed the plan and stopped on OpenFL's KeyError: 'site_1' with a traceback


def test_certificate_mistakes_end_before_fx_starts(site_ws, execv, capsys):
    """The site's own certificate: from another federation's CA, not fitting its key, expired."""
    client = site_ws / "cert" / "client"
    crt, key = client / "col_site_0.crt", client / "col_site_0.key"
    good = crt.read_bytes()
    write_certificate(crt, issue_for_key(key, "site_0")[0])
    said = refused(capsys, execv, str(site_ws), "--name", "site_0")
    assert said.startswith(f"the certificate {crt} (CN=site_0) is issued by CN=other federation ca, not by the "
                           f"federation's CA in {site_ws / 'cert' / 'cert_chain.crt'}")
    crt.write_bytes(good)
    key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    said = refused(capsys, execv, str(site_ws), "--name", "site_0")
    assert said.startswith(f"the certificate {crt} (CN=site_0) does not belong to the private key {key}")
    expired, _ = issue_for_key(key, "site_0", days=(-30, -1))
    write_certificate(crt, expired)
    said = refused(capsys, execv, str(site_ws), "--name", "site_0")
    assert said.startswith(f"the certificate {crt} (CN=site_0) expired on {expired.not_valid_after_utc:%Y-%m-%d %H:%M}")


def test_an_aggregator_from_another_federation_is_named_before_fx_starts(site_ws, execv, capsys, tmp_path):
    """When the aggregator already listens, its certificate is checked too (here: another CA's)."""
    plan = yaml.safe_load((site_ws / "plan" / "plan.yaml").read_text())
    port = plan["network"]["settings"]["agg_port"]
    server = FakeAggregator(*write(tmp_path / "server", "agg", *issue(make_ca("other ca"), "localhost")), port=port)
    try:
        said = refused(capsys, execv, str(site_ws), "--name", "site_0")
    finally:
        server.close()
    assert said.startswith(f"the aggregator at localhost:{port} presents a certificate (CN=localhost) issued by "
                           "CN=other ca, not by the federation's CA in")


def test_every_check_the_collaborator_would_make_runs_before_site_start_says_it_passed(site_ws, execv, capsys,
                                                                                          tmp_path):
    """Issue 21 point 7: the policy, the data line and the public folder were checked only inside fx,
    after its start-up; now `site start` refuses at once, and `doctor` names the same problem."""
    from fedcontrast.data.schema import folder_fingerprint
    from fedcontrast.privacy.policy import POLICY_FILE

    (site_ws / POLICY_FILE).write_text("max_epsilon: 5.0\n")  # MOON's weights leave without DP: ε unbounded
    message = refused(capsys, execv, str(site_ws), "--name", "site_0")
    assert message.startswith(f"this site's policy {site_ws / POLICY_FILE} refuses the plan before any data is read")
    (site_ws / POLICY_FILE).unlink()
    # a public folder whose files differ from the plan's fingerprint: the doctor's (and so site start's) check
    from fedcontrast.openfl.doctor import FAIL, OK, check_shared
    from fedcontrast.openfl.fx import read_workspace_config
    from tests.openfl.test_deploy import deployment, images

    public = images(tmp_path / "public", {"neg": 2, "pos": 2}, seed=5)
    ws = create_workspace(tmp_path / "pub", deployment(public_data={"sha256": folder_fingerprint(public),
                                                                     "folder": str(public)}), log=lambda m: None)
    assert check_shared(ws, read_workspace_config(ws)).status == OK
    images(public, {"neg": 3}, seed=6)  # one more file
    check = check_shared(ws, read_workspace_config(ws))
    assert check.status == FAIL and "fingerprint" in check.message and str(public) in check.message


def test_threads_reach_the_collaborator_it_starts(site_ws, execv, monkeypatch):
    """--threads N: the collaborator (fx, which takes this process over) applies and prints N
    (fedcontrast.threads); without it, its own default rule (nothing handed on)."""
    from fedcontrast.threads import SHARED_ENV, THREADS_ENV

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != THREADS_ENV})  # the test's own
    os.environ[SHARED_ENV] = "4"  # a launcher's share left in the environment is not the user's value
    with pytest.raises(Exec):
        main(["site", "start", str(site_ws), "--name", "site_0", "--threads", "3"])
    assert os.environ[THREADS_ENV] == "3" and os.environ["OMP_NUM_THREADS"] == "3"
    assert SHARED_ENV not in os.environ
    del os.environ[THREADS_ENV]
    with pytest.raises(Exec):
        main(["site", "start", str(site_ws), "--name", "site_0"])
    assert THREADS_ENV not in os.environ
