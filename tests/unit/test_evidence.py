"""The evidence channel end to end between real processes (no torch): a rank helper's stacks and answer, the
agent's collection, and the chaos hangs the helper carries out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from activities.evidence import collect_local, evidence_env, inject_hang
from activities.paths import RunLayout
from activities.ranks import AttemptRecord, RankProcess
from trainguard.procs import start_time

REPO = Path(__file__).resolve().parents[2]

# A rank in a few lines: the helper's progress heartbeat every 20 ms, nothing else.
RANK = """
import time
from trainguard import rank as tg
run = tg.init()
step = 0
while True:
    step += 1
    run.step_done(step)
    time.sleep(0.02)
"""


@pytest.fixture
def ranks(tmp_path: Path):  # type: ignore[no-untyped-def]
    layout = RunLayout.of(tmp_path, "wf")
    (layout.attempt_dir(1) / "progress").mkdir(parents=True)
    record = AttemptRecord("wf", 1, "127.0.0.1", 1, 0, time.time())
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": str(rank),
               "TRAINGUARD_PROGRESS_FILE": str(layout.progress_file(1, rank)),
               "TRAINGUARD_CHECKPOINT_DIR": str(tmp_path / "ck"), **evidence_env(layout, 1, rank, {})}
        env.pop("TORCH_FR_BUFFER_SIZE", None)
        popen = subprocess.Popen([sys.executable, "-c", RANK], env=env, start_new_session=True)
        record.ranks[rank] = RankProcess(rank, popen.pid, start_time(popen.pid), popen)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if all(json.loads(layout.progress_file(1, r).read_text())["step"] > 2 for r in range(2)):
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    yield layout, record
    for proc in record.ranks.values():
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.popen is not None
        proc.popen.wait()


def test_a_python_hang_shows_in_the_culprits_stacks_and_a_stopped_rank_by_its_state(ranks) -> None:  # type: ignore[no-untyped-def]
    layout, record = ranks
    inject_hang(layout, record, 1, "python")
    os.kill(record.ranks[0].pid, signal.SIGSTOP)
    time.sleep(0.3)
    found, texts = collect_local("node-0", layout, record)
    stopped, hung = found
    assert (stopped.state, stopped.answered) == ("T", False)
    assert "no answer" in texts[0]
    assert hung.answered and hung.state == "S" and hung.step is not None and hung.step > 2
    assert hung.in_collective is None  # no Flight Recorder in this rank: not known, never guessed
    assert hung.innermost.startswith("evidence.py:") and "hang_in_python" in hung.innermost
    assert "hang_in_python" in texts[1] and "step_done" in texts[1]


def test_an_io_hang_blocks_in_a_read_and_skip_collective_needs_the_ddp_hook(ranks) -> None:  # type: ignore[no-untyped-def]
    from temporalio.exceptions import ApplicationError

    layout, record = ranks
    with pytest.raises(ApplicationError, match="hook_ddp"):
        inject_hang(layout, record, 0, "skip-collective")
    inject_hang(layout, record, 0, "io")
    time.sleep(0.3)
    found, _ = collect_local("node-0", layout, record)
    assert "hang_in_io" in found[0].innermost
    assert "hang_in_io" not in found[1].innermost  # the other rank goes on
