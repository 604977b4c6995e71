"""Who takes part in a Flower round: a site that stayed silent for a whole exchange is dropped from
the later ones (each would cost the round timeout again), until it shows it is back: a late reply
to a message it was sent arrives, or Flower's grid lists its SuperNode again after it had not.

Used by the ServerApp (:mod:`.server_app`) when the run goes on without silent sites (``min_sites``).
"""

from __future__ import annotations

from typing import Any

from .console import say
from .replies import pull_replies


class Attendance:
    def __init__(self, grid, sites: list[str], node_of: dict[str, int]) -> None:
        self.grid, self.sites, self.node_of = grid, list(sites), dict(node_of)
        self.dropped: dict[str, str] = {}  # site → why it was dropped ("round 2: no answer within 60 s")
        self.listed: dict[str, bool] = {}  # dropped site → whether the grid listed its node when last looked
        self.late: dict[str, str] = {}  # message id sent to a dropped site → that site: a reply may still come
        self.started: set[str] = set()  # sites that answered the start-up query (checked the plan)

    def active(self) -> list[str]:
        """The sites to send the next message to, in the plan's order."""
        return [s for s in self.sites if s not in self.dropped]

    def drop(self, silent: dict[str, str], what: str, timeout: float) -> None:
        """``silent`` (message id → site): no answer within ``timeout``; left out from now on."""
        if not silent:
            return
        online = set(self._online())
        for mid, site in silent.items():
            self.dropped[site] = f"{what}: no answer within {timeout:g} s"
            self.listed[site] = self.node_of[site] in online
            self.late[mid] = site
        names, one = sorted(set(silent.values())), len(set(silent.values())) == 1
        say(f"{what}: dropped {', '.join(names)} after no answer within {timeout:g} s; the later rounds go on "
            f"without {'it' if one else 'them'} until {'it answers' if one else 'they answer'} again")

    def rejoin(self, what: str) -> list[str]:
        """The dropped sites that are back (a late reply came, or the grid lists their node again),
        named on the console; each takes part again from ``what``."""
        if not self.dropped:
            return []
        back: set[str] = set()
        if self.late:
            for reply in pull_replies(self.grid, list(self.late)):
                site = self.late.pop(reply.metadata.reply_to_message_id, None)
                if site is not None:
                    back.add(site)
        online = set(self._online())
        for site in list(self.dropped):
            listed = self.node_of[site] in online
            if listed and not self.listed[site]:
                back.add(site)
            self.listed[site] = listed
        for site in back:
            self.dropped.pop(site, None)
            self.listed.pop(site, None)
        self.late = {m: s for m, s in self.late.items() if s not in back}
        if back:
            say(f"{', '.join(sorted(back))} {'is' if len(back) == 1 else 'are'} back (answered again); "
                f"{'it takes' if len(back) == 1 else 'they take'} part again from {what}")
        return sorted(back)

    def _online(self) -> list[int]:
        try:
            return list(self.grid.get_node_ids())
        except Exception:  # noqa: BLE001 - a grid that cannot list its nodes: only late replies bring sites back
            return []

    def record(self, back: list[str]) -> dict[str, Any]:
        """What a round's record says of attendance: who is dropped (and why), who came back."""
        out: dict[str, Any] = {}
        if self.dropped:
            out["dropped"] = dict(sorted(self.dropped.items()))
        if back:
            out["rejoined"] = back
        return out
