"""`fedcontrast site roster`: every member's key fingerprint from certificates, SuperNode keys and the
operator's folders, as one table and a `peers:` block a site policy takes as is."""

from __future__ import annotations

import datetime as dt
import json
import re

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
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + dt.timedelta(days=1)).sign(key, hashes.SHA256()))


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


# --- the roster pins the members, the threshold and the federation: the operator chooses none of them ----
HOSPITALS = ("hosp1", "hosp2", "hosp3", "hosp4", "hosp5")
PINS = {s: "SHA256:" + f"{i}" * 64 for i, s in enumerate(HOSPITALS, 1)}


def audited(sites, **secure):
    from fedcontrast.audit.report import audit_plan
    from fedcontrast.config import RunConfig

    config = RunConfig(algorithm="fedavg", sites=tuple(sites), clients=len(sites), secure_aggregation=secure)
    plan = {"task_runner": {"settings": {"run_config": config.to_dict()}}, "network": {"settings": {}},
            "aggregator": {"settings": {"rounds_to_train": config.rounds}}}
    return audit_plan(plan, source="plan", sites=[], site_samples={})


def agreed(**changes):
    return SitePolicy(**{"require_secure_aggregation": True, "min_secure_sites": 3, "federation": "hospitals-2026",
                         "secure_threshold": 4, "peers": PINS, **changes})


def test_an_operator_that_leaves_members_out_of_the_plan_is_refused_naming_them():
    """The attack: five hospitals agreed on t = 4; the operator plans the victim and two colluders with
    t = 3, which min_secure_sites 3 alone would pass, and the colluders would read the victim's upload."""
    from fedcontrast.privacy.policy import check_policy

    report = audited(("hosp1", "hosp2", "hosp3"), threshold=3, federation="hospitals-2026")
    assert report.secure_sum_sites == 3 and report.secure_threshold == 3
    violations = check_policy(report, agreed())
    members = [v for v in violations if "not the federation the sites pinned" in v]
    assert len(members) == 1 and "it leaves out hosp4, hosp5" in members[0]
    assert "dropout path, never by leaving it out of the plan" in members[0]
    assert any("threshold is 3 but the sites agreed on 4" in v for v in violations)


def test_a_plan_of_every_member_with_another_threshold_or_federation_is_refused_and_the_honest_one_passes():
    from fedcontrast.privacy.policy import check_policy

    lower = check_policy(audited(HOSPITALS, threshold=3, federation="hospitals-2026"), agreed())
    assert lower == ["the plan's secure-aggregation threshold is 3 but the sites agreed on 4 (the policy's "
                     "secure_threshold): the operator does not choose the threshold"]
    other = check_policy(audited(HOSPITALS, threshold=4, federation="hospitals-2025"), agreed())
    assert len(other) == 1 and "federation hospitals-2025" in other[0] and "pins federation hospitals-2026" in other[0]
    unnamed = check_policy(audited(HOSPITALS, threshold=4), agreed())
    assert len(unnamed) == 1 and unnamed[0].startswith("the plan names no federation (secure_aggregation.federation)")
    stranger = check_policy(audited((*HOSPITALS[:4], "hosp9"), threshold=4, federation="hospitals-2026"), agreed())
    assert any("it leaves out hosp5; it names hosp9, not pinned" in v for v in stranger)
    assert check_policy(audited(HOSPITALS, threshold=4, federation="hospitals-2026"), agreed()) == []
    # no secure_threshold: the agreed one is the default for the pinned members (⌊2·5/3⌋ + 1 = 4); no federation
    # pinned: any name passes
    assert check_policy(audited(HOSPITALS), agreed(secure_threshold=None, federation=None)) == []
    assert check_policy(audited(HOSPITALS, threshold=5), agreed(secure_threshold=None, federation=None)) == [
        "the plan's secure-aggregation threshold is 5 but the sites agreed on 4 (the default ⌊2n/3⌋ + 1 for the 5 "
        "members the policy pins): the operator does not choose the threshold"]


def roster_of(tmp_path, capsys, keys, *options):
    for site, key in keys.items():
        (tmp_path / f"{site}.pub").write_bytes(openssh(key))
    assert main(["site", "roster", *[str(tmp_path / f"{s}.pub") for s in keys], *options]) == 0
    out = capsys.readouterr().out
    digest = next(line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("roster digest: "))
    return out, digest


def test_the_roster_block_is_a_policy_and_its_digest_covers_members_keys_threshold_and_federation(tmp_path, capsys):
    from fedcontrast.audit.format import roster_facts

    keys = {s: ec.generate_private_key(ec.SECP384R1()) for s in HOSPITALS}
    out, digest = roster_of(tmp_path, capsys, keys, "--federation", "hospitals-2026")
    assert "threshold 4 of 5 (the default ⌊2n/3⌋ + 1; --threshold T sets another, from 3 to 5)" in out
    assert sum(line.startswith("roster digest: SHA256:") for line in out.splitlines()) == 1
    block = yaml.safe_load(out[out.index("federation: hospitals-2026"):])
    assert block == {"federation": "hospitals-2026", "secure_threshold": 4,
                     "peers": {s: fingerprint(k.public_key()) for s, k in keys.items()}}
    policy = SitePolicy(require_secure_aggregation=True, **block)
    assert roster_facts(policy)["digest"] == digest  # what the audit prints from the policy is what was read aloud
    seen = {digest}
    for options, changed in [(("--federation", "hospitals-2027"), keys),
                             (("--federation", "hospitals-2026", "--threshold", "5"), keys),
                             (("--federation", "hospitals-2026"), {**keys, "hosp5": ec.generate_private_key(
                                 ec.SECP384R1())}),
                             (("--federation", "hospitals-2026"), {s: keys[s] for s in HOSPITALS[:4]}),
                             (("--federation", "hospitals-2026"), {**keys, "hosp6": ec.generate_private_key(
                                 ec.SECP384R1())})]:  # a key of its own: one key under two names is refused
        for stale in tmp_path.glob("*.pub"):
            stale.unlink()
        seen.add(roster_of(tmp_path, capsys, changed, *options)[1])
    assert len(seen) == 6
    again = roster_of(tmp_path, capsys, {s: keys[s] for s in reversed(HOSPITALS)}, "--federation", "hospitals-2026")
    assert again[1] == digest  # the order the keys were given in does not matter
    # without --federation, one is derived from the members' keys, and the output says so
    out, _ = roster_of(tmp_path, capsys, keys, "--threshold", "3")
    assert "(derived from the members' keys, as no --federation was given" in out
    block = yaml.safe_load(out[out.index("federation: fed-"):])
    assert block["secure_threshold"] == 3 and SitePolicy(**block).federation.startswith("fed-")


def test_the_roster_refuses_a_threshold_below_a_majority_or_above_the_members(tmp_path, capsys):
    keys = {s: ec.generate_private_key(ec.SECP384R1()) for s in HOSPITALS}
    for site, key in keys.items():
        (tmp_path / f"{site}.pub").write_bytes(openssh(key))
    paths = [str(tmp_path / f"{s}.pub") for s in HOSPITALS]
    for bad in ("2", "6"):
        assert main(["site", "roster", *paths, "--threshold", bad]) == 2
        assert f"--threshold {bad} is outside 3..5 for a roster of 5 members" in capsys.readouterr().err
    assert main(["site", "roster", *paths, "--federation", "two words"]) == 2
    assert "--federation must be a name of letters" in capsys.readouterr().err
    out, _ = roster_of(tmp_path, capsys, keys, "--federation", "2026")  # a name YAML would read as a number: quoted
    assert yaml.safe_load(out[out.index("federation: "):])["federation"] == "2026"


@pytest.mark.parametrize("changes, sentence", [
    ({"secure_threshold": 2}, "policy secure_threshold must be an integer from 3 (a majority) to 5, for the 5 members "
                              "under peers:, got 2"),
    ({"secure_threshold": 6}, "policy secure_threshold must be an integer from 3 (a majority) to 5"),
    ({"secure_threshold": "4"}, "policy secure_threshold must be an integer from 3"),
    ({"secure_threshold": True}, "policy secure_threshold must be an integer from 3"),
    ({"secure_threshold": 1, "peers": None}, "policy secure_threshold must be an integer >= 2, got 1"),
    ({"federation": 2026}, "policy federation must be the federation's name as the sites agreed it"),
    ({"federation": ""}, "policy federation must be the federation's name"),
    ({"federation": "a b"}, "policy federation must be the federation's name"),
])
def test_a_bad_secure_threshold_or_federation_in_a_policy_is_one_sentence(changes, sentence):
    from fedcontrast.errors import ConfigError

    with pytest.raises(ConfigError, match="^" + re.escape(sentence)):
        agreed(**changes)


def test_the_protocol_refuses_a_plan_other_than_the_pinned_roster():
    """Defence in depth: a site's own protocol step checks the plan's sites and threshold against the
    roster its policy pins (PinnedKeys), whatever the policy check before it said."""
    import numpy as np

    from fedcontrast.privacy.policy import agreed_roster
    from fedcontrast.privacy.secagg import Quantizer, SecureAggregationError
    from fedcontrast.privacy.secagg_protocol import PinnedKeys, SecAggSteps

    key = ec.generate_private_key(ec.SECP384R1())
    members, threshold = agreed_roster(agreed())
    assert members == list(HOSPITALS) and threshold == 4
    pinned = PinnedKeys(lambda s, t: None, PINS, True, members, threshold)

    def steps(sites, t):
        return SecAggSteps("hosp1", list(sites), t, 1, key, "cert", pinned, np.zeros(4),
                           Quantizer.for_sites(10.0, len(sites)))

    with pytest.raises(SecureAggregationError, match=r"^the plan's secure sum \(hosp1, hosp2, hosp3; threshold 3\) is "
                                                     r"not the roster this site's policy pins \(hosp1, hosp2, hosp3, "
                                                     r"hosp4, hosp5; threshold 4\): this site takes no part"):
        steps(HOSPITALS[:3], 3)
    with pytest.raises(SecureAggregationError, match="threshold 3"):
        steps(HOSPITALS, 3)
    assert steps(HOSPITALS, 4).plan_sites == list(HOSPITALS)
    assert agreed_roster(agreed(require_secure_aggregation=False)) == (None, None)  # a pin only: no roster check


def test_the_audit_shows_the_roster_a_policy_pins_and_a_plan_names_its_federation(tmp_path, capsys):
    """`workspace create --secagg federation=…` puts the name in the plan (as text, whatever YAML would
    read it as); `fedcontrast audit --policy` prints the agreed roster, its digest and what a plan may
    change, and refuses a plan of other members."""
    from fedcontrast.audit.format import roster_facts

    ws = tmp_path / "ws"
    assert main(["workspace", "create", str(ws), "--algorithm", "fedavg", "--sites", ",".join(HOSPITALS),
                 "--secagg", "federation=2026"]) == 0  # the default threshold for 5 sites: 4
    plan = yaml.safe_load((ws / "plan" / "plan.yaml").read_text())
    assert plan["task_runner"]["settings"]["run_config"]["secure_aggregation"]["federation"] == "2026"
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"require_secure_aggregation": True, "federation": "2026", "secure_threshold": 4,
                                      "peers": PINS}))
    capsys.readouterr()
    assert main(["audit", str(ws), "--policy", str(policy)]) == 0
    out = capsys.readouterr().out
    digest = roster_facts(SitePolicy.from_yaml(policy))["digest"]
    assert "  federation: 2026 (secure_aggregation.federation)" in out
    assert ("roster the sites agreed: federation 2026; threshold 4 of 5; members hosp1, hosp2, hosp3, hosp4, hosp5"
            in out)
    assert f"  roster digest: {digest} (as `fedcontrast site roster` prints it" in out
    assert "a plan may change the training settings, rounds, DP, the clip, bits" in out
    assert "but not the members, the threshold or the federation" in out
    assert main(["audit", str(ws), "--policy", str(policy), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["roster"] == {"federation": "2026", "threshold": 4,
                                                             "members": list(HOSPITALS), "digest": digest}
    policy.write_text(yaml.safe_dump({"require_secure_aggregation": True, "federation": "2026",
                                      "peers": {**PINS, "hosp6": "SHA256:" + "6" * 64}}))
    assert main(["audit", str(ws), "--policy", str(policy)]) == 1
    captured = capsys.readouterr()
    assert "VIOLATION: the plan's secure sum is not the federation the sites pinned" in captured.out
    assert "it leaves out hosp6" in captured.out and "threshold 5 of 6 (the default ⌊2n/3⌋ + 1)" in captured.out


def test_one_key_under_two_site_names_is_refused_naming_both(tmp_path, capsys):
    """Issue 46: the same key registered for hosp1 and hosp2 (in a Flower operator's registry, or as two
    key files) passed `site roster`: whoever holds it could speak for both sites. Refused in one
    sentence naming both sites; a policy that pins one key for two sites is refused too."""
    key = ec.generate_private_key(ec.SECP384R1())
    other = ec.generate_private_key(ec.SECP384R1())
    flower = tmp_path / "flower"
    flower.mkdir()
    (flower / "sites.json").write_text(json.dumps({s: {"node_id": i, "fingerprint": "x",
                                                       "public_key": openssh(k).decode()}
                                                   for i, (s, k) in enumerate((("hosp1", key), ("hosp2", key),
                                                                               ("hosp3", other)))}))
    files = tmp_path / "files"
    files.mkdir()
    (files / "hosp1.pub").write_bytes(openssh(other) + b"\n")
    (files / "hosp4.pub").write_bytes(openssh(other) + b"\n")
    shown = fingerprint(key.public_key())
    for source, (a, b, fp) in ((flower, ("hosp1", "hosp2", shown)),
                               (files, ("hosp1", "hosp4", fingerprint(other.public_key())))):
        assert main(["site", "roster", str(source)]) != 0
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err
        assert f"sites {a} and {b} have the same key {fp}" in err and "one party could speak for both sites" in err
    from fedcontrast.errors import ConfigError

    with pytest.raises(ConfigError, match=f"policy peers: sites hosp1 and hosp2 are pinned to the same key {shown}"):
        SitePolicy(require_secure_aggregation=True, peers={"hosp1": shown, "hosp2": shown})
