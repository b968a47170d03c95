"""Warm relaunch at the node agent: a run whose script calls `trainguard.rank.standby()` gets one process per
local rank parked ahead of need, and its next launch hands each rank's role to one of them instead of starting
it cold; a script that never calls it is never started ahead of need; parked processes never outlive the run
here, and are started again after use."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from activities import rank_parking
from activities.models import LaunchRanksInput, StopRanksInput
from activities.parking_models import ParkRanksInput
from activities.rank_records import RankBook
from trainguard import protocol
from trainguard.models import StopReason
from trainguard.procs import start_time
from trainguard.protocol import RunLayout
from workers.node_agent import NodeRanks, check_parked_spares, node_ranks

# A rank that parks (a stand-in for a training script: imports, `standby()`, then one step and a long wait).
PARKS = """
import os, sys, time
from pathlib import Path
from trainguard import protocol, rank as tg
print("importing", os.getpid(), flush=True)
tg.standby(poll_s=0.01)
print("rank", os.environ["RANK"], "of attempt", os.environ["TRAINGUARD_ATTEMPT"], "pid", os.getpid(), flush=True)
protocol.Progress(rank=int(os.environ["RANK"]), step=int(os.environ["TRAINGUARD_RESTORE_STEP"]) + 1,
                  time=time.time(), attempt=int(os.environ["TRAINGUARD_ATTEMPT"]), pid=os.getpid(),
                  ).write(Path(os.environ["TRAINGUARD_PROGRESS_FILE"]))
time.sleep(120)
"""
# The same script without `standby()`: it must only ever run as a rank, never started ahead of need.
COLD = PARKS.replace("tg.standby(poll_s=0.01)", "pass")


@pytest.fixture
async def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[NodeRanks]:
    monkeypatch.setattr(rank_parking, "PARK_POLL_S", 0.05)
    ranks = node_ranks("node-a", tmp_path / "agent", "127.0.0.1", tmp_path)
    yield ranks
    await ranks.book.stop_all(grace_s=0.5)


def _launch(tmp_path: Path, script: str, attempt: int, **changes: object) -> LaunchRanksInput:
    path = tmp_path / "train.py"
    if not path.exists() or path.read_text() != script:
        path.write_text(script)
    fields: dict[str, object] = dict(
        workflow_id="wf", chain_id="c1", attempt=attempt, node="node-a", node_rank=0, num_nodes=1,
        ranks_per_node=2, entrypoint=[sys.executable, str(path)], restore_step=10 * attempt)
    fields.update(changes)
    return LaunchRanksInput(**fields)  # type: ignore[arg-type]


async def _until(check, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _parked(agent: NodeRanks) -> list[int]:
    """The pids of the run's processes waiting in `standby()`, as `ranks.json` records them."""
    pool = agent.book.parking.get("wf")
    return sorted(p.proc.pid for p in pool.processes if p.waiting()) if pool is not None else []


def _recorded(tmp_path: Path) -> protocol.AttemptFile:
    record = protocol.read_attempt_file(RunLayout.of(tmp_path / "agent", "wf").ranks_file)
    assert record is not None
    return record


def _alive(pid: int) -> bool:
    return start_time(pid) is not None


async def _crash(agent: NodeRanks, pid: int, attempt: int) -> None:
    os.kill(pid, signal.SIGKILL)
    await _until(lambda: not _alive(pid))
    await agent.launch.stop_ranks(StopRanksInput(workflow_id="wf", node="node-a", attempt=attempt,
                                                 reason=StopReason.INCIDENT))


async def test_a_relaunch_hands_its_ranks_to_parked_processes_and_parks_again(agent: NodeRanks,
                                                                             tmp_path: Path) -> None:
    first = await agent.launch.launch_ranks(_launch(tmp_path, PARKS, 1))
    await _until(lambda: len(_parked(agent)) == 2)  # after the attempt's first step
    parked = _parked(agent)
    assert sorted(p.pid for p in _recorded(tmp_path).parked) == parked  # found by pid, like the ranks
    assert not set(parked) & set(first.pids)

    await _crash(agent, first.pids[0], attempt=1)
    assert all(_alive(pid) for pid in parked)  # a stop for a relaunch keeps them for it
    started = time.monotonic()
    second = await agent.launch.launch_ranks(_launch(tmp_path, PARKS, 2))

    assert sorted(second.pids) == parked  # no rank started cold
    layout = RunLayout.of(tmp_path / "agent", "wf")
    await _until(lambda: all((p := protocol.read_progress(layout.progress_file(2, r))) is not None and p.step == 21
                             for r in (0, 1)))
    assert time.monotonic() - started < 2.0  # no interpreter to start, no imports to wait for
    assert all(_alive(pid) for pid in second.pids)
    logs = {r: layout.log_file(2, r).read_text() for r in (0, 1)}
    assert "rank 0 of attempt 2" in logs[0] and "rank 1 of attempt 2" in logs[1]  # each rank's output, its log
    assert "importing" not in logs[0] + logs[1]  # what it printed while parked stays in its park log
    # Replaced in the background once attempt 2 has made its first step: two new processes park.
    await _until(lambda: len(_parked(agent)) == 2)
    again = _parked(agent)
    assert not set(again) & set(parked)

    await agent.launch.stop_ranks(StopRanksInput(workflow_id="wf", node="node-a", attempt=None,
                                                 reason=StopReason.RUN_ENDED))
    assert not any(_alive(pid) for pid in [*again, *second.pids])
    assert _recorded(tmp_path).parked == []


async def test_a_script_that_never_calls_standby_is_never_started_ahead_of_need(agent: NodeRanks,
                                                                              tmp_path: Path) -> None:
    first = await agent.launch.launch_ranks(_launch(tmp_path, COLD, 1))
    layout = RunLayout.of(tmp_path / "agent", "wf")
    await _until(lambda: protocol.read_progress(layout.progress_file(1, 1)) is not None)
    await asyncio.sleep(0.5)  # ten keeper turns after its first step
    assert agent.book.parking["wf"].processes == []
    assert not layout.standby_mark(1).exists()

    await _crash(agent, first.pids[1], attempt=1)
    second = await agent.launch.launch_ranks(_launch(tmp_path, COLD, 2))
    assert not set(second.pids) & set(first.pids)
    await _until(lambda: protocol.read_progress(layout.progress_file(2, 1)) is not None)
    assert "rank 1 of attempt 2" in layout.log_file(2, 1).read_text()  # started cold, and runs


async def test_a_launch_of_something_else_starts_cold_and_the_old_parked_processes_go(agent: NodeRanks,
                                                                                    tmp_path: Path) -> None:
    first = await agent.launch.launch_ranks(_launch(tmp_path, PARKS, 1))
    await _until(lambda: len(_parked(agent)) == 2)
    parked = _parked(agent)
    await _crash(agent, first.pids[0], attempt=1)

    second = await agent.launch.launch_ranks(_launch(tmp_path, PARKS, 2, env={"EXTRA": "1"}))

    assert not set(second.pids) & set(parked)  # started with other env: a parked process cannot be it
    assert not any(_alive(pid) for pid in parked)


async def test_parked_processes_die_with_the_agent_and_a_drained_node(agent: NodeRanks, tmp_path: Path) -> None:
    await agent.launch.launch_ranks(_launch(tmp_path, PARKS, 1))
    await _until(lambda: len(_parked(agent)) == 2)
    parked = _parked(agent)
    await agent.launch.stop_ranks(StopRanksInput(workflow_id="wf", node="node-a", attempt=1,
                                                 reason=StopReason.DRAIN))
    assert not any(_alive(pid) for pid in parked)

    await agent.launch.launch_ranks(_launch(tmp_path, PARKS, 2))
    await _until(lambda: len(_parked(agent)) == 2)
    parked = _parked(agent)
    await agent.book.stop_all(grace_s=0.5)
    assert not any(_alive(pid) for pid in parked)


async def test_a_finished_run_keeps_nothing_parked(agent: NodeRanks, tmp_path: Path) -> None:
    finishing = PARKS.replace("time.sleep(120)", """
while not Path(os.environ["RELEASE"]).exists():  # training, until the test has seen the parked processes
    time.sleep(0.01)
protocol.Progress(rank=int(os.environ["RANK"]), step=99, time=time.time(), finished=True
                  ).write(Path(os.environ["TRAINGUARD_PROGRESS_FILE"]))""")
    release = tmp_path / "release"
    await agent.launch.launch_ranks(_launch(tmp_path, finishing, 1, env={"RELEASE": str(release)}))
    await _until(lambda: len(_parked(agent)) == 2)
    parked = _parked(agent)
    release.touch()
    await _until(lambda: "wf" not in agent.book.parking)  # the ranks finished and exited
    # The pool leaves the book as its closing starts; the kill and the wait follow (a parked process sleeps 120 s
    # unless killed, so this times out if nothing kills it).
    await _until(lambda: not any(_alive(pid) for pid in parked))


def test_standby_tells_the_agent_the_script_parks_and_takes_its_role_and_log(tmp_path: Path) -> None:
    role, log = tmp_path / "park.json", tmp_path / "rank.log"
    env = {**os.environ, protocol.ENV_STANDBY_FILE: str(role),
           protocol.ENV_STANDBY_MARK: str(protocol.mark_path(role))}
    script = ("import os, sys; from trainguard import rank as tg; print('parked'); tg.standby(poll_s=0.01); "
              "print('as', os.environ['RANK'], protocol_file := os.environ.get('TRAINGUARD_STANDBY_FILE')); "
              "print('err', file=sys.stderr)")
    with (tmp_path / "park.log").open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while (mark := protocol.StandbyMark.read(protocol.mark_path(role))) is None:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    assert mark == protocol.StandbyMark(proc.pid, parked=True)
    attempt_mark = tmp_path / "standby-mark.json"
    protocol.StandbyRole({"RANK": "5", protocol.ENV_STANDBY_MARK: str(attempt_mark)},
                         log_file=str(log)).write(role)
    assert proc.wait(timeout=20) == 0
    assert log.read_text().split("\n")[:2] == ["as 5 None", "err"]  # its output in the rank's log
    assert (tmp_path / "park.log").read_text() == "parked\n"
    assert protocol.StandbyMark.read(attempt_mark) == protocol.StandbyMark(proc.pid, parked=False)


def test_a_rank_started_as_itself_marks_and_returns_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainguard import rank as rank_module

    monkeypatch.delenv(protocol.ENV_STANDBY_FILE, raising=False)
    monkeypatch.setenv(protocol.ENV_STANDBY_MARK, str(tmp_path / "mark.json"))
    rank_module.standby()
    assert protocol.StandbyMark.read(tmp_path / "mark.json") == protocol.StandbyMark(os.getpid(), parked=False)
    assert json.loads((tmp_path / "mark.json").read_text()) == {"pid": os.getpid(), "parked": False}


# ------------------------------------------------------------------------------------------------ on a spare


def _park(tmp_path: Path, script: str = PARKS, **changes: object) -> ParkRanksInput:
    """What the run asks a spare: its attempt's launch template (the node's own fields placeholders)."""
    return ParkRanksInput(workflow_id="wf", node="node-a", launch=_launch(tmp_path, script, 1, **changes))


async def test_a_spare_parks_for_the_run_and_the_launch_that_brings_it_in_is_warm(agent: NodeRanks,
                                                                                  tmp_path: Path) -> None:
    answer = await agent.launch.park_ranks(_park(tmp_path))
    assert (answer.parked, answer.already) == (2, False)
    await _until(lambda: len(_parked(agent)) == 2)
    parked = _parked(agent)
    recorded = _recorded(tmp_path)  # found by pid, as any node's parked processes: `dev down`, a new agent
    assert (recorded.attempt, recorded.ranks, sorted(p.pid for p in recorded.parked)) == (0, [], parked)
    again = await agent.launch.park_ranks(_park(tmp_path))  # a retry, or the run asking twice
    assert (again.parked, again.already, _parked(agent)) == (2, True, parked)
    assert agent.book.unwatched(0.0) == []  # no attempt here: nothing for the orphan check to fence

    # A GPU fault elsewhere: the spare joins as node rank 1 of attempt 3.
    started = time.monotonic()
    joined = await agent.launch.launch_ranks(_launch(tmp_path, PARKS, 3, node_rank=1, num_nodes=2))

    assert sorted(joined.pids) == parked  # no rank started cold
    layout = RunLayout.of(tmp_path / "agent", "wf")
    await _until(lambda: all(protocol.read_progress(layout.progress_file(3, r)) is not None for r in (2, 3)))
    assert time.monotonic() - started < 2.0
    assert "rank 3 of attempt 3" in layout.log_file(3, 3).read_text()
    # From here on it parks as any node of the run: replaced in the background after the first step.
    await _until(lambda: len(_parked(agent)) == 2)
    assert not set(_parked(agent)) & set(parked) and not agent.book.parking["wf"].spare
    assert sorted(p.pid for p in _recorded(tmp_path).ranks) == parked


async def test_a_spares_parked_processes_go_with_the_run_a_restarted_agent_and_the_agent(agent: NodeRanks,
                                                                                       tmp_path: Path) -> None:
    layout = RunLayout.of(tmp_path / "agent", "wf")
    await agent.launch.park_ranks(_park(tmp_path))
    parked = _parked(agent) or [p.proc.pid for p in agent.book.parking["wf"].processes]
    await agent.launch.stop_ranks(StopRanksInput(workflow_id="wf", node="node-a", attempt=None,
                                                 reason=StopReason.RUN_ENDED))  # the run ended
    assert not any(_alive(pid) for pid in parked) and not layout.ranks_file.exists()

    await agent.launch.park_ranks(_park(tmp_path))
    old = agent.book.parking.pop("wf")
    old.closed = True  # its agent was killed: it stopped nothing, and keeps nothing any more
    parked = [p.proc.pid for p in old.processes]
    restarted = RankBook("node-a", tmp_path / "agent")  # a new agent on the workdir finds them by pid
    await _until(lambda: not any(_alive(pid) for pid in parked))
    assert restarted.record("wf") is None and not layout.ranks_file.exists()
    await old.close()  # reaps them

    await agent.launch.park_ranks(_park(tmp_path))
    parked = [p.proc.pid for p in agent.book.parking["wf"].processes]
    await agent.book.stop_all(grace_s=0.5)  # the agent stops
    assert not any(_alive(pid) for pid in parked)


class _Run:
    def __init__(self, status: str | None) -> None:
        self.status = status

    async def describe(self) -> object:
        from types import SimpleNamespace

        from temporalio.client import WorkflowExecutionStatus
        from temporalio.service import RPCError, RPCStatusCode

        if self.status is None:
            raise RPCError("connection refused", RPCStatusCode.UNAVAILABLE, b"")
        return SimpleNamespace(status=WorkflowExecutionStatus[self.status])


class _Client:
    def __init__(self, run: _Run) -> None:
        self.run = run

    def get_workflow_handle(self, workflow_id: str) -> _Run:
        assert workflow_id == "wf"
        return self.run


async def test_a_spare_closes_what_it_parked_for_a_run_found_closed_and_only_then(agent: NodeRanks,
                                                                                tmp_path: Path) -> None:
    await agent.launch.park_ranks(_park(tmp_path))
    parked = [p.proc.pid for p in agent.book.parking["wf"].processes]
    assert await check_parked_spares(_Client(_Run(None)), agent.book, every_s=0.0) == 0  # Temporal unreachable
    assert await check_parked_spares(_Client(_Run("RUNNING")), agent.book, every_s=0.0) == 0
    assert await check_parked_spares(_Client(_Run("TERMINATED")), agent.book) == 0  # asked a minute apart
    assert all(_alive(pid) for pid in parked)

    # Terminated without telling its spares: the next look closes them.
    assert await check_parked_spares(_Client(_Run("TERMINATED")), agent.book, every_s=0.0) == 1
    assert not any(_alive(pid) for pid in parked) and "wf" not in agent.book.parking


async def test_a_node_that_runs_the_runs_ranks_parks_from_its_launches_not_as_a_spare(agent: NodeRanks,
                                                                                    tmp_path: Path) -> None:
    await agent.launch.launch_ranks(_launch(tmp_path, PARKS, 1))
    assert (await agent.launch.park_ranks(_park(tmp_path))).parked == 0
    await _until(lambda: len(_parked(agent)) == 2)
    assert not agent.book.parking["wf"].spare


async def test_a_node_the_run_left_and_took_back_as_a_spare_keeps_its_parked_processes(agent: NodeRanks,
                                                                                     tmp_path: Path) -> None:
    first = await agent.launch.launch_ranks(_launch(tmp_path, PARKS, 1))
    await _until(lambda: len(_parked(agent)) == 2)
    parked = _parked(agent)
    await _crash(agent, first.pids[0], attempt=1)  # the run replaced the node (a GPU fault) and stopped its ranks

    answer = await agent.launch.park_ranks(_park(tmp_path))  # repaired: the run's spare now

    assert (answer.parked, answer.already) == (2, True) and agent.book.parking["wf"].spare
    assert agent.book.unwatched(0.0) == []  # its old attempt's record no longer leads the orphan check to them
    await asyncio.sleep(0.3)  # a few keeper turns: the spare's keeper keeps them
    assert _parked(agent) == parked and all(_alive(pid) for pid in parked)
