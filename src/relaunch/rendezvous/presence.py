"""The round signal, and the presence check that asks whether every member of the round is alive.

Each member has one thread blocked on its round signal (``news/r{n}/bell``,
``heartbeat.RoundWatch``): whoever marks the round for re-forming (``changed``,
``rounds.Rounds.supersede``) or checks presence (``call``) also writes the round signal, so one
blocked watch a node hears both at once. A re-form whose writer died between its two writes is
caught by the watcher's look at ``changed`` every keep-alive interval; a presence check whose asker
died needs no answer.

The presence check: a node whose workers failed with no restart left asks whether every member is
alive before it calls the failure final (a dead peer breaks collectives before heartbeats tell
of it). Only the first asker awaits the answers; no store event goes to every node per answer.
Keys, under ``relaunch/{run_id}/``::

    news/r{n}/bell  the round signal: rewritten with each change record that supersedes the
                    round, and with ``call`` (on etcd a change and its signal are one transaction)
    news/r{n}/call  the presence check, created once by the first asker, which then writes the
                    round signal
    r{n}/here       the members that answered, a tally (``roster``): one answer per member
    r{n}/present    the outcome, written by the first asker: ``1`` when every member answered
                    in time, else ``0``; the other askers wait for it
"""

from __future__ import annotations

from relaunch.core.rendezvous.rounds import KeyOf
from relaunch.rendezvous.roster import Roster
from relaunch.store.api import Store

#: What the round signal holds when presence is checked (else the change record that wrote it).
CALL = b"call"
#: Seconds the other askers wait for the outcome beyond the first asker's own wait.
OUTCOME_MARGIN = 1.0


def presence_check(
    store: Store, roster: Roster, key: KeyOf, round_: int, members: int, timeout: float
) -> bool | None:
    """Whether all ``members`` of round ``round_`` answer within ``timeout`` seconds (None: no
    outcome came, the first asker having died, say). Many askers share one call."""
    present = key("present", round_)
    if store.compare_set(key("call", round_), 0, CALL).succeeded:
        store.set(key("bell", round_), CALL)
        here = roster.await_tally("here", round_, members, timeout)
        store.compare_set(present, 0, b"1" if here >= members else b"0")
    outcome = store.watch(present, 0, timeout + OUTCOME_MARGIN).value
    return None if outcome is None else outcome == b"1"
