"""The evidence channel end to end between real processes (no torch): a rank helper's stacks and answer, the
agent's collection, and the chaos hangs the helper carries out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest

from activities.chaos import inject_hang
from activities.evidence import collect_local, evidence_env
from activities.rank_records import AttemptRecord, RankProcess
from trainguard.procs import start_time
from trainguard.protocol import RunLayout

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
        assert proc.popen is not None
        if proc.popen.poll() is None:  # a rank that already ended has no group left to signal
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
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
    deadline = time.monotonic() + 15  # the rank picks the request up at its next poll, later on a loaded machine
    while "hang_in_io" not in (found := collect_local("node-0", layout, record)[0])[0].innermost:
        assert time.monotonic() < deadline, f"rank 0 never blocked in the read: {found[0].innermost}"
        time.sleep(0.1)
    assert "hang_in_io" not in found[1].innermost
    assert found[1].answered and record.ranks[1].popen.poll() is None  # the other rank goes on


@pytest.mark.parametrize(("enqueued", "completed", "hooked", "entered", "back", "inside"), [
    # DDP's gradient all-reduce is asynchronous: Flight Recorder marks it complete only once its work object is
    # waited on, which DDP never does, so a rank between steps reads "inside" from it alone. The hook's own
    # count says it is not.
    (12, 9, True, 3, 3, False),
    (12, 9, True, 4, 3, True),  # waiting for a gradient all-reduce's result
    (12, 9, False, 0, 0, True),  # no hook: Flight Recorder's word
    (9, 9, False, 0, 0, False),
    (None, None, False, 0, 0, None),  # no Flight Recorder, no hook: not known, never guessed
    (None, None, True, 2, 1, True),
])
def test_inside_a_collective_comes_from_the_ddp_hook_where_the_script_uses_it(
        enqueued: int | None, completed: int | None, hooked: bool, entered: int, back: int, inside: bool | None) -> None:
    from trainguard.evidence import in_collective

    assert in_collective(enqueued, completed, hooked, entered, back) is inside


def test_the_ddp_hook_counts_each_all_reduce_in_and_out_and_leaves_the_gradients_as_torch_makes_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from trainguard.evidence import RankChannel

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        channel = RankChannel(tmp_path / "rank-00000")
        grads = []
        for hooked in (False, True):
            torch.manual_seed(0)
            model = DistributedDataParallel(torch.nn.Linear(4, 3))
            if hooked:
                model.register_comm_hook(None, channel.allreduce_hook)
                channel.ddp_hooked = True
            for _ in range(3):
                model(torch.ones(2, 4)).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        position = channel.position("r1")
    finally:
        dist.destroy_process_group()
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert (channel.hook_entered, channel.hook_completed) == (3, 3)
    assert position.in_collective is False and position.extra["hook_entered"] == 3


async def test_a_watch_asked_for_evidence_returns_its_hang_with_every_local_ranks_evidence(
        ranks, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from temporalio.testing import ActivityEnvironment

    from activities.evidence import EvidenceActivities
    from activities.models import WatchEventKind, WatchRanksInput
    from trainguard.spec import HealthSpec
    from workers.node_agent import node_ranks

    layout, record = ranks
    agent = node_ranks("node-0", tmp_path, "127.0.0.1", REPO)
    agent.book.attempts["wf"] = record
    agent.watch.hang_evidence = EvidenceActivities(agent.book, uploader=lambda *_: None).for_watch
    inject_hang(layout, record, 1, "python")
    request = WatchRanksInput(workflow_id="wf", attempt=1, node="node-0", evidence=True, evidence_with_event=True,
                              health=HealthSpec(hang_floor_s=0.5, poll_interval_s=0.05))

    event = await ActivityEnvironment().run(agent.watch.watch_ranks, request)

    assert (event.kind, event.rank) == (WatchEventKind.HANG, 1)
    assert [e.rank for e in event.evidence] == [0, 1]
    assert "hang_in_python" in event.evidence[1].innermost and event.evidence[1].answered
    assert layout.incident_file(1, 1).is_file()  # kept on the node, in a folder only the agent writes
