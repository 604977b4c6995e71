"""``fedcontrast audit`` where it is run: at a site it counts that site's own data (as its
collaborator splits it) and computes nothing for the other sites; at the operator, who holds no
data, it says the counts are not known."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedcontrast.audit.report import audit_plan, load_plan
from fedcontrast.cli import main
from fedcontrast.config import DataSchema, RunConfig
from fedcontrast.data.schema import load_site_splits
from fedcontrast.errors import ConfigError
from fedcontrast.openfl.plan import DATA_YAML_HEADER, create_workspace
from fedcontrast.privacy.policy import SitePolicy

CLASSES = ("a", "b", "c")
PRIVACY = {"dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0},
           "representations": {"noise_multiplier": 2.0, "clip": 1.0}}


def images(root: Path, counts: dict[str, int]) -> Path:
    rng = np.random.default_rng(0)
    for cls, n in counts.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), "L").save(root / cls / f"{i}.png")
    return root


def deployment() -> RunConfig:
    return RunConfig(algorithm="fedssc", dataset="imagefolder", sites=("hosp1", "hosp2", "hosp3"), clients=3,
                     data_schema=DataSchema((1, 16, 16), CLASSES), rounds=3, min_samples=5, privacy=PRIVACY,
                     hyperparameters={"fedssc": {"min_class_samples": 6}})


def site_workspace(tmp_path: Path, lines: str) -> Path:
    ws = create_workspace(tmp_path / "ws", deployment(), tls=False)
    (ws / "plan" / "data.yaml").write_text(DATA_YAML_HEADER + lines)  # what `fedcontrast site join` writes
    return ws


def test_the_audit_at_a_site_counts_its_own_data_as_its_collaborator_splits_it(tmp_path, capsys):
    folder = images(tmp_path / "hosp1", {"a": 30, "b": 6})  # c absent; b falls under 6 once 20% is held out
    ws = site_workspace(tmp_path, f"hosp1,{folder}\n")
    plan, workspace = load_plan(ws)
    report = audit_plan(plan, source=str(ws), workspace=workspace)
    config = deployment()
    own = load_site_splits(folder, config.data_schema, test_fraction=config.test_fraction,
                           split_seed=config.split_seed)  # what the collaborator trains on
    trained = {c: int((own.train.y == i).sum()) for i, c in enumerate(CLASSES)}
    assert report.here == ["hosp1"]
    hosp1 = report.sites[0]
    assert (hosp1.name, hosp1.samples, hosp1.classes) == ("hosp1", len(own.train), trained)
    assert hosp1.held_out == len(own.test) and hosp1.classes_under_minimum == ["b"] and trained["b"] < 6
    given = audit_plan(plan, source="t", sites=[("hosp1", "x")], site_samples={"hosp1": len(own.train)})
    assert math.isfinite(hosp1.epsilon_total) and hosp1.epsilon_total == given.sites[0].epsilon_total
    others = report.sites[1:]
    assert [s.name for s in others] == ["hosp2", "hosp3"]
    assert all(s.samples is None and s.classes is None and s.samples_note.startswith("not known here")
               for s in others)
    assert all(math.isfinite(s.epsilon_total) for s in others)  # the plan's bound for its smallest site
    assert main(["audit", str(ws)]) == 0
    out = capsys.readouterr().out
    assert (f"hosp1, counted from its data on this machine: {len(own.train)} training samples, {len(own.test)} held "
            f"out; 2 of 3 classes present (a {trained['a']}, b {trained['b']}); absent: c") in out
    assert f"classes under min_class_samples (6), never shared: b ({trained['b']})" in out
    assert "unknown" not in out


def test_the_audit_at_a_site_computes_nothing_from_shards_it_does_not_hold(tmp_path):
    # A site's data.yaml holding the operator's shard lines for the others: not this site's to know.
    folder = images(tmp_path / "hosp1", {"a": 10, "b": 10, "c": 10})
    ws = site_workspace(tmp_path, f"hosp1,{folder}\nhosp2,shard:1\nhosp3,shard:2\n")
    plan, workspace = load_plan(ws)
    report = audit_plan(plan, source=str(ws), workspace=workspace)
    assert [(s.name, s.samples is None) for s in report.sites] == [("hosp1", False), ("hosp2", True),
                                                                   ("hosp3", True)]
    assert sum(report.sites[0].classes.values()) == report.sites[0].samples == 24  # 30 less 20% held out


def test_site_option_picks_this_site_of_a_demo_workspace_and_leaves_the_others_unknown(tmp_path, capsys):
    ws = create_workspace(tmp_path / "ws", RunConfig(algorithm="fedavg", dataset="digits", clients=3), tls=False)
    assert main(["audit", str(ws), "--site", "site_1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["here"] == ["site_1"]
    site_1 = report["sites"][1]
    assert site_1["samples"] == sum(site_1["classes"].values()) > 0
    assert [s["samples"] for s in report["sites"][::2]] == [None, None]


def test_the_audit_at_the_operator_says_counts_are_not_known(tmp_path, capsys):
    ws = site_workspace(tmp_path, "")
    assert main(["audit", str(ws)]) == 0
    out = capsys.readouterr().out
    assert "sample counts not known here" in out
    plan, workspace = load_plan(ws)
    report = audit_plan(plan, source=str(ws), workspace=workspace)
    assert report.here == [] and all(s.samples is None for s in report.sites)


def test_a_site_policy_is_checked_against_this_sites_own_epsilon(tmp_path, capsys):
    folder = images(tmp_path / "hosp1", {"a": 200, "b": 200})
    ws = site_workspace(tmp_path, f"hosp1,{folder}\n")
    policy = tmp_path / "policy.yaml"
    policy.write_text("accept_conditional_guarantees: true\n")
    plan, workspace = load_plan(ws)
    report = audit_plan(plan, source=str(ws), workspace=workspace, policy=SitePolicy.from_yaml(policy))
    own, bound = report.sites[0].epsilon_total, report.sites[1].epsilon_total
    assert own < bound  # more samples than the plan's smallest site
    policy.write_text(f"max_epsilon: {(own + bound) / 2}\naccept_conditional_guarantees: true\n"
                      "require_tls: false\nrequire_client_auth: false\n")  # this test's workspace has TLS off
    assert main(["audit", str(ws), "--policy", str(policy)]) == 0
    assert "compliant" in capsys.readouterr().out


@pytest.mark.parametrize("site, words", [
    ("hosp9", "--site hosp9: not a site of this plan (hosp1, hosp2, hosp3)"),
    ("hosp2", "has no line for hosp2"),
    ("hosp3", "hosp3's data folder"),
])
def test_a_wrong_site_is_one_sentence(tmp_path, capsys, site, words):
    folder = images(tmp_path / "hosp1", {"a": 5, "b": 5})
    ws = site_workspace(tmp_path, f"hosp1,{folder}\nhosp3,{tmp_path / 'gone'}\n")
    before = (ws / "plan" / "data.yaml").read_text()
    assert main(["audit", str(ws), "--site", site]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fedcontrast: error:") and words in err, err
    assert (ws / "plan" / "data.yaml").read_text() == before


def test_site_option_on_a_plan_file_outside_a_workspace_is_one_sentence(tmp_path, capsys):
    ws = site_workspace(tmp_path, f"hosp1,{images(tmp_path / 'hosp1', {'a': 5, 'b': 5})}\n")
    loose = tmp_path / "loose.yaml"
    loose.write_text((ws / "plan" / "plan.yaml").read_text())
    assert load_plan(loose)[1] is None
    assert main(["audit", str(loose), "--site", "hosp1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fedcontrast: error: --site hosp1:"), err
    assert "not in a workspace" in err
    assert main(["audit", str(loose)]) == 0  # without --site the plan file is audited as before


def test_data_lines_are_read_as_fx_reads_them(tmp_path):
    ws = site_workspace(tmp_path, "hosp1 ,x\n")  # fx's name is "hosp1 ": hosp1 itself has no line
    plan, workspace = load_plan(ws)
    report = audit_plan(plan, source=str(ws), workspace=workspace)
    assert [(s.name, s.data) for s in report.sites] == [("hosp1 ", "x"), ("hosp1", "its own folder (not here)"),
                                                        ("hosp2", "its own folder (not here)"),
                                                        ("hosp3", "its own folder (not here)")]
    (ws / "plan" / "data.yaml").write_text("hosp1 x\n")
    with pytest.raises(ConfigError, match=r"line 1 of .*data.yaml is not NAME,PATH \('hosp1 x'\)"):
        audit_plan(plan, source=str(ws), workspace=workspace)
