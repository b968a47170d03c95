"""A file a rank can write cannot freeze or exhaust the agent that reads it (issue 40 finding 3).

A rank owns its progress folder: in place of its progress file it can put a FIFO (an open for reading waits for a
writer forever), a link to `/dev/zero` (a read never ends) or to a file of someone else's. The agent's reader
(`trainguard.safe_files.read_json`, under every progress, mark and role read) takes regular files only, never
through a link, and only so much of them; the watch goes on heartbeating beside such a rank.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from trainguard import protocol, safe_files

READER = textwrap.dedent("""
    import resource, sys, time
    from pathlib import Path
    # Bounded, so a reader that reads /dev/zero to the end fails here instead of taking the machine's memory.
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    from trainguard import protocol
    started = time.monotonic()
    found = protocol.read_progress(Path(sys.argv[1]))
    print("none" if found is None else "a-report", round(time.monotonic() - started, 3))
""")

READ_PROMPTLY_S = 0.5
"""A read of a progress file is a few microseconds; whatever it meets in its place, it returns within this."""


def _plant(kind: str, path: Path, tmp_path: Path) -> None:
    """Put what a rank could in place of its progress file `path`."""
    real = protocol.Progress(rank=0, step=5, time=time.time()).to_json()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "link-to-a-file":  # a file of someone else's, whole progress JSON or not
        target = tmp_path / "someone-elses.json"
        safe_files.write_json(target, real)
        path.symlink_to(target)
    elif kind == "folder":
        path.mkdir()
    elif kind == "huge":  # valid JSON, padded past any progress report
        path.write_text(" " * (2 << 20) + json.dumps(real))
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "link-to-a-file", "folder", "huge"])
def test_a_progress_file_that_is_no_regular_file_reads_as_none_at_once(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "rank-00000.json"
    _plant(kind, path, tmp_path)

    try:
        done = subprocess.run([sys.executable, "-c", READER, str(path)], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading a {kind} in place of a progress file did not return in 10 s")

    assert done.returncode == 0, done.stderr[-2000:]
    found, took = done.stdout.split()
    assert found == "none" and float(took) < READ_PROMPTLY_S


def test_the_reader_still_reads_a_progress_file(tmp_path: Path) -> None:
    path = tmp_path / "rank-00000.json"
    protocol.Progress(rank=0, step=5, time=1.0, evidence="x").write(path)
    found = protocol.read_progress(path)
    assert found is not None and (found.rank, found.step, found.evidence) == (0, 5, "x")


def _bounded(call: Callable[[], object], fifo: Path, timeout_s: float) -> tuple[bool, object]:
    """Run `call` in a thread; (whether it returned within `timeout_s`, what it returned). A call still blocked
    on `fifo` then is let go (a writer opens and closes it, and it is taken away), so the test ends either way."""
    box: dict[str, object] = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", call()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    returned = not thread.is_alive()
    deadline = time.monotonic() + 30
    while thread.is_alive() and time.monotonic() < deadline:
        with suppress(OSError):
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # only while a reader waits in its open
            with suppress(OSError):
                fifo.unlink()
            os.close(writer)
        thread.join(0.05)
    return returned, box.get("result")


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    popen = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield popen
    popen.kill()
    popen.wait()


def test_the_watch_keeps_heartbeating_beside_a_rank_whose_progress_file_is_a_fifo(
        tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    from temporalio.testing import ActivityEnvironment

    from activities.models import WatchEventKind, WatchRanksInput
    from activities.rank_records import AttemptRecord, RankProcess
    from trainguard.procs import start_time
    from trainguard.spec import HealthSpec
    from workers.node_agent import node_ranks

    agent = node_ranks("node-0", tmp_path / "agent", "127.0.0.1", tmp_path)
    layout = protocol.RunLayout.of(tmp_path / "agent", "wf")
    layout.progress_dir(1).mkdir(parents=True)
    fifo = layout.progress_file(1, 0)
    os.mkfifo(fifo)
    record = AttemptRecord("wf", 1, "127.0.0.1", 1, 0, time.time())
    record.ranks[0] = RankProcess(0, sleeper.pid, start_time(sleeper.pid), sleeper)
    agent.book.attempts["wf"] = record
    beats: list[float] = []
    environment = ActivityEnvironment()
    environment.on_heartbeat = lambda *_: beats.append(time.monotonic())
    request = WatchRanksInput(workflow_id="wf", attempt=1, node="node-0", max_duration_s=1.0,
                              health=HealthSpec(poll_interval_s=0.05))

    returned, event = _bounded(lambda: asyncio.run(environment.run(agent.watch.watch_ranks, request)), fifo, 15.0)

    assert returned, "the watch froze on the rank's FIFO"
    assert getattr(event, "kind", None) == WatchEventKind.KEEPALIVE
    assert len(beats) >= 5 and max(b - a for a, b in zip(beats, beats[1:])) < 0.5
