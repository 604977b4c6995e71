"""`fedcontrast doctor`: a site checks its workspace before joining (its certificate and key, the
aggregator's certificate, its data line, its policy); one line per check, non-zero exit on a failure."""

import shutil

from fedcontrast.cli import main
from fedcontrast.openfl.plan import create_workspace
from fedcontrast.privacy.policy import POLICY_FILE

from .conftest import small_config
from .test_tls_diagnostics import FakeAggregator


def site_workspace(tmp_path, pki, *, port=None):
    ws = create_workspace(tmp_path / "ws", small_config(), **({"port": port} if port else {}))
    shutil.rmtree(ws / "cert")
    shutil.copytree(pki["cert"], ws / "cert")
    return ws


def doctor(ws, capsys, *args):
    code = main(["doctor", str(ws), *args])
    out, err = capsys.readouterr()
    return code, out.strip().splitlines(), err


def test_a_good_workspace_passes_and_an_absent_aggregator_is_a_warning(tmp_path, pki, capsys):
    ws = site_workspace(tmp_path, pki)
    code, lines, err = doctor(ws, capsys, "--name", "site_0")
    assert code == 0 and err == ""
    assert [line.split()[0] for line in lines] == ["OK", "OK", "WARN", "OK", "OK", "OK", "OK", "OK"]
    assert lines[5] == "OK    shared files: the plan shares no files among the sites"
    assert lines[6].startswith("OK    code: no code in the workspace; the plan runs only installed code: fedcontrast ")
    assert lines[7] == "OK    transport: mutual TLS (the aggregator and this site each prove who they are)"
    assert lines[1].startswith("OK    certificate: cert/client/col_site_0.crt (CN=site_0) fits its key, is signed by "
                               "the federation's CA")
    assert "run the doctor again once the operator has started the aggregator" in lines[2]


def test_a_running_aggregator_with_the_federations_certificate_passes(tmp_path, pki, capsys):
    server = FakeAggregator(pki["cert"] / "server" / "agg_localhost.crt", pki["cert"] / "server" / "agg_localhost.key",
                            client_ca=pki["cert"] / "cert_chain.crt")
    try:
        ws = site_workspace(tmp_path, pki, port=server.port)
        code, lines, _ = doctor(ws, capsys, "--name", "site_1")
    finally:
        server.close()
    assert code == 0
    assert lines[2] == (f"OK    aggregator: localhost:{server.port} (the plan's agg_addr:agg_port) presents a "
                        "certificate for localhost signed by the federation's CA and accepts this site's certificate")


def test_a_certificate_from_another_ca_fails_with_the_cause(tmp_path, pki, capsys):
    ws = site_workspace(tmp_path, pki)
    for suffix in ("crt", "key"):
        shutil.copyfile(pki["other_ca_client"] / f"col_site_1.{suffix}",
                        ws / "cert" / "client" / f"col_site_1.{suffix}")
    code, lines, err = doctor(ws, capsys, "--name", "site_1")
    assert code == 1
    failed = [line for line in lines if line.startswith("FAIL")]
    assert len(failed) == 1 and failed[0].startswith("FAIL  certificate: the certificate ")
    assert "col_site_1.crt (CN=site_1) is issued by" in failed[0] and "not by the federation's CA in" in failed[0]
    assert err.startswith("fedcontrast doctor: 1 check failed (certificate)")


def test_a_bad_data_line_and_a_refusing_policy_fail_and_a_missing_name_is_asked_for(tmp_path, pki, capsys):
    ws = site_workspace(tmp_path, pki)
    (ws / "plan" / "data.yaml").write_text("site_0,shard:7\n")
    (ws / POLICY_FILE).write_text("max_epsilon: 5.0\n")
    code, lines, err = doctor(ws, capsys)  # the one site data.yaml names
    assert code == 1
    data, policy = [line for line in lines if line.startswith("FAIL")]
    assert data.startswith("FAIL  data: data path 'shard:7' in plan/data.yaml must be shard:N with 0 <= N < 2")
    assert policy.startswith(f"FAIL  policy: this site's policy {ws / POLICY_FILE} refuses the plan")
    assert "without differential privacy" in policy and "the policy's max_epsilon is 5" in policy
    (ws / "plan" / "data.yaml").write_text("site_0,shard:0\nsite_1,shard:1\n")
    code, lines, err = doctor(ws, capsys)
    assert code == 2 and lines == []
    assert err.strip().endswith("names 2 sites (site_0, site_1); say which one this is with --name")


def test_a_data_line_without_a_comma_is_a_failed_check_with_its_line(tmp_path, pki, capsys):
    ws = site_workspace(tmp_path, pki)
    (ws / "plan" / "data.yaml").write_text("# comment\nsite_0,shard:0\nsite_1 shard:1\n")  # fx would stop on line 3
    code, lines, err = doctor(ws, capsys, "--name", "site_0")
    assert code == 1
    failed = [line for line in lines if line.startswith("FAIL")]
    assert failed == [f"FAIL  data: line 3 of {ws / 'plan' / 'data.yaml'} is not NAME,PATH ('site_1 shard:1'); "
                      "OpenFL would stop on it: correct it, or write this site's line again with `fedcontrast site "
                      "join`"]
    assert err.startswith("fedcontrast doctor: 1 check failed (data)")


def test_a_sites_report_mixing_runs_is_named_in_its_workspace(tmp_path, pki, capsys):
    """Issue 46: a site's take-home table holding rows of two experiments (the layout from before per-run
    folders, no run label) is a failed check naming the file; a report kept per run passes."""
    import json

    from fedcontrast.site.report import SiteReport

    ws = site_workspace(tmp_path, pki)
    old = ws / "local_state" / "site_report" / "site_0"
    old.mkdir(parents=True)
    (old / "rounds.jsonl").write_text("".join(json.dumps({"round": r, "rounds": n}) + "\n"
                                              for r, n in ((1, 4), (4, 4), (5, 5))))
    code, lines, err = doctor(ws, capsys, "--name", "site_0")
    assert code == 1 and "(report)" in err
    [failed] = [line for line in lines if line.startswith("FAIL")]
    assert failed.startswith(f"FAIL  report: site_0: {old / 'rounds.jsonl'} holds rows of at least 2 runs")
    (old / "rounds.jsonl").unlink()
    SiteReport(old, "site_0", 2, None, run="fed_1a2b3c4d").evaluated(0, {"accuracy": 0.5}, 10, 0)
    code, lines, _ = doctor(ws, capsys, "--name", "site_0")
    assert code == 0 and lines[-1].startswith("OK    report: site_0: run fed_1a2b3c4d: its report reaches round 0")
