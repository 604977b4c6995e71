"""The parties' commands of a cross-silo deployment, without a network: what each refuses (with one
sentence, before anything is unpacked or sent), and the certificate checks a site makes. The whole
flow across hosts runs in test_crosssilo.py."""

import datetime as dt
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from PIL import Image

from fedcontrast.cli import main
from fedcontrast.config import DataSchema, RunConfig
from fedcontrast.data.schema import folder_fingerprint
from fedcontrast.deploy.common import DeploymentError, secrets_in
from fedcontrast.errors import DataError
from fedcontrast.openfl.institution_flows import join, package_config, verify_site_certificate
from fedcontrast.openfl.operator_flows import request_site, sign_request
from fedcontrast.openfl.plan import create_workspace

CLASSES = ("neg", "pos")


def images(root: Path, counts: dict[str, int], seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    for cls, n in counts.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), "L").save(root / cls / f"{i}.png")
    return root


def package(tmp_path: Path, config: RunConfig, name: str = "fed") -> Path:
    """A workspace package as `fx workspace export` lays it out (the plan files are what matters here)."""
    ws = create_workspace(tmp_path / "operator" / name, config)
    archive = tmp_path / f"{name}.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for path in (ws / "plan").iterdir():
            z.write(path, f"plan/{path.name}")
    return archive


def deployment(sites=("hosp1", "hosp2"), **changes) -> RunConfig:
    schema = DataSchema((1, 16, 16), CLASSES)
    return RunConfig(algorithm="fedavg", dataset="imagefolder", sites=sites, clients=len(sites), data_schema=schema,
                     **changes)


def test_join_refuses_before_unpacking_anything(tmp_path):
    archive = package(tmp_path, deployment())
    data = images(tmp_path / "data", {"neg": 3, "pos": 3})
    site_dir = tmp_path / "site"
    with pytest.raises(DeploymentError, match=r"'hosp9' is not a site of this plan \(hosp1, hosp2\)"):
        join(archive, name="hosp9", data=data, into=site_dir)
    with pytest.raises(DataError, match=r"class folder\(s\) cat .* not among the plan's classes"):
        join(archive, name="hosp1", data=images(tmp_path / "cats", {"neg": 2, "cat": 2}), into=site_dir)
    with pytest.raises(DeploymentError, match="no data schema"):
        join(package(tmp_path, RunConfig(clients=2), "demo"), name="site_0", data=data, into=site_dir)
    bogus = tmp_path / "bogus.zip"
    with zipfile.ZipFile(bogus, "w") as z:
        z.writestr("readme.txt", "hello")
    with pytest.raises(DeploymentError, match="is not a fedcontrast workspace package"):
        join(bogus, name="hosp1", data=data, into=site_dir)
    latin1 = tmp_path / "latin1.zip"
    with zipfile.ZipFile(latin1, "w") as z:
        z.writestr("plan/plan.yaml", "# caf\xe9\n".encode("latin-1"))  # not UTF-8
    with pytest.raises(DeploymentError, match="is not a fedcontrast workspace package"):
        join(latin1, name="hosp1", data=data, into=site_dir)
    assert not site_dir.exists() or not any(site_dir.iterdir())  # nothing unpacked


def test_join_checks_the_public_folder_against_the_plan(tmp_path):
    public = images(tmp_path / "public", {"neg": 2, "pos": 2}, seed=5)
    config = deployment(public_data={"sha256": folder_fingerprint(public)})
    archive = package(tmp_path, config)
    data = images(tmp_path / "data", {"neg": 3})
    with pytest.raises(DeploymentError, match="pass --public FOLDER"):
        join(archive, name="hosp1", data=data, into=tmp_path / "site")
    other = images(tmp_path / "other", {"neg": 2, "pos": 2}, seed=6)
    with pytest.raises(DeploymentError, match=rf"{other} has fingerprint {folder_fingerprint(other)[:16]}… but the "
                                              rf"plan expects {folder_fingerprint(public)[:16]}…"):
        join(archive, name="hosp1", data=data, public=other, into=tmp_path / "site")
    assert package_config(archive).public_data.sha256 == folder_fingerprint(public)


# --- certificates --------------------------------------------------------------------------------
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(cn: str):
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(key, hashes.SHA256()))
    return key, cert


def issue(ca, cn: str, key=None):
    ca_key, ca_cert = ca
    key = key or rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(2).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def pem(obj) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                             serialization.NoEncryption())


def site_workspace(tmp_path: Path, chain, key, cert) -> Path:
    ws = tmp_path / "ws"
    (ws / "cert" / "client").mkdir(parents=True)
    (ws / "cert" / "cert_chain.crt").write_bytes(pem(chain))
    (ws / "cert" / "client" / "col_hosp1.key").write_bytes(pem(key))
    (ws / "cert" / "client" / "col_hosp1.crt").write_bytes(pem(cert))
    return ws


def test_site_certificate_must_fit_its_key_and_the_federations_ca(tmp_path):
    ca = make_ca("federation CA")
    key, cert = issue(ca, "hosp1")
    verify_site_certificate(site_workspace(tmp_path / "ok", ca[1], key, cert), "hosp1")
    _, someone_elses = issue(ca, "hosp1")  # signed for another request: another key
    with pytest.raises(DeploymentError,
                       match=r"col_hosp1.crt \(CN=hosp1\) does not belong to the private key .*col_hosp1.key"):
        verify_site_certificate(site_workspace(tmp_path / "other_key", ca[1], key, someone_elses), "hosp1")
    _, foreign = issue(make_ca("another CA"), "hosp1", key=key)
    with pytest.raises(DeploymentError, match=r"col_hosp1.crt \(CN=hosp1\) is issued by .*, not by the federation's "
                                              r"CA in .*cert_chain.crt"):
        verify_site_certificate(site_workspace(tmp_path / "other_ca", ca[1], key, foreign), "hosp1")


def test_request_packages_are_read_and_refused_when_they_carry_a_key_or_another_site(tmp_path):
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    csr = x509.CertificateSigningRequestBuilder().subject_name(_name("hosp2")).sign(key, hashes.SHA384())
    good = tmp_path / "col_hosp2_to_agg_cert_request.zip"
    with zipfile.ZipFile(good, "w") as z:
        z.writestr("col_hosp2.csr", csr.public_bytes(serialization.Encoding.PEM))
    site, digest = request_site(good)
    assert site == "hosp2" and len(digest) == 96 and not secrets_in(good)
    leaky = tmp_path / "leaky.zip"
    with zipfile.ZipFile(leaky, "w") as z:
        z.writestr("col_hosp2.csr", csr.public_bytes(serialization.Encoding.PEM))
        z.writestr("col_hosp2.key", pem(key))
    assert secrets_in(leaky) == ["col_hosp2.key"]
    with pytest.raises(DeploymentError, match="not a certificate request package"):
        request_site(leaky)
    ws = create_workspace(tmp_path / "op", deployment(sites=("hosp1", "hosp3")))
    with pytest.raises(DeploymentError, match=r"certificate for 'hosp2', which is not a site of this plan"):
        sign_request(ws, good, confirm=lambda s, h: True)
    ws2 = create_workspace(tmp_path / "op2", deployment(sites=("hosp1", "hosp2")))
    with pytest.raises(DeploymentError, match="no certificate authority yet"):
        sign_request(ws2, good, confirm=lambda s, h: True)
    (ws2 / "cert" / "ca").mkdir(parents=True)
    (ws2 / "cert" / "ca" / "signing-ca.crt").write_text("")
    (ws2 / "cert" / "client").mkdir(parents=True)
    (ws2 / "cert" / "client" / "col_hosp1.csr").write_text("")  # fx would sign the first .csr it finds
    with pytest.raises(DeploymentError, match="unsigned request left"):
        sign_request(ws2, good, confirm=lambda s, h: True)
    (ws2 / "cert" / "client" / "col_hosp1.csr").unlink()
    with pytest.raises(DeploymentError, match="did not match"):
        sign_request(ws2, good, confirm=lambda s, h: False)


# --- workspace create from a schema --------------------------------------------------------------
def test_operator_makes_a_plan_without_any_data(tmp_path, capsys):
    ws = tmp_path / "fed"
    assert main(["workspace", "create", "--algorithm", "moon", "--sites", "hosp1,hosp2,hosp3",
                 "--input-shape", "3x24x24", "--classes", "normal,pneumonia,covid", "--address", "agg.example.org",
                 "--round-timeout", "600", "--min-sites", "2", str(ws)]) == 0
    plan = yaml.safe_load((ws / "plan" / "plan.yaml").read_text())
    run = RunConfig.from_dict(plan["task_runner"]["settings"]["run_config"])
    assert run.data_schema.input_shape == (3, 24, 24) and run.data_schema.classes == ("normal", "pneumonia", "covid")
    assert run.sites == ("hosp1", "hosp2", "hosp3") and run.data_root is None
    assert plan["aggregator"]["settings"]["model_shape"] == {"in_channels": 3, "image_size": 24, "num_classes": 3}
    assert plan["aggregator"]["settings"]["round_timeout"] == 600 and plan["aggregator"]["settings"]["min_sites"] == 2
    assert yaml.safe_load((ws / "plan" / "cols.yaml").read_text())["collaborators"] == ["hosp1", "hosp2", "hosp3"]
    assert all(line.startswith("#") for line in (ws / "plan" / "data.yaml").read_text().splitlines())
    assert "fedcontrast ca init" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "imagefolder", "--collaborators", "2"], "pass --input-shape C×H×W and --classes"),
    (["--input-shape", "1x32x32", "--sites", "a,b"], "needs both --input-shape"),
    (["--input-shape", "1x32", "--classes", "2", "--sites", "a,b"], "CHANNELSxHEIGHTxWIDTH"),
    (["--input-shape", "1x32x32", "--classes", "2"], "--sites NAME,NAME"),
    (["--algorithm", "fedpcl", "--input-shape", "1x16x16", "--classes", "2", "--sites", "a,b"],
     "fedpcl in a deployment needs frozen backbones"),
    (["--input-shape", "1x16x16", "--classes", "2", "--sites", "a,b", "--min-sites", "3"], "min_sites"),
])
def test_bad_deployment_settings_are_one_sentence(tmp_path, capsys, argv, message):
    assert main(["workspace", "create", *argv, str(tmp_path / "ws")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_fedpcl_backbones_are_pretrained_on_the_public_folder_and_hashed(tmp_path):
    public = images(tmp_path / "public", {"neg": 6, "pos": 6})
    ws = tmp_path / "fed"
    assert main(["workspace", "create", "--algorithm", "fedpcl", "--sites", "hosp1,hosp2", "--input-shape", "1x16x16",
                 "--classes", "neg,pos", "--public-data", str(public), "--set", "fedpcl.pretrain_epochs=1",
                 str(ws)]) == 0
    run = RunConfig.from_dict(yaml.safe_load((ws / "plan" / "plan.yaml").read_text())["task_runner"]["settings"]
                              ["run_config"])
    settings = run.hyperparameters["fedpcl"]
    import hashlib

    assert settings["backbone_files"] == ["save/backbones/backbone_0_simple_cnn.pt"]
    assert settings["backbone_sha256"] == [
        hashlib.sha256((ws / settings["backbone_files"][0]).read_bytes()).hexdigest()]
    assert run.public_data.sha256 == folder_fingerprint(public) and (ws / "public").resolve() == public.resolve()
    assert run.data_schema.mean is not None  # measured on the public folder: every party normalises alike
    from fedcontrast.algorithms.fedpcl import check_backbone_files

    (ws / settings["backbone_files"][0]).write_bytes(b"tampered")
    with pytest.raises(DataError, match="has SHA-256 .* but the plan expects"):
        check_backbone_files(settings["backbone_files"], settings["backbone_sha256"], base_dir=ws)


def test_a_workspace_with_results_is_not_exported(tmp_path):
    from fedcontrast.openfl.operator_flows import export_workspace

    ws = create_workspace(tmp_path / "fed", deployment())
    (ws / "save" / "rounds.jsonl").write_text('{"round": 1}\n')  # every site's figures: not for the others
    with pytest.raises(DeploymentError, match="holds results of a run .*rounds.jsonl"):
        export_workspace(ws)
    assert not (ws / "fed.zip").exists()


# --- one certificate per site: the name is read from the CSR, signed once, revoked on record -------
def csr_package(directory: Path, file_site: str, *cns: str, key=None, san: list[str] | None = None) -> Path:
    """A request package laid out as `fx collaborator generate-cert-request` makes it, named for
    ``file_site``, whose CSR's subject carries the common names ``cns`` (made here with `cryptography`)."""
    key = key or rsa.generate_private_key(public_exponent=65537, key_size=2048)
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn) for cn in cns]))
    if san is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in san]), critical=False)
    directory.mkdir(parents=True, exist_ok=True)
    archive = directory / f"col_{file_site}_to_agg_cert_request.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr(f"col_{file_site}.csr", builder.sign(key, hashes.SHA384()).public_bytes(serialization.Encoding.PEM))
    return archive


def operator_workspace(tmp_path: Path, sites=("hosp1", "hosp2")) -> Path:
    """An operator's workspace with a CA where `fx workspace certify` puts it (`fx collaborator
    certify` signs with cert/ca/signing-ca*)."""
    ws = create_workspace(tmp_path / "op", deployment(sites=sites))
    ca_key, ca_cert = make_ca("federation CA")
    (ws / "cert" / "ca" / "signing-ca" / "private").mkdir(parents=True)
    (ws / "cert" / "ca" / "signing-ca" / "private" / "signing-ca.key").write_bytes(pem(ca_key))
    (ws / "cert" / "ca" / "signing-ca.crt").write_bytes(pem(ca_cert))
    (ws / "cert" / "cert_chain.crt").write_bytes(pem(ca_cert))
    return ws


def test_a_request_named_for_one_site_whose_csr_names_another_is_not_signed(tmp_path, capsys):
    ws = operator_workspace(tmp_path)
    impostor = csr_package(tmp_path / "mail", "hosp1", "hosp2")  # the file says hosp1, the CSR says CN=hosp2
    asked = []
    with pytest.raises(DeploymentError) as info:
        sign_request(ws, impostor, confirm=lambda s, h: asked.append(s) or True, site="hosp1", log=lambda m: None)
    assert str(info.value) == (
        "refused to sign col_hosp1_to_agg_cert_request.zip: its file name is for 'hosp1', the CSR inside is "
        "col_hosp1.csr (for 'hosp1'), the CSR's subject is CN=hosp2 ('hosp2') and you are signing it for 'hosp1' — "
        "they must all name the same site; ask that site for its own request (`fedcontrast site join ... --name NAME` "
        "makes it)")
    assert asked == [] and not list((ws / "cert" / "client").glob("*"))  # nothing asked, nothing signed
    assert main(["ca", "sign", str(ws), str(impostor), "--site", "hosp1", "--yes"]) == 2
    out, err = capsys.readouterr()
    assert "the CSR's subject is CN=hosp2" in err and "signed" not in out
    with pytest.raises(SystemExit):  # the operator says whom they sign for
        main(["ca", "sign", str(ws), str(impostor), "--yes"])
    assert "--site" in capsys.readouterr().err
    with pytest.raises(DeploymentError, match=r"the CSR's subject is CN=hosp2 \('hosp2'\) — they must all name"):
        request_site(impostor)  # the site's own view of such a package too
    honest = csr_package(tmp_path / "honest", "hosp1", "hosp1", san=["hosp1"])
    with pytest.raises(DeploymentError, match=r"CN=hosp1 \('hosp1'\) and you are signing it for 'hosp2' — they must"):
        sign_request(ws, honest, confirm=lambda s, h: True, site="hosp2")
    with pytest.raises(DeploymentError, match=r"has 2 common names in its subject \(CN=hosp2,CN=hosp1\)"):
        sign_request(ws, csr_package(tmp_path / "two", "hosp1", "hosp1", "hosp2"), confirm=lambda s, h: True,
                     site="hosp1")
    with pytest.raises(DeploymentError, match=r"\(CN=hosp1\) also names hosp2 in its subject alternative name"):
        sign_request(ws, csr_package(tmp_path / "san", "hosp1", "hosp1", san=["hosp1", "hosp2"]),
                     confirm=lambda s, h: True, site="hosp1")
    assert not list((ws / "cert" / "client").glob("*"))


def test_a_second_certificate_for_a_site_is_signed_only_after_the_first_is_revoked(tmp_path, capsys):
    import json
    import re

    ws = operator_workspace(tmp_path)
    issued = ws / "cert" / "client" / "col_hosp1.crt"
    first = sign_request(ws, csr_package(tmp_path / "a", "hosp1", "hosp1", san=["hosp1"]), confirm=lambda s, h: True,
                         site="hosp1", log=lambda m: None)
    original = issued.read_bytes()
    cert = x509.load_pem_x509_certificate(original)
    assert first.site == "hosp1" and first.signed == ws / "agg_to_col_hosp1_signed_cert.zip"
    assert (first.serial, first.sha256) == (f"{cert.serial_number:x}", cert.fingerprint(hashes.SHA256()).hex())
    again = csr_package(tmp_path / "b", "hosp1", "hosp1")  # a new key: the site joined again
    with pytest.raises(DeploymentError, match=re.escape(
            f"hosp1 already has a certificate signed by this CA ({issued}, serial {first.serial}, valid until ")
            + r".*revoke it first: `fedcontrast ca revoke " + re.escape(f"{ws} hosp1 --reason TEXT`")):
        sign_request(ws, again, confirm=lambda s, h: True, site="hosp1")
    assert issued.read_bytes() == original

    with pytest.raises(SystemExit):
        main(["ca", "revoke", str(ws), "hosp1"])  # a revocation says why
    capsys.readouterr()
    assert main(["ca", "revoke", str(ws), "hosp1", "--reason", "laptop  stolen"]) == 0
    assert f"revoked hosp1's certificate (serial {first.serial}, SHA-256 {first.sha256})" in capsys.readouterr().out
    [record] = [json.loads(line) for line in (ws / "cert" / "revoked.jsonl").read_text().splitlines()]
    assert {k: record[k] for k in ("name", "serial", "sha256", "subject", "reason")} == {
        "name": "hosp1", "serial": first.serial, "sha256": first.sha256, "subject": "CN=hosp1",
        "reason": "laptop stolen"}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", record["revoked_at"])
    assert (ws / "cert" / "revoked" / f"col_hosp1-{first.serial}.crt").read_bytes() == original
    assert not issued.exists()

    assert main(["ca", "sign", str(ws), str(again), "--site", "hosp1", "--yes"]) == 0
    out = capsys.readouterr().out
    renewed = x509.load_pem_x509_certificate(issued.read_bytes())
    assert f"its CSR is for CN=hosp1 (the site hosp1 you sign for); SHA-384 hash {request_site(again)[1]}" in out
    assert f"signed the certificate of hosp1 (CN=hosp1, serial {renewed.serial_number:x}, SHA-256 " in out
    assert renewed.serial_number != cert.serial_number
    assert yaml.safe_load((ws / "plan" / "cols.yaml").read_text())["collaborators"].count("hosp1") == 1
    assert main(["ca", "revoke", str(ws), "hosp2", "--reason", "test"]) == 2  # nothing signed for hosp2 to revoke
    assert "holds no certificate for hosp2 to revoke" in capsys.readouterr().err


def test_a_revoked_key_is_never_signed_again_under_any_name(tmp_path, capsys):
    """Issue 46: after `ca revoke`, the same request (the revoked key) was signed again without a word.
    The revocation record keeps the revoked public key; a request carrying it is refused in one
    sentence, under the same name or another, also for revocations recorded before (from the revoked
    certificate kept in cert/revoked/). A new key is signed."""
    import json
    import re

    ws = operator_workspace(tmp_path)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    first = csr_package(tmp_path / "a", "hosp1", "hosp1", key=key)
    sign_request(ws, first, confirm=lambda s, h: True, site="hosp1", log=lambda m: None)
    assert main(["ca", "revoke", str(ws), "hosp1", "--reason", "key lost with the laptop"]) == 0
    [record] = [json.loads(line) for line in (ws / "cert" / "revoked.jsonl").read_text().splitlines()]
    from fedcontrast.privacy.secagg import fingerprint

    revoked = fingerprint(key.public_key())
    assert record["public_key"] == revoked
    said = (re.escape(f"refused to sign col_hosp1_to_agg_cert_request.zip: its public key {revoked} is the key of "
                      "hosp1's certificate revoked on ")
            + r"\d{4}-\d\d-\d\d \(key lost with the laptop\), and a revoked key is never signed again")
    capsys.readouterr()
    assert main(["ca", "sign", str(ws), str(first), "--site", "hosp1", "--yes"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(said, err), err
    assert not (ws / "cert" / "client" / "col_hosp1.crt").exists()
    with pytest.raises(DeploymentError, match=r"its public key .* is the key of hosp1's certificate revoked"):
        sign_request(ws, csr_package(tmp_path / "b", "hosp2", "hosp2", key=key), confirm=lambda s, h: True,
                     site="hosp2")  # the same key for another site
    (ws / "cert" / "revoked.jsonl").write_text(json.dumps({k: v for k, v in record.items() if k != "public_key"})
                                               + "\n")  # recorded before the key was
    with pytest.raises(DeploymentError, match=re.escape(f"its public key {revoked} is the key of hosp1's")):
        sign_request(ws, first, confirm=lambda s, h: True, site="hosp1")
    renewed = sign_request(ws, csr_package(tmp_path / "c", "hosp1", "hosp1"), confirm=lambda s, h: True,
                           site="hosp1", log=lambda m: None)  # a new key: signed
    assert renewed.site == "hosp1" and (ws / "cert" / "client" / "col_hosp1.crt").exists()


def test_a_site_does_not_install_a_certificate_issued_for_another_name(tmp_path):
    from fedcontrast.openfl.doctor import FAIL, check_certificate
    from fedcontrast.openfl.institution_flows import import_certificate

    ca = make_ca("federation CA")
    key, own = issue(ca, "hosp1")
    ws = site_workspace(tmp_path, ca[1], key, own)
    (ws / "cert" / "client" / "col_hosp1.crt").unlink()  # hosp1 waits for its certificate
    _, for_hosp2 = issue(ca, "hosp2", key=key)  # the federation's CA signed CN=hosp2 for this site's key
    signed = tmp_path / "agg_to_col_hosp1_signed_cert.zip"
    with zipfile.ZipFile(signed, "w") as z:
        z.writestr("client/col_hosp1.crt", pem(for_hosp2))
        z.writestr("cert_chain.crt", pem(ca[1]))
    with pytest.raises(DeploymentError) as info:
        import_certificate(ws, signed, log=lambda m: None)
    assert str(info.value).startswith("agg_to_col_hosp1_signed_cert.zip holds a certificate issued for hosp2 "
                                      f"(CN=hosp2), but this site is hosp1 (its key {ws / 'cert' / 'client'}")
    assert not (ws / "cert" / "client" / "col_hosp1.crt").exists()  # nothing installed
    (ws / "cert" / "client" / "col_hosp1.crt").write_bytes(pem(for_hosp2))  # put in place by hand
    with pytest.raises(DeploymentError, match=r"col_hosp1.crt \(CN=hosp2\) is issued for hosp2, not for hosp1"):
        verify_site_certificate(ws, "hosp1")
    check = check_certificate(ws, "hosp1")  # `fedcontrast site start` and the doctor
    assert check.status == FAIL and "is issued for hosp2, not for hosp1" in check.message


def test_a_certificate_refused_after_the_import_is_not_left_installed(tmp_path):
    """Issue 21 point 9: the certificate fits the site's name but not its key (signed from another
    request): fx installs it, the check refuses it, and the site's files are as they were."""
    from fedcontrast.openfl.institution_flows import import_certificate

    ca = make_ca("federation CA")
    key, own = issue(ca, "hosp1")
    ws = site_workspace(tmp_path, ca[1], key, own)
    (ws / "cert" / "client" / "col_hosp1.crt").unlink()  # hosp1 waits for its certificate
    chain_before = (ws / "cert" / "cert_chain.crt").read_bytes()
    _, other_key_cert = issue(ca, "hosp1")  # CN=hosp1, but for a key this site does not hold
    signed = tmp_path / "agg_to_col_hosp1_signed_cert.zip"
    with zipfile.ZipFile(signed, "w") as z:
        z.writestr("client/col_hosp1.crt", pem(other_key_cert))
        z.writestr("cert_chain.crt", pem(make_ca("another CA")[1]))
    with pytest.raises(DeploymentError, match="does not belong to the private key"):
        import_certificate(ws, signed, log=lambda m: None)
    assert not (ws / "cert" / "client" / "col_hosp1.crt").exists()
    assert (ws / "cert" / "cert_chain.crt").read_bytes() == chain_before
