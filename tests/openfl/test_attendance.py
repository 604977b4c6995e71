"""A site that missed a round's timeout (the round closed without it, as min_sites allows) costs that
one round only: the later rounds close as soon as every site still attending has reported, until the
dropped site connects again and takes part from the next round (issue 37)."""

import logging

from fedcontrast.openfl.attendance import AttendanceRounds
from fedcontrast.openfl.launch import read_rounds, start, stop_all

from .conftest import FEDERATION_TIMEOUT, small_config


class StockRounds:
    """What the mixin needs of OpenFL's Aggregator: a round ends once every site is done (its
    WaitForAllPolicy), and stragglers get no tasks."""

    def __init__(self, sites, rounds_to_train):
        self.authorized_cols, self.rounds_to_train = list(sites), rounds_to_train
        self.round_number, self.collaborators_done, self.stragglers = 0, [], []
        self.failure, self.relay, self.lock, self.ended = None, None, _NoLock(), []

    def _end_of_round_with_stragglers_check(self):
        if len(self.collaborators_done) == len(self.authorized_cols):
            self._end_of_round_check()

    def _end_of_round_check(self):
        self.ended.append((self.round_number, list(self.stragglers)))
        self.round_number += 1
        self.stragglers, self.collaborators_done = [], []

    def get_tasks(self, name):
        return ([] if name in self.stragglers else ["train"]), self.round_number, 0, False

    def report(self, name):  # a site's results of the round (OpenFL's process_task_results)
        if name not in self.stragglers:
            self.collaborators_done.append(name)
            self._end_of_round_with_stragglers_check()


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Aggregator(AttendanceRounds, StockRounds):
    pass


def test_a_dropped_site_is_not_waited_for_until_it_connects_again(caplog):
    agg = Aggregator(["site_0", "site_1", "site_2"], rounds_to_train=5)
    caplog.set_level(logging.INFO, logger="fedcontrast.openfl.components")
    for site in ("site_0", "site_1"):
        agg.report(site)
    assert agg.round_number == 0  # round 1 waits for site_2 …
    agg.drop_silent(["site_2"])  # … until its timeout (the watchdog), then closes without it
    agg._end_of_round_check()
    assert agg.ended == [(0, ["site_2"])]
    assert "site site_2 dropped from later rounds after missing round 1's timeout; it rejoins when it connects" \
        in caplog.text
    for site in ("site_0", "site_1"):  # round 2 closes as soon as the attending sites reported
        agg.report(site)
    assert agg.ended[-1] == (1, ["site_2"]) and agg.round_number == 2
    assert agg.get_tasks("site_2")[0] == []  # it connects again in round 3: no tasks in this one …
    assert "site site_2 connected again (dropped after missing round 1's timeout); it takes part again from round 4" \
        in caplog.text
    for site in ("site_0", "site_1"):
        agg.report(site)
    assert agg.ended[-1] == (2, ["site_2"])
    assert agg.get_tasks("site_2")[0] == ["train"]  # … and is waited for again from round 4
    for site in ("site_0", "site_1"):
        agg.report(site)
    assert agg.round_number == 3
    agg.report("site_2")
    assert agg.ended[-1] == (3, []) and agg.round_number == 4


def test_a_site_missing_the_last_round_is_not_announced_as_dropped(caplog):
    agg = Aggregator(["site_0", "site_1"], rounds_to_train=1)
    caplog.set_level(logging.INFO, logger="fedcontrast.openfl.components")
    agg.report("site_0")
    agg.drop_silent(["site_1"])
    agg._end_of_round_check()
    assert agg.ended == [(0, ["site_1"])] and "dropped from later rounds" not in caplog.text


ROUND_TIMEOUT = 30  # seconds: round 1 waits it out for site_2; site_0's and site_1's own round must fit in it


def test_a_site_never_started_costs_only_the_first_round(make_workspace):
    """3 sites, site_2 never started, 2 training rounds and the evaluation round: only round 1 waits
    out the round timeout; before, every round (the evaluation one included) did."""
    ws = make_workspace(small_config(algorithm="fedavg", clients=3, rounds=2), round_timeout=ROUND_TIMEOUT,
                        min_sites=2)
    procs = {"aggregator": start(ws, ["aggregator", "start"], "aggregator.log")}
    procs.update({s: start(ws, ["collaborator", "start", "-n", s], f"{s}.log") for s in ("site_0", "site_1")})
    try:
        assert procs["aggregator"].wait(timeout=FEDERATION_TIMEOUT) == 0
        for site in ("site_0", "site_1"):
            assert procs[site].wait(timeout=60) == 0
    finally:
        stop_all(procs)
    records = read_rounds(ws)
    assert [r["round"] for r in records] == [1, 2] and all(r["absent"] == ["site_2"] for r in records)
    assert set(records[0]["sites"]) == {"site_0", "site_1"} and "evaluation" in records[0]["sites"]["site_0"]
    log = (ws / "logs" / "aggregator.log").read_text()
    assert f"round 1: no answer from site_2 within {ROUND_TIMEOUT} s; aggregated without them" in log
    assert "site site_2 dropped from later rounds after missing round 1's timeout; it rejoins when it connects" in log
    assert "no answer from site_2 within" not in log.split("dropped from later rounds", 1)[1]  # never waited again
    # round 2 and the evaluation round close as soon as site_0 and site_1 reported: the round timeout (whose
    # watchdog says so each time it closes a round, as it did for every round before) closed round 1 only
    assert log.count(" no answer from ") == 1 and "did not complete within" not in log
    # Issue 37: the run's end names every party's outputs (it used to be OpenFL's ✔️ OK alone), and the
    # finished federation restarted says so at once (it used to serve nothing for a minute, then ✔️ OK)
    said = " ".join(log.split())
    assert ("fedcontrast aggregator: federation finished (2 rounds); final model save/final_model.pt, round records "
            f"save/rounds.jsonl (`fedcontrast report {ws}` prints them and writes accuracy.png, rounds.csv and "
            f"summary.json), log {ws / 'logs' / 'aggregator.log'}; each site's outputs are in its own workspace, "
            "local_state/site_report/<site>/<run>/") in said, said[-2000:]
    for site in ("site_0", "site_1"):
        said = " ".join((ws / "logs" / f"{site}.log").read_text().split())
        run = (ws / "local_state" / "site_report" / site / "latest").resolve().name  # this run's own folder
        assert (f"fedcontrast collaborator: {site} finished the federation (2 rounds); its outputs are in "
                f"local_state/site_report/{site}/{run}/ (rounds.csv, rounds.jsonl, accuracy.png, final_model.pt; "
                f"`fedcontrast report {ws}` prints its rows), log {ws / 'logs' / f'{site}.log'}") in said, said[-2000:]
        assert (ws / "local_state" / "site_report" / site / run / "final_model.pt").is_file()
    proc = start(ws, ["aggregator", "start"], "restarted.log")
    try:
        assert proc.wait(timeout=45) == 0
    finally:
        stop_all({"aggregator": proc})
    said = " ".join((ws / "logs" / "restarted.log").read_text().split())
    assert "fedcontrast aggregator: federation ws finished already (round 2 of 2, " in said, said[-2000:]
    assert (f"nothing to run; final model save/final_model.pt, round records save/rounds.jsonl (`fedcontrast report "
            f"{ws}` prints them") in said
    assert "to run it again, create a new workspace (`fedcontrast workspace create`, then `fx plan initialize`)" in said
    assert "Traceback" not in said
    # told at once: it ended in its recovery, before serving (it used to serve nothing for a minute)
    assert "Starting Aggregator gRPC Server" in log and "Starting Aggregator gRPC Server" not in said
