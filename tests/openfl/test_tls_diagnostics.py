"""TLS mistakes end at once with one sentence naming the certificate and the cause (which CA, which
name, which date) instead of ~30 identical "handshake failed" retries: a site's certificate from
another CA or for another key, an aggregator certificate from another CA, for another name or expired,
an aggregator refusing the site's certificate, and an aggregator started without a certificate for
its plan's address."""

import datetime as dt
import socket
import ssl
import subprocess
import threading
import time
from functools import partial
from types import SimpleNamespace

import grpc
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fedcontrast.deploy.certificates import check_aggregator_certificate, check_own_certificate
from fedcontrast.errors import ConfigError
from fedcontrast.openfl.collaborator import BoundedRetry, diagnose_handshake
from fedcontrast.openfl.components import SafeAggregator, SafeCollaborator
from fedcontrast.openfl.enrolment import check_enrolled_certificates
from fedcontrast.openfl.fx import fx_executable
from fedcontrast.openfl.plan import build_plan, create_workspace
from fedcontrast.openfl.protocol import CollaboratorStopped
from fedcontrast.openfl.startup_checks import check_aggregator_plan

from .conftest import run_collaborator, small_config

NOW = dt.datetime.now(dt.timezone.utc)


def make_ca(name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(NOW - dt.timedelta(days=10))
            .not_valid_after(NOW + dt.timedelta(days=300))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(key, hashes.SHA256()))
    return key, cert


def issue(ca, name: str, *, days=(-1, 30), san: str | None = None, key=None):
    ca_key, ca_cert = ca
    key = key or ec.generate_private_key(ec.SECP256R1())
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(NOW + dt.timedelta(days=days[0])).not_valid_after(NOW + dt.timedelta(days=days[1]))
               .add_extension(x509.SubjectAlternativeName([x509.DNSName(san or name)]), critical=False))
    return key, builder.sign(ca_key, hashes.SHA256())


def write(directory, stem: str, key, cert):
    directory.mkdir(parents=True, exist_ok=True)
    crt, pem = directory / f"{stem}.crt", directory / f"{stem}.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return crt, pem


@pytest.fixture(scope="module")
def cas():
    return {"federation": make_ca("federation ca"), "other": make_ca("other ca")}


@pytest.fixture
def site(tmp_path, cas):
    """A site's cert/ folder: the federation's chain and site_0's key and certificate."""
    chain = write(tmp_path / "cert", "cert_chain", None, cas["federation"][1])[0]
    crt, key = write(tmp_path / "cert" / "client", "col_site_0", *issue(cas["federation"], "site_0"))
    return SimpleNamespace(chain=chain, crt=crt, key=key)


class FakeAggregator:
    """A TLS server on localhost presenting a given certificate (and, with ``client_ca``, requiring a
    client certificate signed by it), answering a few bytes after the handshake, as gRPC would;
    ``connections``: how many it accepted."""

    def __init__(self, crt, key, client_ca=None, port: int = 0) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(str(crt), str(key))
        if client_ca is not None:
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(str(client_ca))
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1  # before the handshake: counted once a client's handshake is done
            try:
                with self.context.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"\x00\x00\x00\x04")
                    tls.recv(64)
            except (OSError, ssl.SSLError):
                conn.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread: nothing listens any more
        except OSError:
            pass
        self.sock.close()


@pytest.fixture
def serve(tmp_path):
    servers = []

    def start(ca, name="localhost", *, san=None, days=(-1, 30), client_ca=None, port=0) -> FakeAggregator:
        crt, key = write(tmp_path / "server", f"agg_{len(servers)}", *issue(ca, name, san=san, days=days))
        servers.append(FakeAggregator(crt, key, client_ca, port))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_a_site_certificate_from_another_ca_names_both_cas(site, cas):
    check_own_certificate(site.crt, site.key, site.chain)  # the good one
    write(site.crt.parent, "col_site_0", *issue(cas["other"], "site_0"))
    with pytest.raises(ConfigError) as info:
        check_own_certificate(site.crt, site.key, site.chain)
    message = str(info.value)
    assert f"certificate {site.crt} (CN=site_0) is issued by CN=other ca" in message
    assert f"not by the federation's CA in {site.chain} (CN=federation ca)" in message


def test_a_site_certificate_for_another_key_is_named(site, cas):
    write(site.crt.parent, "col_site_0", None, issue(cas["federation"], "site_0")[1])  # a new key's certificate
    with pytest.raises(ConfigError, match=f"certificate {site.crt} .* does not belong to the private key {site.key}"):
        check_own_certificate(site.crt, site.key, site.chain)


def test_a_collaborator_with_another_cas_certificate_stops_before_connecting(site, cas):
    write(site.crt.parent, "col_site_0", *issue(cas["other"], "site_0"))
    client = SimpleNamespace(use_tls=True, require_client_auth=True, root_certificate=str(site.chain),
                             certificate=str(site.crt), private_key=str(site.key))
    with pytest.raises(CollaboratorStopped) as info:
        SafeCollaborator(client=client, task_runner=None)
    assert str(info.value).startswith(f"fedcontrast collaborator: error: the certificate {site.crt} (CN=site_0)")
    assert "issued by CN=other ca" in str(info.value)


@pytest.mark.parametrize("mistake, words", [
    ("another_ca", ["issued by CN=other ca, not by the federation's CA", "(CN=federation ca)"]),
    ("another_name", ["issued for otherhost, not for localhost, the plan's agg_addr"]),
    ("expired", ["that expired on "]),
])
def test_each_aggregator_certificate_mistake_is_named_at_once(site, cas, serve, mistake, words):
    ca = cas["other"] if mistake == "another_ca" else cas["federation"]
    server = serve(ca, "otherhost" if mistake == "another_name" else "localhost",
                   days=(-30, -2) if mistake == "expired" else (-1, 30))
    with pytest.raises(ConfigError) as info:
        check_aggregator_certificate("localhost", server.port, site.chain)
    assert server.connections == 1  # named from the one handshake, not retried
    message = str(info.value)
    assert message.startswith(f"the aggregator at localhost:{server.port} presents a certificate (CN=")
    assert all(w in message for w in words), message
    if mistake == "expired":
        assert (NOW - dt.timedelta(days=2)).strftime("%Y-%m-%d") in message


def test_a_good_aggregator_passes_and_an_absent_one_may_be_retried(site, cas, serve):
    server = serve(cas["federation"], client_ca=site.chain)
    assert check_aggregator_certificate("localhost", server.port, site.chain, certificate=site.crt,
                                        private_key=site.key) is None
    server.close()
    reason = check_aggregator_certificate("localhost", server.port, site.chain)
    assert reason is not None and "cannot be reached" in reason


def test_an_aggregator_that_refuses_the_sites_certificate_is_named(site, cas, serve, tmp_path):
    other_chain = write(tmp_path / "other", "chain", None, cas["other"][1])[0]
    server = serve(cas["federation"], client_ca=other_chain)  # it trusts another CA's clients only
    with pytest.raises(ConfigError) as info:
        check_aggregator_certificate("localhost", server.port, site.chain, certificate=site.crt, private_key=site.key)
    assert f"does not accept this site's certificate {site.crt} (CN=site_0, issued by CN=federation ca)" in str(
        info.value)


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "failed to connect to all addresses"


def test_a_failed_handshake_ends_the_collaborator_without_retrying(site, cas, serve):
    server = serve(cas["federation"], days=(-30, -2))  # an expired aggregator certificate
    client = SimpleNamespace(uri=f"localhost:{server.port}", root_certificate=str(site.chain), require_client_auth=True,
                             certificate=str(site.crt), private_key=str(site.key))
    slept: list[float] = []
    retry = BoundedRetry(30.0, client.uri, 30, diagnose=partial(diagnose_handshake, client), sleeper=slept.append)
    with pytest.raises(CollaboratorStopped) as info:
        try:
            raise Unavailable()
        except grpc.RpcError:
            retry.sleep()  # would sleep 30 s before the next of 30 retries
    assert slept == [] and server.connections == 1  # one handshake looked at, no wait for a retry
    assert str(info.value).startswith(f"fedcontrast collaborator: error: the aggregator at localhost:{server.port} "
                                      "presents a certificate (CN=localhost) that expired on")
    assert "retries" not in str(info.value)


def test_nothing_listening_is_still_retried(site):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    client = SimpleNamespace(uri=f"localhost:{port}", root_certificate=str(site.chain), require_client_auth=True,
                             certificate=str(site.crt), private_key=str(site.key))
    retry = BoundedRetry(0.0, client.uri, 2, diagnose=partial(diagnose_handshake, client))
    for _ in range(2):
        try:
            raise Unavailable()
        except grpc.RpcError:
            retry.sleep()
    with pytest.raises(CollaboratorStopped, match="cannot reach the aggregator .*gave up after 2 retries"):
        try:
            raise Unavailable()
        except grpc.RpcError:
            retry.sleep()


def aggregator_workspace(tmp_path, cas):
    config = small_config(algorithm="fedavg")
    ws = create_workspace(tmp_path / "ws", config)
    settings = {k: build_plan(config)["aggregator"]["settings"][k] for k in ("run_config", "model_shape",
                                                                            "rounds_to_train")}
    write(ws / "cert", "cert_chain", None, cas["federation"][1])
    return ws, config, settings


def test_an_aggregator_certificate_for_another_name_is_named_at_start(tmp_path, cas):
    ws, config, settings = aggregator_workspace(tmp_path, cas)
    argv = ["fx", "aggregator", "start"]
    write(ws / "cert" / "server", "agg_otherhost", *issue(cas["federation"], "otherhost"))
    with pytest.raises(ConfigError) as info:
        check_aggregator_plan(config, settings, argv=argv, cwd=ws)
    assert str(info.value).startswith(f"{ws / 'cert' / 'server'} holds a certificate for agg_otherhost, but the "
                                      "plan's agg_addr is localhost")
    # the right file name, but a certificate issued for another name: the sites would refuse it
    write(ws / "cert" / "server", "agg_localhost", *issue(cas["federation"], "localhost", san="otherhost"))
    with pytest.raises(ConfigError, match="agg_localhost.crt is issued for otherhost, not for localhost"):
        check_aggregator_plan(config, settings, argv=argv, cwd=ws)
    write(ws / "cert" / "server", "agg_localhost", *issue(cas["federation"], "localhost"))
    check_aggregator_plan(config, settings, argv=argv, cwd=ws)


def test_fx_aggregator_start_with_a_certificate_for_another_name_says_so(tmp_path, cas):
    ws, _, _ = aggregator_workspace(tmp_path, cas)
    write(ws / "cert" / "server", "agg_otherhost", *issue(cas["federation"], "otherhost"))
    proc = subprocess.run([fx_executable(), "aggregator", "start"], cwd=ws, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output and "FileNotFoundError" not in output
    assert "fedcontrast aggregator: error:" in output and "holds a certificate for agg_otherhost" in output


def test_fx_collaborator_facing_an_aggregator_certificate_from_another_ca_stops_without_retrying(make_workspace, cas,
                                                                                                  serve):
    ws = make_workspace(small_config(algorithm="fedavg"), max_retries=30)
    port = yaml.safe_load((ws / "plan" / "plan.yaml").read_text())["network"]["settings"]["agg_port"]
    serve(cas["other"], port=port)  # listens where the plan's aggregator is, with a certificate of another CA
    code, reason = run_collaborator(ws, "site_0", timeout=120)
    assert code != 0
    assert reason.startswith(f"the aggregator at localhost:{port} presents a certificate (CN=localhost) issued by "
                             "CN=other ca, not by the federation's CA in ")
    assert "retry" not in (ws / "logs" / "site_0.log").read_text()  # ended at the first failed handshake


def test_an_aggregator_certificate_from_another_ca_is_refused_at_start(tmp_path, cas):
    ws, config, settings = aggregator_workspace(tmp_path, cas)
    write(ws / "cert" / "server", "agg_localhost", *issue(cas["other"], "localhost"))
    with pytest.raises(ConfigError, match=r"agg_localhost.crt \(CN=localhost\) is issued by CN=other ca, not by the "
                                          r"federation's CA in .*cert_chain.crt \(CN=federation ca\)"):
        check_aggregator_plan(config, settings, argv=["fx", "aggregator", "start"], cwd=ws)


def test_certificates_signed_here_for_the_sites_are_checked_at_start(tmp_path, cas):
    cert = tmp_path / "cert"
    write(cert, "cert_chain", None, cas["federation"][1])
    client = cert / "client"
    write(client, "col_site_0", *issue(cas["federation"], "site_0"))  # good
    expired = issue(cas["federation"], "site_1", days=(-30, -2))[1]
    write(client, "col_site_1", None, expired)
    write(client, "col_site_2", *issue(cas["other"], "site_2"))
    soon = issue(cas["federation"], "site_3", days=(-1, 2))[1]
    write(client, "col_site_3", None, soon)
    write(client, "col_site_4", *issue(cas["federation"], "somebody"))
    (client / "col_site_5.crt").write_text("not a certificate")
    problems = check_enrolled_certificates(cert, [f"site_{i}" for i in range(7)])  # site_6: signed elsewhere
    assert problems == [
        f"site_1's certificate {client / 'col_site_1.crt'} (CN=site_1) expired on "
        f"{expired.not_valid_after_utc:%Y-%m-%d %H:%M} UTC",
        f"site_2's certificate {client / 'col_site_2.crt'} (CN=site_2) is issued by CN=other ca, not by the "
        f"federation's CA in {cert / 'cert_chain.crt'}",
        f"site_3's certificate {client / 'col_site_3.crt'} (CN=site_3) expires on "
        f"{soon.not_valid_after_utc:%Y-%m-%d %H:%M} UTC",
        f"site_4's certificate {client / 'col_site_4.crt'} (CN=somebody) is issued for somebody, not for site_4",
        f"site_5's certificate {client / 'col_site_5.crt'} is not a PEM certificate",
    ]


def test_the_aggregator_names_the_sites_it_is_still_waiting_for(monkeypatch, caplog):
    import fedcontrast.openfl.aggregator as components

    aggregator = SafeAggregator.__new__(SafeAggregator)
    aggregator.authorized_cols, aggregator.seen = ["hosp1", "hosp2", "hosp3"], {"hosp2"}
    aggregator.tls_log = SimpleNamespace(refused=4)
    aggregator.started, aggregator.waiting_noted = time.monotonic() - 125, time.monotonic()
    with caplog.at_level("INFO", logger=components.logger.name):
        aggregator._note_waiting()
        assert caplog.messages == []  # not yet: once a minute
        monkeypatch.setattr(components, "WAITING_NOTICE_S", 0.0)
        aggregator._note_waiting()
    [message] = caplog.messages
    assert message.startswith("waiting for hosp1, hosp3: not connected in the 12")
    assert message.endswith("s since the aggregator started (4 TLS connection(s) refused meanwhile: see above)")
