"""Secure aggregation over a real OpenFL federation (fx aggregator + fx collaborators, mutual TLS, on
localhost): the aggregator's relay routes the protocol's messages over OpenFL's own calls and unmasks
only the sum; the result is the simulator's secure run bit for bit, with every site pinning its
peers' certificate keys in its policy; a site that never answers is dropped at the round's deadline
when min_sites allows, and named; a site whose own upload is not finite withdraws, naming why, and
the federation goes on without it. The OpenFL glue's key check: a certificate the operator's CA
minted for a site's name passes the CA check but not the site's pinned roster."""

import datetime as dt

import pytest
import torch

from fedcontrast.openfl.fx import read_workspace_config
from fedcontrast.openfl.launch import export_results, run_federation
from fedcontrast.site.roster import format_roster, read_roster

from .conftest import FEDERATION_TIMEOUT, small_config
from .test_federation import assert_same_weights, simulator_final_weights


def pin_every_site(ws, sites):
    """The workspace's site policy (every collaborator here runs in it): secure aggregation required,
    every member's certificate key pinned, as `fedcontrast site roster` prints them."""
    roster = format_roster(read_roster([ws / "cert" / "client" / f"col_{s}.crt" for s in sites]))
    (ws / "site_policy.yaml").write_text("require_secure_aggregation: true\n" + roster[roster.index("peers:"):] + "\n")


def test_secure_federation_equals_the_simulators_secure_run_and_the_plain_mean(make_workspace, tmp_path):
    config = small_config(algorithm="fedavg", secure_aggregation={"bits": 64})
    ws = make_workspace(config)
    pin_every_site(ws, ["site_0", "site_1"])
    records = run_federation(ws, timeout=FEDERATION_TIMEOUT)
    assert [r["round"] for r in records] == [1, 2]
    export_results(ws, tmp_path / "out")
    exported = torch.load(tmp_path / "out" / "final_model.pt", weights_only=True)
    secure, _ = simulator_final_weights(read_workspace_config(ws))
    assert_same_weights(exported, secure)  # the same masked sums, decoded alike: identical
    plain, _ = simulator_final_weights(read_workspace_config(ws).replace(secure_aggregation=None))
    for key, value in plain.items():  # and the plain weighted mean within float32 rounding
        assert torch.allclose(exported[key].double(), value.double(), atol=1e-5, rtol=1e-5), key
    log = (ws / "logs" / "aggregator.log").read_text()
    assert "aggregated the secure sum of site_0, site_1" in log
    for site in ("site_0", "site_1"):
        site_log = (ws / "logs" / f"{site}.log").read_text()
        assert "took part in the secure sum" in site_log
        assert "were checked against the federation's CA only" not in site_log


def test_a_site_that_never_answers_is_dropped_from_the_secure_sum_and_named(make_workspace):
    """…and left out of the later rounds: round 2's secure sum does not wait for it again (issue 37)."""
    config = small_config(algorithm="fedavg", clients=3, rounds=2, secure_aggregation={"threshold": 2})
    ws = make_workspace(config, round_timeout=20, min_sites=2)
    records = run_federation(ws, timeout=FEDERATION_TIMEOUT, collaborators=["site_0", "site_1"])
    assert [r["round"] for r in records] == [1, 2] and all(r["absent"] == ["site_2"] for r in records)
    log = (ws / "logs" / "aggregator.log").read_text()
    assert "no advert message from site_2 within 20 s; the secure sum goes on without them" in log
    assert "site site_2 dropped from later rounds after missing round 1's timeout" in log
    assert log.count("no advert message from site_2") == 1 and "no answer from site_2" not in log
    assert log.count("aggregated the secure sum of site_0, site_1") == 2
    # the one deadline it missed was round 1's: round 2's sum did not wait for it (it waited 20 s more before)
    assert "round 1: no advert message from site_2 within 20 s" in log


def test_a_site_with_a_nan_upload_withdraws_at_the_site_and_the_round_goes_on(make_workspace, test_plugins):
    """nan_upload: site_1's second-round upload is NaN. It never reaches the ring: site_1 refuses it
    itself and withdraws, naming why; the round sums site_0 and site_2 (threshold 2, min_sites 2)."""
    config = small_config(algorithm="nan_upload", clients=3, rounds=2, secure_aggregation={"threshold": 2})
    ws = make_workspace(config, round_timeout=60, min_sites=2)
    records = run_federation(ws, timeout=FEDERATION_TIMEOUT)
    assert [r["round"] for r in records] == [1, 2]
    log = (ws / "logs" / "aggregator.log").read_text()
    assert "round 2: site site_1 took no part in the secure sum: site 'site_1' uploaded" in log
    assert "NaN or infinite values" in log and "aggregated the secure sum of site_0, site_2" in log


def test_a_certificate_the_operators_ca_minted_for_a_sites_name_is_refused_by_the_pinned_roster(pki, tmp_path):
    """The operator holds the federation's CA: a certificate it mints for site_1 with a key of its own
    passes the CA check every site makes, and fails the roster the site pinned."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from fedcontrast.openfl.secure import CertificateKeys
    from fedcontrast.privacy.secagg import SecureAggregationError, fingerprint
    from fedcontrast.privacy.secagg_protocol import PinnedKeys

    cert_dir = pki["cert"]
    genuine = x509.load_pem_x509_certificate((cert_dir / "client" / "col_site_1.crt").read_bytes())
    ca_cert = next(c for c in x509.load_pem_x509_certificates((cert_dir / "cert_chain.crt").read_bytes())
                   if c.subject == genuine.issuer)
    ca_key = serialization.load_pem_private_key(next(p for p in cert_dir.rglob("*.key")
                                                     if _signs(p, ca_cert)).read_bytes(), None)
    impostor = ec.generate_private_key(ec.SECP384R1())
    now = dt.datetime.now(dt.timezone.utc)
    minted = (x509.CertificateBuilder().subject_name(genuine.subject).issuer_name(ca_cert.subject)
              .public_key(impostor.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - dt.timedelta(minutes=1)).not_valid_after(now + dt.timedelta(days=1))
              .add_extension(genuine.extensions.get_extension_for_class(x509.SubjectAlternativeName).value, False)
              .sign(ca_key, hashes.SHA384()))
    pem = minted.public_bytes(serialization.Encoding.PEM).decode()
    check = CertificateKeys(cert_dir / "cert_chain.crt")
    assert fingerprint(check("site_1", pem)) == fingerprint(impostor.public_key())  # the CA check lets it through
    pinned = PinnedKeys(check, {"site_1": fingerprint(genuine.public_key())}, required=True)
    with pytest.raises(SecureAggregationError, match="site site_1's key SHA256:.* is not the key pinned for it"):
        pinned("site_1", pem)
    assert fingerprint(pinned("site_1", genuine.public_bytes(serialization.Encoding.PEM).decode())) == \
        fingerprint(genuine.public_key())


def _signs(key_path, ca_cert) -> bool:
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), None)
    except (ValueError, TypeError):
        return False
    return key.public_key().public_numbers() == ca_cert.public_key().public_numbers()


def test_an_openfl_site_gives_the_protocol_the_roster_its_policy_pins(tmp_path):
    """Defence in depth on OpenFL: the collaborator's secure-aggregation channel hands the roster its
    policy pins (members, threshold) to the protocol, which refuses a plan that differs (here one that
    got past the policy check) before the site sends anything."""
    from types import SimpleNamespace

    import numpy as np
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from fedcontrast.openfl.secure import OpenFLChannel
    from fedcontrast.privacy.policy import SitePolicy
    from fedcontrast.privacy.secagg import SecureAggregationError

    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "site_0")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + dt.timedelta(days=1)).sign(key, hashes.SHA384()))
    (tmp_path / "col.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    (tmp_path / "col.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    sent = []
    client = SimpleNamespace(use_tls=True, require_client_auth=True, private_key=str(tmp_path / "col.key"),
                             certificate=str(tmp_path / "col.crt"), root_certificate=str(tmp_path / "col.crt"),
                             send_local_task_results=lambda *args: sent.append(args))
    policy = SitePolicy(require_secure_aggregation=True, secure_threshold=2,
                        peers={f"site_{i}": "SHA256:" + f"{i}" * 64 for i in range(3)})
    col = SimpleNamespace(client=client, federation_uuid="f",
                          task_runner=SimpleNamespace(data_loader=SimpleNamespace(site_policy=policy)))
    config = small_config(secure_aggregation={"threshold": 2})  # site_0 and site_1: site_2 left out
    with pytest.raises(SecureAggregationError, match=r"^the plan's secure sum \(site_0, site_1; threshold 2\) is not "
                                                     r"the roster this site's policy pins \(site_0, site_1, site_2; "
                                                     r"threshold 2\)"):
        OpenFLChannel(col).run("site_0", 1, np.zeros(4, dtype=np.float32), config)
    assert not sent
