"""A site's side of a run, engine-free: what the simulator, a Flower site and an OpenFL collaborator
each did in their own copy before — build the site's context, restore the state a round (or a task)
first started from, so that a round retried or asked for again starts where its first attempt did,
save the state after, and run the round's tasks (:func:`.site.run_site_task`) and the evaluation each
round starts with (:func:`.site.evaluate_site`). Where the state lives is the engine's: in memory
(:class:`MemoryStateStore`, the simulator) or on the site's disk (:class:`DiskStateStore`, a deployed
site under Flower or OpenFL)."""

from __future__ import annotations

import copy
import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ..algorithms import Algorithm, SiteContext
from ..atomic import atomic_torch_save
from ..config import RunConfig
from ..construction import site_privacy, task_seed
from ..errors import CheckpointError
from ..models import ContrastiveNet
from ..privacy.releases import ReleaseChoices
from ..seeds import derive_seed
from ..site.report import SiteReport
from .site import SiteTask, evaluate_site, run_site_task

EVALUATION_STREAM = 1 << 16  # the evaluation's seed: task_seed(…, EVALUATION_STREAM), apart from every task's

State = dict[str, Any]


class SiteStateStore(Protocol):
    """Where a site's state lives between its tasks: the latest, and the state the task under way
    first started from (kept until another task starts: starting one means those before it were
    accepted)."""

    def load(self) -> State:
        """The latest state (empty before the site's first task)."""

    def save(self, state: State) -> None:
        """``state`` is the latest (after a task)."""

    def started(self, round_num: int, task: str) -> State | None:
        """What ``task`` of ``round_num`` first started from (None: not kept), as a copy of its own."""

    def keep_start(self, round_num: int, task: str, state: State) -> None:
        """Keeps ``state`` as what ``task`` of ``round_num`` starts from; what others started from is dropped."""


class MemoryStateStore:
    """A site's state in memory (the simulator): ``state``, the latest, is the dict the tasks change."""

    def __init__(self, state: State | None = None) -> None:
        self.state: State = {} if state is None else state
        self._start: tuple[int, str, State] | None = None

    def load(self) -> State:
        return self.state

    def save(self, state: State) -> None:
        self.state = state

    def started(self, round_num: int, task: str) -> State | None:
        if self._start is None or self._start[:2] != (round_num, task):
            return None
        return copy.deepcopy(self._start[2])  # a retried task may change it again

    def keep_start(self, round_num: int, task: str, state: State) -> None:
        self._start = (round_num, task, copy.deepcopy(state))  # the task changes ``state`` in place


class DiskStateStore:
    """A site's state on its own disk, in ``folder``: ``<stem>.pt``, the latest (so that a restarted
    site keeps it), and ``<stem>.round<r>.<task>.pt``, what the task under way first started from;
    each written atomically. ``latest``: the latest state as the engine also holds it (a Flower
    SuperNode's ``context.state``), read instead of the file."""

    def __init__(self, folder: str | Path, stem: str, device: torch.device, latest: bytes | None = None) -> None:
        self.folder, self.stem, self.device = Path(folder), stem, device
        self.path = self.folder / f"{stem}.pt"
        self._latest = latest

    def start_path(self, round_num: int, task: str) -> Path:
        return self.folder / f"{self.stem}.round{round_num}.{task}.pt"

    def load(self) -> State:
        if self._latest:
            return self._read(self._latest, self.path)
        return self._read(self.path.read_bytes(), self.path) if self.path.exists() else {}

    def save(self, state: State) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(state, self.path)
        self._latest = None

    def started(self, round_num: int, task: str) -> State | None:
        path = self.start_path(round_num, task)
        return self._read(path.read_bytes(), path) if path.exists() else None

    def keep_start(self, round_num: int, task: str, state: State) -> None:
        path = self.start_path(round_num, task)
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(state, path)
        pattern = re.compile(rf"{re.escape(self.stem)}\.round\d+\.\w+\.pt")
        for old in self.folder.iterdir():
            if old != path and pattern.fullmatch(old.name):
                old.unlink(missing_ok=True)

    def _read(self, data: bytes, path: Path) -> State:
        try:
            state = torch.load(io.BytesIO(data), map_location=self.device, weights_only=True)
        except Exception as exc:
            state, problem = None, type(exc).__name__
        else:
            problem = f"it holds a {type(state).__name__}, not a site's state"
        if not isinstance(state, dict):  # a plugin would fail on it with a message that names no file
            raise CheckpointError(f"this site's state file {path} is corrupt ({problem}); "
                                  "move it away to start the site afresh")
        return state


@dataclass
class SiteSession:
    """One site's side of a run: its name and index among the plan's sites, its data (``train``, and
    the held-out ``test`` and ``validation`` parts its evaluation scores), the plugin, the scratch
    model its tasks load weights into, the device, the plan, the public set, and what it lets leave
    (``releases``). ``noise_stream``: None, DP noise from the operating system, as a deployed site
    must draw it (the plan and its seeds are the aggregator's too); a stream: noise seeded from each
    task's seed and the stream (the simulator: reproducible runs)."""

    name: str
    index: int
    config: RunConfig
    algorithm: Algorithm
    model: ContrastiveNet
    device: torch.device
    releases: ReleaseChoices
    train: Any  # fedcontrast.data.ArrayDataset
    test: Any = None
    validation: Any = None
    public: Any = None
    noise_stream: int | None = None

    def context(self, round_num: int, seed: int, state: State, *, private: bool = True) -> SiteContext:
        """What a task (or, not ``private``, an evaluation: it releases nothing) of ``round_num`` sees."""
        privacy = None
        if private:
            noise_seed = None if self.noise_stream is None else derive_seed(seed, self.noise_stream)
            privacy = site_privacy(self.config, state, round_num, noise_seed=noise_seed)
        return SiteContext(name=self.name, data=self.train, model=self.model,
                           training=self.config.training_at(round_num), round_num=round_num, seed=seed,
                           device=self.device, state=state, public=self.public, index=self.index, privacy=privacy)

    def state_at(self, round_num: int, store: SiteStateStore) -> State:
        """The state at the start of ``round_num``: what its first task started from when the round was
        started before (a lost attempt may have saved a newer one), else the latest."""
        started = store.started(round_num, self.algorithm.tasks[0])
        return store.load() if started is None else started

    def task_start(self, round_num: int, task: str, store: SiteStateStore) -> State:
        """The state ``task`` of ``round_num`` starts from: what its first attempt started from, else
        the latest, kept as that now."""
        started = store.started(round_num, task)
        if started is not None:
            return started
        state = store.load()
        store.keep_start(round_num, task, state)
        return state

    def run_task(self, round_num: int, task: str, received: dict[str, torch.Tensor],
                 store: SiteStateStore) -> SiteTask:
        """``task`` of ``round_num`` alone (an OpenFL task), from the state it first started from; the
        state after it is saved."""
        done, state = self._run(round_num, task, received, self.task_start(round_num, task, store))
        store.save(state)
        return done

    def run_round(self, round_num: int, received: dict[str, torch.Tensor], store: SiteStateStore, *,
                  finished: Callable[[SiteTask], None] | None = None) -> list[SiteTask]:
        """Every task of ``round_num``, in order, from the state the round first started from; the state
        after the last is saved. ``finished``: called with each task as it ends (the engine's records)."""
        state = self.task_start(round_num, self.algorithm.tasks[0], store)
        out = []
        for task in self.algorithm.tasks:
            done, state = self._run(round_num, task, received, state)
            if finished is not None:
                finished(done)
            out.append(done)
        store.save(state)
        return out

    def evaluate(self, round_num: int, received: dict[str, torch.Tensor], store: SiteStateStore,
                 report: SiteReport, *, shape: dict[str, int],
                 sent_bytes: Callable[[dict[str, float]], int] | None = None) -> dict[str, float]:
        """What the site received at the start of ``round_num`` scored on its held-out parts, with the
        state the round started from (:func:`.site.evaluate_site`: its report's row, the final model)."""
        seed = task_seed(self.config, round_num, self.index, EVALUATION_STREAM)
        site = self.context(round_num, seed, self.state_at(round_num, store), private=False)
        return evaluate_site(self.algorithm, site, received, self.test, report, config=self.config, shape=shape,
                             sent_bytes=sent_bytes, validation=self.validation)

    def _run(self, round_num: int, task: str, received: dict[str, torch.Tensor],
             state: State) -> tuple[SiteTask, State]:
        seed = task_seed(self.config, round_num, self.index, self.algorithm.tasks.index(task))
        site = self.context(round_num, seed, state)
        return run_site_task(self.algorithm, site, task, received, self.releases), site.state
