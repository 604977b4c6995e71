"""The operator's side of a real Flower deployment: the ``ServerApp`` the SuperLink runs. It holds
no data.

It drives the plugin's server calls (``initial_downlink``, the upload screen, ``aggregate``) over the
sites it reaches through Flower's grid, one SuperNode per site, each admitted by its registered key
(:mod:`fedcontrast.flower.deploy` records which node is which site). The run's settings come from the
Flower App's run config (written by ``fedcontrast flower init``): the typed run configuration
(``fedcontrast-config``), the output folder, the registered nodes, the timeouts.

What it writes, in the operator's run folder: ``metrics.csv`` (each site's released training
metrics and held-out evaluation per round; a ``global`` row per round: the sites' held-out accuracy of
the global model, weighted by their held-out sizes), ``summary.json``, ``accuracy.png`` and
``rounds.jsonl`` (a record per round: each site's weight and released metrics, the uploads excluded),
``outcome.json`` (``finished``, or ``failed`` with the one sentence that stopped the run), which
``fedcontrast flower run`` reads and prints.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from ..algorithms import Downlink
from ..config import RunConfig, site_names
from ..construction import algorithm_class, data_shape, load_public
from ..devices import resolve_device
from ..errors import FedContrastError
from ..outputs import (
    GLOBAL_SITE,
    build_summary,
    metric_row,
    one_site,
    plot_curves,
    sites_evaluated,
    test_accuracy_curve,
    write_json,
    write_metrics_csv,
)
from ..privacy.releases import describe_withheld
from ..privacy.secagg_relay import relay_for
from ..rounds import AggregatorRound, RoundOutcome
from ..rounds.transport import Replies, run_round, run_rounds
from ..threads import apply_threads
from . import runs
from .attendance import Attendance
from .console import say
from .records import CONFIG_KEY, flwr_app, from_array_record, plan_pins, to_array_record
from .replies import _reason, _refused, pull_replies  # noqa: F401 (_reason: re-exported)
from .server_records import SECURE_SAMPLES, RoundRecords, _count, nbytes
from .standby import Standby
from .trace import trace

logger = logging.getLogger("fedcontrast.flower.server")

OUTCOME_FILE = "outcome.json"
REFUSAL_GRACE_S = 3.0  # after a refusal that stops the run: how long the other sites' answers may still come
REPLY_POLL_S = 0.05  # between two pulls of the sites' replies


class SiteProblem(FedContrastError):
    """A site did not answer, refused, or failed: the run stops naming it."""


class FlowerServer(RoundRecords):  # its records of each round: flower/server_records.py
    def __init__(self, grid, config: RunConfig, out_dir: Path, site_nodes: dict[str, int], *,
                 round_timeout: float, start_timeout: float, shared: dict[str, bytes] | None = None,
                 base_dir: Path = Path("."), site_keys: dict[str, str] | None = None, min_sites: int | None = None,
                 resume: bool = False, flower_run: str = "") -> None:
        """``flower_run``: Flower's run id, which the sites bind their secure-aggregation session to (and
        draw its neighbourhood graph from, as the relay does here)."""
        self.grid, self.config, self.out = grid, config, Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.round_timeout, self.start_timeout = round_timeout, start_timeout
        self.min_sites = min_sites  # a round goes on without silent sites while this many answered
        self.absent: dict[str, str] = {}  # site → why it is not in the current round
        self.refusals: dict[str, str] = {}  # site → its refusal or failure, as the operator was told
        self.sites = site_names(config)
        unregistered = [s for s in self.sites if s not in site_nodes]
        if unregistered:
            raise SiteProblem(f"site(s) {', '.join(unregistered)} of the plan have no registered SuperNode key: "
                              "register each with `fedcontrast flower register`")
        self.node_of = {s: int(site_nodes[s]) for s in self.sites}
        self.site_of = {n: s for s, n in self.node_of.items()}
        self.attendance = Attendance(grid, self.sites, self.node_of)  # flower/attendance.py: who is dropped
        self.back: list[str] = []  # sites back in the current round
        self.standby = Standby(grid, self.node_of, round_timeout)  # flower/standby.py: no idle SuperNode
        self.shared = shared or {}
        self.device = resolve_device(config.device)
        public = load_public(config, base_dir=base_dir) if algorithm_class(config).requires_public else None
        self.core = AggregatorRound(config, data_shape(config), public=public, device=self.device)  # fedcontrast.rounds
        self.algorithm, self.server, self.specs = self.core.algorithm, self.core.server, self.core.specs
        self.screen, self.sum_layout = self.core.screen, self.core.sum_layout
        self.downlink = self.core.initial_downlink()
        self.rows: list[dict[str, Any]] = []
        self.withheld: dict[int, dict[str, list[str]]] = {}  # round → which site withheld which metrics
        self.round_seconds, self.timed_rounds = 0.0, 0  # the rounds' own time and count, over every part of a
        # resumed run (seconds_per_round)
        secure = config.secure_aggregation  # the sites' protocol messages meet at the relay (flower/secure.py)
        self.relay = (None if secure is None or self.sum_layout is None  # both, or neither
                      else relay_for(self.sites, secure, self.sum_layout, config.to_dict(), flower_run))
        self.site_keys = dict(site_keys or {})
        self.start_round, self.run_label = 0, runs.new_label()
        if resume:  # the run in out_dir, from its checkpoint (flower run --resume checked it is this plan's)
            state = runs.load(out_dir, self.device)
            self.start_round, self.run_label, self.rows = state["rounds_done"], state["label"], list(state["rows"])
            timing = state.get("timing") or {}  # the earlier parts' rounds (none kept by an older checkpoint)
            self.round_seconds = float(timing.get("round_seconds", 0.0))
            self.timed_rounds = int(timing.get("rounds", 0))
            self.downlink = state["downlink"]
            self.core.load_state_dict(state["core"])

    # --- messages ----------------------------------------------------------------------------------
    def message(self, site: str, kind: str, records: dict[str, Any], round_num: int):
        app = flwr_app()
        return app.Message(app.RecordDict(records), dst_node_id=self.node_of[site], message_type=kind,
                           group_id=str(round_num))

    def ask(self, messages: dict[str, Any], timeout: float, what: str, *,
                 drop: bool = False) -> dict[str, Any]:
        """Sends one message per site and waits up to ``timeout`` seconds for every reply. A site that
        fails or stays silent stops the run, named with its reason — unless ``drop`` and ``min_sites``
        let the round go on without it (named, in :attr:`absent`)."""
        trace("server", "push", what=what)
        ids = dict(zip(self.grid.push_messages(list(messages.values())), messages))  # message id → site
        trace("server", "pushed", what=what)
        self.standby.begin(messages)  # a standby behind each (none after the final evaluation)
        pending, replies, failed = set(ids), {}, {}
        deadline = time.monotonic() + timeout
        may_drop = drop and self.min_sites is not None
        while pending and time.monotonic() < deadline:
            for reply in pull_replies(self.grid, [*pending, *self.standby.sent]):
                if self.standby.dropped(reply.metadata.reply_to_message_id):  # a standby's reply: nothing in it
                    continue
                site = ids.get(reply.metadata.reply_to_message_id)
                if site is None:
                    continue
                pending.discard(reply.metadata.reply_to_message_id)
                trace("server", "reply", site=site)
                self.standby.note(site, reply)  # when; a start-up reply: does it take standby messages
                why = _refused(reply, site)
                if why is None:
                    replies[site] = reply
                    continue
                failed[site] = why
                say(f"{what}: {why}")  # at once, whatever the others do
                if not may_drop:  # the run stops: the others' refusals have a moment to arrive, not the timeout
                    deadline = min(deadline, time.monotonic() + REFUSAL_GRACE_S)
            if pending:
                time.sleep(REPLY_POLL_S)
        self.refusals.update({s: f"{what}: {why}" for s, why in failed.items()})
        if failed and (not may_drop or len(replies) < (self.min_sites or 0)):
            raise SiteProblem(f"{what}: {'; '.join(failed[s] for s in sorted(failed))}"
                              + (f"; fewer than min_sites {self.min_sites} answered" if may_drop else "")
                              + "; the run stops here")
        silent = sorted(ids[m] for m in pending)
        if silent and not (may_drop and len(replies) >= (self.min_sites or 0)):
            raise SiteProblem(f"{what}: no answer from site(s) {', '.join(silent)} within {timeout:g} s (stopped, "
                              "or its SuperNode lost the connection); the run stops here")
        self.attendance.drop({m: ids[m] for m in pending}, what, timeout)  # not asked again until it is back
        self.absent.update({**{s: f"no answer within {timeout:g} s" for s in silent}, **failed})
        if failed:  # each named above as it came
            say(f"{what} goes on without {', '.join(sorted(failed))} ({len(replies)} sites answered, "
                f"min_sites {self.min_sites})")
        return replies

    # --- the run -----------------------------------------------------------------------------------
    def connect(self) -> None:
        """Waits for every site's SuperNode, then asks each to check the plan (policy, audit) and
        read its folder."""
        deadline = time.monotonic() + self.start_timeout
        online: set[int] = set()
        while time.monotonic() < deadline:
            online = set(self.grid.get_node_ids())
            if set(self.node_of.values()) <= online:
                break
            time.sleep(0.5)
        missing = [s for s in self.sites if self.node_of[s] not in online]
        if missing and (self.min_sites is None or len(self.sites) - len(missing) < self.min_sites):
            raise SiteProblem(f"site(s) {', '.join(missing)} did not connect within {self.start_timeout:g} s "
                              f"(their SuperNode is not running, or cannot reach this SuperLink)")
        if missing:
            say(f"site(s) {', '.join(missing)} did not connect within {self.start_timeout:g} s; the run starts without "
                f"them (min_sites {self.min_sites}) and takes each in when its SuperNode connects")
            for site in missing:
                self.attendance.dropped[site] = f"start-up: did not connect within {self.start_timeout:g} s"
                self.attendance.listed[site] = False
        ready = self.start_up([s for s in self.sites if s not in missing], "start-up")
        say(f"{len(ready)} sites ready: {', '.join(ready)} (each checked the plan against its policy "
            "before reading its data)")

    def start_up(self, sites: list[str], what: str) -> list[str]:
        """Asks ``sites`` to check the plan (policy, audit) and read their folders: those that did."""
        app = flwr_app()
        content = {"task": app.ConfigRecord({"run": self.run_label})}
        if self.shared:
            content["shared"] = app.ConfigRecord(dict(self.shared))
        replies = self.ask({s: self.message(s, "query", dict(content), 0) for s in sites}, self.round_timeout,
                                what, drop=True)
        for site, reply in replies.items():
            claimed = str(reply.content["site"]["site"])
            if claimed != site:
                raise SiteProblem(f"the SuperNode registered as site {site} says it is {claimed!r}; the run stops")
        self.attendance.started.update(replies)
        return [s for s in self.sites if s in replies]

    def attending(self, what: str) -> tuple[list[str], list[str]]:
        """The sites a message goes to now (dropped ones left out; those back, after their start-up if
        they never had one) and the sites back since the last message."""
        back = self.attendance.rejoin(what)
        fresh = [s for s in back if s not in self.attendance.started]
        if fresh:
            self.start_up(fresh, f"{what} (start-up of {', '.join(fresh)})")
        self.absent = {s: f"dropped ({why})" for s, why in self.attendance.dropped.items()}
        return self.attendance.active(), back

    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.connect()
        start = time.perf_counter()
        if self.start_round:
            say(f"resuming run {self.run_label} after round {self.start_round} of {self.config.rounds}")
        self.round_start = time.perf_counter()
        try:  # the round's loop (fedcontrast.rounds): this server is the transport; _RunRecords records each round
            self.downlink = run_rounds(self.core, self, _RunRecords(self), self.downlink, self.start_round + 1,
                                       self.config.rounds)
        finally:  # a round that stops the run (on_rejected: stop) or fails is recorded first
            write_metrics_csv(self.out / "metrics.csv", self.rows)
        self.final_evaluation()
        write_metrics_csv(self.out / "metrics.csv", self.rows)
        summary = build_summary(self.rows, config=self.config.to_dict(), wall_time_s=time.perf_counter() - t0,
                                rounds_total=self.config.rounds)
        summary["startup_s"] = round(start - t0, 3)
        if self.refusals or self.attendance.dropped:  # who refused or failed, who is dropped at the end
            summary["sites_absent"] = {"refused": dict(self.refusals), "dropped": dict(self.attendance.dropped)}
        # the rounds' own time over the rounds run, in every part of a resumed run (not this part's time over all)
        summary["seconds_per_round"] = round(self.round_seconds / max(1, self.timed_rounds), 3)
        summary["rounds_this_part"] = self.config.rounds - self.start_round  # run by this ServerApp (resume: fewer)
        if self.relay is not None:
            summary["samples"] = SECURE_SAMPLES
        final = self.withheld.get(self.config.rounds + 1)
        if final:
            summary["final_evaluation_withheld"] = final
        write_json(self.out / "summary.json", summary)
        curve = test_accuracy_curve(self.rows)
        if curve:
            plot_curves(self.out / "accuracy.png", {self.config.algorithm: curve},
                        title=f"{self.config.algorithm} on Flower", ylabel="sites' held-out accuracy")
        return summary

    def run_round(self, round_num: int) -> None:
        """Round ``round_num`` alone, recorded as :meth:`run` records each (without the checkpoint)."""
        replies, outcome = run_round(self.core, self, round_num, self.downlink)
        self.record(round_num, replies, outcome)
        if outcome.stop:  # on_rejected: stop — aggregated without them, recorded; the run stops here
            raise outcome.stopped(round_num)

    # --- the transport (fedcontrast.rounds.transport.SiteTransport; its secure sum: server_records.py) ---
    def exchange(self, round_num: int, downlink: Downlink) -> Replies:
        """Round ``round_num``'s training message to every site attending, with what it receives of
        ``downlink``; their replies: uploads and weights (but under secure aggregation, where each
        site sends its keys and the sum comes by the protocol), and their released metrics and
        evaluations of what they received, as rows of ``metrics.csv``."""
        app = flwr_app()
        task = app.ConfigRecord({"round": round_num, "run": self.run_label})
        sites, self.back = self.attending(f"round {round_num}")
        down = {s: nbytes(downlink.for_site(s)) for s in sites}  # each site's downlink payload
        messages = {s: self.message(s, "train", {"task": task, "received": to_array_record(downlink.for_site(s))},
                                    round_num) for s in sites}
        answered = self.ask(messages, self.round_timeout, f"round {round_num}", drop=True)
        replies = Replies(messages=answered)
        evaluations: dict[str, dict[str, float]] = {}
        released: dict[str, dict[str, dict[str, float]]] = {}
        self.first_rows = {}
        for site in answered:
            outcome = answered[site].content["outcome"]
            released[site] = json.loads(str(outcome["metrics"]))
            evaluations[site] = json.loads(str(outcome["evaluation"]))
            if self.relay is None:  # else its keys, not its uploads: they are summed securely (secure_sum)
                replies.weights[site] = float(outcome["weight"])
                replies.uploads[site] = from_array_record(answered[site].content["uploads"], self.device)
            # samples: the count the site released (under secure aggregation it is inside the sum: None);
            # bytes: the payloads of the round's messages, on the site's first task's row (as the simulator's
            # downloaded bytes): its uploads (its secure-aggregation messages, filled in by record), its downlink
            samples = None if self.relay is not None else _count(replies.weights[site])
            for t, (task_name, metrics) in enumerate(released[site].items() or [(self.algorithm.tasks[0], {})]):
                row = metric_row(round_num, site, task_name, samples, metrics,
                                 nbytes(replies.uploads.get(site, {})) if t == 0 else 0, down[site] if t == 0 else 0)
                self.rows.append(row)
                self.first_rows.setdefault(site, row)
        self.withheld[round_num] = self.withheld_by(released, evaluations)
        if self.withheld[round_num]:
            say(f"round {round_num}: {describe_withheld(self.withheld[round_num])}")
        self.evaluation_rows(round_num, evaluations)
        self.round_evaluations = evaluations
        trace("server", "aggregate")
        return replies

    def prepare(self, round_num: int, downlink: Downlink) -> None:
        trace("server", "aggregated")
        self.downlink = downlink

    def final_evaluation(self) -> None:
        """The final model goes to every site, which scores it and keeps it (``site_report/``)."""
        app = flwr_app()
        rounds = self.config.rounds
        task = app.ConfigRecord({"round": rounds + 1, "run": self.run_label})  # evaluation only, after the last
        sites, _ = self.attending("the final evaluation")
        messages = {s: self.message(s, "evaluate",
                                    {"task": task, "received": to_array_record(self.downlink.for_site(s))},
                                    rounds + 1) for s in sites}
        replies = self.ask(messages, self.round_timeout, "final evaluation", drop=True)
        evaluations = {s: json.loads(str(r.content["outcome"]["evaluation"])) for s, r in replies.items()}
        self.withheld[rounds + 1] = self.withheld_by({}, evaluations)  # the final model's evaluation
        if self.withheld[rounds + 1]:
            say(f"final evaluation: {describe_withheld(self.withheld[rounds + 1])}")
        self.evaluation_rows(rounds + 1, evaluations)


class _RunRecords:
    """What :meth:`FlowerServer.run` keeps of each round: the round's records, then ``metrics.csv``,
    the checkpoint a ``--resume`` continues from (not after a round that stops the run) and the
    round's line on the console."""

    def __init__(self, server: FlowerServer) -> None:
        self.server = server

    def record(self, round_num: int, replies: Replies, outcome: RoundOutcome) -> None:
        server = self.server
        server.record(round_num, replies, outcome)
        if outcome.stop:
            return
        write_metrics_csv(server.out / "metrics.csv", server.rows)
        server.round_seconds += time.perf_counter() - server.round_start
        server.timed_rounds += 1
        trace("server", "save")
        runs.save(server.out, server.config, server.run_label, round_num, server.downlink, server.core.state_dict(),
                  server.rows, timing={"round_seconds": server.round_seconds, "rounds": server.timed_rounds})
        trace("server", "saved")
        acc = [r for r in server.rows if r["site"] == GLOBAL_SITE and r["round"] == round_num - 1]
        say(f"round {round_num}/{server.config.rounds} done in {time.perf_counter() - server.round_start:.1f} s"
            + (f"; sites' held-out accuracy of the model after round {round_num - 1}: {acc[0]['accuracy']:.4f}"
               + one_site(sites_evaluated(server.rows, round_num - 1)) if acc else ""))
        server.round_start = time.perf_counter()


def server_app():
    """The ServerApp of every plugin, for a deployment."""
    from flwr.serverapp import ServerApp

    app = ServerApp()

    @app.main()
    def main(grid, context) -> None:
        rc = context.run_config
        out = Path(str(rc["out-dir"]))
        out.mkdir(parents=True, exist_ok=True)
        server = None
        try:
            config = RunConfig.from_dict(json.loads(str(rc[CONFIG_KEY])))
            base = Path(str(rc.get("base-dir", ".") or "."))
            shared = {rel: (base / rel).read_bytes() for rel in plan_pins(config)}  # e.g. FedPCL's backbones
            threads = apply_threads(int(rc.get("threads", 0) or 0) or None)  # init's --threads, else the cores
            say(f"ServerApp {threads.line()}")
            server = FlowerServer(grid, config, out, json.loads(str(rc["site-nodes"])),
                                  round_timeout=float(rc["round-timeout"]), start_timeout=float(rc["start-timeout"]),
                                  shared=shared, base_dir=base,
                                  site_keys=json.loads(str(rc.get("site-keys", "{}") or "{}")),
                                  min_sites=int(rc["min-sites"]) if int(rc.get("min-sites", 0) or 0) else None,
                                  resume=str(rc.get("resume", "false")).lower() == "true",
                                  flower_run=str(getattr(context, "run_id", "")))
            summary = server.run()
            summary["threads"] = threads.record()  # recorded with the run
            write_json(out / "summary.json", summary)
        except FedContrastError as exc:
            say(f"error: {exc}")
            write_json(out / OUTCOME_FILE, {"status": "failed", "error": str(exc),  # and each site that refused
                                            "refused": dict(server.refusals) if server is not None else {}})
            return
        except Exception as exc:
            logger.exception("the ServerApp failed")
            write_json(out / OUTCOME_FILE, {"status": "failed", "error": f"{type(exc).__name__}: {exc}"})
            return
        sites = sites_evaluated(server.rows, config.rounds) if server is not None else 0  # 1: one site's, no mean
        write_json(out / OUTCOME_FILE, {"status": "finished", "final_accuracy": summary.get("final_accuracy"),
                                        "final_sites": sites, "rounds": summary.get("rounds_completed")})
        acc = summary.get("final_accuracy")
        say(f"finished: {config.rounds} rounds; the sites' held-out accuracy of the final model "
            f"{'n/a' if acc is None else f'{acc:.4f}'}{one_site(sites)}; the operator's outputs in {out} (metrics.csv, "
            f"summary.json, rounds.jsonl, accuracy.png); each site's in its own folder, site_report/<site>/<run>/ "
            f"(this run: {server.run_label if server is not None else '?'})")

    return app


server = server_app()  # the component the Flower App names: fedcontrast.flower.server_app:server
