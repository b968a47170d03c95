"""The node agent's record of one rank process: when it exited, even when nothing was watching."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from activities.rank_records import RankProcess
from trainguard.procs import start_time


def _child(seconds: float) -> RankProcess:
    popen = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])
    proc = RankProcess(0, popen.pid, start_time(popen.pid), popen)
    threading.Thread(target=proc.stamp_exit, daemon=True).start()
    return proc


def test_exit_time_is_stamped_when_it_happens_not_when_first_polled() -> None:
    proc = _child(0.2)
    deadline = time.time() + 10  # a loaded machine may take a while to start the child at all
    while proc.exited_at is None and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(1.0)  # no watch polls meanwhile (a controller is down, say)
    polled_at = time.time()

    assert proc.poll()
    assert proc.exited_at is not None
    assert proc.exited_at < polled_at - 0.5  # seconds before anyone looked
    assert proc.exit_code == 0


def test_the_stamping_thread_does_not_reap_the_child() -> None:
    proc = _child(0.1)
    deadline = time.time() + 10
    while proc.exited_at is None and time.time() < deadline:
        time.sleep(0.02)

    assert proc.exited_at is not None
    assert proc.poll() and proc.exit_code == 0  # the exit code is still ours to read


def test_a_running_child_has_no_exit_time() -> None:
    proc = _child(30)
    try:
        assert not proc.poll()
        assert proc.exited_at is None
    finally:
        assert proc.popen is not None
        proc.popen.kill()
        proc.popen.wait()
