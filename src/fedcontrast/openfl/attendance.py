"""Who an OpenFL round waits for: a site that missed a round's ``round_timeout`` (the round was
closed without it, as ``min_sites`` allows) is dropped from the later rounds, each of which would
otherwise wait the whole timeout for it again; a round then closes as soon as every site still
attending has reported. A dropped site that connects again (asks for tasks) takes part again from
the next round.

A mixin of :class:`~.aggregator.SafeAggregator`, over OpenFL's ``Aggregator``: the dropped sites are
OpenFL's ``stragglers`` of every round (given no tasks, their late results not taken).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

logger = logging.getLogger("fedcontrast.openfl.components")


def round_label(round_number: int, rounds_to_train: int) -> str:
    """OpenFL's round ``round_number`` (from 0) in words; the last of ``rounds_to_train`` evaluates only."""
    return "the evaluation round" if round_number == rounds_to_train - 1 else f"round {round_number + 1}"


class AttendanceRounds:
    """Sites dropped from the later rounds after missing a round's timeout, and their return."""

    if TYPE_CHECKING:  # what the class this mixes into provides (SafeAggregator over OpenFL's Aggregator)
        lock: Any
        relay: Any
        round_number: int
        rounds_to_train: int
        authorized_cols: list[str]
        collaborators_done: list[str]
        stragglers: list[str]
        failure: str | None

    def attendance_state(self) -> tuple[dict[str, str], set[str]]:
        """``dropped`` (site → the round whose timeout it missed, in words) and ``back`` (dropped sites
        that connected again: they take part from the next round)."""
        state = self.__dict__.get("_attendance")
        if state is None:  # first use (possibly during OpenFL's recovery, inside its __init__)
            state = self.__dict__["_attendance"] = ({}, set())
        return state

    def drop_silent(self, missing: list[str]) -> None:
        """The round is being closed without ``missing`` (past its timeout): they are its stragglers, and
        are left out of the later rounds until they connect again."""
        dropped, back = self.attendance_state()
        label = round_label(self.round_number, self.rounds_to_train)
        self.stragglers = [c for c in self.authorized_cols if c in missing or c in self.stragglers]
        if self.round_number >= self.rounds_to_train - 1:
            return  # the last round: there is no later one to leave them out of
        for site in missing:
            if site not in dropped:
                dropped[site] = label
                back.discard(site)
                logger.warning("site %s dropped from later rounds after missing %s's timeout; it rejoins when it "
                               "connects", site, label)

    def _end_of_round_check(self) -> None:
        round_number = self.round_number
        super()._end_of_round_check()  # type: ignore[misc]  # OpenFL's Aggregator, next in the MRO
        if self.round_number != round_number:  # the round ended: who the next one waits for
            self._begin_attended_round()

    def _begin_attended_round(self) -> None:
        dropped, back = self.attendance_state()
        for site in back:
            dropped.pop(site, None)
        back.clear()
        self.stragglers = [c for c in self.authorized_cols if c in dropped]
        relay = getattr(self, "relay", None)
        if self.stragglers and relay is not None and self.round_number < self.rounds_to_train - 1:
            relay.begin(self.round_number + 1)  # the secure sum does not wait for them either
            for site in self.stragglers:
                relay.dropped[site] = f"dropped after missing {dropped[site]}'s timeout"

    def _end_of_round_with_stragglers_check(self) -> None:
        """OpenFL's (which waits for every site), except that a round whose dropped sites are all that
        is missing closes at once."""
        if self.stragglers and self.failure is None and all(
                c in self.collaborators_done for c in self.authorized_cols if c not in self.stragglers):
            self._end_of_round_check()
            return
        super()._end_of_round_with_stragglers_check()  # type: ignore[misc]

    def get_tasks(self, collaborator_name: str) -> Any:
        dropped, back = self.attendance_state()
        if collaborator_name in dropped and collaborator_name not in back and self.round_number < self.rounds_to_train:
            with self.lock:  # only then: the lock is held while a round is aggregated
                back.add(collaborator_name)
                logger.info("site %s connected again (dropped after missing %s's timeout); it takes part again from "
                            "%s", collaborator_name, dropped[collaborator_name],
                            round_label(self.round_number + 1, self.rounds_to_train))
        return super().get_tasks(collaborator_name)  # type: ignore[misc]
