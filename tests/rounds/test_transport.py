"""A fourth engine, written only against the seam (:mod:`fedcontrast.rounds.transport`) and the plugin
API: its sites are objects in this process. A whole federation over it gives the simulator's model,
bit for bit, in plain and in secure rounds — the loop, the aggregator's decisions and the sites' tasks
are the same code whatever carries the messages (docs/layout.md, "Adding an engine")."""

import copy

import numpy as np
import pytest
import torch

from fedcontrast.algorithms import Downlink, SiteContext
from fedcontrast.config import site_names
from fedcontrast.construction import load_splits, partition, site_validation, task_seed
from fedcontrast.privacy.releases import release_choices
from fedcontrast.robust import RejectedUpload
from fedcontrast.rounds import AggregatorRound, RoundOutcome, run_site_task
from fedcontrast.rounds.transport import Replies, SecureSum, run_rounds
from fedcontrast.sim.federation import Federation
from tests.plans import small_config


class InMemoryTransport:
    """Each site holds its shard and state here; a round runs every plugin task of every site."""

    def __init__(self, config, core: AggregatorRound) -> None:
        self.config, self.core = config, core
        splits = load_splits(config)
        self.sites = {}
        for index, (name, part) in enumerate(zip(site_names(config), partition(config, splits))):
            part = np.asarray(part, dtype=np.int64)
            kept, _ = site_validation(config, splits.train.y[part], index)  # a site keeps its validation part
            self.sites[name] = (index, splits.train.subset(part[kept]))
        self.states = {name: {} for name in self.sites}
        self.model = copy.deepcopy(core.model)  # the network the sites' tasks load weights into
        self.releases = release_choices(config.privacy)
        self.prepared: list[int] = []

    def exchange(self, round_num: int, downlink: Downlink) -> Replies:
        replies = Replies()
        for name, (index, data) in self.sites.items():
            received = downlink.for_site(name)
            for t, task in enumerate(self.core.algorithm.tasks):
                site = SiteContext(name=name, data=data, model=self.model, round_num=round_num, index=index,
                                   training=self.config.training_at(round_num), device=torch.device("cpu"),
                                   seed=task_seed(self.config, round_num, index, t), state=self.states[name])
                done = run_site_task(self.core.algorithm, site, task, received, self.releases)
                replies.uploads.setdefault(name, {}).update(done.uploads)
                replies.weights[name] = done.weight
                replies.rows.append({"round": round_num, "site": name, "task": task, **done.released})
        return replies

    def secure_sum(self, round_num: int, replies: Replies, uploads) -> SecureSum:
        from fedcontrast.privacy.secagg_protocol import session_digest
        from fedcontrast.privacy.secagg_sim import secure_terms_sum

        session = session_digest(self.config.to_dict(), site_names(self.config), "simulator")
        total, _ = secure_terms_sum(self.core.algorithm, uploads, replies.weights, self.config.secure_aggregation,
                                    round_num, self.core.sum_layout, session=session)
        return SecureSum(total, len(uploads))

    def prepare(self, round_num: int, downlink: Downlink) -> None:
        self.prepared.append(round_num)


class Recorder:
    def __init__(self) -> None:
        self.rounds: list[tuple[int, Replies, RoundOutcome]] = []

    def record(self, round_num: int, replies: Replies, outcome: RoundOutcome) -> None:
        self.rounds.append((round_num, replies, outcome))


def federate(config):
    """The run over the in-memory transport: its final downlink, recorder and transport."""
    splits = load_splits(config)
    shape = {"in_channels": splits.in_channels, "image_size": splits.image_size, "num_classes": splits.num_classes}
    core = AggregatorRound(config, shape)
    transport, recorder = InMemoryTransport(config, core), Recorder()
    downlink = run_rounds(core, transport, recorder, core.initial_downlink(), 1, config.rounds)
    return downlink, recorder, transport


def simulated(config) -> Downlink:
    federation = Federation(config)
    for r in range(1, config.rounds + 1):
        federation.run_round(r)
    return federation.downlink


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("secure", [None, {"threshold": 2}], ids=["plain", "secure"])
def test_a_federation_over_an_in_memory_transport_is_the_simulators_bit_for_bit(secure):
    config = small_config(algorithm="moon", clients=3, rounds=2, projection_dim=8, secure_aggregation=secure)
    downlink, recorder, transport = federate(config)
    assert [r for r, _, _ in recorder.rounds] == [1, 2]
    assert transport.prepared == [2, 3]  # each next round's downlink, offered as soon as it exists
    assert all(sorted(replies.weights) == ["site_0", "site_1", "site_2"] for _, replies, _ in recorder.rounds)
    expected = simulated(config)
    assert_same(downlink.global_tensors, expected.global_tensors)
    first = recorder.rounds[0][1].uploads["site_0"]
    assert not all(torch.equal(first[k], downlink.global_tensors[k]) for k in first)  # the model moved


def test_a_rejected_upload_is_left_out_and_recorded_and_stop_ends_the_run_after_recording():
    config = small_config(algorithm="fedavg", clients=3, rounds=3, projection_dim=8,
                          robustness={"on_rejected": "stop"})
    splits = load_splits(config)
    core = AggregatorRound(config, {"in_channels": splits.in_channels, "image_size": splits.image_size,
                                    "num_classes": splits.num_classes})

    class Hostile(InMemoryTransport):
        def exchange(self, round_num, downlink):
            replies = super().exchange(round_num, downlink)
            sent = replies.uploads["site_1"]
            replies.uploads["site_1"] = {k: torch.full_like(v, float("nan")) for k, v in sent.items()}
            return replies

    transport, recorder = Hostile(config, core), Recorder()
    with pytest.raises(RejectedUpload, match="site_1.*round 1 was aggregated without them and the federation stops"):
        run_rounds(core, transport, recorder, core.initial_downlink(), 1, config.rounds)
    assert [r for r, _, _ in recorder.rounds] == [1]  # the stopping round is on record, no round after it
    outcome = recorder.rounds[0][2]
    assert list(outcome.excluded) == ["site_1"] and sorted(outcome.accepted) == ["site_0", "site_2"]
