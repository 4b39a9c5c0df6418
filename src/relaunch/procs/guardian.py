"""The orphan guardian: a tiny process that kills every live worker tree if the launcher dies.

Workers run in process groups of their own, so that stopping a worker stops whatever it started.
That also means nothing kills them if the launching process is itself killed (even by SIGKILL,
which no handler can catch). The guardian is a POSIX shell (about a millisecond to start, about a
megabyte of memory) in a session of its own, reading the launcher's registrations of live process
groups from a pipe. When the pipe reaches end of file, which the kernel guarantees however the
launcher dies, it SIGKILLs every group still registered, has the launcher's death notice written
(``rendezvous.death_notice``: its round re-forms at once), and removes the temporary files
registered with it (the agent's shared-memory channel). Unlike a parent-death signal it also
covers the workers' descendants, and it does not fire when the thread that started a worker exits.

Descendants that left their worker's process group (a daemon in a session of its own) carry
their group's token in their environment (``procs.descendants``): for each token still
registered, the guardian SIGKILLs every process whose /proc/PID/environ holds it, found with
one ``grep`` over /proc, again until none is left (what they forked meanwhile carries it too).
It needs no ancestry: the agent's orphans have gone to init by then.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

_SCRIPT = r"""
trap '' INT TERM HUP QUIT PIPE USR1
live=' '
files=' '
trees=' '
word=
while read -r op arg; do
  case "$op" in
    w) word="$arg" ;;
    +) live="$live$arg " ;;
    -) case "$live" in *" $arg "*) live="${live%%" $arg "*} ${live#*" $arg "}" ;; esac ;;
    f) files="$files$arg " ;;
    r) case "$files" in *" $arg "*) files="${files%%" $arg "*} ${files#*" $arg "}" ;; esac ;;
    t) trees="$trees$arg " ;;
    u) case "$trees" in *" $arg "*) trees="${trees%%" $arg "*} ${trees#*" $arg "}" ;; esac ;;
  esac
done
for pid in $live; do kill -KILL -"$pid" 2>/dev/null; kill -KILL "$pid" 2>/dev/null; done
[ -z "$word" ] || printf '%s\n' "$word" | "$0" -I -c "$1" "$2" &
round=0
while [ -n "${trees# }" ] && [ "$round" -lt 20 ]; do
  round=$((round + 1))
  found=
  for tree in $trees; do
    for environ in $(grep -l -F -e "$tree" /proc/[0-9]*/environ 2>/dev/null); do
      pid=${environ#/proc/}
      pid=${pid%/environ}
      [ "$pid" = "$$" ] || { kill -KILL "$pid" 2>/dev/null && found=1; }
    done
  done
  [ -n "$found" ] || break
done
for file in $files; do rm -rf -- "$file"; done
wait
"""
#: What the guardian runs for a dead agent's death notice (``rendezvous.death_notice``), with this
#: interpreter, isolated (``-I``), the directory relaunch is in first on its path.
_DEATH_NOTICE = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from relaunch.rendezvous.death_notice import main; sys.exit(main())"
)


class Guardian:
    """The orphan guardian of one launching process; ``register`` a worker's pid right after
    starting it."""

    def __init__(self) -> None:
        relaunch_in = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self._proc = subprocess.Popen(
            ["/bin/sh", "-c", _SCRIPT, sys.executable, _DEATH_NOTICE, relaunch_in],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
        assert self._proc.stdin is not None
        self._fd = self._proc.stdin.fileno()
        self._lock = threading.Lock()
        self._broken = False

    @property
    def pid(self) -> int:
        return self._proc.pid

    def register(self, pid: int) -> None:
        self._send(f"+ {pid}\n")

    def unregister(self, pid: int) -> None:
        self._send(f"- {pid}\n")

    def register_file(self, path: str) -> None:
        """Remove ``path`` if the launcher dies without removing it (a temporary file, or a
        directory relaunch made, with what is in it)."""
        if any(c.isspace() for c in path):
            raise ValueError(f"the guardian cannot track a path with spaces: {path!r}")
        self._send(f"f {path}\n")

    def unregister_file(self, path: str) -> None:
        self._send(f"r {path}\n")

    def register_tree(self, token: str) -> None:
        """SIGKILL every process whose environment carries ``token`` (``procs.descendants``) if
        the launcher dies before ``unregister_tree``."""
        if not token or any(not (c.isalnum() or c == "-") for c in token):
            raise ValueError(f"the guardian cannot track the token {token!r}")
        self._send(f"t {token}\n")

    def unregister_tree(self, token: str) -> None:
        self._send(f"u {token}\n")

    def set_death_notice(self, line: str | None) -> None:
        """Have the guardian write ``line`` (``rendezvous.death_notice``) if the launcher dies,
        after killing its workers; None: say nothing."""
        if line is not None and ("\n" in line or not line.strip()):
            raise ValueError("a death notice is one line")
        self._send(f"w {line or ''}\n")

    def _send(self, line: str) -> None:
        with self._lock:
            if self._broken:
                return
            try:
                # One short write to a pipe is atomic: the guardian never reads half a line.
                os.write(self._fd, line.encode())
            except OSError as exc:
                self._broken = True
                log.warning("the orphan guardian (pid %d) is gone: %s", self._proc.pid, exc)

    def close(self) -> None:
        """End the pipe, as the launcher's death does: the guardian does its work and exits."""
        try:
            os.close(self._fd)
        except OSError:
            pass
        self._broken = True

    def _forget_in_child(self) -> None:
        # A forked child must not hold the pipe open, or the guardian would outlive a dead launcher.
        self.close()


_guardian: Guardian | None = None
_guardian_lock = threading.Lock()


def guardian() -> Guardian:
    """The guardian of this process, started on first use."""
    global _guardian
    with _guardian_lock:
        if _guardian is None:
            _guardian = Guardian()
        return _guardian


def _after_fork_in_child() -> None:
    global _guardian, _guardian_lock
    if _guardian is not None:
        _guardian._forget_in_child()
    _guardian = None
    _guardian_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
