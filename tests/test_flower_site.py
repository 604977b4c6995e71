"""The Flower engine's pieces that need no Flower: a site's handling of each message in plain data
(:func:`fedcontrast.flower.site_app.handle`, what its worker and its ClientApp run), and the parties'
files (:mod:`fedcontrast.flower.deploy`). The deployment itself is tested across hosts in
tests/flower (the Flower environment)."""

from __future__ import annotations

import io
import json
import os
import socket
import stat

import numpy as np
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedcontrast.cli.common import parse_classes, parse_input_shape
from fedcontrast.config import DataSchema, RunConfig
from fedcontrast.construction import (
    build_algorithm,
    data_shape,
    initial_model,
    server_seed,
)
from fedcontrast.errors import ConfigError
from fedcontrast.flower import deploy, site_app

SITES = ("hosp1", "hosp2")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from fedcontrast.data.folders import write_site_folders

    root = tmp_path_factory.mktemp("flower_site")
    return write_site_folders(RunConfig(dataset="digits", clients=2, sites=SITES, seed=0), root / "data")


def plan(algorithm="moon", **changes) -> RunConfig:
    schema = DataSchema(parse_input_shape("1x32x32"), parse_classes("10"))
    from fedcontrast.config import TrainingConfig

    return RunConfig(algorithm=algorithm, dataset="imagefolder", data_schema=schema, sites=SITES, clients=2, rounds=2,
                     training=TrainingConfig(local_epochs=1), min_samples=5, seed=3, **changes)


def settings(folders, tmp_path, site="hosp1", **extra):
    return {"site-name": site, "data": str(folders[site]), "workdir": str(tmp_path / site), "threads": "1",
            "tls": "true", "node-auth": "true", **extra}


def downlink(config: RunConfig) -> dict[str, np.ndarray]:
    from fedcontrast.algorithms import ServerContext

    shape = data_shape(config)
    model = initial_model(config, **shape)
    server = ServerContext(model=model, round_num=0, seed=server_seed(config, 0), device=torch.device("cpu"),
                           num_classes=shape["num_classes"])
    return {k: v.numpy() for k, v in build_algorithm(config).initial_downlink(server).global_tensors.items()}


@pytest.fixture(autouse=True)
def fresh_runtimes():
    site_app._RUNTIMES.clear()
    cwd = os.getcwd()
    yield
    site_app._RUNTIMES.clear()
    os.chdir(cwd)  # a runtime works in its site's folder


def test_a_site_answers_each_message_and_its_state_round_trips(folders, tmp_path):
    config = plan()
    text = json.dumps(config.to_dict())
    s = settings(folders, tmp_path)
    reply, state = site_app.handle("query", 7, text, s, {}, None)
    assert reply == {"site": {"site": "hosp1"}} and state is None
    content = {"task": {"round": 1}, "received": downlink(config)}
    reply, state = site_app.handle("train", 7, text, s, content, None)
    specs = build_algorithm(config).upload_specs(initial_model(config, **data_shape(config)), 10)
    assert set(reply["uploads"]) == {spec.name for spec in specs}
    outcome = reply["outcome"]
    assert outcome["site"] == "hosp1" and outcome["weight"] > 0
    assert "loss" in json.loads(outcome["metrics"])["train"]
    assert json.loads(outcome["evaluation"])["samples"] > 0
    kept = torch.load(io.BytesIO(state), weights_only=True)
    assert kept  # MOON keeps its previous model at the site
    # the copy on the site's disk is this run's, byte for byte
    assert (tmp_path / "hosp1" / "local_state" / "hosp1.run7.pt").read_bytes() == state

    # Round 2 from the state the SuperNode kept equals round 2 in a runtime that never stopped.
    second = {"task": {"round": 2}, "received": {k: v.numpy() for k, v in
                                                  site_app._tensors(reply["uploads"], torch.device("cpu")).items()
                                                  if k in content["received"]}}
    again, _ = site_app.handle("train", 7, text, s, second, state)
    site_app._RUNTIMES.clear()  # a new worker: everything from the message and the kept state
    fresh, state_b = site_app.handle("train", 7, text, s, second, state)
    for name in again["uploads"]:
        assert np.array_equal(again["uploads"][name], fresh["uploads"][name]), name
    final, none = site_app.handle("evaluate", 7, text, s, {"task": {"round": 3}, "received": second["received"]},
                                  state_b)
    assert none is None and json.loads(final["outcome"]["evaluation"])["accuracy"] >= 0
    report = tmp_path / "hosp1" / "site_report" / "hosp1" / "7"  # this run's own folder (no label: Flower's run)
    assert (report / "final_model.pt").exists() and (tmp_path / "hosp1" / "site_report" / "hosp1" / "latest" /
                                                     "final_model.pt").exists()
    assert [json.loads(line)["round"] for line in (report / "rounds.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_a_site_refuses_before_reading_any_data(folders, tmp_path):
    config = plan()
    policy = tmp_path / "policy.yaml"
    policy.write_text("allow_weights: false\n")
    s = settings(folders, tmp_path, data=str(tmp_path / "no such folder"), policy=str(policy))
    with pytest.raises(site_app.SiteRefused, match="^this site's policy .* refuses the plan before any data is read"):
        site_app.handle("query", 1, json.dumps(config.to_dict()), s, {}, None)
    with pytest.raises(site_app.SiteRefused, match="not one of the plan's sites"):
        site_app.handle("query", 2, json.dumps(config.to_dict()), {**settings(folders, tmp_path), "site-name": "hosp9"},
                        {}, None)


def test_a_refusal_or_a_failure_becomes_the_sites_reply(folders, tmp_path, capsys):
    """What the worker and the ClientApp send back (site_app.answer): a reply holding one sentence,
    which the operator's ServerApp names within seconds, never a ClientApp that stops without one."""
    config = plan()
    policy = tmp_path / "policy.yaml"
    policy.write_text("allow_weights: false\n")
    s = settings(folders, tmp_path, policy=str(policy))
    reply, state = site_app.answer(kind="query", run_id=1, run_config=json.dumps(config.to_dict()), settings=s,
                                   content={}, state=None)
    refusal = reply[site_app.REFUSAL_RECORD]
    assert state is None and refusal["kind"] == "refused" and refusal["site"] == "hosp1"
    assert refusal["sentence"].startswith("this site's policy") and "refuses the plan" in refusal["sentence"]
    assert "site hosp1 refused: this site's policy" in capsys.readouterr().out  # the site's own log says it too
    reply, _ = site_app.answer(kind="train", run_id=2, run_config=json.dumps(config.to_dict()),
                               settings=settings(folders, tmp_path), content={"task": {}}, state=None)
    assert reply[site_app.REFUSAL_RECORD]["kind"] == "failed"  # a bug is a failure, named as one
    assert reply[site_app.REFUSAL_RECORD]["sentence"].startswith("KeyError")


def test_shared_files_are_written_only_when_the_plan_pins_them(folders, tmp_path):
    data = b"frozen backbone"
    pinned = plan("fedpcl", hyperparameters={"fedpcl": {"backbone_files": ["save/backbones/b0.pt"],
                                                        "backbone_sha256": ["0" * 64]}})
    with pytest.raises(site_app.SiteRefused, match="does not match the plan's SHA-256 pin"):
        site_app.handle("query", 3, json.dumps(pinned.to_dict()), settings(folders, tmp_path), {
            "shared": {"save/backbones/b0.pt": data}}, None)
    assert not (tmp_path / "hosp1" / "save" / "backbones" / "b0.pt").exists()
    with pytest.raises(site_app.SiteRefused, match="does not pin"):
        site_app.handle("query", 4, json.dumps(pinned.to_dict()), settings(folders, tmp_path), {
            "shared": {"../../evil.py": data}}, None)


# --- the parties' files ---------------------------------------------------------------------------
def test_a_site_key_stays_private_and_its_fingerprint_is_the_public_keys(tmp_path):
    private, public, fingerprint = deploy.make_site_key(tmp_path, "hosp1")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    key = serialization.load_ssh_public_key(public.read_bytes())
    assert isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp384r1"
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    import hashlib

    assert fingerprint == "SHA256:" + hashlib.sha256(der).hexdigest()
    with pytest.raises(ConfigError, match="exists already"):
        deploy.make_site_key(tmp_path, "hosp1")
    (tmp_path / "junk.pub").write_text("not a key")
    with pytest.raises(ConfigError, match="not an OpenSSH public key"):
        deploy.key_fingerprint(tmp_path / "junk.pub")


def test_the_operator_folder_holds_certificates_and_an_app_without_code(tmp_path):
    folder = deploy.init_operator(tmp_path / "op", plan(), host="agg.example.org", port=9100)
    certs = folder / "certs"
    ca = x509.load_pem_x509_certificate((certs / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((certs / "superlink.crt").read_bytes())
    ca.public_key().verify(server.signature, server.tbs_certificate_bytes, ec.ECDSA(hashes.SHA384()))
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"agg.example.org", "localhost"} <= set(names.get_values_for_type(x509.DNSName))
    assert "127.0.0.1" in {str(a) for a in names.get_values_for_type(x509.IPAddress)}
    assert stat.S_IMODE((certs / "ca.key").stat().st_mode) == 0o600
    app = (folder / "app" / "pyproject.toml").read_text()
    assert 'serverapp = "fedcontrast.flower.server_app:server"' in app
    assert 'clientapp = "fedcontrast.flower.client_app:client"' in app
    assert not list((folder / "app").rglob("*.py"))
    import tomllib

    run_config = tomllib.loads(app)["tool"]["flwr"]["app"]["config"]
    assert RunConfig.from_dict(json.loads(run_config["fedcontrast-config"])) == plan()
    assert 'address = "agg.example.org:9100"' in (folder / "flwr_home" / "config.toml").read_text()
    with pytest.raises(ConfigError, match="holds a Flower deployment already"):
        deploy.init_operator(folder, plan(), host="agg.example.org")


def test_registration_and_runs_refuse_in_one_sentence(tmp_path):
    folder = deploy.init_operator(tmp_path / "op", plan(), host="localhost")
    _, public, fingerprint = deploy.make_site_key(tmp_path, "k")
    with pytest.raises(ConfigError, match="'hosp9' is not a site of this deployment"):
        deploy.register_site(folder, public, "hosp9")
    (folder / "sites.json").write_text(json.dumps({"hosp1": {"node_id": 1, "fingerprint": fingerprint}}))
    with pytest.raises(ConfigError, match="registered for site hosp1 already"):
        deploy.register_site(folder, public, "hosp2")
    with pytest.raises(ConfigError, match=r"site\(s\) hosp2 have no registered key"):
        deploy.run_command(folder)
    with pytest.raises(ConfigError, match="not a Flower deployment folder"):
        deploy.load_operator(tmp_path)


def test_a_supernode_names_what_it_lacks_before_it_starts(tmp_path, folders):
    private, _, _ = deploy.make_site_key(tmp_path, "hosp1")
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    common = {"superlink": "agg:9092", "ca": ca, "key": private, "name": "hosp1", "workdir": tmp_path}
    with pytest.raises(ConfigError, match="data folder .* does not exist"):
        deploy.supernode_command(**common, data=tmp_path / "nothing")
    with pytest.raises(ConfigError, match="must be HOST:PORT"):
        deploy.supernode_command(**{**common, "superlink": "agg"}, data=folders["hosp1"])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ConfigError, match=f"port {busy.getsockname()[1]} on this machine is in use"):
            deploy.supernode_command(**common, data=folders["hosp1"], port=busy.getsockname()[1])


def test_a_sites_clientapp_process_refuses_code_from_the_operators_bundle(tmp_path):
    """The interpreter-start guard (fedcontrast_fx_guard.pth) in a process named flwr-clientapp of a
    SuperNode that `fedcontrast flower supernode` started: a module inside FLWR_HOME/apps is refused
    before any of it runs; installed modules load as usual."""
    import subprocess
    import sys

    bundle = tmp_path / "home" / "apps" / "operator.app.1.0.0"
    bundle.mkdir(parents=True)
    (bundle / "evil.py").write_text("open('ran', 'w').write('yes')\n")
    script = tmp_path / "flwr-clientapp"
    script.write_text(f"import sys, json\nsys.path.insert(0, {str(bundle)!r})\nimport json\nimport evil\n")
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "home"), "FEDCONTRAST_FLOWER_SITE": "1"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 1
    assert "the operator's Flower app bundle carries code (evil" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "ran").exists()
    env.pop("FEDCONTRAST_FLOWER_SITE")  # another Flower app in this environment is left alone
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0 and (tmp_path / "ran").exists()


# --- secure aggregation at a Flower site ------------------------------------------------------------
def secure_sites(folders, tmp_path, *, pins=True, also=""):
    """hosp1 and hosp2 under secure aggregation, each with its SuperNode key and a policy that requires
    secure aggregation and pins the roster (``pins``: the federation, its threshold and every member's
    key, ``also`` more pinned members' lines); returns (plan text, settings by site, keys)."""
    from fedcontrast.privacy.secagg import fingerprint

    config = plan("fedavg", secure_aggregation={"federation": "hospitals-2026"})
    keys = {s: deploy.make_site_key(tmp_path / "keys", s) for s in SITES}
    public = {s: serialization.load_ssh_public_key(keys[s][1].read_bytes()) for s in SITES}
    out = {}
    roster = ("federation: hospitals-2026\nsecure_threshold: 2\npeers:\n"  # as site roster prints it
              + "".join(f"  {s}: {fingerprint(public[s])}\n" for s in SITES) + also)
    for site in SITES:
        policy = tmp_path / f"{site}-policy.yaml"
        policy.write_text("require_secure_aggregation: true\n" + (roster if pins else ""))
        out[site] = settings(folders, tmp_path, site, policy=str(policy), worker="1",
                             **{"signing-key": str(keys[site][0])})
    return json.dumps(config.to_dict()), out, keys


def secure_exchange(text, sts, config, relay, answers=None):
    """Each site's train reply (its advert), then the four query.secagg steps through ``relay``;
    ``answers(site, kind, honest)`` may replace what the relay answers. Returns the errors by site."""
    from fedcontrast.flower.secure import PHASES

    answers = answers or (lambda site, kind, honest: honest)
    content = {"task": {"round": 1}, "received": downlink(config)}
    errors = {}
    for site in SITES:
        reply, _ = site_app.handle("train", 5, text, sts[site], content, None)
        relay.receive(site, 1, "advert", bytes(reply["secagg"]["payload"]))
    for phase, answer in PHASES:
        if phase == "graph" and relay.full:
            continue
        for site in relay.members[relay.phase]:
            if site in errors:
                continue
            message = {"task": {"round": 1, "phase": phase},
                       "secagg": {"payload": answers(site, answer, relay.answer(site, 1, answer))}}
            try:
                reply, _ = site_app.handle("secagg", 5, text, sts[site], message, None)
            except Exception as exc:  # noqa: BLE001 — what the site answers the operator with
                errors[site] = site_app.refusal(exc)
                continue
            relay.receive(site, 1, phase, bytes(reply["secagg"]["payload"]))
    return errors


def secure_relay(config):
    from fedcontrast.privacy.secagg_relay import relay_for
    from fedcontrast.privacy.secagg_terms import SumLayout

    algorithm = build_algorithm(config)
    specs = algorithm.upload_specs(initial_model(config, **data_shape(config)), 10)
    relay = relay_for(list(SITES), config.secure_aggregation, SumLayout.of(algorithm, specs, config.secure_aggregation),
                      config.to_dict(), "5")  # the plan and the run the sites derive their session from
    relay.begin(1)
    return relay


def test_flower_sites_with_pinned_keys_give_the_secure_sum(folders, tmp_path):
    text, sts, _ = secure_sites(folders, tmp_path)
    config = RunConfig.from_dict(json.loads(text))
    relay = secure_relay(config)
    assert not secure_exchange(text, sts, config, relay)
    assert relay.survivors == list(SITES) and relay.total(1).size == relay.words


def test_a_flower_site_refuses_a_peer_key_the_operator_substituted(folders, tmp_path):
    """The ServerApp puts its own key in hosp2's place in the adverts hosp1 receives, signed with that
    key: the check against the key inside the advert passes; hosp1's pinned roster does not."""
    from fedcontrast.flower.secure import _openssh
    from fedcontrast.privacy.secagg import Quantizer
    from fedcontrast.privacy.secagg_protocol import SecAggSteps

    text, sts, _ = secure_sites(folders, tmp_path)
    config = RunConfig.from_dict(json.loads(text))
    relay = secure_relay(config)
    impostor = ec.generate_private_key(ec.SECP384R1())
    fake = json.loads(SecAggSteps("hosp2", list(SITES), 2, 0, impostor, _openssh(impostor.public_key()),
                                  lambda s, t: None, np.zeros(4), Quantizer.for_sites(10.0, 2)).advert())

    def lying(site, kind, honest):
        if site == "hosp1" and kind == "adverts":
            answer = json.loads(honest)
            answer["adverts"]["hosp2"] = fake
            return json.dumps(answer).encode()
        return honest

    errors = secure_exchange(text, sts, config, relay, lying)
    assert "site hosp2's key SHA256:" in errors["hosp1"] and "is not the key pinned for it" in errors["hosp1"]
    assert "hosp1" not in relay.received[2]  # hosp1 sent no share


def test_a_flower_site_that_requires_secure_aggregation_refuses_an_unpinned_plan(folders, tmp_path):
    text, sts, _ = secure_sites(folders, tmp_path, pins=False)
    with pytest.raises(site_app.SiteRefused, match="requires secure aggregation but pins no key for hosp1, hosp2"):
        site_app.handle("query", 6, text, sts["hosp1"], {}, None)


def test_a_flower_site_refuses_a_plan_that_is_not_the_roster_the_sites_pinned(folders, tmp_path):
    """The sites pinned hosp1, hosp2 and hosp3; the operator's plan names hosp1 and hosp2 (with threshold
    2, all two would need): the site refuses it before any data is read, naming hosp3. A plan for
    another federation is refused too; the roster reaches the protocol's own check."""
    from fedcontrast.flower import secure

    text, sts, _ = secure_sites(folders, tmp_path, also="  hosp3: SHA256:" + "3" * 64 + "\n")
    with pytest.raises(site_app.SiteRefused, match=r"^this site's policy .* refuses the plan before any data is read: "
                                                   r".*the plan's secure sum is not the federation the sites pinned "
                                                   r"under peers: \(hosp1, hosp2, hosp3\): it leaves out hosp3"):
        site_app.handle("query", 6, text, sts["hosp1"], {}, None)
    (tmp_path / "pinned").mkdir()
    text, sts, _ = secure_sites(folders, tmp_path / "pinned")
    other = json.dumps({**json.loads(text), "secure_aggregation": {**json.loads(text)["secure_aggregation"],
                                                                   "federation": "hospitals-2025"}})
    with pytest.raises(site_app.SiteRefused, match="the plan is for federation hospitals-2025"):
        site_app.handle("query", 6, other, sts["hosp1"], {}, None)
    site_app.handle("train", 5, text, sts["hosp1"], {"task": {"round": 1}, "received": downlink(plan())}, None)
    steps = next(v for k, v in secure._SESSIONS.items() if k[1] == "hosp1")
    assert (steps.peer_key.members, steps.peer_key.threshold) == (list(SITES), 2)


def test_a_flower_site_with_a_nan_upload_withdraws_naming_the_cause(folders, tmp_path, monkeypatch):
    from fedcontrast.privacy.secagg import SecureAggregationError

    text, sts, _ = secure_sites(folders, tmp_path)
    config = RunConfig.from_dict(json.loads(text))
    honest_train = site_app.SiteRuntime.train

    def train(self, *args):
        uploads, weight, metrics = honest_train(self, *args)
        if self.name == "hosp2":
            name = next(iter(uploads))
            uploads[name] = uploads[name].clone().fill_(float("nan"))
        return uploads, weight, metrics

    monkeypatch.setattr(site_app.SiteRuntime, "train", train)
    relay = secure_relay(config)
    with pytest.raises(SecureAggregationError, match="hosp2 withdrew: site 'hosp2' uploaded .* NaN or infinite values"):
        secure_exchange(text, sts, config, relay)
    assert "hosp2" in relay.withdrawn and "hosp2" not in relay.received[0]
