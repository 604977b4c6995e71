"""The Flower deployment's ServerApp on a stand-in grid (no network): the same upload screen as the
other engines, and one sentence naming a silent site."""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest

pytest.importorskip("flwr", reason="the Flower engine is the extra [flower] (its own environment)")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from fedcontrast.config import DataSchema, RobustnessConfig, RunConfig, TrainingConfig
from fedcontrast.flower.packing import unpack_arrays  # what a site reads (flower/packing.py)
from fedcontrast.flower.server_app import REFUSAL_GRACE_S, FlowerServer, SiteProblem
from fedcontrast.robust import RejectedUpload

SITES = ("hosp1", "hosp2", "hosp3")


@pytest.fixture(autouse=True)
def task_identity():
    """What Flower sets in a ServerApp process: the run and node the messages come from."""
    from flwr.supercore.task_identity import TaskIdentity

    before = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = before


class FakeClock:
    """The ``time`` of flower/server_app.py, without waiting: ``sleep`` moves ``now`` on at once, so a
    test reads how long the server chose to wait (its timeouts, its polls), whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    time = staticmethod(time.time)  # the wall-clock stamp of a round's record


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr("fedcontrast.flower.server_app.time", fake)
    return fake


NODES = {"hosp1": 11, "hosp2": 22, "hosp3": 33}


class Grid:
    """Answers every message as a site would: its name; its received weights (scaled by
    ``scale[site]``) as its upload; ``silent`` sites never answer."""

    def __init__(self, scale=None, silent=(), refuse=None, offline=()):
        self.scale, self.silent = scale or {}, set(silent)
        self.refuse = dict(refuse or {})  # site → (message type, the sentence its refusal reply holds)
        self.offline = set(offline)  # sites whose node the grid does not list (and that never answer)
        self.ids = itertools.count()
        self.pending = {}
        self.sent = []  # (site, message type) of every message pushed

    def get_node_ids(self):
        return [n for s, n in getattr(self, "nodes", NODES).items() if s not in self.offline]

    def push_messages(self, messages):
        out = []
        for msg in messages:
            mid = str(next(self.ids))
            self.pending[mid] = msg
            self.sent.append((next(s for s, n in getattr(self, "nodes", NODES).items()
                                   if n == msg.metadata.dst_node_id),
                              msg.metadata.message_type))
            out.append(mid)
        return out

    def pull_messages(self, ids):
        replies = []
        for mid in list(ids):
            msg = self.pending.get(mid)
            site = next(s for s, n in NODES.items() if n == msg.metadata.dst_node_id)
            if site in self.silent or site in self.offline:
                continue
            del self.pending[mid]
            kind = msg.metadata.message_type
            if self.refuse.get(site, ("",))[0] == kind:  # as site_app.answer replies: a refusal record
                content = {"refusal": ConfigRecord({"kind": "refused", "site": site, "sentence": self.refuse[site][1]})}
            elif kind == "query.standby":  # a standby (flower/standby.py): its reply holds nothing
                content = {"standby": ConfigRecord({"held": 0.0})}
            elif kind == "query":
                content = {"site": ConfigRecord({"site": site})}
            else:
                received = {k: v * self.scale.get(site, 1.0) for k, v in unpack_arrays(msg.content["received"]).items()}
                content = {"uploads": ArrayRecord({k: Array.from_numpy_ndarray(np.ascontiguousarray(v))
                                                   for k, v in received.items()}),
                           "outcome": ConfigRecord({"site": site, "weight": 100.0, "metrics": "{}",
                                                    "evaluation": json.dumps({"accuracy": 0.5, "samples": 10.0})})}
            reply = Message(RecordDict(content), reply_to=msg)
            reply.metadata._reply_to_message_id = mid  # the stand-in grid's own message ids
            replies.append(reply)
        return replies


def config(sites=SITES, **robustness):
    schema = DataSchema((1, 32, 32), tuple(str(i) for i in range(10)))
    return RunConfig(algorithm="fedavg", dataset="imagefolder", data_schema=schema, sites=sites, clients=len(sites),
                     rounds=2, training=TrainingConfig(local_epochs=1),
                     robustness=RobustnessConfig(**{"reject_replays": False, **robustness}))


def test_the_same_screen_rejects_a_hostile_upload_and_names_its_site(tmp_path):
    server = FlowerServer(Grid(), config(max_update_ratio=10.0), tmp_path, NODES,
                          round_timeout=5, start_timeout=5)
    server.connect()
    server.run_round(1)  # round 1: every upload equals what was received, an update of zero
    server.grid.scale = {"hosp2": 1e30}
    with pytest.raises(RejectedUpload, match="hosp2.*round 2 was aggregated without them"):
        server.run_round(2)
    # on_rejected: stop, as every engine: the round is aggregated without it and recorded, then the run stops
    record = json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[-1])
    assert record["round"] == 2 and list(record["excluded"]) == ["hosp2"]


def test_a_run_writes_the_operators_records(tmp_path):
    server = FlowerServer(Grid(), config(), tmp_path, NODES, round_timeout=5, start_timeout=5)
    summary = server.run()
    assert summary["rounds_completed"] == 2 and summary["final_accuracy"] == pytest.approx(0.5)
    records = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2] and set(records[0]["sites"]) == set(SITES)
    assert (tmp_path / "metrics.csv").exists() and (tmp_path / "summary.json").exists()


def test_a_silent_site_is_named_within_the_round_timeout(tmp_path):
    server = FlowerServer(Grid(silent={"hosp3"}), config(), tmp_path, NODES, round_timeout=1, start_timeout=1)
    with pytest.raises(SiteProblem, match=r"no answer from site\(s\) hosp3 within 1 s"):
        server.connect()


def test_a_site_without_a_registered_key_is_named(tmp_path):
    with pytest.raises(SiteProblem, match=r"site\(s\) hosp3 of the plan have no registered SuperNode key"):
        FlowerServer(Grid(), config(), tmp_path, {"hosp1": 11, "hosp2": 22}, round_timeout=1, start_timeout=1)


class SecureGrid(Grid):
    """Sites that take part in secure aggregation with the real protocol steps: each answers a train
    message with its signed keys (its upload: what it received × ``scale``, weight ``weights``), then
    the ``query.secagg`` steps; ``impostor`` signs with a key other than its registered one."""

    def __init__(self, settings, scale, weights, impostor=None, withdraws=None, nodes=None, silent_in=None):
        super().__init__(scale)
        self.withdraws = withdraws
        from cryptography.hazmat.primitives.asymmetric import ec

        from fedcontrast.flower.secure import _openssh
        from fedcontrast.privacy.secagg_protocol import session_digest

        self.nodes = dict(nodes or NODES)
        self.sites = list(self.nodes)
        self.silent_in = dict(silent_in or {})  # site → the secure-aggregation phase it never answers
        self.plan = config(sites=tuple(self.sites)).replace(secure_aggregation=settings)
        self.session = session_digest(self.plan.to_dict(), self.sites, "")  # what the ServerApp binds (run "")
        self.settings, self.weights, self.steps = settings, weights, {}
        self.keys = {s: ec.generate_private_key(ec.SECP384R1()) for s in self.sites}
        self.registered = {s: _openssh(k.public_key()) for s, k in self.keys.items()}
        if impostor is not None:
            self.keys[impostor] = ec.generate_private_key(ec.SECP384R1())
        self.seen_uploads = []

    def pull_messages(self, ids):
        import torch

        from fedcontrast.algorithms.fedavg import FedAvg
        from fedcontrast.flower.secure import _openssh, registered_key
        from fedcontrast.privacy.secagg import Quantizer
        from fedcontrast.privacy.secagg_protocol import SecAggSteps
        from fedcontrast.privacy.secagg_terms import secure_vector

        replies = []
        for mid in list(ids):
            msg = self.pending[mid]
            site = next(s for s, n in self.nodes.items() if n == msg.metadata.dst_node_id)
            kind = msg.metadata.message_type
            if kind == "query.secagg" and self.silent_in.get(site) == str(msg.content["task"]["phase"]):
                continue  # it never answers
            del self.pending[mid]
            if kind == "query":
                content = {"site": ConfigRecord({"site": site})}
            elif kind == "train":
                round_num = int(msg.content["task"]["round"])
                upload = {k: torch.from_numpy(v * self.scale.get(site, 1.0))
                          for k, v in unpack_arrays(msg.content["received"]).items()}
                self.seen_uploads.append(upload)
                n = len(self.sites)
                steps = SecAggSteps(site, self.sites, self.settings.sites_needed(n), round_num, self.keys[site],
                                    _openssh(self.keys[site].public_key()), registered_key,
                                    secure_vector(FedAvg(), upload, self.weights[site], self.settings),
                                    Quantizer.for_sites(self.settings.clip, n, self.settings.bits), self.session,
                                    self.settings.neighbours)
                self.steps[site] = steps
                from fedcontrast.privacy.secagg_protocol import withdrawal

                advert = withdrawal("its upload holds NaN") if site == self.withdraws else steps.advert()
                content = {"secagg": ConfigRecord({"payload": advert}),
                           "outcome": ConfigRecord({"site": site, "metrics": "{}",
                                                    "evaluation": json.dumps({"accuracy": 0.5, "samples": 10.0})})}
            elif kind == "query.secagg":
                phase = str(msg.content["task"]["phase"])
                payload = getattr(self.steps[site], phase)(bytes(msg.content["secagg"]["payload"]))
                content = {"secagg": ConfigRecord({"payload": payload})}
            else:
                content = {"outcome": ConfigRecord({"site": site,
                                                    "evaluation": json.dumps({"accuracy": 0.5, "samples": 10.0})})}
            reply = Message(RecordDict(content), reply_to=msg)
            reply.metadata._reply_to_message_id = mid
            replies.append(reply)
        return replies


def test_under_secure_aggregation_the_server_gets_only_the_weighted_mean(tmp_path):
    from fedcontrast.algorithms.base import WEIGHT_PREFIX
    from fedcontrast.config import SecureAggregationConfig

    settings = SecureAggregationConfig(bits=64)
    scale, weights = {"hosp1": 0.5, "hosp2": 1.0, "hosp3": 2.0}, {"hosp1": 100.0, "hosp2": 300.0, "hosp3": 600.0}
    grid = SecureGrid(settings, scale, weights)
    server = FlowerServer(grid, grid.plan, tmp_path, NODES, round_timeout=5,
                          start_timeout=5, site_keys=grid.registered)
    server.connect()
    before = {k: v.clone() for k, v in server.downlink.global_tensors.items()}
    server.run_round(1)
    factor = sum(scale[s] * weights[s] for s in SITES) / sum(weights.values())  # each site sent received × scale
    for key, value in server.downlink.global_tensors.items():
        if key.startswith(WEIGHT_PREFIX) and value.is_floating_point():
            expected = (before[key].double().clamp(-settings.clip, settings.clip) * factor).to(value.dtype)
            assert (value - expected).abs().max() <= 1e-6, key
    record = json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[0])
    assert record["secure_sum_of"] == list(SITES) and "weight" not in record["sites"]["hosp1"]


def test_under_secure_aggregation_a_key_other_than_the_registered_one_stops_the_run(tmp_path):
    from fedcontrast.config import SecureAggregationConfig
    from fedcontrast.privacy.secagg import SecureAggregationError

    settings = SecureAggregationConfig()
    grid = SecureGrid(settings, {}, {s: 100.0 for s in SITES}, impostor="hosp2")
    server = FlowerServer(grid, grid.plan, tmp_path, NODES, round_timeout=5,
                          start_timeout=5, site_keys=grid.registered)
    server.connect()
    with pytest.raises(SecureAggregationError,
                       match="site hosp2 advertised a signing key other than the one registered"):
        server.run_round(1)


def test_under_secure_aggregation_a_site_that_withdraws_is_named_and_the_others_summed(tmp_path, capsys):
    from fedcontrast.config import SecureAggregationConfig

    settings = SecureAggregationConfig(bits=64, threshold=2)
    weights = {"hosp1": 100.0, "hosp2": 300.0, "hosp3": 600.0}
    grid = SecureGrid(settings, {}, weights, withdraws="hosp3")
    server = FlowerServer(grid, grid.plan, tmp_path, NODES, round_timeout=5,
                          start_timeout=5, site_keys=grid.registered)
    server.connect()
    server.run_round(1)
    record = json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[0])
    assert record["secure_sum_of"] == ["hosp1", "hosp2"] and record["excluded"] == {"hosp3": "its upload holds NaN"}
    assert set(record["secure_bytes"]) == set(SITES)
    out = capsys.readouterr().out
    assert "site hosp3 takes no part in the secure sum: its upload holds NaN" in out
    assert "secure sum of hosp1, hosp2 (threshold 2;" in out


# --- dropouts, resume and run isolation (the same policy as the other engines) ----------------------------
SCALE = {"hosp1": 0.5, "hosp2": 1.0, "hosp3": 2.0}


class StopsAnswering(Grid):
    """Every site answers the start-up and round 1, then none answers (the ServerApp's host went down)."""

    def pull_messages(self, ids):
        for mid in list(ids):
            msg = self.pending.get(mid)
            if msg is not None and msg.metadata.message_type == "train" and int(msg.content["task"]["round"]) >= 2:
                self.silent = set(SITES)
        return super().pull_messages(ids)


def test_with_min_sites_a_round_goes_on_without_a_silent_site_and_names_it(tmp_path, capsys):
    server = FlowerServer(Grid(silent={"hosp3"}), config(), tmp_path, NODES, round_timeout=1, start_timeout=5,
                          min_sites=2)
    summary = server.run()
    assert summary["rounds_completed"] == 2
    records = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2] and all(set(r["sites"]) == {"hosp1", "hosp2"} for r in records)
    # silent at start-up: one timeout, then dropped from every later round (not one timeout per round)
    assert all(r["excluded"] == {"hosp3": f"round {r['round']}: dropped (start-up: no answer within 1 s)"}
               for r in records)
    assert "start-up: dropped hosp3 after no answer within 1 s; the later rounds go on without it" in \
        capsys.readouterr().out
    with pytest.raises(SiteProblem, match="no answer from site\\(s\\) hosp3 within 1 s"):  # without min_sites: stops
        FlowerServer(Grid(silent={"hosp3"}), config(), tmp_path / "b", NODES, round_timeout=1, start_timeout=5).run()


def test_a_stopped_run_resumes_from_its_last_round_to_the_uninterrupted_result(tmp_path):
    plan = config().replace(rounds=3)
    whole = FlowerServer(Grid(scale=SCALE), plan, tmp_path / "whole", NODES, round_timeout=5, start_timeout=5)
    whole.run()
    out = tmp_path / "run"
    with pytest.raises(SiteProblem, match="round 2: no answer"):
        FlowerServer(StopsAnswering(scale=SCALE), plan, out, NODES, round_timeout=1, start_timeout=5).run()
    resumed = FlowerServer(Grid(scale=SCALE), plan, out, NODES, round_timeout=5, start_timeout=5, resume=True)
    assert resumed.start_round == 1
    resumed.run()
    for key, value in whole.downlink.global_tensors.items():  # the same model as the run that never stopped
        assert np.array_equal(value.numpy(), resumed.downlink.global_tensors[key].numpy()), key
    records = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2, 3]


def test_a_run_folder_holds_one_run(tmp_path):
    from fedcontrast.errors import ConfigError
    from fedcontrast.flower.runs import check_run_folder

    out = tmp_path / "run"
    assert check_run_folder(out, config(), resume=False) == "new"
    FlowerServer(Grid(), config(), out, NODES, round_timeout=5, start_timeout=5).run()
    with pytest.raises(ConfigError, match=f"{out} holds an earlier run \\(2 of 2 rounds done\\): pass --resume"):
        check_run_folder(out, config(), resume=False)
    assert check_run_folder(out, config(), resume=True) == "finished"
    with pytest.raises(ConfigError, match="holds a run of another plan"):
        check_run_folder(out, config().replace(rounds=5), resume=True)


# --- the operator always learns why (issue 37, item 2) ------------------------------------------------
def test_a_refusal_at_start_up_is_named_with_its_sentence_within_seconds_for_every_site(tmp_path, capsys, clock):
    refuse = {"hosp2": ("query", "this site's policy refuses the plan: allow_weights is false"),
              "hosp3": ("query", "the operator's Flower app bundle carries code (evil)")}
    server = FlowerServer(Grid(refuse=refuse), config(), tmp_path, NODES, round_timeout=60, start_timeout=60)
    with pytest.raises(SiteProblem) as stopped:
        server.connect()
    assert clock.now <= REFUSAL_GRACE_S  # the others' refusals have a moment to come, not the round timeout
    text = str(stopped.value)
    assert "site hosp2 refused: this site's policy refuses the plan: allow_weights is false" in text
    assert "site hosp3 refused: the operator's Flower app bundle carries code (evil)" in text
    assert "site hosp2 refused: this site's policy" in capsys.readouterr().out  # on the console as it came
    assert set(server.refusals) == {"hosp2", "hosp3"}


def test_a_refusal_in_a_round_is_named_and_recorded_and_the_run_goes_on_with_min_sites(tmp_path, clock):
    refuse = {"hosp3": ("train", "its upload would exceed the policy's byte limit")}
    server = FlowerServer(Grid(refuse=refuse), config(), tmp_path, NODES, round_timeout=60, start_timeout=60,
                          min_sites=2)
    summary = server.run()
    assert clock.now < server.round_timeout  # no round waited for the site that refused
    records = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert "site hosp3 refused: its upload would exceed" in records[0]["excluded"]["hosp3"]
    assert "site hosp3 refused" in summary["sites_absent"]["refused"]["hosp3"]


def test_a_refusal_in_a_round_without_min_sites_stops_the_run_naming_it_within_seconds(tmp_path, clock):
    server = FlowerServer(Grid(refuse={"hosp1": ("train", "its data folder is gone")}), config(), tmp_path, NODES,
                          round_timeout=60, start_timeout=60)
    server.connect()
    t0 = clock.now
    with pytest.raises(SiteProblem, match="round 1: site hosp1 refused: its data folder is gone; the run stops here"):
        server.run_round(1)
    assert clock.now - t0 <= REFUSAL_GRACE_S


# --- silent sites are dropped until they are back (issue 37, item 3) ------------------------------------
def test_a_silent_site_costs_one_timeout_then_is_dropped_until_it_answers_again(tmp_path, capsys, clock):
    grid = Grid(silent={"hosp3"})
    server = FlowerServer(grid, config().replace(rounds=3), tmp_path, NODES, round_timeout=2, start_timeout=1,
                          min_sites=2)
    server.connect()  # the start-up query: its one timeout
    server.run_round(1)
    assert server.round_timeout <= clock.now < 2 * server.round_timeout  # one timeout (2 s), not two
    assert ("hosp3", "train") not in grid.sent
    assert "start-up: dropped hosp3 after no answer within 2 s" in capsys.readouterr().out
    grid.silent = set()  # its late reply to the start-up query arrives: it is back
    server.run_round(2)
    assert ("hosp3", "train") in grid.sent
    assert "hosp3 is back (answered again); it takes part again from round 2" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert records[0]["dropped"] == {"hosp3": "start-up: no answer within 2 s"}
    assert "dropped" in records[0]["excluded"]["hosp3"]
    assert records[1]["rejoined"] == ["hosp3"] and "dropped" not in records[1] and "hosp3" in records[1]["sites"]


def test_a_site_that_never_connected_joins_when_its_node_is_listed(tmp_path, clock):
    grid = Grid(offline={"hosp3"})
    server = FlowerServer(grid, config(), tmp_path, NODES, round_timeout=1, start_timeout=1, min_sites=2)
    server.connect()
    server.run_round(1)
    # the start-up's wait for its node, and no round timeout for it
    assert ("hosp3", "train") not in grid.sent and clock.now <= server.start_timeout
    grid.offline = set()
    server.run_round(2)
    assert [m for s, m in grid.sent if s == "hosp3" and m != "query.standby"] == ["query", "train"]  # its start-up
    # first, then the round (a standby message behind its start-up: flower/standby.py)
    server.final_evaluation()
    assert ("hosp3", "evaluate") in grid.sent


def test_the_final_evaluation_skips_a_dropped_site(tmp_path, clock):
    grid = Grid()
    server = FlowerServer(grid, config(), tmp_path, NODES, round_timeout=3, start_timeout=1, min_sites=2)
    server.connect()
    grid.silent = {"hosp2"}
    server.run_round(1)  # its one timeout
    assert clock.now >= server.round_timeout
    t0 = clock.now
    server.run_round(2)
    server.final_evaluation()  # neither waits for hosp2 (each would take the 3 s timeout)
    assert clock.now - t0 < server.round_timeout and ("hosp2", "evaluate") not in grid.sent


def test_the_run_says_where_every_partys_outputs_are(tmp_path, capsys):
    from fedcontrast.flower import server_app
    from fedcontrast.flower.records import CONFIG_KEY

    class Context:
        run_config = {CONFIG_KEY: json.dumps(config().to_dict()), "out-dir": str(tmp_path), "round-timeout": 5,
                      "start-timeout": 5, "site-nodes": json.dumps(NODES)}

    server_app.server._main(Grid(), Context())  # the ServerApp's main, as the SuperLink calls it
    out = capsys.readouterr().out
    assert f"the operator's outputs in {tmp_path} (metrics.csv, summary.json" in out
    assert "each site's in its own folder, site_report/<site>/" in out
    assert "accuracy of the final model 0.5000;" in out  # rounded
    assert json.loads((tmp_path / "outcome.json").read_text())["status"] == "finished"


TEN = {f"hosp{i:02d}": 100 + i for i in range(10)}


@pytest.mark.parametrize("silent", [None, ("hosp03", "masked"), ("hosp05", "consistency")])
def test_secagg_plus_on_the_serverapp_draws_its_graph_from_the_sites_randomness_and_sums_exactly(tmp_path, silent):
    """Ten sites with four neighbours each (SecAgg+): the ServerApp carries the graph phase (each
    site's committed randomness) before the shares, and the model is the weighted mean of the sites
    in the sum, within the ring's rounding, with a site silent after the graph is drawn or not."""
    from fedcontrast.algorithms.base import WEIGHT_PREFIX
    from fedcontrast.config import SecureAggregationConfig

    settings = SecureAggregationConfig(bits=64, neighbours=4)
    scale = {s: 0.5 + i / 4 for i, s in enumerate(TEN)}
    weights = {s: 100.0 * (i + 1) for i, s in enumerate(TEN)}
    grid = SecureGrid(settings, scale, weights, nodes=TEN, silent_in=dict([silent]) if silent else None)
    server = FlowerServer(grid, grid.plan, tmp_path, TEN, round_timeout=2, start_timeout=5,
                          site_keys=grid.registered, min_sites=8)
    server.connect()
    before = {k: v.clone() for k, v in server.downlink.global_tensors.items()}
    server.run_round(1)
    assert not server.relay.full and server.relay.graph.k == 4 and set(server.relay.randomness) == set(TEN)
    in_sum = [s for s in TEN if not silent or s != silent[0] or silent[1] == "consistency"]
    assert server.relay.survivors == in_sum
    factor = sum(scale[s] * weights[s] for s in in_sum) / sum(weights[s] for s in in_sum)
    for key, value in server.downlink.global_tensors.items():
        if key.startswith(WEIGHT_PREFIX) and value.is_floating_point():
            expected = (before[key].double().clamp(-settings.clip, settings.clip) * factor).to(value.dtype)
            assert (value - expected).abs().max() <= 1e-5, key


def test_secagg_plus_on_the_serverapp_ends_the_round_naming_a_site_that_keeps_its_graph_randomness(tmp_path):
    from fedcontrast.config import SecureAggregationConfig
    from fedcontrast.privacy.secagg import SecureAggregationError

    settings = SecureAggregationConfig(bits=64, neighbours=4)
    grid = SecureGrid(settings, {}, {s: 100.0 for s in TEN}, nodes=TEN, silent_in={"hosp04": "graph"})
    server = FlowerServer(grid, grid.plan, tmp_path, TEN, round_timeout=1, start_timeout=5,
                          site_keys=grid.registered, min_sites=8)
    server.connect()
    with pytest.raises(SecureAggregationError, match="hosp04 sent its advert but not the randomness it committed to"):
        server.run_round(1)
