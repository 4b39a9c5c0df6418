import sys

FIRST = (__import__("time").time(), sorted(sys.modules), list(globals()))

# A worker for tests/integration/test_preload.py, run cold and forked from a --preload zygote:
# it writes what it sees as it starts to $PRELOAD_TEST_OUT/w-<restart>-<rank>.json, then does
# what its argument says. (No imports above the first line: sys.modules is read as it starts.)

import ctypes  # noqa: E402
import gc  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

import __main__  # noqa: E402


def stream(name):
    value = getattr(sys, name)
    if value is None:
        return None
    raw = value.buffer.raw if isinstance(value.buffer, io.BufferedIOBase) else value.buffer
    return {
        "type": type(value).__name__,
        "buffer": type(value.buffer).__name__,
        "encoding": value.encoding,
        "errors": value.errors,
        "line_buffering": value.line_buffering,
        "write_through": value.write_through,
        "mode": value.mode,
        "raw_name": raw.name,
        "fileno": value.fileno(),
        "isatty": value.isatty(),
        "same_as_dunder": value is getattr(sys, f"__{name}__"),
    }


def c_environ():
    """The C library's environment, as a child process would inherit it."""
    libc = ctypes.CDLL(None)
    entries = ctypes.POINTER(ctypes.c_char_p).in_dll(libc, "environ")
    found = {}
    index = 0
    while entries[index] is not None:
        name, _, value = entries[index].partition(b"=")
        found[name] = value
        index += 1
    return found


def status(*names):
    with open("/proc/self/status") as file:
        fields = dict(line.split(":", 1) for line in file)
    return {name: fields[name].strip() for name in names}


def descriptors():
    listing = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        return sorted(int(fd) for fd in os.listdir(listing) if int(fd) != listing)
    finally:
        os.close(listing)


def fd_kind(fd):
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return None
    return oct(mode >> 12)


def private_dirty():
    with open("/proc/self/smaps_rollup") as file:
        fields = dict(line.split(":", 1) for line in file if ":" in line)
    return int(fields["Private_Dirty"].split()[0])


def parent_cmdline():
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as file:
        return file.read().replace(b"\0", b" ").decode(errors="replace")


def main():
    out, tag, action = os.environ["PRELOAD_TEST_OUT"], "w", sys.argv[1]
    first_time, modules, names = FIRST
    umask = os.umask(0)
    os.umask(umask)
    seen = {
        "time": first_time,
        "modules": modules,
        "main_globals": names,
        "argv": sys.argv,
        "orig_argv": getattr(sys, "orig_argv", None),
        "executable": sys.executable,
        "main_file": getattr(__main__, "__file__", None),
        "main_name": __main__.__name__,
        "main_spec": None if __main__.__spec__ is None else __main__.__spec__.name,
        "main_loader": type(__main__.__loader__).__name__,
        "main_package": __main__.__package__,
        "name": __name__,
        "path": sys.path,
        "cwd": os.getcwd(),
        "environ": dict(os.environ),
        "c_environ_matches": c_environ() == dict(os.environb),
        "signals": {
            str(int(number)): repr(signal.getsignal(number))
            for number in signal.valid_signals()
            if number not in (signal.SIGKILL, signal.SIGSTOP)
        },
        "status": status("SigBlk", "SigIgn", "SigCgt", "NoNewPrivs"),
        "session_leader": os.getsid(0) == os.getpid(),
        "group_leader": os.getpgid(0) == os.getpid(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "umask": umask,
        "streams": {name: stream(name) for name in ("stdin", "stdout", "stderr")},
        "fd_kinds": [fd_kind(fd) for fd in (0, 1, 2)],
        "descriptors": descriptors(),
        "flags": list(sys.flags),
        "ppid": os.getppid(),
        "parent": parent_cmdline(),
        "pid": os.getpid(),
        "hash_randomized": sys.flags.hash_randomization,
        "gc": [gc.isenabled(), gc.get_threshold()],
        "gc_frozen": gc.get_freeze_count(),
    }
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    rank = os.environ["RANK"]
    path = os.path.join(out, f"{tag}-{restart}-{rank}.json")
    with open(path + ".tmp", "w") as file:
        json.dump(seen, file)
    os.rename(path + ".tmp", path)
    print(f"started rank {rank} restart {restart}", flush=True)
    if action.endswith("-once") and restart == "0":  # once both ranks have said what they see
        peer = os.path.join(out, f"{tag}-{restart}-{1 - int(rank)}.json")
        while not os.path.exists(peer):
            time.sleep(0.005)
    if action == "exit3":
        sys.exit(3)
    if action == "raise":
        raise ValueError(f"boom from rank {rank}")
    if action == "kill-self-once" and restart == "0" and rank == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "kill-zygote-once" and restart == "0":
        if rank == "0":
            os.kill(os.getppid(), signal.SIGKILL)  # this worker dies with its zygote
        time.sleep(60)
    if action == "collect":  # the KiB of pages a full collection made this process's own
        before = private_dirty()
        gc.collect()
        print(f"copied {private_dirty() - before}", flush=True)
    if action == "hang":
        print("ready", flush=True)
        time.sleep(120)


main()
