"""A site's session (:class:`fedcontrast.rounds.SiteSession`): its state after a round is the same in
memory (the simulator) and on disk (a deployed site); a round or a task redone after a crash starts
from the state its first attempt started from, not from what that attempt left; its context carries
the task's seed and the noise source its engine asks for. Against values worked out by hand."""

import io

import pytest
import torch

from fedcontrast.algorithms import TaskResult
from fedcontrast.config import RunConfig
from fedcontrast.privacy.releases import release_choices
from fedcontrast.rounds import DiskStateStore, MemoryStateStore, SiteSession
from fedcontrast.seeds import derive_seed

CPU = torch.device("cpu")
RECEIVED = {"w": torch.tensor([1.0, 2.0])}
DP = RunConfig(privacy={"dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}})


class Counter:
    """Two tasks that change the state in place, as plugins do: ``train`` counts its runs and notes
    their rounds, ``sum`` adds what it received to a running total. ``fail``: the (round, task) whose
    first attempt dies after changing the state."""

    tasks = ("train", "sum")
    task_metrics = {"train": ("runs",)}

    def __init__(self, fail=None):
        self.fail = fail
        self.seeds = []

    def run_task(self, task, site, received):
        self.seeds.append(site.seed)
        state = site.state
        if task == "train":
            state["runs"] = state.get("runs", 0) + 1
            state.setdefault("rounds", []).append(site.round_num)
        else:
            state.setdefault("total", torch.zeros(2)).add_(received["w"])
        if self.fail == (site.round_num, task):
            self.fail = None
            raise RuntimeError("the site's process died")
        return TaskResult({f"{task}.out": torch.zeros(1)}, 10, {"runs": float(state["runs"])})


def session(plugin, config=None, noise_stream=None):
    config = RunConfig() if config is None else config
    return SiteSession("hosp1", 1, config, plugin, None, CPU, release_choices(config.privacy), train=list(range(10)),
                       noise_stream=noise_stream)


def stores(tmp_path):
    return {"memory": MemoryStateStore(), "disk": DiskStateStore(tmp_path, "site_0", CPU)}


def test_the_memory_and_the_disk_store_hold_the_same_state_after_each_round(tmp_path):
    memory, disk = MemoryStateStore(), DiskStateStore(tmp_path, "hosp1.run7", CPU)
    for store in (memory, disk):
        plugin = Counter()
        for round_num in (1, 2):
            session(plugin).run_round(round_num, RECEIVED, store)
        assert plugin.seeds == [derive_seed(0, r, 1, t) for r in (1, 2) for t in (0, 1)]  # task_seed(plan, r, site, t)
    restarted = DiskStateStore(tmp_path, "hosp1.run7", CPU).load()  # what a restarted site reads
    for state in (memory.load(), restarted):
        assert state.keys() == {"runs", "rounds", "total"}
        assert state["runs"] == 2 and state["rounds"] == [1, 2] and state["total"].tolist() == [2.0, 4.0]
    # the latest, and what round 2 started from (round 1's was dropped when round 2 started)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hosp1.run7.pt", "hosp1.run7.round2.train.pt"]


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_a_round_redone_after_a_crash_starts_from_the_state_its_first_attempt_started_from(tmp_path, kind):
    store = stores(tmp_path)[kind]
    first = session(Counter(fail=(2, "sum")))
    first.run_round(1, RECEIVED, store)
    with pytest.raises(RuntimeError):
        first.run_round(2, RECEIVED, store)  # both tasks changed the state, then the site died
    assert first.state_at(2, store)["runs"] == 1  # what round 2's evaluation sees again: the round's start
    done = session(Counter()).run_round(2, RECEIVED, store)
    assert [task.result.metrics["runs"] for task in done] == [2.0, 2.0]  # not 3: train ran once more, from 1
    state = store.load()
    assert state["runs"] == 2 and state["rounds"] == [1, 2] and state["total"].tolist() == [2.0, 4.0]


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_a_task_redone_after_its_state_was_saved_starts_from_the_state_it_first_started_from(tmp_path, kind):
    store, site = stores(tmp_path)[kind], session(Counter())
    for task in ("train", "sum"):
        site.run_task(1, task, RECEIVED, store)
    site.run_task(2, "train", RECEIVED, store)  # saved its state, then died before its upload left the site
    assert store.load()["runs"] == 2 and site.state_at(2, store)["runs"] == 1
    assert site.run_task(2, "train", RECEIVED, store).result.metrics["runs"] == 2.0  # redone from runs = 1
    site.run_task(2, "sum", RECEIVED, store)
    state = store.load()
    assert state["runs"] == 2 and state["rounds"] == [1, 2] and state["total"].tolist() == [2.0, 4.0]
    if kind == "disk":  # the latest, and what the task under way started from; the earlier starts dropped
        assert sorted(p.name for p in tmp_path.iterdir()) == ["site_0.pt", "site_0.round2.sum.pt"]


def test_the_state_an_engine_holds_besides_the_file_is_read_instead_of_it(tmp_path):
    DiskStateStore(tmp_path, "hosp1.run7", CPU).save({"runs": 1})
    held = io.BytesIO()
    torch.save({"runs": 5}, held)
    assert DiskStateStore(tmp_path, "hosp1.run7", CPU, held.getvalue()).load() == {"runs": 5}
    assert DiskStateStore(tmp_path, "hosp1.run7", CPU).load() == {"runs": 1}


def test_a_sites_context_carries_its_seed_and_the_noise_source_its_engine_asks_for():
    simulated = session(Counter(), DP, noise_stream=0xD9).context(3, 1234, {"runs": 1})
    assert (simulated.name, simulated.index, simulated.round_num, simulated.seed) == ("hosp1", 1, 3, 1234)
    assert simulated.state == {"runs": 1} and simulated.training.lr == DP.training_at(3).lr
    assert simulated.privacy.generator.initial_seed() == derive_seed(1234, 0xD9)  # reproducible
    assert not simulated.privacy.secure
    deployed = [session(Counter(), DP).context(3, 1234, {}).privacy for _ in range(2)]
    assert all(p.secure for p in deployed)  # the operating system's noise, sampled securely
    assert deployed[0].generator.initial_seed() != deployed[1].generator.initial_seed()
    assert session(Counter(), DP).context(3, 1234, {}, private=False).privacy is None  # an evaluation: no release
    assert session(Counter(), noise_stream=0xD9).context(3, 1234, {}).privacy is None  # the plan has no DP
