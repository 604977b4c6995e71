"""What a party checks when it starts, so that a bad file ends it at once with one sentence instead of
a traceback or endless retries: a stale init.pbuf, a corrupt tensor.db, an expired certificate."""

import datetime as dt
import sqlite3
from types import SimpleNamespace

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from openfl.pipelines import NoCompressionPipeline
from openfl.protocols import utils

from fedcontrast.algorithms import TensorSpec
from fedcontrast.deploy.certificates import check_certificate_dates
from fedcontrast.errors import ConfigError
from fedcontrast.openfl.components import SafeCollaborator
from fedcontrast.openfl.packing import GLOBAL_PACKED, packed_size
from fedcontrast.openfl.plan import build_plan, create_workspace
from fedcontrast.openfl.protocol import CollaboratorStopped
from fedcontrast.openfl.startup_checks import check_aggregator_plan, check_initial_model, check_tensor_db

from .conftest import small_config
from .test_tls_diagnostics import issue, make_ca, write

SPECS = [TensorSpec("model.w", (10, 3), "float32", "download"), TensorSpec("model.b", (3,), "float16", "download")]


def write_init(path, values: int) -> None:
    proto = utils.construct_model_proto({GLOBAL_PACKED: np.zeros(values, np.float32)}, 0, NoCompressionPipeline())
    utils.dump_proto(proto, str(path))


def test_an_init_pbuf_made_for_another_plan_says_to_initialise_again(tmp_path):
    path = tmp_path / "init.pbuf"
    write_init(path, packed_size(SPECS))
    check_initial_model(path, SPECS)  # this plan's
    write_init(path, packed_size(SPECS) + 7)  # the plan's model changed after `fx plan initialize`
    with pytest.raises(ConfigError) as info:
        check_initial_model(path, SPECS)
    assert f"{packed_size(SPECS) + 7} values where the plan's model has {packed_size(SPECS)}" in str(info.value)
    assert "re-run `fx plan initialize`" in str(info.value)
    path.write_bytes(b"\x0a\xff\xff\xff garbage")
    with pytest.raises(ConfigError, match=r"init.pbuf cannot be read .*re-run `fx plan initialize`"):
        check_initial_model(path, SPECS)


def test_a_corrupt_tensor_db_is_named_and_left_untouched(tmp_path):
    path = tmp_path / "tensor.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE t (x INTEGER)")
    check_tensor_db(path)  # a good database
    check_tensor_db(tmp_path / "none.db")  # a first start: no database yet
    garbage = b"this is not an sqlite database" * 200
    path.write_bytes(garbage)
    with pytest.raises(ConfigError) as info:
        check_tensor_db(path)
    assert f"checkpoint database {path} is corrupt" in str(info.value) and "move it away" in str(info.value)
    assert path.read_bytes() == garbage


def make_certificate(path, *, valid_from_days: float, valid_to_days: float, name: str = "site_0",
                     key_path=None) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now + dt.timedelta(days=valid_from_days))
            .not_valid_after(now + dt.timedelta(days=valid_to_days)).sign(key, hashes.SHA256()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key_path is not None:
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))


def test_expired_and_not_yet_valid_certificates_are_named_with_their_dates(tmp_path):
    good, expired, future = tmp_path / "ca.crt", tmp_path / "col_site_0.crt", tmp_path / "later.crt"
    make_certificate(good, valid_from_days=-10, valid_to_days=300, name="ca")
    make_certificate(expired, valid_from_days=-30, valid_to_days=-2)
    make_certificate(future, valid_from_days=5, valid_to_days=30)
    check_certificate_dates([good, tmp_path / "missing.crt"])  # a missing file is OpenFL's to name
    expiry = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=2)).strftime("%Y-%m-%d")
    with pytest.raises(ConfigError, match=f"certificate {expired} \\(CN=site_0\\) expired on {expiry}"):
        check_certificate_dates([good, expired])
    with pytest.raises(ConfigError, match="later.crt .* is not valid before"):
        check_certificate_dates([future])


def test_a_collaborator_with_an_expired_certificate_stops_at_once(tmp_path):
    chain, own = tmp_path / "cert_chain.crt", tmp_path / "client" / "col_site_0.crt"
    make_certificate(chain, valid_from_days=-10, valid_to_days=300, name="ca")
    make_certificate(own, valid_from_days=-30, valid_to_days=-1)
    client = SimpleNamespace(use_tls=True, require_client_auth=True, root_certificate=str(chain), certificate=str(own))
    with pytest.raises(CollaboratorStopped) as info:  # before any connection is tried
        SafeCollaborator(client=client, task_runner=None)
    assert str(info.value).startswith("fedcontrast collaborator: error: the certificate")
    assert "col_site_0.crt" in str(info.value) and "expired on" in str(info.value)


def test_the_aggregator_checks_its_own_certificate_at_start(tmp_path):
    config = small_config()
    ws = create_workspace(tmp_path / "ws", config)
    plan = build_plan(config)
    settings = {k: plan["aggregator"]["settings"][k] for k in ("run_config", "model_shape", "rounds_to_train")}
    make_certificate(ws / "cert" / "cert_chain.crt", valid_from_days=-10, valid_to_days=300, name="ca")
    make_certificate(ws / "cert" / "server" / "agg_localhost.crt", valid_from_days=-30, valid_to_days=-1,
                     name="localhost", key_path=ws / "cert" / "server" / "agg_localhost.key")
    argv = ["fx", "aggregator", "start"]
    with pytest.raises(ConfigError, match=r"server/agg_localhost.crt \(CN=localhost\) expired on"):
        check_aggregator_plan(config, settings, argv=argv, cwd=ws)
    ca = make_ca("ca")  # in date, and signed by the federation's CA that the sites trust
    write(ws / "cert", "cert_chain", None, ca[1])
    write(ws / "cert" / "server", "agg_localhost", *issue(ca, "localhost"))
    check_aggregator_plan(config, settings, argv=argv, cwd=ws)


def test_the_aggregator_built_by_openfl_refuses_a_stale_init_pbuf_then_a_corrupt_tensor_db(tmp_path, monkeypatch,
                                                                                           capsys):
    from openfl.federated import Plan

    from fedcontrast.construction import build_algorithm, initial_model

    config = small_config(algorithm="fedavg")
    ws = create_workspace(tmp_path / "ws", config)
    shape = build_plan(config)["aggregator"]["settings"]["model_shape"]
    specs = [s for s in build_algorithm(config).download_specs(initial_model(config, **shape), shape["num_classes"])
             if not s.per_site]
    monkeypatch.chdir(ws)

    def start_aggregator():
        plan = Plan.parse(plan_config_path=ws / "plan" / "plan.yaml", cols_config_path=ws / "plan" / "cols.yaml")
        with pytest.raises(SystemExit) as info:
            plan.get_aggregator()
        err = capsys.readouterr().err.strip().splitlines()
        assert info.value.code == 2 and len(err) == 1 and err[0].startswith("fedcontrast aggregator: error:")
        return err[0]

    write_init(ws / "save" / "init.pbuf", packed_size(specs) + 1)
    assert "re-run `fx plan initialize`" in start_aggregator()
    write_init(ws / "save" / "init.pbuf", packed_size(specs))
    (ws / "local_state" / "tensor.db").write_bytes(b"\0garbage" * 100)
    assert "checkpoint database local_state/tensor.db is corrupt" in start_aggregator()


def test_a_collaborator_without_a_data_line_is_told_how_to_add_one(tmp_path):
    from .conftest import run_collaborator

    ws = create_workspace(tmp_path / "ws", small_config(algorithm="fedavg"), max_retries=1)
    code, reason = run_collaborator(ws, "site_2", timeout=120)  # data.yaml: site_0 and site_1 only
    assert code != 0
    assert reason == ("plan/data.yaml has no line for collaborator site_2: add one "
                      "(site_2,PATH to its data), e.g. with `fedcontrast site join`")


def test_a_checkpoint_database_killed_mid_transaction_is_not_called_corrupt(tmp_path):
    """kill -9 of the aggregator in the middle of a write leaves a hot journal; SQLite rolls it back
    on the next open with write access. A read-only check failed on it ("attempt to write a readonly
    database") and refused the restart, calling the database corrupt."""
    import os
    import sqlite3
    import subprocess
    import sys

    from fedcontrast.openfl.startup_checks import check_tensor_db

    path = tmp_path / "tensor.db"
    script = ("import os, sqlite3, sys\n"
              "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
              "db.execute('pragma cache_size=2')\n"
              "db.execute('create table t(x blob)')\n"
              "db.execute('insert into t values (randomblob(4000))')\n"
              "db.execute('begin')\n"
              "for _ in range(200): db.execute('insert into t values (randomblob(4000))')\n"
              "os._exit(0)\n")  # no commit, no close: as a SIGKILL leaves it
    subprocess.run([sys.executable, "-c", script, str(path)], check=True)
    assert (tmp_path / "tensor.db-journal").exists()
    check_tensor_db(path)
    with sqlite3.connect(path) as db:
        assert db.execute("select count(*) from t").fetchone()[0] == 1  # the open transaction rolled back
    assert not os.path.exists(tmp_path / "tensor.db-journal") or os.path.getsize(tmp_path / "tensor.db-journal") == 0
