"""The Flower deployment's ServerApp on a stand-in grid (no network): the same upload screen as the
other engines, and one sentence naming a silent site."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

pytest.importorskip("flwr", reason="the Flower engine is the extra [flower] (its own environment)")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from fedcontrast.config import DataSchema, RobustnessConfig, RunConfig, TrainingConfig
from fedcontrast.flower.packing import unpack_arrays  # what a site reads (flower/packing.py)
from fedcontrast.flower.server_app import FlowerServer, SiteProblem
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
NODES = {"hosp1": 11, "hosp2": 22, "hosp3": 33}


class Grid:
    """Answers every message as a site would: its name; its received weights (scaled by
    ``scale[site]``) as its upload; ``silent`` sites never answer."""

    def __init__(self, scale=None, silent=()):
        self.scale, self.silent = scale or {}, set(silent)
        self.ids = itertools.count()
        self.pending = {}

    def get_node_ids(self):
        return list(NODES.values())

    def push_messages(self, messages):
        out = []
        for msg in messages:
            mid = str(next(self.ids))
            self.pending[mid] = msg
            out.append(mid)
        return out

    def pull_messages(self, ids):
        replies = []
        for mid in list(ids):
            msg = self.pending.get(mid)
            site = next(s for s, n in NODES.items() if n == msg.metadata.dst_node_id)
            if site in self.silent:
                continue
            del self.pending[mid]
            kind = msg.metadata.message_type
            if kind == "query.standby":  # a standby (flower/standby.py): its reply holds nothing
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


def config(**robustness):
    schema = DataSchema((1, 32, 32), tuple(str(i) for i in range(10)))
    return RunConfig(algorithm="fedavg", dataset="imagefolder", data_schema=schema, sites=SITES, clients=3, rounds=2,
                     training=TrainingConfig(local_epochs=1), robustness=RobustnessConfig(**{"reject_replays": False, **robustness}))


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

    def __init__(self, settings, scale, weights, impostor=None, withdraws=None):
        super().__init__(scale)
        self.withdraws = withdraws
        from cryptography.hazmat.primitives.asymmetric import ec

        from fedcontrast.flower.secure import _openssh

        self.settings, self.weights, self.steps = settings, weights, {}
        self.keys = {s: ec.generate_private_key(ec.SECP384R1()) for s in SITES}
        self.registered = {s: _openssh(k.public_key()) for s, k in self.keys.items()}
        if impostor is not None:
            self.keys[impostor] = ec.generate_private_key(ec.SECP384R1())
        self.seen_uploads = []

    def pull_messages(self, ids):
        import torch

        from fedcontrast.algorithms.fedavg import FedAvg
        from fedcontrast.flower.secure import _openssh, registered_key
        from fedcontrast.privacy.secagg import Quantizer
        from fedcontrast.privacy.secagg_terms import secure_vector
        from fedcontrast.privacy.secagg_protocol import SecAggSteps

        replies = []
        for mid in list(ids):
            msg = self.pending.pop(mid)
            site = next(s for s, n in NODES.items() if n == msg.metadata.dst_node_id)
            kind = msg.metadata.message_type
            if kind == "query":
                content = {"site": ConfigRecord({"site": site})}
            elif kind == "train":
                round_num = int(msg.content["task"]["round"])
                upload = {k: torch.from_numpy(v * self.scale.get(site, 1.0))
                          for k, v in unpack_arrays(msg.content["received"]).items()}
                self.seen_uploads.append(upload)
                t = self.settings.sites_needed(3)
                steps = SecAggSteps(site, list(SITES), t, round_num, self.keys[site], _openssh(self.keys[site].public_key()),
                                    registered_key, secure_vector(FedAvg(), upload, self.weights[site],
                                                                  self.settings),
                                    Quantizer.for_sites(self.settings.clip, 3, self.settings.bits))
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
                content = {"outcome": ConfigRecord({"site": site, "evaluation": json.dumps({"accuracy": 0.5, "samples": 10.0})})}
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
    server = FlowerServer(grid, config().replace(secure_aggregation=settings), tmp_path, NODES, round_timeout=5,
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
    server = FlowerServer(grid, config().replace(secure_aggregation=settings), tmp_path, NODES, round_timeout=5,
                          start_timeout=5, site_keys=grid.registered)
    server.connect()
    with pytest.raises(SecureAggregationError, match="site hosp2 advertised a signing key other than the one registered"):
        server.run_round(1)


def test_under_secure_aggregation_a_site_that_withdraws_is_named_and_the_others_summed(tmp_path, capsys):
    from fedcontrast.config import SecureAggregationConfig

    settings = SecureAggregationConfig(bits=64, threshold=2)
    weights = {"hosp1": 100.0, "hosp2": 300.0, "hosp3": 600.0}
    grid = SecureGrid(settings, {}, weights, withdraws="hosp3")
    server = FlowerServer(grid, config().replace(secure_aggregation=settings), tmp_path, NODES, round_timeout=5,
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
    assert all(r["excluded"] == {"hosp3": f"round {r['round']}: no answer within 1 s"} for r in records)
    assert "round 1 goes on without hosp3 (hosp3: no answer within 1 s; 2 sites answered, min_sites 2)" in \
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
