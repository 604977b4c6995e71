"""A hospital need not trust the operator's package: it runs no code the site has not installed, carries
no key, keeps TLS on unless the site's policy allows otherwise, and a policy cannot be switched off by
putting something else at its path. Each attack is tried the way an operator would send it."""

import datetime as dt
import os
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import NameOID

from fedcontrast.audit.format import format_report
from fedcontrast.audit.report import audit_plan
from fedcontrast.cli import main
from fedcontrast.deploy.common import DeploymentError, secrets_in
from fedcontrast.deploy.templates import template_problems
from fedcontrast.deploy.trust import PackageRefused, check_workspace, key_material, requirement_problems
from fedcontrast.errors import SiteRefusal
from fedcontrast.openfl.guard import guard_installed
from fedcontrast.openfl.institution_flows import join
from fedcontrast.openfl.operator_flows import export_workspace
from fedcontrast.openfl.plan import build_plan, create_workspace
from fedcontrast.privacy.policy import POLICY_ENV, POLICY_FILE, SitePolicy, check_policy, site_policy_path
from fedcontrast.site.checks import enforce_site_policy
from tests.plans import small_config

from .test_deploy import deployment, images

EVIL = '''
from pathlib import Path
Path("EVIL_RAN").write_text("the operator's code ran at the site")


class EvilLoader:
    def __init__(self, **settings):
        Path("EVIL_RAN").write_text("the operator's loader read the site's data")
'''


def evil_plan(plan: dict) -> dict:
    plan["data_loader"]["template"] = "src.evil.EvilLoader"
    return plan


def write_package(path: Path, plan: dict, extra: dict[str, bytes] | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("plan/plan.yaml", yaml.safe_dump(plan, sort_keys=False))
        z.writestr("plan/cols.yaml", "collaborators: [hosp1, hosp2]\n")
        z.writestr("plan/data.yaml", "# data lines\n")
        if "requirements.txt" not in (extra or {}):
            z.writestr("requirements.txt", f"fedcontrast=={version('fedcontrast')}\n")
        z.writestr("src/README.md", "nothing to edit\n")
        for name, data in (extra or {}).items():
            z.writestr(name, data)
    return path


def ec_key():
    return ec.generate_private_key(ec.SECP256R1())


def test_the_generated_plans_name_only_installed_components():
    assert template_problems(build_plan(small_config()), "plan") == []
    assert template_problems(build_plan(deployment()), "plan") == []


@pytest.mark.parametrize("section, template, words", [
    ("data_loader", "src.evil.EvilLoader", "data_loader.template names 'src.evil.EvilLoader'"),
    ("task_runner", "subprocess.Popen", "task_runner.template names 'subprocess.Popen'"),
    ("task_runner", "fedcontrast.cli.main", "fedcontrast.cli.main"),  # installed, but not a component
    ("compression_pipeline", "openfl.pipelines.SKCPipeline", "openfl.pipelines.SKCPipeline"),
])
def test_any_other_component_is_refused_by_name(section, template, words):
    plan = build_plan(small_config())
    plan[section]["template"] = template
    problems = template_problems(plan, "its plan")
    assert len(problems) == 1 and words in problems[0] and "not the installed fedcontrast's component" in problems[0]
    plan = build_plan(small_config())
    plan["tasks"]["train"]["aggregation_type"]["template"] = "src.evil.Aggregate"
    assert "tasks.train.aggregation_type.template names 'src.evil.Aggregate'" in template_problems(plan, "p")[0]
    plan = build_plan(small_config())
    plan["extra"] = {"template": "os.system", "settings": {"command": "true"}}
    assert "builds a component at extra ('os.system')" in template_problems(plan, "p")[0]
    plan = build_plan(small_config())
    plan["aggregator"]["defaults"] = "../../../../tmp/other.yaml"
    assert "reads its defaults from another file" in template_problems(plan, "p")[0]


def test_join_refuses_a_package_with_code_and_runs_none_of_it(tmp_path):
    plan = evil_plan(build_plan(deployment()))
    archive = write_package(tmp_path / "fed.zip", plan, {"src/evil.py": EVIL.encode()})
    data = images(tmp_path / "data", {"neg": 3, "pos": 3})
    with pytest.raises(PackageRefused) as info:
        join(archive, name="hosp1", data=data, into=tmp_path / "site")
    message = str(info.value)
    assert message.startswith("fed.zip is refused, nothing was unpacked: it carries code (src/evil.py (Python code))")
    assert "data_loader.template names 'src.evil.EvilLoader'" in message
    assert not (tmp_path / "site" / "fed").exists() and not list(tmp_path.rglob("EVIL_RAN"))
    # the same plan without the file is still refused: the template alone names code the site did not install
    with pytest.raises(PackageRefused, match="src.evil.EvilLoader"):
        join(write_package(tmp_path / "fed2.zip", plan), name="hosp1", data=data, into=tmp_path / "site")


def test_join_refuses_requirements_the_site_does_not_run(tmp_path):
    assert requirement_problems([f"fedcontrast=={version('fedcontrast')}"]) == []
    problems = requirement_problems(["fedcontrast==99.0", "evil-helper==1.0", "torch>=2"])
    assert "pins fedcontrast==99.0 but this site runs fedcontrast " in problems[0]
    assert "asks for evil-helper==1.0, which this site has not installed" in problems[1]
    assert "asks for 'torch>=2', not one distribution at one version" in problems[2]
    archive = write_package(tmp_path / "fed.zip", build_plan(deployment()), {"requirements.txt": b"evil-helper==1.0\n"})
    with pytest.raises(DeploymentError, match="evil-helper==1.0, which this site has not installed"):
        join(archive, name="hosp1", data=images(tmp_path / "data", {"neg": 3, "pos": 3}), into=tmp_path / "site")


def test_key_material_is_found_whatever_the_file_is_called(tmp_path):
    key = ec_key()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    encrypted = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                                  serialization.BestAvailableEncryption(b"secret"))
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hosp1")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    p12 = pkcs12.serialize_key_and_certificates(b"x", key, cert, None, serialization.BestAvailableEncryption(b"pw"))
    assert key_material(pem) == "a PEM private key"
    assert key_material(der) == "a DER private key"
    assert key_material(encrypted) == "an encrypted DER private key"
    assert key_material(p12) == "a PKCS#12 bundle"
    public = cert.public_bytes(serialization.Encoding.PEM)
    assert key_material(public) is None and key_material(cert.public_bytes(serialization.Encoding.DER)) is None
    assert key_material(b"plain text") is None
    archive = write_package(tmp_path / "fed.zip", build_plan(deployment()), {
        "src/ca_backup.txt": pem, "save/weights.bin": der, "plan/notes.dat": p12, "cert/client/col_hosp1.crt": public,
        "cert/cert_chain.crt": public})
    assert secrets_in(archive, workspace_package=True) == ["cert/client/col_hosp1.crt", "plan/notes.dat",
                                                           "save/weights.bin", "src/ca_backup.txt"]
    with pytest.raises(PackageRefused, match=r"it carries private-key material \(.*src/ca_backup.txt"):
        join(archive, name="hosp1", data=images(tmp_path / "data", {"neg": 3, "pos": 3}), into=tmp_path / "site")


def test_export_refuses_a_ca_key_renamed_into_src_and_code(tmp_path, capsys):
    ws = create_workspace(tmp_path / "fed", deployment())
    (ws / "src" / "helper.py").write_text("print('hi')\n")
    with pytest.raises(DeploymentError, match=r"helper.py is Python code, which the package would carry"):
        export_workspace(ws, log=lambda m: None)
    (ws / "src" / "helper.py").unlink()
    key = ec_key().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                 serialization.NoEncryption())
    (ws / "src" / "ca_backup.txt").write_bytes(key)
    assert main(["workspace", "export", str(ws)]) == 2
    err = capsys.readouterr().err
    assert "fed.zip would carry private key material (src/ca_backup.txt); it was deleted — nothing was sent" in err
    assert not (ws / "fed.zip").exists()


def test_tls_off_is_refused_at_join_doctor_and_start_unless_the_policy_allows_it(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    plan = build_plan(deployment(), tls=False)
    archive = write_package(tmp_path / "fed.zip", plan)
    data = images(tmp_path / "data", {"neg": 3, "pos": 3})
    with pytest.raises(PackageRefused, match=r"its plan turns TLS off \(network.settings.use_tls: false\)"):
        join(archive, name="hosp1", data=data, into=tmp_path / "site")
    plan_on = build_plan(deployment())
    plan_on["network"]["settings"]["require_client_auth"] = False
    with pytest.raises(PackageRefused, match="turns client authentication off"):
        join(write_package(tmp_path / "noauth.zip", plan_on), name="hosp1", data=data, into=tmp_path / "site")
    allow = tmp_path / "policy.yaml"
    allow.write_text("require_tls: false\nrequire_client_auth: false\n")
    joined = join(archive, name="hosp1", data=data, into=tmp_path / "site", policy=allow, log=lambda m: None)
    ws = joined.workspace
    assert (ws / POLICY_FILE).read_text() == allow.read_text()  # installed: checked again at every start
    check_workspace(ws, plan, SitePolicy.from_yaml(ws / POLICY_FILE))
    (ws / POLICY_FILE).unlink()
    with pytest.raises(PackageRefused, match="turns TLS off"):
        check_workspace(ws, plan, None)
    assert main(["doctor", str(ws), "--name", "hosp1"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  transport: the plan turns TLS off" in out
    with pytest.raises(SiteRefusal, match="^the plan turns TLS off"):  # the collaborator itself, no policy file
        enforce_site_policy(deployment(), plan["network"]["settings"], {"in_channels": 1}, str(data), cwd=ws)


@pytest.mark.parametrize("make", ["folder", "dangling link", "unreadable"])
def test_something_else_at_the_policy_path_is_an_error_not_no_policy(tmp_path, make, monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    path = tmp_path / POLICY_FILE
    if make == "folder":
        path.mkdir()
    elif make == "dangling link":
        path.symlink_to(tmp_path / "gone.yaml")
    else:
        path.write_bytes(b"\xff\xfe not utf-8 \xff")
    assert site_policy_path(tmp_path) == path
    plan = build_plan(small_config())
    with pytest.raises(SiteRefusal, match=f"^cannot check this site's policy {path}"):
        enforce_site_policy(small_config(), plan["network"]["settings"], plan["data_loader"]["settings"]["model_shape"],
                            "shard:0", cwd=tmp_path)


def test_raw_fx_collaborator_start_refuses_the_operators_code_before_importing_it(tmp_path):
    assert guard_installed() is not None  # fedcontrast_fx_guard.pth, installed by pip with fedcontrast
    ws = create_workspace(tmp_path / "fed", small_config())
    plan = evil_plan(yaml.safe_load((ws / "plan" / "plan.yaml").read_text()))
    (ws / "plan" / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    (ws / "src" / "evil.py").write_text(EVIL)
    fx = Path(sys.executable).with_name("fx")
    proc = subprocess.run([str(fx), "collaborator", "start", "-n", "site_0"], cwd=ws, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 1, proc.stderr[-2000:]
    err = proc.stderr.strip()
    assert err.startswith("fedcontrast collaborator: error: this workspace is refused before anything runs: "
                          "the workspace holds Python code (") and "evil.py" in err
    assert "data_loader.template names 'src.evil.EvilLoader'" in err and len(err.splitlines()) == 1
    assert not (ws / "EVIL_RAN").exists()
    # other programs in the environment are untouched by the guard
    other = subprocess.run([sys.executable, "-c", "print('ok')"], cwd=ws, capture_output=True, text=True)
    assert other.stdout == "ok\n"


def test_the_audit_names_the_code_every_party_runs(tmp_path):
    ws = create_workspace(tmp_path / "fed", small_config())
    assert f"fedcontrast=={version('fedcontrast')}" in (ws / "requirements.txt").read_text()
    plan = yaml.safe_load((ws / "plan" / "plan.yaml").read_text())
    report = audit_plan(plan, source=str(ws), workspace=ws)
    text = format_report(report)
    assert f"fedcontrast=={version('fedcontrast')}" in text and f"here {version('fedcontrast')}" in text
    assert "torch" in text and "the plan builds only installed components" in text
    assert check_policy(report, SitePolicy()) == []
    (ws / "requirements.txt").write_text("fedcontrast==99.0\n")
    report = audit_plan(evil_plan(plan), source=str(ws), workspace=ws)
    violations = check_policy(report, SitePolicy())
    assert any("data_loader.template names 'src.evil.EvilLoader'" in v for v in violations)
    assert any("requirements.txt pins fedcontrast==99.0 but this machine runs" in v for v in violations)
    assert "NOT INSTALLED CODE" in format_report(report) and "MISMATCH" in format_report(report)


def test_raw_fx_aggregator_start_with_a_broken_plan_is_one_sentence(tmp_path):
    ws = create_workspace(tmp_path / "fed", small_config())
    plan = ws / "plan" / "plan.yaml"
    plan.write_text(plan.read_text() + "network:\n  settings: {agg_port: 1}\n")  # a key given twice
    fx = Path(sys.executable).with_name("fx")
    proc = subprocess.run([str(fx), "aggregator", "start"], cwd=ws, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    err = proc.stderr.strip()
    assert err.startswith(f"fedcontrast aggregator: error: plan {plan}") and "network" in err, err
    assert len(err.splitlines()) == 1


def test_fx_collaborator_start_refuses_a_plan_other_than_the_roster_the_sites_pinned(tmp_path, monkeypatch):
    """The sites pinned site_0, site_1 and site_2 with threshold 2 for federation hospitals-2026; the
    operator's plan leaves site_2 out, or names another federation: fx's start-up guard refuses it
    from the site's policy before any data is read, naming what differs. The plan as pinned passes."""
    from fedcontrast.openfl.guard import guard_collaborator_start

    monkeypatch.delenv(POLICY_ENV, raising=False)
    pins = {f"site_{i}": "SHA256:" + f"{i}" * 64 for i in range(3)}
    roster = ("federation: hospitals-2026\nsecure_threshold: 2\npeers:\n"
              + "".join(f"  {s}: {f}\n" for s, f in pins.items()))

    def start(config, name):
        ws = create_workspace(tmp_path / name, config)
        (ws / POLICY_FILE).write_text("require_secure_aggregation: true\n" + roster)
        guard_collaborator_start(["fx", "collaborator", "start", "-n", "site_0"], ws)

    two = small_config(secure_aggregation={"threshold": 2, "federation": "hospitals-2026"})
    with pytest.raises(PackageRefused, match=r"refuses the plan before any data is read: .*the plan's secure sum is "
                                             r"not the federation the sites pinned under peers: \(site_0, site_1, "
                                             r"site_2\): it leaves out site_2"):
        start(two, "two")
    other = small_config(clients=3, secure_aggregation={"threshold": 2, "federation": "hospitals-2025"})
    with pytest.raises(PackageRefused, match="the plan is for federation hospitals-2025 .* but this site's policy pins "
                                             "federation hospitals-2026"):
        start(other, "other")
    agreed = small_config(clients=3, secure_aggregation={"threshold": 2, "federation": "hospitals-2026"})
    with pytest.raises(PackageRefused, match=r"col_site_0.key, .* missing, and the plan uses TLS"):  # the policy
        start(agreed, "agreed")  # passed: what stops this bare workspace is the next check, its certificate
