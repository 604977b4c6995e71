"""Who the aggregator waits for: exactly the plan's sites, each once, as plan/cols.yaml lists them.
A name missing, added (``fx collaborator certify`` appends every name it signs) or repeated would
have the federation run without a site or count one site's data twice: refused at start, in one
sentence naming the difference and the operator's step to fix it."""

import pytest
import yaml

from fedcontrast.errors import ConfigError
from fedcontrast.openfl.plan import create_workspace
from fedcontrast.openfl.startup_checks import _check_collaborators

from .conftest import small_config


def start_aggregator(ws, monkeypatch, capsys) -> str:
    """The aggregator as `fx aggregator start` builds it from the plan; its one line on stderr."""
    from openfl.federated import Plan

    monkeypatch.chdir(ws)
    plan = Plan.parse(plan_config_path=ws / "plan" / "plan.yaml", cols_config_path=ws / "plan" / "cols.yaml")
    with pytest.raises(SystemExit) as info:
        plan.get_aggregator()
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and err[0].startswith("fedcontrast aggregator: error:"), err
    return err[0]


@pytest.mark.parametrize("cols, words", [
    (["site_0", "site_2"], "plan/cols.yaml lacks site_1, a site of the plan (site_0, site_1, site_2)"),
    (["site_0", "site_1", "site_2", "hosp_new"], "plan/cols.yaml admits hosp_new, which the plan does not name"),
    (["site_0", "site_1", "site_2", "site_1"], "plan/cols.yaml lists site_1 more than once"),
])
def test_the_aggregator_refuses_cols_yaml_that_differs_from_the_plans_sites(tmp_path, monkeypatch, capsys,
                                                                          cols, words):
    ws = create_workspace(tmp_path / "ws", small_config(algorithm="fedavg", clients=3))
    (ws / "plan" / "cols.yaml").write_text(yaml.safe_dump({"collaborators": cols}))
    before = sorted(p.relative_to(ws) for p in ws.rglob("*"))
    err = start_aggregator(ws, monkeypatch, capsys)
    assert words in err and "cols.yaml" in err
    assert "fedcontrast workspace create" in err  # the operator's explicit step
    assert sorted(p.relative_to(ws) for p in ws.rglob("*")) == before  # nothing written (no tensor.db, no report)


def test_cols_yaml_listing_exactly_the_plans_sites_is_accepted():
    config = small_config(algorithm="fedavg", clients=3)
    _check_collaborators(config, ["site_2", "site_0", "site_1"], 2)  # order is OpenFL's business
    with pytest.raises(ConfigError, match="lacks site_2"):
        _check_collaborators(config, ["site_0", "site_1"], 2)  # min_sites does not excuse a site left out


# --- one certificate per name: the aggregator admits a name only with the certificate signed for it ---
class Refused(Exception):
    """What grpc's context.abort raises."""


class FakeContext:
    """The gRPC context validate_collaborator reads: the client certificate's common name and PEM."""

    def __init__(self, cert) -> None:
        from cryptography.hazmat.primitives import serialization
        from cryptography.x509.oid import NameOID

        self.pem = cert.public_bytes(serialization.Encoding.PEM)
        self.cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value

    def auth_context(self):
        return {"x509_common_name": [self.cn.encode()], "x509_pem_cert": [self.pem]}

    def peer(self):
        return "ipv4:10.0.0.9:51000"

    def abort(self, code, details):
        raise Refused(code, details)


def enrolled_server(cert_dir, sites):
    """OpenFL's gRPC server as far as validate_collaborator sees it, serving a SafeAggregator whose
    operator holds ``cert_dir``."""
    from types import SimpleNamespace

    from fedcontrast.openfl.components import SafeAggregator
    from fedcontrast.openfl.enrolment import EnrolledCertificates

    aggregator = SafeAggregator.__new__(SafeAggregator)
    aggregator.authorized_cols, aggregator.single_col_cert_common_name = list(sites), ""
    aggregator.enrolment = EnrolledCertificates(cert_dir)
    return SimpleNamespace(aggregator=aggregator, use_tls=True, require_client_auth=True)


def connect(server, name, cert):
    """validate_collaborator as OpenFL's server calls it on every call from ``name`` presenting
    ``cert``: the refusal's sentence (always UNAUTHENTICATED), or None when admitted."""
    from types import SimpleNamespace

    import grpc
    from openfl.transport.grpc import aggregator_server as grpc_server

    request = SimpleNamespace(header=SimpleNamespace(sender=name))
    try:
        grpc_server.AggregatorGRPCServer.validate_collaborator(server, request, FakeContext(cert))
    except Refused as exc:
        assert exc.args[0] == grpc.StatusCode.UNAUTHENTICATED
        return exc.args[1]
    return None


def sha256(cert) -> str:
    from cryptography.hazmat.primitives import hashes

    return cert.fingerprint(hashes.SHA256()).hex()


def test_the_aggregator_admits_a_name_only_with_the_certificate_signed_for_it(tmp_path, monkeypatch, caplog):
    from openfl.transport.grpc import aggregator_server as grpc_server

    from fedcontrast.openfl import aggregator as components

    from .test_tls_diagnostics import issue, make_ca, write

    monkeypatch.setattr(grpc_server, "sleep", lambda s: None)  # OpenFL's random delay before its own refusals
    ca = make_ca("federation ca")
    cert = tmp_path / "cert"
    write(cert, "cert_chain", None, ca[1])
    key, signed = issue(ca, "hosp1")
    on_file = write(cert / "client", "col_hosp1", None, signed)[0]  # what `fedcontrast ca sign` keeps
    server = enrolled_server(cert, ["hosp1", "hosp2", "hosp3"])
    assert connect(server, "hosp1", signed) is None
    _, another = issue(ca, "hosp1", key=key)  # the federation's CA's, for hosp1 and its key: not the one on file
    with caplog.at_level("ERROR", logger=components.logger.name):
        reason = connect(server, "hosp1", another)
        assert connect(server, "hosp1", another) == reason  # refused every time, logged once a minute
    assert reason == (f"refused hosp1: the certificate it presented (CN=hosp1, serial {another.serial_number:x}, "
                      f"SHA-256 {sha256(another)[:16]}…) is not the certificate this CA signed for hosp1 ({on_file}, "
                      f"SHA-256 {sha256(signed)[:16]}…)")
    assert caplog.messages == [f"{reason} (connection from ipv4:10.0.0.9:51000)"]
    assert "Invalid collaborator. CN: |hosp1| collaborator_common_name: |hosp2|" in connect(server, "hosp2", signed)
    _, elsewhere = issue(ca, "hosp3")  # no certificate on file for hosp3: only what this CA signed and holds (issue 34)
    assert connect(server, "hosp3", elsewhere) == (
        f"refused hosp3: this CA holds no certificate signed for hosp3 ({cert / 'client' / 'col_hosp3.crt'} does not "
        "exist), and the aggregator admits only the certificates its CA signed and still holds; restore the file from "
        "the CA's backup, or sign hosp3's new request (`fedcontrast ca sign`)")
    # The issue's impostor, signed before requests were checked: CN=hosp2, filed as hosp1's certificate.
    _, impostor = issue(ca, "hosp2")
    filed = write(cert / "client", "col_hosp1", None, impostor)[0]
    assert connect(server, "hosp2", impostor) == (
        f"refused hosp2: the certificate it presented (CN=hosp2, serial {impostor.serial_number:x}, SHA-256 "
        f"{sha256(impostor)[:16]}…) is the certificate this CA signed for hosp1 ({filed})")


def test_a_revoked_certificate_is_refused_from_the_next_call_on(tmp_path):
    import grpc

    from fedcontrast.errors import ConfigError
    from fedcontrast.openfl.collaborator import explain_rpc_error
    from fedcontrast.openfl.enrolment import EnrolledCertificates, revoke_certificate

    from .test_tls_diagnostics import issue, make_ca, write

    ca = make_ca("federation ca")
    cert = tmp_path / "cert"
    write(cert, "cert_chain", None, ca[1])
    _, signed = issue(ca, "hosp1")
    write(cert / "client", "col_hosp1", None, signed)
    server = enrolled_server(cert, ["hosp1", "hosp2"])
    assert connect(server, "hosp1", signed) is None
    record = revoke_certificate(cert, "hosp1", "key lost with a laptop")  # `fedcontrast ca revoke`, aggregator running
    reason = connect(server, "hosp1", signed)
    assert reason == (f"refused hosp1: the certificate it presented (CN=hosp1, serial {signed.serial_number:x}, "
                      f"SHA-256 {sha256(signed)[:16]}…) was revoked on {record['revoked_at']} "
                      "(key lost with a laptop); the site needs a newly signed certificate")
    class Unauthenticated(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAUTHENTICATED

        def details(self):
            return reason

    message, retry = explain_rpc_error(Unauthenticated(), "agg:50051")
    assert message == f"the aggregator at agg:50051 {reason}" and not retry  # the site's one sentence, no retries
    _, renewed = issue(ca, "hosp1")
    write(cert / "client", "col_hosp1", None, renewed)  # signed after the revocation
    assert connect(server, "hosp1", renewed) is None
    assert connect(server, "hosp1", signed) == reason
    with open(cert / "revoked.jsonl", "a") as f:
        f.write("{not json\n")
    refused = connect(server, "hosp1", renewed)  # which certificates are revoked is unknown: nobody is admitted
    assert refused.startswith("refused hosp1: line 2 of the revocation record") and "append-only" in refused
    with pytest.raises(ConfigError, match="line 2 of the revocation record"):
        EnrolledCertificates(cert).revoked()  # SafeAggregator reads it at start: no start on a damaged record


def test_revocation_survives_the_loss_of_its_record(tmp_path, caplog):
    """Issue 34: deleting cert/revoked.jsonl does not re-admit a revoked certificate: the certificate kept in
    cert/revoked/ still refuses it (naming the missing record), and with that gone too, the aggregator admits
    only certificates its CA signed and still holds."""
    from fedcontrast.openfl import aggregator as components
    from fedcontrast.openfl.enrolment import revoke_certificate

    from .test_tls_diagnostics import issue, make_ca, write

    ca = make_ca("federation ca")
    cert = tmp_path / "cert"
    write(cert, "cert_chain", None, ca[1])
    _, signed = issue(ca, "hosp1")
    write(cert / "client", "col_hosp1", None, signed)
    record = revoke_certificate(cert, "hosp1", "key lost")
    (cert / "revoked.jsonl").unlink()  # the record lost
    server = enrolled_server(cert, ["hosp1", "hosp2"])
    with caplog.at_level("ERROR", logger=components.logger.name):
        reason = connect(server, "hosp1", signed)
    shown = f"the certificate it presented (CN=hosp1, serial {signed.serial_number:x}, SHA-256 {sha256(signed)[:16]}…)"
    assert reason == (f"refused hosp1: {shown} is a certificate this CA revoked (kept as {record['kept']}); the "
                      f"revocation record {cert / 'revoked.jsonl'} has no line for it — restore the record from its "
                      "backup; the site needs a newly signed certificate")
    assert any(f"{record['kept']} is a certificate this CA revoked, but the revocation record {cert / 'revoked.jsonl'} "
               "has no line for it" in m for m in caplog.messages)  # said when the record is read (at start)
    for kept in (cert / "revoked").iterdir():
        kept.unlink()  # both records lost: still not held by this CA
    assert connect(server, "hosp1", signed).startswith("refused hosp1: this CA holds no certificate signed for hosp1")


def test_grpc_hands_the_aggregator_the_certificate_it_checks(tmp_path):
    """The check behind a real mutual-TLS gRPC server: gRPC's auth context carries the client's
    certificate (x509_pem_cert), and the refusal reaches the client as UNAUTHENTICATED with its sentence."""
    from concurrent import futures
    from types import SimpleNamespace

    import grpc
    from cryptography.hazmat.primitives import serialization
    from openfl.transport.grpc import aggregator_server as grpc_server

    from .test_tls_diagnostics import issue, make_ca, write

    def pem(obj):
        if hasattr(obj, "subject"):
            return obj.public_bytes(serialization.Encoding.PEM)
        return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca = make_ca("federation ca")
    cert = tmp_path / "cert"
    key, signed = issue(ca, "hosp1")
    write(cert / "client", "col_hosp1", None, signed)
    server = enrolled_server(cert, ["hosp1"])

    def get_tasks(request, context):
        grpc_server.AggregatorGRPCServer.validate_collaborator(
            server, SimpleNamespace(header=SimpleNamespace(sender="hosp1")), context)
        return b"tasks"

    handler = grpc.method_handlers_generic_handler("test", {"GetTasks": grpc.unary_unary_rpc_method_handler(get_tasks)})
    grpc_srv = grpc.server(futures.ThreadPoolExecutor(2))
    grpc_srv.add_generic_rpc_handlers((handler,))
    server_key, server_cert = issue(ca, "localhost")
    port = grpc_srv.add_secure_port("localhost:0", grpc.ssl_server_credentials(
        [(pem(server_key), pem(server_cert))], root_certificates=pem(ca[1]), require_client_auth=True))
    grpc_srv.start()
    try:
        def call(client_cert):
            credentials = grpc.ssl_channel_credentials(pem(ca[1]), pem(key), pem(client_cert))
            with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
                return channel.unary_unary("/test/GetTasks")(b"", timeout=10)

        assert call(signed) == b"tasks"
        _, another = issue(ca, "hosp1", key=key)
        with pytest.raises(grpc.RpcError) as info:
            call(another)
    finally:
        grpc_srv.stop(0)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert info.value.details().startswith("refused hosp1: the certificate it presented (CN=hosp1, serial "
                                           f"{another.serial_number:x}")
