"""relaunch's benchmarks, for maintainers: ``python -m benchmarks --list`` (see README.md)."""

from __future__ import annotations

#: Every benchmark: its name (a module of this package) and what it measures.
BENCHMARKS = {
    "launch": "the relaunch command vs torchrun: start-up, RSS, failure -> restart, SIGTERM",
    "procs": "start_processes: start-up vs Popen, tee throughput, line latency",
    "rendezvous": "c10d and etcd rendezvous: K agents, a node killed, 1024 simulated nodes",
    "timers": "expiry timers vs torch's: deadline -> death, 1,000 live timers, expires() cost",
    "console": "progress bars on the console, report_progress cost, the node bar",
    "idle": "wake-ups per second of an idle 8-worker job's launcher, vs torchrun",
    "imports": "worker import cost: import relaunch + report_progress vs python -c pass",
    "store": "the built-in store: memory per idle connection, 4,096 clients, parked, flood",
    "chaos": "faults at random moments in real jobs: survival, leaks, lost lines, reports",
    "spares": "a lost node's place taken by a waiting spare vs a node started cold",
    "resilience": "a hang's deadline -> every stack and a restart (1 and 2 nodes); stragglers",
    "recovery": "a DDP job's worker or node killed -> next step, steps lost: memory vs checkpoints",
    "replicas": "torchft replica groups, a worker killed: the others' stall, the group back",
    "eviction": "a slow node evicted to a spare: onset -> flagged -> evicted; the job's time",
}
