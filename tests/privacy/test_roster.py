"""`fedcontrast site roster`: every member's key fingerprint from certificates, SuperNode keys and the
operator's folders, as one table and a `peers:` block a site policy takes as is."""

from __future__ import annotations

import datetime as dt
import json

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fedcontrast.cli import main
from fedcontrast.privacy.policy import SitePolicy
from fedcontrast.privacy.secagg import fingerprint


def certificate(name, key):
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
            .sign(key, hashes.SHA256()))


def openssh(key):
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)


def test_the_roster_reads_every_source_and_its_block_is_a_policy(tmp_path, capsys):
    keys = {s: ec.generate_private_key(ec.SECP384R1()) for s in ("hosp1", "hosp2", "hosp3")}
    ws = tmp_path / "ws" / "cert" / "client"
    ws.mkdir(parents=True)
    (ws / "col_hosp1.crt").write_bytes(certificate("hosp1", keys["hosp1"]).public_bytes(serialization.Encoding.PEM))
    flower = tmp_path / "flower"
    flower.mkdir()
    (flower / "sites.json").write_text(json.dumps({"hosp2": {"node_id": 1, "fingerprint": "x",
                                                              "public_key": openssh(keys["hosp2"]).decode()}}))
    (tmp_path / "h3.pub").write_bytes(openssh(keys["hosp3"]) + b"\n")
    assert main(["site", "roster", str(tmp_path / "ws"), str(flower), str(tmp_path / "h3.pub"), "--name", "hosp3"]) == 0
    out = capsys.readouterr().out
    for site, key in keys.items():
        assert f"{site}  {fingerprint(key.public_key())}" in out
    block = yaml.safe_load(out[out.index("peers:"):])
    policy = SitePolicy(require_secure_aggregation=True, **block)
    assert policy.peers == {s: fingerprint(k.public_key()) for s, k in keys.items()}


def test_two_sources_that_disagree_about_a_key_are_refused(tmp_path, capsys):
    a, b = (tmp_path / "a" / "hosp1.pub", tmp_path / "b" / "hosp1.pub")
    for path in (a, b):
        path.parent.mkdir()
        path.write_bytes(openssh(ec.generate_private_key(ec.SECP384R1())))
    assert main(["site", "roster", str(a.parent), str(b.parent)]) != 0
    assert "hosp1 has two different keys" in capsys.readouterr().err


@pytest.mark.parametrize("content", [b"not a key", b""])
def test_a_file_that_is_no_key_is_one_sentence(tmp_path, capsys, content):
    (tmp_path / "x.pub").write_bytes(content)
    assert main(["site", "roster", str(tmp_path / "x.pub")]) != 0
    err = capsys.readouterr().err
    assert "is no certificate, public key or unencrypted private key" in err and "Traceback" not in err


def test_a_policy_fingerprint_that_is_malformed_is_refused():
    from fedcontrast.errors import ConfigError

    with pytest.raises(ConfigError, match="hosp2's fingerprint must be SHA256: and 64 hex digits"):
        SitePolicy(peers={"hosp2": "SHA256:abc"})
