"""A rank's failure in its own words: the tail of its log, and the signature that tells a script failing the
same way on every attempt from a fault a relaunch fixes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from temporalio.testing import ActivityEnvironment

from activities.models import WatchEventKind, WatchRanksInput
from activities.rank_logs import exception_line, failure_signature, read_tail
from workers.node_agent import node_ranks

TRACEBACK = """step 9 done
Traceback (most recent call last):
  File "/home/u/examples/train.py", line 190, in <module>
    main()
  File "/home/u/examples/train.py", line 142, in main
    raise ValueError(f"loss is nan at step {step}")
ValueError: loss is nan at step 10
"""


def test_the_tail_is_the_last_lines_within_the_byte_bound(tmp_path: Path) -> None:
    log = tmp_path / "rank.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    assert read_tail(log, max_lines=3).splitlines() == ["line 997", "line 998", "line 999"]
    assert read_tail(log, max_lines=100, max_bytes=26).splitlines() == ["line 997", "line 998", "line 999"]
    assert read_tail(log, max_lines=100, max_bytes=25).splitlines() == ["line 998", "line 999"]
    assert read_tail(tmp_path / "missing.log") == ""
    log.write_text("x" * 5000)  # one line longer than the bound: its end
    assert read_tail(log, max_bytes=100) == "x" * 100


SIGNATURES = [
    pytest.param(TRACEBACK, "train.py:142 in main: ValueError: loss is nan at step 10", id="python-traceback"),
    pytest.param(TRACEBACK.replace("in main", "in main").replace("step 10", "step 10 (pid 123456, 0x7f3a9c)"),
                 "train.py:142 in main: ValueError: loss is nan at step 10 (pid N, N)", id="pids-and-addresses-masked"),
    pytest.param('Traceback (most recent call last):\n  File "t.py", line 3, in f\n'
                 "torch.distributed.DistBackendError: Connection reset by peer [127.0.0.1]:45678\n",
                 "t.py:3 in f: torch.distributed.DistBackendError: Connection reset by peer N", id="ports-masked"),
    pytest.param("".join(f"[rank1]: {line}\n" for line in TRACEBACK.splitlines()),
                 "train.py:142 in main: ValueError: loss is nan at step 10", id="torch-rank-prefix"),
    pytest.param("step 9 done\nRuntimeError: printed by the script, not raised\n", None, id="no-frame-no-signature"),
    pytest.param("step 9 done\n", None, id="silent-exit"),
    pytest.param("", None, id="empty-log"),
]


@pytest.mark.parametrize(("tail", "signature"), SIGNATURES)
def test_failure_signature(tail: str, signature: str | None) -> None:
    assert failure_signature(tail) == signature


def test_the_same_failure_on_another_attempt_has_the_same_signature_and_another_one_does_not() -> None:
    again = TRACEBACK.replace("step 9 done", "step 9 done\nrestored step 0")
    elsewhere = TRACEBACK.replace("line 142", "line 150")
    assert failure_signature(again) == failure_signature(TRACEBACK)
    assert failure_signature(elsewhere) != failure_signature(TRACEBACK)
    assert exception_line(TRACEBACK) == "ValueError: loss is nan at step 10"


SCRIPT = "import sys\nprint('starting', flush=True)\ndef main():\n    raise ValueError('boom at step 10')\nmain()\n"


async def test_a_rank_that_raises_is_reported_with_its_traceback_log_and_signature(tmp_path: Path) -> None:
    """The node agent's own watch, on a real process: the exit event carries what the rank printed."""
    from activities.models import LaunchRanksInput

    agent = node_ranks("node-a", tmp_path / "agent", "127.0.0.1", tmp_path,
                           allowed=(str(Path(sys.executable).parent),))
    try:
        await agent.launch.launch_ranks(LaunchRanksInput(
            workflow_id="wf", chain_id="c1", attempt=1, node="node-a", node_rank=0, num_nodes=1,
            ranks_per_node=1, entrypoint=[sys.executable, "-c", SCRIPT]))
        event = await ActivityEnvironment().run(agent.watch.watch_ranks, WatchRanksInput(
            workflow_id="wf", attempt=1, node="node-a", max_duration_s=30))
    finally:
        await agent.book.stop_all(grace_s=0.5)
    assert event.kind is WatchEventKind.RANK_EXITED and event.exit_code == 1
    assert event.detail == "rank 0 exited with code 1: ValueError: boom at step 10"
    assert event.log_path is not None and event.log_path.endswith("attempt-0001/logs/rank-00000.log")
    assert Path(event.log_path).is_file()
    assert "starting" in event.log_tail and "Traceback (most recent call last)" in event.log_tail
    assert event.failure_signature == "<string>:4 in main: ValueError: boom at step 10"


async def test_the_agent_reads_a_ranks_log_newest_attempt_first_from_an_offset_or_its_tail(tmp_path: Path) -> None:
    from activities.rank_logs import RankLogActivities, ReadRankLogInput
    from trainguard.protocol import RunLayout

    layout = RunLayout.of(tmp_path, "wf")
    for attempt, text in ((1, "first attempt\n"), (2, "second attempt\nline 2\n")):
        path = layout.log_file(attempt, 3)
        path.parent.mkdir(parents=True)
        path.write_text(text)
    logs = RankLogActivities("node-a", tmp_path)
    env = ActivityEnvironment()

    newest = await env.run(logs.read_rank_log, ReadRankLogInput(workflow_id="wf", node="node-a", rank=3))
    assert (newest.attempt, newest.text, newest.node, newest.rank) == (2, "second attempt\nline 2\n", "node-a", 3)
    tail = await env.run(logs.read_rank_log, ReadRankLogInput(workflow_id="wf", node="node-a", rank=3, tail_bytes=7))
    assert tail.text == "line 2\n" and tail.next_offset == tail.size
    first = await env.run(logs.read_rank_log, ReadRankLogInput(workflow_id="wf", node="node-a", rank=3, attempt=1,
                                                               offset=6))
    assert first.text == "attempt\n"
    from temporalio.exceptions import ApplicationError

    with pytest.raises(ApplicationError, match="node node-a has no log of rank 9 of wf"):
        await env.run(logs.read_rank_log, ReadRankLogInput(workflow_id="wf", node="node-a", rank=9))
