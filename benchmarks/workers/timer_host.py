"""The helper process of one timer implementation (``sys.argv[1]``: relaunch or torch): it
imports its ``timer`` package once, then forks a server or a worker for each command it reads
on stdin (see benchmarks/timers.py)."""

import json
import os
import signal
import sys
import time
import traceback

IMPL = sys.argv[1]
if IMPL == "torch":
    from torch.distributed.elastic.timer import FileTimerClient, FileTimerServer, expires
else:
    from relaunch.timer import FileTimerClient, FileTimerServer, expires


def say(*words):
    os.write(1, (" ".join(str(w) for w in words) + "\n").encode())


class Recording:
    """Forwards to the real client and remembers each expiration time that it sent."""

    def __init__(self, inner):
        self.inner = inner
        self.sent = {}

    def acquire(self, scope_id, expiration_time):
        self.sent[scope_id] = expiration_time
        self.inner.acquire(scope_id, expiration_time)

    def release(self, scope_id):
        self.inner.release(scope_id)


def serve(fifo, max_interval, mode):
    # SIGUSR1 stops the server (sigwait below). "survive": SIGTERM is ignored, so that torch's
    # server outlives the SIGTERM it sends itself after a reap (the workers ask for SIGTERM).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    if mode == "survive":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    counts: dict[str, int] = {}

    def count(name):
        counts[name] = counts.get(name, 0) + 1

    if IMPL == "torch":

        def log_event(name, request):
            count(name)
            if name == "timer expired" and request is not None:
                say(
                    "expired",
                    request.worker_pid,
                    repr(time.time()),
                    json.dumps(request.scope_id),
                    repr(request.expiration_time),
                )

        server = FileTimerServer(fifo, "bench", max_interval=max_interval, log_event=log_event)
    else:

        def on_reap(worker_id, timers):
            now = time.time()
            for timer in timers:
                say("expired", worker_id, repr(now), json.dumps(timer.scope), repr(timer.deadline))

        server = FileTimerServer(
            fifo,
            "bench",
            max_interval=max_interval,
            log_event=lambda name, request: count(name),
            on_reap=on_reap,
            # The workers are this server's siblings (both forked by the host), not its
            # descendants, which is all it reaps by default: reap any pid, as torch's does.
            may_reap=lambda pid: True,
        )
    server.start()
    say("ready", os.getpid())
    signal.sigwait({signal.SIGUSR1})
    server.stop()
    counts = {name.replace(" ", "_"): n for name, n in counts.items()}  # one word each
    say("stopped", os.getpid(), json.dumps(counts, separators=(",", ":")))


def latency(fifo, after):
    client = Recording(FileTimerClient(fifo))
    with expires(after=after, scope="latency", client=client):
        say("deadline", os.getpid(), repr(client.sent["latency"]))
        time.sleep(600)
    say("survived", os.getpid())


def many(fifo, index, workers, timers, base, spread, margin, late, sig, gap):
    client = Recording(FileTimerClient(fifo, signal=sig))
    scopes = [f"w{index}-s{j}" for j in range(timers)]
    entered = []
    try:
        for j, scope in enumerate(scopes):
            deadline = base + spread * (j + index / workers) / timers
            context = expires(after=deadline - time.time(), scope=scope, client=client)
            context.__enter__()
            entered.append(context)
            if gap > 0:
                time.sleep(gap)
    except Exception as exc:
        say(
            "error",
            os.getpid(),
            json.dumps(f"acquire {len(entered) + 1} of {timers}: {type(exc).__name__}: {exc}"),
        )
        os._exit(1)  # no releases from the garbage collector
    say("acquired", os.getpid(), len(entered), repr(time.time()))
    for j, context in enumerate(entered):
        deadline = client.sent[scopes[j]]
        if j == late:
            say("holding", os.getpid(), json.dumps(scopes[j]), repr(deadline))
            continue
        pause = deadline - margin - time.time()
        if pause > 0:
            time.sleep(pause)
        try:
            context.__exit__(None, None, None)
        except Exception as exc:
            say("relerr", os.getpid(), j, json.dumps(f"{type(exc).__name__}: {exc}"))
            continue
        # Written after the release: the release certainly left this long before the deadline.
        say("rel", os.getpid(), j, repr(deadline - time.time()))
    time.sleep(600)


class Null:
    def acquire(self, scope_id, expiration_time):
        pass

    def release(self, scope_id):
        pass


def cost(fifo, batches, calls):
    # Batches of ``calls`` small enough for the pipe's buffer (64 KiB), with a pause for the
    # server to drain it: a full pipe would time the server, not the client. "-": no client
    # (expires() itself).
    client = Null() if fifo == "-" else FileTimerClient(fifo)
    # the scope given / the default scope, alternating
    per_call: dict[object, list[float]] = {"cost": [], None: []}
    try:
        for batch in range(batches):
            for scope in ("cost", None) if batch % 2 else (None, "cost"):
                time.sleep(0.1)
                start = time.perf_counter()
                for _ in range(calls):
                    with expires(after=60, scope=scope, client=client):
                        pass
                per_call[scope].append((time.perf_counter() - start) / calls * 1e6)
    except Exception as exc:
        say("error", os.getpid(), json.dumps(f"{type(exc).__name__}: {exc}"))
        return
    say("cost", os.getpid(), *(f"{sorted(r)[len(r) // 2]:.3f}" for r in per_call.values()))


def idle():
    say("idle", os.getpid())
    time.sleep(600)


COMMANDS = {
    "idle": lambda a: idle(),
    "serve": lambda a: serve(a[0], float(a[1]), a[2]),
    "latency": lambda a: latency(a[0], float(a[1])),
    "many": lambda a: many(
        a[0],
        int(a[1]),
        int(a[2]),
        int(a[3]),
        float(a[4]),
        float(a[5]),
        float(a[6]),
        int(a[7]),
        int(a[8]),
        float(a[9]),
    ),
    "cost": lambda a: cost(a[0], int(a[1]), int(a[2])),
}

say("hello", os.getpid())
children = set()
while True:
    line = sys.stdin.readline()
    if not line:
        break
    command, *args = line.split()
    if command == "wait":
        pid = int(args[0])
        children.discard(pid)
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            say("status", pid, "not-a-child")
            continue
        if os.WIFSIGNALED(status):
            say("status", pid, "signal", os.WTERMSIG(status))
        else:
            say("status", pid, "exit", os.WEXITSTATUS(status))
        continue
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            COMMANDS[command](args)
        except BaseException:
            traceback.print_exc()
            code = 70
        finally:
            os._exit(code)
    children.add(pid)
    say("forked", pid, command)
for pid in children:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except OSError:
        pass
