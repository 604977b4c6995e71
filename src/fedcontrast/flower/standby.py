"""Standby messages: what keeps a site's SuperNode from going idle between two of the ServerApp's
messages.

A Flower 1.42 SuperNode (``flwr/supernode/start_client_internal.py``) asks the SuperLink for its next
message at once after it sent a reply, but sleeps a fixed 3 s whenever it finds none (not
configurable). Between two rounds it always finds none: it sent its reply before the others finished
and the ServerApp aggregated, so the next round's message waited 0–3 s at every site, nearly 3 s
when aggregation is quick. The ServerApp (:class:`Standby`, used by ``server_app.FlowerServer.exchange``)
therefore queues one small standby message right behind each site's message; it holds (at the
site: ``client_app.standby``) as long as that site's next message took to come after its reply last
time (+ a margin), so the next message is already queued when the standby's reply goes. (Standbys
queued one after another while a site waits were tried: behind them, in the SuperLink's first-in
first-out queue, the next message waited longer than the 3 s sleep they avoided.) Only sites
whose start-up reply says they run every message in one long-lived process (``flower/runner.py``)
get them (and every site one, right behind the start-up message: the first round's message follows
it, before its reply said which kind it is): a ClientApp process per message would cost ~1.3 s of
imports per standby. None after the final evaluation. A standby touches nothing of the site and
its reply is dropped. Too short a hold costs that site the 3 s sleep; too long delays it only by
the excess, which a site that was waiting for the others never notices.
"""

from __future__ import annotations

import time
from typing import Any

from .client_app import STANDBY_MAX_S, STANDBY_MESSAGE
from .records import flwr_app

DEFAULT_S = 1.0  # a standby's hold before this site's gap was measured
# The longest hold asked for: the SuperNode's own idle sleep. A longer hold could only delay a site past
# what its idle poll would (a gap measured across a start-up or round that waited out a timeout for a
# silent site once held the next round's message for 15 s, past that round's timeout).
HOLD_MAX_S = 3.0
MARGIN_S = 0.3  # added to the gap: the site starts its standby before the ServerApp sees its reply


class Standby:
    def __init__(self, grid, node_of: dict[str, int], ttl: float) -> None:
        self.grid, self.node_of, self.ttl = grid, node_of, ttl
        self.sites: set[str] = set()  # those that take standbys (their start-up reply said so)
        self.sent: dict[str, str] = {}  # message id → site: standbys whose replies are still to be pulled
        self.replied: dict[str, float] = {}  # site → when its last reply was seen
        self.gap: dict[str, float] = {}  # site → from its last reply seen to its next message, last measured

    def note(self, site: str, reply: Any) -> None:
        """A site's reply seen: when (its next message's gap is measured from it), and, from its
        start-up reply, whether it takes standbys."""
        self.replied[site] = time.monotonic()
        if reply.has_content() and "site" in reply.content and int(reply.content["site"].get("standby", 0) or 0):
            self.sites.add(site)

    def begin(self, messages: dict[str, Any]) -> None:
        """``messages`` were just pushed: the gap each site waited since its last reply, and a standby
        behind each (none after the final evaluation, which nothing follows)."""
        now = time.monotonic()
        for site in messages:
            if site in self.replied:
                self.gap[site] = now - self.replied.pop(site)
        kinds = {m.metadata.message_type for m in messages.values()}
        if "evaluate" in kinds:
            return
        self.push(list(messages), every="query" in kinds)  # the first round's message follows the start-up

    def dropped(self, message_id: str) -> bool:
        """Whether this reply answers a standby (it is dropped)."""
        return self.sent.pop(message_id, None) is not None

    def push(self, sites: list[str], *, every: bool = False) -> None:
        """A standby to each of ``sites`` that takes them (``every``: to each, before their start-up
        replies said whether they do; a site that does not costs one ClientApp process, once), held
        for the gap its next message took last time."""
        app = flwr_app()
        out = {}
        for site in sites:
            if not (every or site in self.sites):
                continue
            hold = round(min(DEFAULT_S if site not in self.gap else self.gap[site] + MARGIN_S, HOLD_MAX_S,
                             STANDBY_MAX_S), 3)
            out[site] = app.Message(app.RecordDict({"standby": app.ConfigRecord({"hold": hold})}),
                                    dst_node_id=self.node_of[site], message_type=STANDBY_MESSAGE, ttl=hold + self.ttl)
        if out:
            self.sent.update((i, s) for i, s in zip(self.grid.push_messages(list(out.values())), out) if i)
