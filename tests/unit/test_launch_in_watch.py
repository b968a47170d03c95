"""A relaunch's first watch launches the node's ranks itself (downloading their shards first), so a relaunch
needs no launch or download activity per node. The launch is the agent's real one (real processes),
idempotent by attempt, and a download the store fails is retried inside the watch while bad bytes fail it at
once."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities import rank_watch
from activities.models import (
    AttemptDecision,
    DownloadShardsInput,
    DownloadShardsResult,
    HealthSpec,
    LaunchRanksInput,
    RankEvidence,
    WatchCheckpoints,
    WatchEventKind,
    WatchRanksInput,
)
from trainguard.protocol import RunLayout
from workers.node_agent import NodeRanks, node_ranks

PRINT_RESTORE = "import os; print('restore', os.environ.get('TRAINGUARD_RESTORE_DIR'))"


class Store:
    """The agent's downloader: fails `transient` times as an unreachable store would, then restores."""

    def __init__(self, tmp_path: Path, transient: int = 0, corrupt: bool = False) -> None:
        self.calls: list[DownloadShardsInput] = []
        self.transient, self.corrupt, self.restore_dir = transient, corrupt, tmp_path / "restored"

    async def __call__(self, request: DownloadShardsInput) -> DownloadShardsResult:
        self.calls.append(request)
        if self.corrupt:
            raise ApplicationError("shard rank 0: sha256 mismatch", type="CorruptCheckpoint", non_retryable=True)
        if len(self.calls) <= self.transient:
            raise ConnectionError("store unreachable")
        return DownloadShardsResult(restore_dir=str(self.restore_dir))


@pytest.fixture
async def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[NodeRanks]:
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setattr(rank_watch, "DOWNLOAD_RETRY_INITIAL_S", 0.05)
    made = node_ranks("node-b", tmp_path / "agent", "127.0.0.1", tmp_path)
    yield made
    await made.book.stop_all(grace_s=0.5)


def _watch(attempt: int = 2, download: bool = True) -> WatchRanksInput:
    launch = LaunchRanksInput(workflow_id="wf", chain_id="c1", attempt=attempt, node="node-b", node_rank=1,
                              num_nodes=2, ranks_per_node=2, master_addr="127.0.0.1", master_port=29999,
                              entrypoint=["python", "-c", PRINT_RESTORE], restore_step=10)
    return WatchRanksInput(workflow_id="wf", attempt=attempt, node="node-b", health=HealthSpec(poll_interval_s=0.05),
                           launch=launch, max_duration_s=30,
                           download=DownloadShardsInput(workflow_id="wf", attempt=attempt, node="node-b", bucket="b",
                                                        manifest_key="m", ranks=[2, 3]) if download else None)


async def test_the_first_watch_launches_from_the_restored_shards_and_a_second_launches_nothing(
        agent: NodeRanks, tmp_path: Path) -> None:
    store = Store(tmp_path)
    agent.watch.downloader = store
    event = await ActivityEnvironment().run(agent.watch.watch_ranks, _watch())
    assert event.kind is WatchEventKind.FINISHED
    record = agent.book.record("wf")
    assert record is not None and record.attempt == 2 and sorted(record.ranks) == [2, 3]
    log = RunLayout.of(agent.book.workdir, "wf").log_file(2, 2).read_text()
    assert f"restore {store.restore_dir}" in log, "the ranks restore from what the watch downloaded"
    pids = sorted(p.pid for p in record.ranks.values())

    again = await ActivityEnvironment().run(agent.watch.watch_ranks, _watch())
    assert again.kind is WatchEventKind.FINISHED
    assert sorted(p.pid for p in agent.book.record("wf").ranks.values()) == pids, "nothing launched twice"
    assert len(store.calls) == 1, "nor downloaded twice"


async def test_a_store_outage_is_ridden_out_inside_the_watch(agent: NodeRanks, tmp_path: Path) -> None:
    store = Store(tmp_path, transient=2)
    agent.watch.downloader = store
    event = await ActivityEnvironment().run(agent.watch.watch_ranks, _watch())
    assert event.kind is WatchEventKind.FINISHED and len(store.calls) == 3


async def test_bad_bytes_fail_the_watch_at_once_and_launch_nothing(agent: NodeRanks, tmp_path: Path) -> None:
    store = Store(tmp_path, corrupt=True)
    agent.watch.downloader = store
    with pytest.raises(ApplicationError) as failed:
        await ActivityEnvironment().run(agent.watch.watch_ranks, _watch())
    assert failed.value.type == "CorruptCheckpoint" and len(store.calls) == 1
    assert agent.book.record("wf") is None, "no rank of the attempt started"


async def test_a_watch_never_launches_an_older_attempt_than_the_node_runs(agent: NodeRanks,
                                                                          tmp_path: Path) -> None:
    agent.watch.downloader = Store(tmp_path)
    await ActivityEnvironment().run(agent.watch.watch_ranks, _watch(attempt=3, download=False))
    with pytest.raises(ApplicationError) as stale:
        await ActivityEnvironment().run(agent.watch.watch_ranks, _watch(attempt=2, download=False))
    assert stale.value.type == "NoSuchAttempt"
    assert agent.book.record("wf").attempt == 3


async def test_a_relaunchs_watch_stops_the_previous_attempts_ranks_before_launching(agent: NodeRanks,
                                                                                    tmp_path: Path) -> None:
    """A relaunch sends no stop to a node that stays in the run: its launching watch fences the old attempt.
    Its ranks (alive, blocked in a sleep) must be gone before the new ones start, never beside them."""
    agent.watch.downloader = Store(tmp_path)
    old = _watch(attempt=1, download=False).launch
    assert old is not None
    await agent.launch.launch_ranks(old.model_copy(update={"entrypoint": ["python", "-c",
                                                                          "import time; time.sleep(600)"]}))
    before = agent.book.record("wf")
    assert before is not None and before.attempt == 1
    old_ranks = list(before.ranks.values())
    assert not any(p.poll() for p in old_ranks), "attempt 1 runs"

    event = await ActivityEnvironment().run(agent.watch.watch_ranks, _watch(attempt=2, download=False))

    assert event.kind is WatchEventKind.FINISHED
    assert all(p.poll() for p in old_ranks), "attempt 1's ranks were stopped"
    after = agent.book.record("wf")
    assert after is not None and after.attempt == 2
    assert not {p.pid for p in old_ranks} & {p.pid for p in after.ranks.values()}


class Decisions:
    """The agent's reader of the run's decision in the store: what the run has published so far."""

    def __init__(self) -> None:
        self.published: AttemptDecision | None = None
        self.reads = 0

    def __call__(self, target: WatchCheckpoints) -> AttemptDecision | None:
        self.reads += 1
        return self.published if target.run_prefix == "runs/wf" else None

    async def publish_once_read(self, decision: AttemptDecision, after: Callable[[], bool] = lambda: True) -> None:
        """Publish `decision` once `after()` holds and the watch has read the store since (it ran the old attempt
        when the decision came)."""
        deadline = time.monotonic() + 10
        while not after():
            assert time.monotonic() < deadline, "condition never held"
            await asyncio.sleep(0.01)
        seen = self.reads
        while self.reads <= seen:
            assert time.monotonic() < deadline, "the watch never read the store"
            await asyncio.sleep(0.01)
        self.published = decision


def _decision(attempt: int, **changes: object) -> AttemptDecision:
    launch = _watch(attempt=attempt).launch
    assert launch is not None
    return AttemptDecision(workflow_id="wf", chain_id="c1", attempt=attempt,
                           launch=launch.model_copy(update={"node": "", "node_rank": 0}),
                           download=DownloadShardsInput(workflow_id="wf", attempt=attempt, node="", bucket="b",
                                                        manifest_key="m"),
                           starters=["node-a"], launched=["node-a"], **changes)  # type: ignore[arg-type]


def _following(attempt: int = 1) -> WatchRanksInput:
    return _watch(attempt=attempt, download=False).model_copy(update={
        "launch": None, "follow_decisions": True, "decision_every_s": 0.05,
        "checkpoints": WatchCheckpoints(bucket="b", run_prefix="runs/wf")})


async def _training(agent: NodeRanks) -> list[object]:
    """Attempt 1 running on the node (alive, blocked in a sleep); its rank processes."""
    old = _watch(attempt=1, download=False).launch
    assert old is not None
    await agent.launch.launch_ranks(old.model_copy(update={"entrypoint": ["python", "-c",
                                                                          "import time; time.sleep(600)"]}))
    record = agent.book.record("wf")
    assert record is not None and record.attempt == 1
    return list(record.ranks.values())


async def test_a_watch_takes_up_the_runs_published_relaunch_in_place_at_its_node_rank(agent: NodeRanks,
                                                                                       tmp_path: Path) -> None:
    """A large run relaunches in place: the watch still running attempt 1 reads the run's decision from the
    store, stops attempt 1's ranks, downloads the shards its node rank restores and launches attempt 2, and
    goes on watching it: its events say which attempt they are of."""
    store = Store(tmp_path)
    agent.watch.downloader = store
    old_ranks = await _training(agent)
    decisions = Decisions()
    agent.watch.decisions = decisions

    publishing = asyncio.ensure_future(decisions.publish_once_read(_decision(2)))
    event = await ActivityEnvironment().run(agent.watch.watch_ranks, _following())
    await publishing

    assert event.kind is WatchEventKind.FINISHED and event.attempt == 2
    assert all(p.poll() for p in old_ranks), "attempt 1's ranks were stopped"
    record = agent.book.record("wf")
    assert record is not None and record.attempt == 2 and sorted(record.ranks) == [2, 3]  # node rank 1 kept
    assert [(c.node, c.attempt, c.ranks) for c in store.calls] == [("node-b", 2, [2, 3])]
    log = RunLayout.of(agent.book.workdir, "wf").log_file(2, 2).read_text()
    assert f"restore {store.restore_dir}" in log


async def test_a_node_leaving_the_run_takes_up_no_relaunch(agent: NodeRanks, tmp_path: Path) -> None:
    """A node replaced in the relaunch (a straggler, say) reads the same decision and launches nothing."""
    agent.watch.downloader = Store(tmp_path)
    old_ranks = await _training(agent)
    agent.watch.decisions = lambda target: _decision(2, leaving=["node-b"])
    watch = _following().model_copy(update={"max_duration_s": 0.5})

    event = await ActivityEnvironment().run(agent.watch.watch_ranks, watch)

    assert event.kind is WatchEventKind.KEEPALIVE and event.attempt == 1
    assert not any(p.poll() for p in old_ranks) and agent.book.record("wf").attempt == 1


async def test_a_node_that_reported_waits_in_its_watch_and_takes_up_the_relaunch(agent: NodeRanks,
                                                                                   tmp_path: Path) -> None:
    """Its ranks of attempt 1 failed and the run has that report: the watch the group starts next reports
    nothing of attempt 1 (the exit again would be a second incident), and launches attempt 2 once published;
    a node the decision says is leaving returns at once instead."""
    store = Store(tmp_path)
    agent.watch.downloader = store
    failed = _watch(attempt=1, download=False).launch
    assert failed is not None
    await agent.launch.launch_ranks(failed.model_copy(update={"entrypoint": ["python", "-c", "raise SystemExit(3)"]}))
    old_ranks = list(agent.book.record("wf").ranks.values())
    decisions = Decisions()
    agent.watch.decisions = decisions

    # Published only once the old ranks have exited and the watch has looked since: it must not report that.
    publishing = asyncio.ensure_future(decisions.publish_once_read(_decision(2), after=lambda: all(
        p.poll() for p in old_ranks)))
    event = await ActivityEnvironment().run(agent.watch.watch_ranks,
                                            _following().model_copy(update={"after_attempt": 1}))
    await publishing
    assert event.kind is WatchEventKind.FINISHED and event.attempt == 2
    assert [(c.node, c.ranks) for c in store.calls] == [("node-b", [2, 3])]

    agent.watch.decisions = lambda target: _decision(3, leaving=["node-b"])
    left = await ActivityEnvironment().run(agent.watch.watch_ranks, _following(attempt=2).model_copy(
        update={"after_attempt": 2}))
    assert left.kind is WatchEventKind.KEEPALIVE and agent.book.record("wf").attempt == 2


async def test_a_large_runs_watch_heartbeats_only_as_often_as_the_run_asks(agent: NodeRanks,
                                                                           tmp_path: Path) -> None:
    """Every heartbeat is an RPC and a write on the Temporal server: a watch asked for one every 0.5 s sends
    two or three in 1.2 s of watching, the first no sooner than its share of the interval, where one left to
    its poll (every 0.05 s) sends one per poll, the first at once."""
    agent.watch.downloader = Store(tmp_path)
    sleeper = ["python", "-c", "import time; time.sleep(600)"]
    counts, firsts = [], []
    for every in (None, 0.5):
        beats: list[float] = []
        env = ActivityEnvironment()
        env.on_heartbeat = lambda *_: beats.append(time.monotonic())
        watch = _watch(attempt=len(counts) + 1, download=False)
        assert watch.launch is not None
        watch = watch.model_copy(update={"max_duration_s": 1.2, "heartbeat_every_s": every,
                                         "launch": watch.launch.model_copy(update={"entrypoint": sleeper})})
        began = time.monotonic()
        event = await env.run(agent.watch.watch_ranks, watch)
        assert event.kind is WatchEventKind.KEEPALIVE
        counts.append(len(beats))
        firsts.append(beats[0] - began)
    every_poll, asked = counts
    assert 2 <= asked <= 3, counts
    assert every_poll >= 4 * asked, counts
    share = watch.first_heartbeat_s()
    assert 0.25 <= share <= 0.5 and firsts[1] >= share, (share, firsts)


def test_a_large_runs_watches_spread_their_first_heartbeats_over_the_interval() -> None:
    """A launch starts thousands of watches within seconds: none heartbeats at once, and their first heartbeats
    spread over the second half of the interval, the same for a node every time (the timeout is three)."""
    small = _watch(attempt=1, download=False)
    assert small.first_heartbeat_s() == 0.0  # a small run's watch heartbeats at every poll, from its start
    firsts = [small.model_copy(update={"node": f"node-{i:04d}", "heartbeat_every_s": 20.48}).first_heartbeat_s()
              for i in range(4096)]
    assert 10.24 <= min(firsts) and max(firsts) <= 20.48
    assert len({round(f) for f in firsts}) >= 10, "spread over the interval, not in one burst"
    assert firsts == [small.model_copy(update={"node": f"node-{i:04d}", "heartbeat_every_s": 20.48})
                      .first_heartbeat_s() for i in range(4096)]


def _hang_evidence(stopped: int | None) -> Callable[..., Any]:
    """The agent's evidence taker: every local rank (2 and 3) asleep inside the collective its peers wait in,
    but `stopped`, which is stopped outside it."""
    async def take(record: Any, layout: Any, checkpoints: Any) -> list[RankEvidence]:
        taken.append(record.attempt)
        return [RankEvidence(node="node-b", rank=r, state="T" if r == stopped else "S", answered=r != stopped,
                             collectives_enqueued=20 if r == stopped else 21, in_collective=r != stopped)
                for r in (2, 3)]
    taken: list[int] = []
    take.taken = taken  # type: ignore[attr-defined]
    return take


def _hanging(attempt: int = 1) -> WatchRanksInput:
    """A large run's watch (it follows decisions) of ranks that never step: a hang within half a second."""
    return _following(attempt).model_copy(update={
        "evidence": True, "evidence_with_event": True,
        "health": HealthSpec(poll_interval_s=0.05, startup_grace_s=0.5)})


async def test_a_large_runs_watch_whose_ranks_wait_for_a_peer_takes_up_the_relaunch_instead_of_reporting(
        agent: NodeRanks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a hang every node's watch judges it; one whose ranks all wait inside a collective for a peer is not to
    blame: it holds its report, and the run's relaunch (published from the culprit's node's report) comes
    first, so it takes that up in place and never reports: thousands of nodes do not all report at once."""
    monkeypatch.setattr(rank_watch, "PEER_HANG_REPORT_DELAY_S", 30.0)
    agent.watch.downloader = Store(tmp_path)
    await _training(agent)
    agent.watch.hang_evidence = evidence = _hang_evidence(stopped=None)
    decisions = Decisions()
    agent.watch.decisions = decisions

    publishing = asyncio.ensure_future(decisions.publish_once_read(_decision(2), after=lambda: bool(evidence.taken)))
    event = await ActivityEnvironment().run(agent.watch.watch_ranks, _hanging())
    await publishing

    assert event.kind is WatchEventKind.FINISHED and event.attempt == 2
    assert evidence.taken == [1]


async def test_a_large_runs_watch_reports_a_hang_at_once_when_its_own_rank_is_to_blame_or_no_relaunch_comes(
        agent: NodeRanks, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node whose rank is stopped reports the hang as soon as it is judged; a node whose ranks wait for a peer
    reports it too once `PEER_HANG_REPORT_DELAY_S` passed with no relaunch (the culprit's node could not)."""
    monkeypatch.setattr(rank_watch, "PEER_HANG_REPORT_DELAY_S", 1.0)
    agent.watch.decisions = Decisions()
    await _training(agent)
    agent.watch.hang_evidence = _hang_evidence(stopped=3)
    began = time.monotonic()
    blamed = await ActivityEnvironment().run(agent.watch.watch_ranks, _hanging())
    at_once = time.monotonic() - began

    agent.watch.hang_evidence = _hang_evidence(stopped=None)
    began = time.monotonic()
    waited = await ActivityEnvironment().run(agent.watch.watch_ranks, _hanging())

    assert blamed.kind is WatchEventKind.HANG and [e.state for e in blamed.evidence] == ["S", "T"]
    assert waited.kind is WatchEventKind.HANG and waited.attempt == 1
    assert at_once < 1.0 <= time.monotonic() - began  # its ranks silent already: judged at once, then held
