"""Issue 37 (Flower rounds as fast as OpenFL's): the site's runner that takes its SuperNode's tasks
in its long-lived worker (flower/runner.py: the operator's app bundle checked first) and the
ServerApp's standby messages that keep a SuperNode from its 3 s idle sleep (flower/standby.py)."""

from __future__ import annotations

import io
import zipfile

import pytest

pytest.importorskip("flwr", reason="the Flower engine is the extra [flower] (its own environment)")

from flwr.app import ConfigRecord, Message, RecordDict

from fedcontrast.flower import client_app
from fedcontrast.flower.runner import bundle_problem
from fedcontrast.flower.server_app import FlowerServer

from .test_flower_server import NODES, SITES, Grid, config, task_identity  # noqa: F401  # the fixture too

PYPROJECT = ('[tool.flwr.app.components]\nserverapp = "fedcontrast.flower.server_app:server"\n'
             'clientapp = "{clientapp}"\n')


def fab(clientapp: str = "fedcontrast.flower.client_app:client", **extra: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("pyproject.toml", PYPROJECT.format(clientapp=clientapp))
        for name, text in extra.items():
            z.writestr(name, text)
    return buffer.getvalue()


def test_the_runner_runs_only_a_bundle_that_names_the_installed_clientapp_and_carries_no_code():
    assert bundle_problem(fab()) is None
    assert "carries code (evil.py)" in str(bundle_problem(fab(**{"evil.py": "import os"})))
    assert "names the ClientApp 'evil:client'" in str(bundle_problem(fab("evil:client")))
    assert "cannot be read" in str(bundle_problem(b"not a zip"))


class StandbyGrid(Grid):
    """Sites whose start-up reply says they take standby messages (all but ``plain``); a standby's
    reply holds nothing."""

    def __init__(self, plain=()):
        super().__init__()
        self.plain = set(plain)
        self.log = []  # (site, message type) of every message pushed

    def push_messages(self, messages):
        messages = list(messages)
        self.log += [(next(s for s, n in NODES.items() if n == m.metadata.dst_node_id), m.metadata.message_type)
                     for m in messages]
        return super().push_messages(messages)

    def pull_messages(self, ids):
        standbys, others = [], []
        for mid in ids:
            (standbys if self.pending[mid].metadata.message_type == client_app.STANDBY_MESSAGE else others).append(mid)
        replies = super().pull_messages(others)
        for reply in replies:
            if "site" in reply.content and reply.content["site"]["site"] not in self.plain:
                reply.content["site"]["standby"] = 1
        for mid in standbys:
            msg = self.pending.pop(mid)
            assert 0 < float(msg.content["standby"]["hold"]) <= client_app.STANDBY_MAX_S
            reply = Message(RecordDict({"standby": ConfigRecord({"held": 0.0})}), reply_to=msg)
            reply.metadata._reply_to_message_id = mid
            replies.append(reply)
        return replies


def test_a_standby_follows_each_message_to_a_site_that_takes_them_and_none_the_final_evaluation(tmp_path):
    """Every site gets one behind its start-up message (its kind is not known yet); then only those
    whose start-up reply said they take them."""
    grid = StandbyGrid(plain={"hosp3"})
    summary = FlowerServer(grid, config(), tmp_path, NODES, round_timeout=5, start_timeout=5).run()
    assert summary["rounds_completed"] == 2
    for site in SITES:
        kinds = [k for s, k in grid.log if s == site]
        assert kinds[:2] == ["query", client_app.STANDBY_MESSAGE]  # every site: one behind its start-up message
        assert kinds[-1] == "evaluate"  # none after the final evaluation
        if site == "hosp3":  # a ClientApp process per message: no other standby
            assert kinds.count(client_app.STANDBY_MESSAGE) == 1
        else:
            for i, kind in enumerate(kinds):
                if kind == "train":
                    assert kinds[i + 1] == client_app.STANDBY_MESSAGE
    assert not grid.pending or all(m.metadata.message_type == client_app.STANDBY_MESSAGE
                                   for m in grid.pending.values())


def test_a_standby_holds_as_asked_and_touches_nothing(monkeypatch):
    held = []
    monkeypatch.setattr(client_app.time, "sleep", held.append)
    msg = Message(RecordDict({"standby": ConfigRecord({"hold": 0.25})}), dst_node_id=1,
                  message_type=client_app.STANDBY_MESSAGE)
    msg.metadata._message_id = "1"
    reply = client_app.standby(msg, None)
    assert held == [0.25] and list(reply.content) == ["standby"]


def test_tensors_cross_as_one_packed_record_and_come_back_exactly():
    import numpy as np
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    arrays = {"conv.weight": np.random.default_rng(0).standard_normal((4, 3, 2, 2)).astype(np.float32),
              "bn.num_batches_tracked": np.array(7, dtype=np.int64), "empty": np.zeros((0, 3), dtype=np.float64)}
    from fedcontrast.flower.packing import pack_arrays, unpack_arrays

    record = pack_arrays(arrays)
    assert len(get_all_nested_objects(record)) == 3  # the record, its one array and its one chunk
    back = unpack_arrays(record)
    assert list(back) == list(arrays)
    for name, value in arrays.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        assert np.array_equal(back[name], value)
    import json

    from flwr.app import Array, ArrayRecord

    layout = json.dumps([[k, v.dtype.str, list(v.shape)] for k, v in arrays.items()]).encode()
    earlier = ArrayRecord(array_dict={  # as an earlier fedcontrast packs: the layout in an array of its own
        "__layout__": Array.from_numpy_ndarray(np.frombuffer(layout, dtype=np.uint8)),
        "__packed__": Array.from_numpy_ndarray(np.concatenate([np.frombuffer(v.tobytes(), dtype=np.uint8)
                                                               for v in arrays.values()]))})
    assert all(np.array_equal(unpack_arrays(earlier)[k], v) for k, v in arrays.items())


def test_a_standby_never_holds_longer_than_the_supernodes_idle_sleep():
    """A gap measured across a wait for a silent site (15 s here) must not hold the next round's message
    for 15 s: that once took the sites past the round's timeout. The hold is capped at the 3 s idle sleep."""
    from fedcontrast.flower.standby import HOLD_MAX_S, Standby

    class Pushed:
        def __init__(self):
            self.messages = []

        def push_messages(self, messages):
            self.messages += messages
            return [f"m{len(self.messages)}-{i}" for i in range(len(messages))]

    grid = Pushed()
    standby = Standby(grid, {"hosp1": 1, "hosp2": 2}, ttl=30.0)
    standby.sites = {"hosp1", "hosp2"}
    standby.gap = {"hosp1": 15.0, "hosp2": 0.4}
    standby.push(["hosp1", "hosp2"])
    holds = {m.metadata.dst_node_id: float(m.content["standby"]["hold"]) for m in grid.messages}
    assert HOLD_MAX_S == 3.0 and holds == {1: 3.0, 2: pytest.approx(0.7)}
