"""Issue 37, item 3 (command line and PKI): report and doctor on Flower folders, without OpenFL; PKI
reuse on Flower (--pki-from); DP and secure aggregation by flags; CAs named after the federation; the
audit's code table pinned as the docs say."""

import json
import subprocess
import sys

from cryptography import x509

from fedcontrast.cli import main
from fedcontrast.cli.app import build_parser
from fedcontrast.cli.common import config_from_args
from fedcontrast.deploy.anchor import fingerprint_of_chain
from fedcontrast.outputs import metric_row, write_metrics_csv

BLOCK_OPENFL = ("import sys; sys.modules['openfl'] = None; from fedcontrast.cli import main; "
                "sys.exit(main(sys.argv[1:]))")


def fake_flower_run(run, rounds=2):
    run.mkdir(parents=True)
    rows = []
    for r in range(1, rounds + 1):
        rows += [metric_row(r, "hosp1", "evaluate", 50, {"accuracy": 0.5 + r / 10}),
                 metric_row(r, "hosp2", "evaluate", 150, {"accuracy": 0.7 + r / 10}),
                 metric_row(r, "global", "evaluate", 200, {"accuracy": 0.65 + r / 10})]
    write_metrics_csv(run / "metrics.csv", rows)
    (run / "rounds.jsonl").write_text("".join(json.dumps({"round": r, "sites": {}, "excluded": (
        {"hosp3": f"round {r}: silent"} if r == 2 else {})}) + "\n" for r in range(1, rounds + 1)))
    (run / "progress.json").write_text(json.dumps({"rounds_done": rounds, "rounds": rounds, "label": "x"}))
    (run / "summary.json").write_text(json.dumps({"final_accuracy": 0.85, "best_accuracy": 0.85, "best_round": 2,
                                                  "rounds_completed": rounds, "rounds_planned": rounds}))
    (run / "outcome.json").write_text(json.dumps({"status": "finished", "final_accuracy": 0.85}))
    return run


def test_report_on_a_flower_run_folder_prints_its_rounds_and_accuracy_without_openfl(tmp_path):
    run = fake_flower_run(tmp_path / "run")
    done = subprocess.run([sys.executable, "-c", BLOCK_OPENFL, "report", str(run)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "round 1/2: sites' held-out accuracy of the model after round 1 0.7500 (weighted by their held-out " \
           "sizes; hosp1 0.6000, hosp2 0.8000)" in out
    assert "round 2/2: sites' held-out accuracy of the final model 0.8500" in out and "left out: hosp3" in out
    assert "finished: 2 of 2 rounds; the sites' held-out accuracy of the final model 0.8500" in out
    assert f"metrics.csv, summary.json, rounds.jsonl in {run}" in out
    assert "openfl" not in (done.stdout + done.stderr).lower()


def test_report_on_an_operator_folder_and_a_site_workdir(tmp_path, capsys):
    folder = tmp_path / "fed"
    fake_flower_run(folder / "run")
    (folder / "deployment.json").write_text("{}")
    assert main(["report", str(folder)]) == 0
    assert "finished: 2 of 2 rounds" in capsys.readouterr().out
    site = tmp_path / "work" / "site_report" / "hosp1"
    site.mkdir(parents=True)
    (site / "rounds.jsonl").write_text(json.dumps({"round": 1, "rounds": 1, "accuracy": 0.9, "bytes_received": 0,
                                                   "bytes_sent": 0}) + "\n")
    assert main(["report", str(tmp_path / "work")]) == 0
    out = capsys.readouterr().out
    assert "hosp1, round 1/1 (final model): held-out accuracy 0.9000" in out and "rounds.jsonl in" in out
    assert main(["report", str(tmp_path / "work"), "--score"]) == 2
    assert "--score reads an OpenFL site workspace" in capsys.readouterr().err


def test_report_and_doctor_on_a_folder_that_is_neither_say_so_in_one_sentence(tmp_path, capsys):
    for command in ("report", "doctor"):
        assert main([command, str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"fedcontrast: error: {tmp_path} is neither an OpenFL workspace") and \
            err.count("\n") == 1


def flower_init(tmp_path, name, *extra):
    return main(["flower", "init", "--algorithm", "fedavg", "--sites", "hosp1,hosp2", "--input-shape", "1x8x8",
                 "--classes", "3", "--rounds", "2", *extra, str(tmp_path / name)])


def test_flower_ca_is_named_after_the_federation_and_doctor_checks_the_operator_folder(tmp_path, capsys):
    assert flower_init(tmp_path, "fed_moon") == 0
    out = capsys.readouterr().out
    assert "the federation's CA (CN=fed_moon fedcontrast CA,O=fed_moon)" in out
    ca = x509.load_pem_x509_certificate((tmp_path / "fed_moon" / "certs" / "ca.crt").read_bytes())
    assert ca.subject.rfc4514_string() == "CN=fed_moon fedcontrast CA,O=fed_moon"
    assert flower_init(tmp_path, "other", "--federation", "Cardiology 2026") == 0
    assert "CN=Cardiology 2026 fedcontrast CA" in capsys.readouterr().out
    assert main(["doctor", str(tmp_path / "fed_moon")]) == 0
    out = capsys.readouterr().out
    assert "OK    CA: CN=fed_moon fedcontrast CA" in out and "OK    SuperLink certificate" in out
    assert "WARN  sites: registered: none; not yet: hosp1, hosp2" in out


def test_flower_init_with_pki_from_keeps_the_ca_and_carries_the_registered_keys(tmp_path, capsys):
    from fedcontrast.flower.deploy import make_site_key

    assert flower_init(tmp_path, "exp1") == 0
    _, pub, fingerprint = make_site_key(tmp_path, "hosp1")
    (tmp_path / "exp1" / "sites.json").write_text(json.dumps({"hosp1": {
        "node_id": 7, "fingerprint": fingerprint, "public_key": " ".join(pub.read_text().split()[:2])}}))
    capsys.readouterr()
    assert flower_init(tmp_path, "exp2", "--pki-from", str(tmp_path / "exp1"), "--address", "agg.example.org") == 0
    out = capsys.readouterr().out
    old = fingerprint_of_chain((tmp_path / "exp1" / "certs" / "ca.crt").read_bytes(), "old")
    new = fingerprint_of_chain((tmp_path / "exp2" / "certs" / "ca.crt").read_bytes(), "new")
    assert old == new and "reused the CA of" in out and "the keys of hosp1; hosp2 send their key" in out
    assert "flower register" in out and "--carried" in out
    carried = tmp_path / "exp2" / "keys" / "hosp1.pub"
    from fedcontrast.flower.deploy import key_fingerprint

    assert key_fingerprint(carried) == fingerprint
    link = x509.load_pem_x509_certificate((tmp_path / "exp2" / "certs" / "superlink.crt").read_bytes())
    assert link.issuer == x509.load_pem_x509_certificate((tmp_path / "exp1" / "certs" / "ca.crt").read_bytes()).subject
    assert "agg.example.org" in str(link.extensions)
    assert (tmp_path / "exp2" / "certs" / "ca.key").stat().st_mode & 0o077 == 0
    assert flower_init(tmp_path, "exp3", "--pki-from", str(tmp_path)) == 2
    assert "is not a Flower operator's folder" in capsys.readouterr().err


def parse(*argv):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_dp_and_secure_aggregation_by_flags_in_every_create_command(tmp_path):
    base = ["--algorithm", "fedavg", "--sites", "hosp1,hosp2,hosp3", "--input-shape", "1x8x8", "--classes", "3"]
    for command in (["workspace", "create"], ["flower", "init"]):
        config = parse(*command, *base, "--dp-sgd", "1.1,0.5", "--dp-delta", "1e-6", "--secure-aggregation",
                       str(tmp_path / "x"))
        assert config.privacy.dp_sgd.noise_multiplier == 1.1 and config.privacy.dp_sgd.max_grad_norm == 0.5
        assert config.privacy.delta == 1e-6 and config.secure_aggregation is not None
    config = parse("simulate", "--algorithm", "fedssc", "--dp-representations", "2")
    assert config.privacy.representations.noise_multiplier == 2 and config.privacy.representations.clip == 1
    assert parse("simulate").privacy is None


def test_a_bad_dp_flag_is_one_sentence(tmp_path, capsys):
    assert main(["simulate", "--dp-sgd", "a,b,c"]) == 2
    assert "--dp-sgd expects NOISE or NOISE,CLIP" in capsys.readouterr().err
    assert main(["simulate", "--dp-delta", "1e-6"]) == 2
    assert "--dp-delta sets the δ of a DP guarantee" in capsys.readouterr().err


def test_the_openfl_ca_step_names_the_federation_in_fx_layout(tmp_path):
    from fedcontrast.openfl.pki import ca_subject, certify_workspace

    chain = certify_workspace(tmp_path / "fed_moon")
    assert ca_subject(chain) == "CN=fed_moon fedcontrast CA,O=fed_moon"
    certs = x509.load_pem_x509_certificates(chain.read_bytes())
    assert certs[1].subject.rfc4514_string() == "CN=fed_moon fedcontrast signing CA,O=fed_moon"
    assert certs[1].issuer == certs[0].subject
    ca = tmp_path / "fed_moon" / "cert" / "ca"
    for path in ("root-ca.crt", "signing-ca.crt", "signing-ca/private/signing-ca.key", "root-ca/private/root-ca.key"):
        assert (ca / path).is_file(), path  # where fx aggregator/collaborator certify look for them
    assert (ca / "signing-ca" / "private" / "signing-ca.key").stat().st_mode & 0o077 == 0
    assert "Simple" not in chain.read_text()


def test_the_audit_code_table_marks_the_libraries_pinned(tmp_path):
    from fedcontrast.provenance import LIBRARIES, code_lines, installed_version, requirements_text

    lines = code_lines("fedavg", requirements_text("fedavg").splitlines())
    for line in lines:
        if installed_version(line.distribution) is not None:
            assert line.pinned == line.installed and not line.mismatch, line
    assert {line.distribution for line in lines if line.pinned} >= {
        lib for lib in LIBRARIES if installed_version(lib) is not None} | {"fedcontrast"}
