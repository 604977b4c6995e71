"""The site's trust anchor is the CA it confirmed at join (issue 34): ``site import-cert`` refuses, in one
sentence and installing nothing, a chain from any other CA — even one carrying a certificate for the
site's own key — and nothing else replaces ``cert/cert_chain.crt`` unnoticed."""

import zipfile

import pytest

from fedcontrast.cli import main
from fedcontrast.deploy.anchor import PIN_FILE, fingerprint_of_chain, pin_ca, read_pin, shown
from fedcontrast.deploy.common import DeploymentError
from fedcontrast.openfl.doctor import FAIL, check_certificate
from fedcontrast.openfl.institution_flows import import_certificate, join
from fedcontrast.openfl.plan import build_plan

from .test_deploy import deployment, images, issue, make_ca, pem, site_workspace
from .test_package_trust import write_package


def signed_package(path, cert, *chain):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("client/col_hosp1.crt", pem(cert))
        z.writestr("cert_chain.crt", b"".join(pem(c) for c in chain))
    return path


def pinned_site(tmp_path):
    """hosp1 waiting for its certificate, having pinned the federation's CA at join."""
    ca = make_ca("federation CA")
    key, own = issue(ca, "hosp1")
    ws = site_workspace(tmp_path, ca[1], key, own)
    (ws / "cert" / "client" / "col_hosp1.crt").unlink()
    pin_ca(ws / "cert", *fingerprint_of_chain(pem(ca[1]), "chain"), "confirmed at join")
    return ca, key, own, ws


def test_import_cert_refuses_a_chain_from_another_ca_in_one_sentence(tmp_path, capsys):
    ca, key, own, ws = pinned_site(tmp_path)
    chain_before = (ws / "cert" / "cert_chain.crt").read_bytes()
    other = make_ca("other federation CA")
    _, foreign = issue(other, "hosp1", key=key)  # for this site's own key and name, from another federation's CA
    signed = signed_package(tmp_path / "agg_to_col_hosp1_signed_cert.zip", foreign, other[1])
    assert main(["site", "import-cert", str(signed), "--workspace", str(ws)]) == 2
    err = capsys.readouterr().err.strip()
    ours = shown(fingerprint_of_chain(pem(ca[1]), "x")[0])
    theirs = shown(fingerprint_of_chain(pem(other[1]), "x")[0])
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err == (f"fedcontrast: error: the CA chain in agg_to_col_hosp1_signed_cert.zip is from another CA "
                   f"(CN=other federation CA, {theirs}) than the federation's CA this site pinned at join "
                   f"(CN=federation CA, {ours}, in {ws / 'cert' / PIN_FILE}): not installed; a site trusts only the CA "
                   "it confirmed at join — ask the operator for the package signed by the federation's CA")
    assert (ws / "cert" / "cert_chain.crt").read_bytes() == chain_before  # nothing replaced
    assert not (ws / "cert" / "client" / "col_hosp1.crt").exists()
    # the federation's chain with a foreign CA appended (every certificate of the file is a root to gRPC)
    (tmp_path / "b").mkdir()
    appended = signed_package(tmp_path / "b" / "agg_to_col_hosp1_signed_cert.zip", own, ca[1], other[1])
    with pytest.raises(DeploymentError, match="holds 2 self-signed CA certificates"):
        import_certificate(ws, appended, log=lambda m: None)
    assert (ws / "cert" / "cert_chain.crt").read_bytes() == chain_before


def test_the_pinned_ca_is_accepted_and_a_chain_replaced_by_hand_is_named(tmp_path):
    ca, key, own, ws = pinned_site(tmp_path)
    signed = signed_package(tmp_path / "agg_to_col_hosp1_signed_cert.zip", own, ca[1])
    from fedcontrast.openfl import institution_flows

    def fx_import(workspace, args, **kw):  # what `fx collaborator certify --import` does with the package
        with zipfile.ZipFile(args[-1]) as z:
            (workspace / "cert" / "client" / "col_hosp1.crt").write_bytes(z.read("client/col_hosp1.crt"))
            (workspace / "cert" / "cert_chain.crt").write_bytes(z.read("cert_chain.crt"))
        return ""

    institution_flows.run_fx, real = fx_import, institution_flows.run_fx
    try:
        assert import_certificate(ws, signed, log=lambda m: None) == "hosp1"
    finally:
        institution_flows.run_fx = real
    assert check_certificate(ws, "hosp1").status == "OK"
    other = make_ca("other federation CA")
    (ws / "cert" / "cert_chain.crt").write_bytes(pem(other[1]))  # replaced by hand
    check = check_certificate(ws, "hosp1")
    assert check.status == FAIL and "is from another CA (CN=other federation CA" in check.message
    assert "it was replaced after the join" in check.message


def test_join_pins_the_ca_it_confirmed_and_refuses_another(tmp_path, capsys):
    ca, other = make_ca("federation CA"), make_ca("other federation CA")
    ours = shown(fingerprint_of_chain(pem(ca[1]), "x")[0])
    package = write_package(tmp_path / "fed.zip", build_plan(deployment()), {"cert/cert_chain.crt": pem(other[1])})
    data = images(tmp_path / "data", {"neg": 3, "pos": 3})
    with pytest.raises(DeploymentError, match=r"fed.zip is refused, nothing was unpacked: its CA \(CN=other "
                                              r"federation CA, SHA256:[0-9a-f]{64}\) is not the federation's CA whose "
                                              "fingerprint you were given"):
        join(package, name="hosp1", data=data, into=tmp_path / "site", ca_fingerprint=ours)
    assert not (tmp_path / "site" / "fed").exists()
    assert main(["site", "join", str(package), "--name", "hosp1", "--data", str(data), "--into",
                 str(tmp_path / "site"), "--ca-fingerprint", "SHA256:12"]) == 2
    assert "'SHA256:12' is not a SHA-256 fingerprint" in capsys.readouterr().err
    asked = []
    with pytest.raises(DeploymentError, match="was not confirmed"):
        join(package, name="hosp1", data=data, into=tmp_path / "site",
             confirm_ca=lambda subject, fp: asked.append((subject, fp)) or False)
    assert asked == [("CN=other federation CA", fingerprint_of_chain(pem(other[1]), "x")[0])]
    assert read_pin(tmp_path) is None
