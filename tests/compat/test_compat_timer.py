"""relaunch.timer beside torch.distributed.elastic.timer: what a worker meets when no server
reads the FIFO (BrokenPipeError, as torch's FileTimerClient raises), with no client configured
(RuntimeError), the request line both clients write, a request queue's ``get(size, timeout)``
and a server started twice."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

from relaunch import timer
from relaunch.timer import api as relaunch_timer_api
from relaunch.timer.file_based_local_timer import FileTimerServer

pytestmark = pytest.mark.xdist_group("torch")

torch_timer = pytest.importorskip("torch.distributed.elastic.timer")


@pytest.fixture
def unread_fifo(tmp_path) -> str:
    path = str(tmp_path / "unread.fifo")
    os.mkfifo(path, 0o600)
    return path


@pytest.mark.timeout(30)
@pytest.mark.parametrize("which", ["missing", "unread"])
def test_expires_with_no_server_is_a_broken_pipe_in_both(which, tmp_path, unread_fifo) -> None:
    path = str(tmp_path / "missing") if which == "missing" else unread_fifo
    with (
        pytest.raises(BrokenPipeError),
        torch_timer.expires(after=5, client=torch_timer.FileTimerClient(path)),
    ):
        pass
    with (
        pytest.raises(BrokenPipeError, match="no timer server reads"),
        timer.expires(after=5, client=timer.FileTimerClient(path)),
    ):
        pass


def test_a_server_that_went_away_is_a_broken_pipe(tmp_path) -> None:
    server = FileTimerServer(str(tmp_path / "fifo"), "run", max_interval=0.1)
    server.start()
    client = timer.FileTimerClient(server.file_path)
    try:
        with timer.expires(after=60, client=client):
            pass  # the client keeps the pipe open
    finally:
        server.stop()
    with pytest.raises(BrokenPipeError, match="no timer server reads"):
        client.acquire("late", time.time() + 60)


def test_expires_with_no_client_is_a_runtime_error_in_both(monkeypatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_TIMER_FILE", raising=False)
    monkeypatch.setattr(relaunch_timer_api, "_client", None)
    monkeypatch.setattr(torch_timer.api, "_timer_client", None)
    with pytest.raises(RuntimeError), torch_timer.expires(after=1):
        pass
    with pytest.raises(RuntimeError, match="no timer client is configured"), timer.expires(after=1):
        pass


def test_both_clients_write_the_same_request_line() -> None:
    for expiration, sig in [(1.7e9, int(signal.SIGKILL)), (-1, 0)]:
        mine = timer.FileTimerRequest(1234, "step", expiration, sig)
        theirs = torch_timer.FileTimerRequest(1234, "step", expiration, sig)
        assert mine.to_json() == theirs.to_json()
        assert mine.worker_pid == theirs.worker_pid == 1234


def test_a_request_too_large_for_one_write_is_a_runtime_error(tmp_path, unread_fifo) -> None:
    client = timer.FileTimerClient(unread_fifo)
    with pytest.raises(RuntimeError, match="too long"):
        client.acquire("x" * 5000, time.time() + 1)


def test_file_server_liveness_and_process_probe_as_torchs(tmp_path) -> None:
    assert timer.FileTimerServer.is_process_running(os.getpid()) is True
    dead = 2**22 + 12345  # above the default pid_max: no such process
    assert timer.FileTimerServer.is_process_running(dead) is (
        torch_timer.FileTimerServer.is_process_running(dead)
    )
    server = FileTimerServer(str(tmp_path / "fifo"), "run", max_interval=0.05)
    before = int(time.time())
    assert before <= server.get_last_progress_time() <= int(time.time())
    server.start()
    try:
        first = server.get_last_progress_time()
        assert isinstance(first, int) and first >= before
        server.clear_timers(worker_pids={os.getpid()})  # torch's keyword
    finally:
        server.stop()


def _put_later(mp_queue, count: int, pause: float) -> threading.Thread:
    def put() -> None:
        for i in range(count):
            time.sleep(pause)  # the requests' pace is what is tested
            mp_queue.put(timer.TimerRequest(1000 + i, f"scope{i}", time.time() + 60))

    thread = threading.Thread(target=put, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["torch", "relaunch"])
@pytest.mark.parametrize(("size", "count"), [(5, 5), (5, 3)])
def test_request_queue_get_waits_for_size_requests_or_the_timeout(which, size, count) -> None:
    """``get(size, timeout)`` returns once ``size`` requests arrived, or at the timeout with
    fewer: requests that come one by one are not cut off at the first."""
    module = torch_timer.local_timer if which == "torch" else timer.local_timer
    mp_queue = multiprocessing.get_context("spawn").Queue()
    try:
        request_queue = module.MultiprocessingRequestQueue(mp_queue)
        putter = _put_later(mp_queue, count, 0.05)
        started = time.monotonic()
        got = request_queue.get(size, timeout=3.0 if count == size else 1.0)
        waited = time.monotonic() - started
        putter.join(timeout=10)
        assert [request.worker_id for request in got] == [1000 + i for i in range(count)]
        if count == size:
            assert waited < 2.5  # returned once the last one came, not at the timeout
        else:
            assert waited >= 0.9  # waited out the timeout for the missing ones
    finally:
        mp_queue.close()
        mp_queue.join_thread()


def _reapers() -> int:
    return sum(thread.name == "relaunch-timer-reaper" for thread in threading.enumerate())


@pytest.mark.timeout(30)
def test_a_timer_server_started_twice_goes_on_with_one_reaper() -> None:
    mp_queue = multiprocessing.get_context("spawn").Queue()
    server = timer.LocalTimerServer(mp_queue, max_interval=0.05)
    before = _reapers()
    try:
        server.start()
        server.start()  # torch's tests start their server again; it goes on
        assert _reapers() == before + 1
    finally:
        server.stop()
        mp_queue.close()
        mp_queue.join_thread()
    assert _reapers() == before
