"""A dead agent's death notice: its round re-forms at once, not after the heartbeats' silence.

An agent killed by SIGKILL or the OOM killer leaves its machine alive, and its orphan guardian
(``procs.guardian``) sees the death first: the end of its pipe. While the agent is a member of a
round, it leaves the guardian a *death notice*: one line saying how to reach the store and which
change to write there (its round superseded by "node of group rank G lost (its agent died)"). At the
pipe's end, after killing the agent's workers, the guardian runs ``main`` in a fresh interpreter,
which writes that change the way the node's store kind writes any change (compare-and-set from
absent, and the round signal every member blocks on): the others re-form within about a second
instead of ``keep_alive_interval * keep_alive_max_attempt``. The heartbeats stay for machines that
vanish whole.

An agent that leaves its round itself takes its death notice back first (``DeathNotice.retract``);
one that did not, ending while its round had ended anyway, writes nothing: the round's change is
there already and the compare-and-set fails. A death notice that cannot reach the store within
``DEADLINE_S`` (the store went with the agent's node) is dropped.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: How long the dead agent's death notice may take to reach the store.
DEADLINE_S = 3.0
#: One write to a pipe up to this size is atomic (POSIX ``PIPE_BUF``): the guardian reads the
#: whole line or none of it.
MAX_LINE = 4096


class DeathNotice:
    """What this agent leaves its guardian while it is a member of a round. ``where``: how to reach
    the store (``"store"``: its kind's backend name, and what that kind's ``write_death_notice``
    reads: ``kind_registry``); ``send`` (or ``send_to``, by the agent, which owns the guardian):
    hands the guardian its line (None takes it back). Without one, nothing is left."""

    def __init__(
        self, where: dict[str, Any], send: Callable[[str | None], None] | None = None
    ) -> None:
        self._where, self._send = where, send
        self._left = False

    def send_to(self, send: Callable[[str | None], None]) -> None:
        """Hand the death notices to ``send`` from now on."""
        self._send = send

    def move_to(self, host: str, port: int) -> None:
        """The job's built-in store moved to ``host:port`` (``failover``): write it there."""
        self._where.update(host=host, port=port)

    def leave(self, changed: str, round_signal: str, record: bytes) -> None:
        """Should this agent die, write ``record`` at ``changed`` and write ``round_signal``."""
        if self._send is None:
            return
        line = json.dumps(
            {**self._where, "changed": changed, "bell": round_signal, "record": record.decode()}
        )
        if len(line) >= MAX_LINE:
            log.warning("no death notice for the guardian: %d bytes is too long", len(line))
            self.retract()
            return
        self._send(line)
        self._left = True

    def retract(self) -> None:
        """This agent leaves its round itself: nothing to say should it die."""
        if self._left and self._send is not None:
            self._send(None)
            self._left = False


def write_death_notice(line: str) -> bool:
    """Write the change of the death notice ``line``; whether it was written (False: the round had
    a change already)."""
    from relaunch.rendezvous.kind_registry import kind_module

    notice = json.loads(line)
    changed, round_signal, record = notice["changed"], notice["bell"], notice["record"].encode()
    return kind_module(notice["store"]).write_death_notice(
        notice, changed, round_signal, record, DEADLINE_S
    )


def main() -> int:
    """The guardian's call: the death notice on standard input, written; 0, or 1 when it could not
    be (nobody reads the status: the heartbeats notice the death then)."""
    try:
        write_death_notice(sys.stdin.readline())
    except Exception:
        return 1
    return 0
