"""A real Slurm cluster on this machine, for tests: one ``slurmctld`` and three ``slurmd``.

Every node is this machine: ``NodeName=n[1-3] NodeHostname=localhost``, each slurmd on its own
port (``slurmd -N n1``), with ``proctrack/linuxproc`` and ``task/none`` so nothing needs cgroups,
and munge on a private socket with a fresh key. ``srun -N2 --ntasks-per-node=1 relaunch ...``
then starts one relaunch per "node", each with the environment a real cluster gives.

The node names must resolve, as a real cluster's do (relaunch puts the store on the first node of
the step): the cluster adds ``127.0.0.1 n1 n2 n3`` to ``/etc/hosts`` while it runs and takes the
line out when it stops (a line left by a run killed outright is taken out by the next one).

Needs root and Debian's ``slurm-wlm`` and ``munge``, which ``install()`` puts in with apt-get when
``slurmctld`` is missing (``make install-test`` does too). Every daemon is started by this
module, dies with the thread that started it (``PR_SET_PDEATHSIG``), and is killed by its pid.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from types import TracebackType

from relaunch.endpoints import find_free_port

NODES = ("n1", "n2", "n3")
HOSTS_FILE = "/etc/hosts"
HOSTS_MARK = "# relaunch-test-slurm"
START_TIMEOUT = 60.0
MARK_VAR = "RELAUNCH_TEST_MARK"

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def install() -> str | None:
    """Put in slurm-wlm and munge with apt-get where ``slurmctld`` is missing; None when they are
    there, else why they could not be."""
    if shutil.which("slurmctld") and shutil.which("munged"):
        return None
    if os.geteuid() != 0:
        return "slurmctld is not installed and installing it needs root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"],
    ):
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            return f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}"
    return None


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as file:
            return "".join(file.readlines()[-lines:])
    except OSError:
        return ""


class SlurmCluster:
    """The daemons, their config (``conf``: pass ``env`` to srun, sinfo, scancel) and logs."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="relaunch-slurm-")
        os.chmod(self.dir, 0o755)  # munged refuses a world-writable directory on its path
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and name != MARK_VAR
        }
        self.env["SLURM_CONF"] = self.conf

    # -- starting ------------------------------------------------------------------------------

    def start(self) -> SlurmCluster:
        try:
            self._add_hosts()
            self._start_munge()
            self._write_conf()
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
            for node in NODES:
                self._spawn(node, ["slurmd", "-D", "-N", node, "-f", self.conf])
            self._wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def _add_hosts(self) -> None:
        self._remove_hosts(stale=True)
        with open(HOSTS_FILE, "a") as file:
            file.write(f"127.0.0.1 {' '.join(NODES)} {HOSTS_MARK} {self.dir}\n")

    def _remove_hosts(self, stale: bool = False) -> None:
        """Take out this cluster's line (``stale``: and those of clusters whose files are gone)."""
        try:
            with open(HOSTS_FILE) as file:
                lines = file.readlines()
        except OSError:
            return

        def ours(line: str) -> bool:
            if HOSTS_MARK not in line:
                return False
            owner = line.split(HOSTS_MARK, 1)[1].strip()
            return owner == self.dir or (stale and not os.path.isdir(owner))

        kept = [line for line in lines if not ours(line)]
        if kept != lines:
            with open(HOSTS_FILE, "w") as file:  # in place: /etc/hosts may be a bind mount
                file.writelines(kept)

    def _start_munge(self) -> None:
        munge = os.path.join(self.dir, "munge")
        os.mkdir(munge, 0o700)
        key = os.path.join(munge, "munge.key")
        with open(key, "wb") as file:
            file.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = os.path.join(munge, "munge.socket")
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={munge}/munged.pid",
                f"--seed-file={munge}/munged.seed",
                f"--log-file={munge}/munged.log",
            ],
        )
        deadline = time.monotonic() + 10
        while not os.path.exists(self.munge_socket):
            if self.procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("munged did not start: " + _tail(f"{munge}/munged.log"))
            time.sleep(0.05)

    def _write_conf(self) -> None:
        ports = []
        while len(ports) < 1 + len(NODES):
            port = find_free_port("127.0.0.1")
            if port not in ports:
                ports.append(port)
        self.ctld_port = ports[0]
        d = self.dir
        for sub in ("state", "spool"):
            os.mkdir(os.path.join(d, sub))
        lines = [
            "ClusterName=relaunchtest",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "CredType=cred/munge",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "KillWait=5",
            "InactiveLimit=0",
            "MinJobAge=5",
            "SlurmdTimeout=30",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/slurmctld.log",
            f"SlurmdLogFile={d}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            f"PlugStackConfig={d}/plugstack.conf",
        ]
        for node, port in zip(NODES, ports[1:], strict=True):
            lines.append(
                f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=1 Port={port}"
            )
        lines.append(
            f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP"
        )
        with open(self.conf, "w") as file:
            file.write("\n".join(lines) + "\n")
        open(f"{d}/plugstack.conf", "w").close()
        for node in NODES:
            os.makedirs(os.path.join(d, "spool", node))

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(os.path.join(self.dir, f"{name}.out"), "wb") as log:
            self.procs[name] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                preexec_fn=_die_with_parent,
            )

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        states = ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode}: {self.log(name)}")
            done = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            states = done.stdout.strip()
            idle = {line.split()[0] for line in states.splitlines() if line.endswith(" idle")}
            if idle == set(NODES):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the nodes are not idle after {START_TIMEOUT}s: {states!r}")

    # -- using ---------------------------------------------------------------------------------

    def run(
        self, argv: list[str], check: bool = True, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """A Slurm client command (sinfo, squeue, scancel, scontrol) against this cluster."""
        done = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr}")
        return done

    def log(self, name: str) -> str:
        """The last lines of a daemon's log (``slurmctld``, ``n1``, ``munged``...)."""
        paths = {
            "slurmctld": f"{self.dir}/slurmctld.log",
            "munged": f"{self.dir}/munge/munged.log",
        }
        path = paths.get(name, f"{self.dir}/slurmd-{name}.log")
        return _tail(path) + _tail(os.path.join(self.dir, f"{name}.out"))

    # -- stopping ------------------------------------------------------------------------------

    def _cancel_jobs(self) -> None:
        """Cancel every job (all are this cluster's) and wait for the queue to empty."""
        if "slurmctld" not in self.procs or self.procs["slurmctld"].poll() is not None:
            return
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                jobs = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=5).stdout
            except subprocess.TimeoutExpired:
                return
            if not jobs.split():
                return
            self.run(["scancel", *jobs.split()], check=False, timeout=5)
            time.sleep(0.2)

    def _step_daemons(self) -> list[int]:
        """The slurmstepd processes of this cluster: they leave slurmd's process tree, so they
        are found by the files they hold open under this cluster's directory."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as file:
                    if not file.read().startswith(b"slurmstepd"):
                        continue
                fds = os.listdir(f"/proc/{entry}/fd")
                targets = [os.readlink(f"/proc/{entry}/fd/{fd}") for fd in fds]
            except OSError:
                continue
            if any(target.startswith(self.dir + "/") for target in targets):
                found.append(int(entry))
        return found

    def stop(self) -> None:
        """Cancel the jobs, stop every daemon this cluster started (TERM, then KILL) by pid, and
        remove its files."""
        self._cancel_jobs()
        for pid in self._step_daemons():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        procs = list(self.procs.values())
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in reversed(procs):
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        self._remove_hosts()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()
