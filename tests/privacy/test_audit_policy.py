"""Plan-time validation, ``fedcontrast audit`` and the site policy."""

import json
import math

import pytest
import yaml

from fedcontrast.audit.report import audit_plan
from fedcontrast.cli import main
from fedcontrast.config import RunConfig
from fedcontrast.construction import build_algorithm
from fedcontrast.errors import ConfigError
from fedcontrast.openfl.loader import SiteDataLoader
from fedcontrast.openfl.plan import build_plan, create_workspace
from fedcontrast.openfl.protocol import CollaboratorStopped
from fedcontrast.privacy import planned_epsilon
from fedcontrast.privacy.policy import POLICY_ENV, SitePolicy, check_policy

REPS = {"representations": {"noise_multiplier": 2.0, "clip": 1.0}}
DP_SGD = {"dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}}


@pytest.mark.parametrize("privacy,fragment", [
    ({"representations": {"noise_multiplier": 0}}, "noise_multiplier must be a number > 0"),
    ({"representations": {"noise_multiplier": -1}}, "noise_multiplier must be a number > 0"),
    ({"dp_sgd": {"noise_multiplier": 0.0}}, "noise_multiplier must be a number > 0"),
    ({"representations": {"clip": 0}}, "clip must be a number > 0"),
    ({"dp_sgd": {"max_grad_norm": -2}}, "max_grad_norm must be a number > 0"),
    ({"delta": 0, **REPS}, "delta must be in (0, 0.01]"),
    ({"delta": 1.0, **REPS}, "delta must be in (0, 0.01]"),
    # δ = 0.5 gave a negative ε per round, δ = 0.999 a finite ε: δ must be well below 1/n.
    ({"delta": 0.5, **REPS}, "delta must be in (0, 0.01], well below 1/n"),
    ({"delta": 0.999, **REPS}, "delta must be in (0, 0.01]"),
    # Magnitudes that were accepted at plan time and blamed on a site's upload (NaN) or the audit later.
    ({"dp_sgd": {"max_grad_norm": 1e300}}, "max_grad_norm must be a number > 0 and at most 10000"),
    ({"representations": {"clip": 1e300}}, "clip must be a number > 0 and at most 10000"),
    ({"dp_sgd": {"noise_multiplier": 1e-300}}, "noise_multiplier must be a number > 0 in [0.1, 1e+06]"),
    ({"representations": {"noise_multiplier": 1e300}}, "noise_multiplier must be a number > 0 in [0.1, 1e+06]"),
    ({"count_noise_multiplier": float("nan"), **REPS}, "count_noise_multiplier must be a number > 0"),
    ({"dp_sgd": {"noise_multiplier": [1]}}, "privacy.dp_sgd.noise_multiplier must be a number, got [1]"),
    ({"secure_mode": "yes", **REPS}, "privacy.secure_mode must be true or false or left out"),
    ({"accountant": "gdp", **REPS}, "accountant must be one of rdp, prv"),
    ({"representations": {"sigma": 1}}, "unknown privacy.representations setting"),
])
def test_bad_privacy_settings_are_rejected(privacy, fragment):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"privacy": privacy})
    assert fragment in str(err.value)


@pytest.mark.parametrize("algorithm,privacy,kind", [
    ("moon", REPS, "representations"), ("fedavg", REPS, "representations"),
    ("fedprox", DP_SGD, "dp_sgd"), ("fedpcl", DP_SGD, "dp_sgd"), ("flesd", DP_SGD, "dp_sgd"),
    ("fedsiam_da", REPS, "representations"), ("fedavg_simclr", DP_SGD, "dp_sgd"),
])
def test_dp_on_a_plugin_that_does_not_support_it_is_rejected_at_plan_time(tmp_path, capsys, algorithm, privacy, kind):
    config = RunConfig(algorithm=algorithm, privacy=privacy)
    with pytest.raises(ConfigError, match=f"{algorithm} does not support privacy.{kind}"):
        build_algorithm(config)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"algorithm": algorithm, "privacy": privacy}))
    assert main(["workspace", "create", "--config", str(path), "--collaborators", "2", str(tmp_path / "ws")]) == 2
    assert f"does not support privacy.{kind}" in capsys.readouterr().err
    assert not (tmp_path / "ws").exists()


def audit(config, **network):
    return audit_plan(build_plan(config, **network), source="test")


def test_audit_lists_every_upload_with_its_kind_and_mechanism():
    report = audit(RunConfig(algorithm="fedssc", clients=3, rounds=4, privacy={**DP_SGD, **REPS}))
    kinds = {t.name: (t.kind, t.mechanism) for t in report.tensors}
    assert kinds["fedssc.class_means"][0] == "representation" and "Gaussian" in kinds["fedssc.class_means"][1]
    assert kinds["fedssc.class_counts"][0] == "count"
    assert kinds["model.classifier.weight"][0] == "weights" and "DP-SGD" in kinds["model.classifier.weight"][1]
    means = next(t for t in report.tensors if t.name == "fedssc.class_means")
    assert means.shape == (10, 256) and means.bytes_per_round == 10 * 256 * 4
    assert report.guarantee.startswith("end-to-end")
    assert [s.name for s in report.sites] == ["site_0", "site_1", "site_2"]
    config = RunConfig(algorithm="fedssc", privacy={**DP_SGD, **REPS})
    for s in report.sites:
        expected = planned_epsilon(config.privacy, config.training, n=s.samples, rounds=4)
        assert s.epsilon_total == pytest.approx(expected.total, abs=1e-9)
    assert report.certificates is None


def test_audit_flags_tls_off_epsilon_over_budget_and_weights_leaving():
    config = RunConfig(algorithm="fedssc", clients=2, rounds=50, privacy={**DP_SGD, **REPS})
    report = audit(config, tls=False)
    assert not report.tls and not report.client_auth
    policy = SitePolicy(max_epsilon=1.0, require_tls=True, require_client_auth=True, allow_weights=False,
                        min_class_count=20)
    violations = check_policy(report, policy)
    text = " | ".join(violations)
    assert "TLS is off" in text and "client authentication is off" in text
    assert "model weights leave the site" in text
    assert "over the policy's max_epsilon 1" in text and "site_0" in text and "site_1" in text
    assert "as few as 10 samples" in text
    # a compliant policy for the same plan
    assert check_policy(report, SitePolicy(max_epsilon=1e6, require_tls=False, require_client_auth=False)) == []
    # TLS and client authentication are required unless a policy says false explicitly
    assert [v.split(" (")[0] for v in check_policy(report, SitePolicy(max_epsilon=1e6))] == [
        "TLS is off", "client authentication is off"]


def test_no_dp_means_unbounded_epsilon():
    report = audit(RunConfig(algorithm="moon", clients=2))
    assert all(math.isinf(s.epsilon_total) for s in report.sites)
    assert "unbounded" in check_policy(report, SitePolicy(max_epsilon=100))[0]
    assert report.to_dict()["sites"][0]["epsilon_total"] is None


def test_cli_audit_exits_1_naming_the_violation(tmp_path, capsys):
    ws = create_workspace(tmp_path / "ws", RunConfig(algorithm="fedpcl", clients=2, privacy=REPS), tls=False)
    policy = tmp_path / "p.yaml"
    policy.write_text("require_tls: true\nallow_weights: false\n")
    assert main(["audit", str(ws), "--policy", str(policy)]) == 1
    captured = capsys.readouterr()
    assert "TLS is off" in captured.err and "VIOLATION" in captured.out
    assert "fedpcl.local_prototypes" in captured.out and "no certificates found" in captured.out
    assert main(["audit", str(ws / "plan" / "plan.yaml"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["weights_leave"] is False and data["violations"] == []
    assert main(["audit", str(tmp_path / "nowhere")]) == 2


def test_audit_reads_certificate_expiry(tmp_path):
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ws = create_workspace(tmp_path / "ws", RunConfig(clients=2))
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "site_0")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=30))
            .sign(key, hashes.SHA256()))
    (ws / "cert" / "client").mkdir(parents=True)
    (ws / "cert" / "client" / "col_site_0.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    report = audit_plan(build_plan(RunConfig(clients=2)), source="t", workspace=ws)
    assert [c.subject for c in report.certificates] == ["CN=site_0"]
    assert report.certificates[0].days_left in (29, 30)
    assert not any("expired" in v for v in check_policy(report, SitePolicy()))
    # An expired certificate is a policy violation, named.
    old = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
           .serial_number(2).not_valid_before(now - dt.timedelta(days=60)).not_valid_after(now - dt.timedelta(days=2))
           .sign(key, hashes.SHA256()))
    (ws / "cert" / "client" / "col_site_0.crt").write_bytes(old.public_bytes(serialization.Encoding.PEM))
    report = audit_plan(build_plan(RunConfig(clients=2)), source="t", workspace=ws)
    assert report.certificates[0].days_left < 0
    assert any("certificate" in v and "col_site_0.crt" in v and "expired" in v
               for v in check_policy(report, SitePolicy()))


def test_site_policy_stops_the_data_loader_before_any_data_is_read(tmp_path, monkeypatch):
    plan = build_plan(RunConfig(algorithm="moon", clients=2), tls=False)
    settings = plan["data_loader"]["settings"]
    policy = tmp_path / "site_policy.yaml"
    policy.write_text("require_tls: true\nallow_weights: false\n")
    monkeypatch.setenv(POLICY_ENV, str(policy))
    with pytest.raises(CollaboratorStopped) as info:  # the folder does not exist: reading it would fail otherwise
        SiteDataLoader(data_path=str(tmp_path / "no-such-folder"), **settings)
    message = str(info.value)
    assert "refuses the plan before any data is read" in message
    assert "TLS is off" in message and "model weights leave the site" in message
    policy.write_text("require_tls: false\n")  # client authentication (off with TLS) is still required
    with pytest.raises(CollaboratorStopped, match="client authentication is off"):
        SiteDataLoader(data_path="shard:1", **settings)
    policy.write_text("require_tls: false\nrequire_client_auth: false\n")
    loader = SiteDataLoader(data_path="shard:1", **settings)  # compliant: starts and reads its shard
    assert loader.get_train_data_size() > 0


def test_audit_of_flesd_with_representation_dp_is_site_level_and_bounded():
    report = audit_plan(build_plan(RunConfig(algorithm="flesd", clients=2, rounds=3, privacy=REPS)), source="t")
    assert [(t.name, t.kind) for t in report.tensors] == [("flesd.similarity", "representation")]
    assert report.guarantee.startswith("end-to-end at site level")
    assert all(math.isfinite(s.epsilon_total) and s.epsilon_total > s.epsilon_round for s in report.sites)


def one_sentence(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_policy_max_delta_must_be_a_probability_below_one(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"policy max_delta must be in \(0, 1\)"):
        SitePolicy(max_delta=2)
    ws = create_workspace(tmp_path / "ws", RunConfig(algorithm="fedpcl", clients=2, privacy=REPS), tls=False)
    policy = tmp_path / "p.yaml"
    policy.write_text("max_delta: 2\n")
    assert main(["audit", str(ws), "--policy", str(policy)]) == 2
    assert "policy max_delta must be in (0, 1)" in one_sentence(capsys)


def test_audit_of_a_plan_with_a_vanishing_noise_multiplier_is_one_sentence(tmp_path, capsys):
    # σ = 1e-300 used to end in a ZeroDivisionError inside the accountant.
    ws = create_workspace(tmp_path / "ws", RunConfig(algorithm="fedpcl", clients=2, privacy=REPS), tls=False)
    plan = ws / "plan" / "plan.yaml"
    text = plan.read_text()
    assert text.count("noise_multiplier: 2.0") == 1  # the run configuration is one anchored copy
    plan.write_text(text.replace("noise_multiplier: 2.0", "noise_multiplier: 1.0e-300"))
    assert main(["audit", str(ws)]) == 2
    assert "privacy.representations.noise_multiplier must be a number > 0 in [0.1" in one_sentence(capsys)


def test_a_key_given_twice_in_a_plan_or_a_policy_is_refused(tmp_path, capsys):
    ws = create_workspace(tmp_path / "ws", RunConfig(algorithm="fedpcl", clients=2, rounds=2, privacy=REPS),
                          tls=False)
    plan = ws / "plan" / "plan.yaml"
    text = plan.read_text()
    plan.write_text(text.replace("rounds_to_train: 2\n", "rounds_to_train: 2\n    rounds_to_train: 4\n", 1))
    assert main(["audit", str(ws)]) == 2
    err = one_sentence(capsys)
    assert f"plan {plan}" in err and "'rounds_to_train' is given twice" in err
    plan.write_text(text)
    policy = tmp_path / "p.yaml"
    policy.write_text("max_epsilon: 100\nrequire_tls: true\nmax_epsilon: 1.0e+9\n")
    assert main(["audit", str(ws), "--policy", str(policy)]) == 2
    err = one_sentence(capsys)
    assert f"site policy {policy}" in err and "'max_epsilon' is given twice (lines 1 and 3)" in err
