"""Node scale: one run of N nodes x R ranks on the real workflows, what it costs Temporal, N = 16 ... 4,096.

    python -m infra.bench.nodes [--nodes 16 256 1024 4096] [--ranks-per-node 8] [--checkpoints 6]
                                [--timeout-s S] [--json .bench/nodes.json]

For each N, a private Temporal dev server (`infra/bench/stack.py`, Temporal only), and on it:
- the controller worker in its own process (so its CPU seconds and peak RSS are its own): the real workflows
  (`TrainingRun`, `NodePool`) and the real controller activities as `workers.controller.build_worker` registers
  them, except the store's, which are stand-ins over manifests kept in memory (`infra/bench/standins.py`);
- simulated nodes: stand-ins for every node-pinned activity, all served from this process, with per-node state
  in memory (0.05 s steps, a checkpoint every `--every-steps`), their watches heartbeating every 4 s (what an
  operator sets at thousands of nodes). A relaunch's watches launch their nodes, as the real agents' do. The
  node pool is started with the N nodes and two spares already registered.

QUEUES: the stand-ins do not poll one `trainguard-node-<node>` queue per node (4,096 Workers is too heavy).
In both processes, before any worker starts, `trainguard.node_task_queue` (and every module's reference to it)
is replaced by a routing onto shared queues (`--queues`, else one per 16 nodes, 16 to 64), by
crc32(node) % queues. The Temporal cost of an activity (its events, the pending count, its payloads) does not
depend on which queue it is on; how long a burst of them waits to be matched does (see `NODES_PER_QUEUE`).
Past 1,024 nodes a simulated step lasts N/1,024 times `--step-time` (`LARGE_RUN_NODES`).

Schedule per N: checkpoints; after a third of `--checkpoints` are committed, a rank crash (the run's real
`inject_fault` update, fault `crash`); after half, a hang (`hang`: a rank stopped; every node's watch judges the
hang and reports it with its ranks' evidence, the run names the culprit from them); after two thirds, a lost
node (`node-down`: its watch stops heartbeating and Temporal times it out; a spare replaces it); then every rank
reaches the final step and the run finishes.
A run that is not done within the timeout, or whose workflow task keeps being refused, is reported with
`completed` false and what was measured, and terminated.

Figures, per N, across every execution that belongs to the run (the root workflow, its continued-as-new runs and
any child workflows: listed by workflow id prefix and followed through history links):
- `events_total`, `events_root`: history events of all executions / of the root workflow id only;
- `events_per_checkpoint`: `all` and `root`, the marginal events per checkpoint: events between two consecutive
  commits of the same attempt (no incident in between), summed over such intervals, over their number; that is
  the steady-state price of a checkpoint, without start-up and recovery. `events_per_commit_avg` is the plain
  total / committed checkpoints;
- `max_pending`: the most activities + child workflows open at once in any one execution, walking each history
  (scheduled or initiated minus closed);
- `largest_payload_bytes`: the largest single payload in any event of any history;
- `hang`: the hang's incident: the culprit it names against the rank stopped, `attribution_s`, how many nodes
  the run had to ask for evidence (`collect_evidence`: 0 when every node brought its own with its report), and
  its own relaunch p95 / max;
- `relaunch_p95_s`: per incident, from its `detected_at` to each node of the next attempt having launched (the
  stand-ins' launch times), p95 over nodes and incidents (`relaunch_max_s`: the slowest node);
- `continue_as_new`, `controller_cpu_s` (during the run), `controller_peak_rss_mb` (VmHWM), `wall_s`.

A benchmark, not a test: it prints figures next to issue 12's targets and writes them to JSON, never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from collections.abc import AsyncIterator
from typing import Any

from infra.bench.history import HistoryFigures, marginal_per_checkpoint, percentile

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / ".bench"
DEFAULT_JSON = BENCH_DIR / "nodes.json"
PORT_SEARCH_START = 36000
DEFAULT_NODES = (16, 256, 1024, 4096)
NUM_SPARES = 2
TICK_S = 0.5
STUCK_CHECK_S = 5.0
STUCK_ATTEMPTS = 5
"""A workflow task that fails this many times in a row is refused every time (e.g. over the pending-activities
limit): the run is stuck and the benchmark stops waiting for it."""
CONTROLLER_READY_S = 60.0
SERVER_ARGS = ("--sqlite-pragma", "journal_mode=wal", "--sqlite-pragma", "synchronous=off")
"""The dev server's SQLite without a sync per commit: durability across a crash of this machine is not what
is measured, and the disk's commit rate would otherwise be what limits 4,096 nodes here, not trainguard (a
production Temporal cluster runs on Cassandra or PostgreSQL, sharded)."""

NAMESPACE_POLLS = 1100
"""Activity polls the stand-ins keep open in all, under the server's default limit of 1,200 concurrent polls
per namespace (`frontend.namespaceCount`): past it the server refuses polls ("namespace concurrent poller
limit exceeded"), as a production namespace refuses agents' polls past its limit (the README's Scale section).
With the limit raised to 5,000 (64 queues x 20 polls all open) a 4,096-node first launch missed its bound
again, with the dev server at a full core; that run had other tests beside it, so it does not say by how much
the extra polls were to blame."""

STANDIN_HEARTBEAT_INTERVAL = timedelta(seconds=4)
"""How often a stand-in watch's heartbeat reaches Temporal, as an agent's `TRAINGUARD_HEARTBEAT_INTERVAL_S`
would at thousands of nodes (the README says 5 s there). Left to the SDK it is 0.8 x the 10 s heartbeat
timeout, 2 s of slack: at 4,096 nodes sharing two cores with the server, late heartbeats read as lost nodes."""

NODES_PER_QUEUE = 16
MAX_QUEUES = 64
"""Without `--queues`, a size gets a shared queue per 16 nodes, at least 16 and at most 64 (polls are bounded
by `NAMESPACE_POLLS` in all). A real agent polls a queue of its own; the fewer nodes share a queue here, the
nearer that is. With 16 queues (256 nodes each) at 4,096 nodes, the first launch's 4,095 launching watches
mostly found no poll waiting, queued in the dev server's backlog, and 1,100 were not matched within 30 s: the
run never got going; with 64 queues every one was matched (p95 13.7 s) and the run completed. At 1,024 nodes,
16 queues: launching watches matched p95 13.9 s after they were scheduled, relaunch p95 18.3 s; 64 queues:
7.8 s and 13.4 s. At 4,096 nodes on 100 queues (11 polls each) the dev server, at a full core, let three live
nodes' first heartbeats arrive past their 61 s timeout, and the run paused without spares."""

LARGE_RUN_NODES = 1024
"""Past this size a simulated step lasts proportionally longer (`step_s_for`): each checkpoint interval of a
4,096-node run then lasts 12 s, not 3 s, so its faults, injected through updates the run answers in seconds at
that size, land while it trains (with 3 s, the run finished before its crash took effect)."""

MAX_POLLS_PER_QUEUE = 20
"""Activity polls a shared queue's worker keeps open: as many as its nodes' agents would (5 each, the SDK's
default), up to this. A burst of one activity per node (a watch each after a checkpoint) must start well within
the node-pinned schedule-to-start timeout (10 s); `start_wait_s` shows whether it did. Measured here at 64
nodes: 5 polls a queue, node activities waited up to 5.3 s to start; 20, up to 1.2 s; 50 (at 256 nodes) loads
the dev server more and helps nothing."""
FAULT_UPDATE_TIMEOUT_S = 60.0
CLOCK_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")

TARGET_PENDING = 1000
TARGET_PAYLOAD_BYTES = 256 * 1024
TARGET_RELAUNCH_P95_S = 15.0

log = logging.getLogger("trainguard.bench.nodes")


def target_events_per_checkpoint(nodes: int) -> float:
    """Issue 12: history events per committed checkpoint, all histories together, at most 50 + N/10."""
    return 50 + nodes / 10


@dataclass(slots=True)
class Size:
    """The figures of one N."""

    nodes: int
    ranks_per_node: int = 8
    completed: bool = False
    wall_s: float | None = None
    events_total: int | None = None
    events_root: int | None = None
    events_per_checkpoint: dict[str, Any] = field(default_factory=dict)
    """`all`, `root`: marginal events per checkpoint (`method` says `marginal`, or `average` where no attempt
    committed twice)."""
    events_per_commit_avg: dict[str, float | None] = field(default_factory=dict)
    max_pending: int | None = None
    max_pending_execution: str | None = None
    largest_payload_bytes: int | None = None
    largest_payload_event: str | None = None
    relaunch_p95_s: float | None = None
    relaunch_max_s: float | None = None
    relaunch_p95_by_kind: dict[str, float | None] = field(default_factory=dict)
    """The same p95 for each kind of incident on its own (crash, hang, node_unresponsive): a hang's relaunch waits
    for its evidence, so it is told apart from the others'."""
    continue_as_new: int | None = None
    controller_cpu_s: float | None = None
    controller_peak_rss_mb: float | None = None
    server_cpu_s: float | None = None
    """The Temporal dev server's CPU seconds during the run."""
    standins_cpu_s: float | None = None
    """This process's (the stand-in nodes') CPU seconds during the run."""
    hang: dict[str, Any] = field(default_factory=dict)
    """The hang's incident (`hang` above)."""
    histories: int | None = None
    commits: int = 0
    incidents: list[str] = field(default_factory=list)
    activities: dict[str, int] = field(default_factory=dict)
    """Activities scheduled across all histories, by type."""
    workflow_task_failures: dict[str, int] = field(default_factory=dict)
    activity_troubles: dict[str, int] = field(default_factory=dict)
    """Activities that timed out or failed, by type and how."""
    start_wait_s: dict[str, float | None] = field(default_factory=dict)
    """p95 and max seconds from scheduled to started, node-pinned activities (`node_p95`, `node_max`: the
    stand-ins keeping up, or not) and the controller's (`controller_p95`, `controller_max`)."""
    stack_up_s: float | None = None
    queues: int | None = None
    """Shared queues the stand-ins were served on (`queues_for`)."""
    step_s: float | None = None
    """Simulated seconds per step (`step_s_for`)."""
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Plan:
    """What one run does: its spec and when its faults come."""

    nodes: list[str]
    spares: list[str]
    ranks_per_node: int
    every_steps: int
    final_step: int
    step_s: float
    crash_after: int
    """Commits before the rank crash."""
    hang_after: int
    """Commits before the hang (a rank stopped: every node's watch reports it with its ranks' evidence)."""
    down_after: int
    """Commits before the node-down."""

    @classmethod
    def of(cls, num_nodes: int, ranks_per_node: int, checkpoints: int, every_steps: int, step_s: float) -> Plan:
        return cls(nodes=[f"node-{i:04d}" for i in range(num_nodes)], spares=[f"spare-{i}" for i in range(NUM_SPARES)],
                   ranks_per_node=ranks_per_node, every_steps=every_steps,
                   final_step=every_steps * checkpoints + every_steps // 2, step_s=step_s,
                   crash_after=(crash := max(1, math.ceil(checkpoints / 3))),
                   hang_after=(hang := max(crash + 1, math.ceil(checkpoints / 2))),
                   down_after=max(hang + 1, math.ceil(2 * checkpoints / 3)))

    def spec(self) -> dict[str, Any]:
        return {
            "entrypoint": ["standin", "--steps", str(self.final_step), "--step-time", str(self.step_s)],
            "nodes": self.nodes,
            "spare_nodes": self.spares,
            "ranks_per_node": self.ranks_per_node,
            "checkpoint": {"every_steps": self.every_steps, "keep_last": 3, "prefix": "bench-nodes"},
        }

    @property
    def crash_node(self) -> str:
        return self.nodes[len(self.nodes) // 3]

    @property
    def hang_node(self) -> str:
        return self.nodes[len(self.nodes) // 2]

    @property
    def down_node(self) -> str:
        return self.nodes[(2 * len(self.nodes)) // 3]


# ------------------------------------------------------------------------------------ the controller


async def serve_controller(num_queues: int, commits_file: Path) -> None:
    """The controller worker as `workers.controller` builds it, with the stand-in store and shared queues."""
    import workers.controller as controller
    from infra.bench.standins import NodeRecords, StandinStore, install_routing
    from trainguard.connect import connect
    from workers.common import setup_logging, stop_event

    setup_logging("bench-controller")
    StandinStore.commits_file = commits_file
    StandinStore.records = NodeRecords(commits_file.parent / "records")
    controller.StoreActivities = StandinStore  # type: ignore[misc]
    install_routing(num_queues)
    client = await connect()
    stop = stop_event()
    async with controller.build_worker(client):
        await stop.wait()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process, from /proc (0 once it is gone)."""
    from trainguard.procs import stat_fields

    fields = stat_fields(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) * CLOCK_TICK_S


class Controller:
    """The controller subprocess: started, measured from /proc, stopped."""

    def __init__(self, home: Path, num_queues: int) -> None:
        self.log_path = home / "logs" / "bench-controller.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.commits_file = home / "commits.jsonl"
        self.commits_file.touch()
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(  # noqa: S603 - argv list
                [sys.executable, "-m", "infra.bench.nodes", "--serve-controller", "--queues", str(num_queues),
                 "--commits-file", str(self.commits_file)],
                cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def cpu_s(self) -> float:
        return cpu_s(self.proc.pid)

    def peak_rss_mb(self) -> float | None:
        with suppress(OSError):
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
        return None

    def commits(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.commits_file.read_text().splitlines() if line.strip()]

    def log_tail(self, lines: int = 15) -> list[str]:
        with suppress(OSError):
            return self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return []

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


async def wait_for_controller(client: Any, controller: Controller) -> None:
    from temporalio.api.enums.v1 import TaskQueueType

    from activities.nodes import has_pollers
    from trainguard import TASK_QUEUE

    deadline = time.monotonic() + CONTROLLER_READY_S
    while not await has_pollers(client, TASK_QUEUE, TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW, 30.0):
        if controller.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("controller did not start: " + " | ".join(controller.log_tail(5)))
        await asyncio.sleep(0.2)


async def wait_for_standins(client: Any, queues: list[str]) -> None:
    """Until every shared queue has a poller: the run's `find_node_agents` looks for them at once."""
    from temporalio.api.enums.v1 import TaskQueueType

    from activities.nodes import has_pollers

    deadline = time.monotonic() + CONTROLLER_READY_S
    waiting = list(queues)
    while waiting:
        waiting = [q for q in waiting
                   if not await has_pollers(client, q, TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY, 30.0)]
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"no stand-in polls {', '.join(waiting)}")
        await asyncio.sleep(0.2 if waiting else 0)


# -------------------------------------------------------------------------------------------- a run


async def seed_pool(client: Any, plan: Plan) -> None:
    """The node pool with every node and spare registered (as their agents would have on start), started packed
    as the pool continues as new: 4,098 nodes are 790 KB of plain JSON, over Temporal's 512 KB payload warning,
    and about 60 KB packed."""
    from trainguard import TASK_QUEUE
    from trainguard.models import PoolNode, PoolStatus
    from workflows.node_pool import POOL_WORKFLOW_ID, POOL_WORKFLOW_TYPE

    nodes = [PoolNode(node=n, host=f"{n}.sim", healthy=True) for n in [*plan.nodes, *plan.spares]]
    await client.start_workflow(POOL_WORKFLOW_TYPE, PoolStatus.pack(nodes), id=POOL_WORKFLOW_ID,
                                task_queue=TASK_QUEUE)


def stuck_reason(description: Any) -> str | None:
    pending = description.raw_description.pending_workflow_task
    if pending.attempt >= STUCK_ATTEMPTS:
        return (f"workflow task failed or timed out {pending.attempt - 1} times in a row "
                f"(causes in workflow_task_failures)")
    return None


async def drive(client: Any, plan: Plan, workflow_id: str, controller: Controller, size: Size,
                timeout_s: float) -> tuple[Any, list[Any]]:
    """Start the run, inject its faults on schedule, wait for it to end (or give up). Returns the result (None
    unless completed) and the incidents."""
    from temporalio.client import WorkflowFailureError, WorkflowUpdateFailedError

    from trainguard.client import TrainguardClient
    from trainguard.models import Phase, RunResult, RunStatus

    tg = TrainguardClient(client)
    await tg.start_run(plan.spec(), workflow_id=workflow_id)
    handle = client.get_workflow_handle(workflow_id, result_type=RunResult)
    result_task = asyncio.ensure_future(handle.result())
    deadline = time.monotonic() + timeout_s
    next_stuck_check = time.monotonic() + STUCK_CHECK_S
    faults = [("crash", plan.crash_node, plan.crash_after), ("hang", plan.hang_node, plan.hang_after),
              ("node-down", plan.down_node, plan.down_after)]
    crash_attempt: int | None = None
    while not result_task.done():
        if time.monotonic() > deadline:
            size.notes.append(f"not done within the timeout ({timeout_s:.0f}s)")
            break
        if time.monotonic() > next_stuck_check:
            next_stuck_check = time.monotonic() + STUCK_CHECK_S
            with suppress(Exception):
                reason = stuck_reason(await asyncio.wait_for(handle.describe(), 10))
                if reason:
                    size.notes.append(f"stuck: {reason}")
                    break
        if faults and len(controller.commits()) >= faults[0][2]:
            fault, node, _ = faults[0]
            try:
                status = await asyncio.wait_for(handle.query("status", result_type=RunStatus), 10)
                if status.phase is Phase.RUNNING and (crash_attempt is None or status.attempt > crash_attempt):
                    await asyncio.wait_for(tg.inject_fault(workflow_id, fault, node), FAULT_UPDATE_TIMEOUT_S)
                    log.info("%s on %s at attempt %d", fault, node, status.attempt)
                    crash_attempt = status.attempt
                    faults.pop(0)
            except WorkflowUpdateFailedError as error:  # refused (e.g. not running yet): try again
                log.info("%s on %s not injected yet: %s", fault, node, error)
            except Exception as error:  # noqa: BLE001 - a busy run may time the update out: note it, try again
                size.notes.append(f"{fault} on {node}: update not answered ({type(error).__name__}), retried")
        await asyncio.wait([result_task], timeout=TICK_S)
    if result_task.done():
        try:
            result = result_task.result()
        except WorkflowFailureError as error:
            size.notes.append(f"run failed: {error.cause or error}"[:300])
            result = None
    else:
        result_task.cancel()
        result = None
    incidents: list[Any] = []
    if result is not None:
        incidents = list(result.incidents)
        size.completed = result.steps_completed == plan.final_step
        if not size.completed:
            size.notes.append(f"finished at step {result.steps_completed}, not {plan.final_step}")
    else:
        with suppress(Exception):
            incidents = list((await asyncio.wait_for(handle.query("status", result_type=RunStatus), 15)).incidents)
    return result, incidents


async def executions(client: Any, workflow_id: str) -> list[tuple[str, str]]:
    """(workflow id, run id) of every execution whose workflow id starts with the run's."""
    found: list[tuple[str, str]] = []
    with suppress(Exception):
        async for execution in client.list_workflows(f"WorkflowId STARTS_WITH '{workflow_id}'"):
            found.append((execution.id, execution.run_id))
    if not found:
        async for execution in client.list_workflows(f"WorkflowId = '{workflow_id}'"):
            found.append((execution.id, execution.run_id))
    return found


async def read_histories(client: Any, workflow_id: str, save: Path | None = None) -> list[HistoryFigures]:
    """Every history of the run, each walked once as its pages arrive; children and continued runs found from the
    histories themselves too (visibility may lag)."""
    queue = await executions(client, workflow_id)
    seen: set[tuple[str, str]] = set()
    figures: list[HistoryFigures] = []
    while queue:
        key = queue.pop()
        if key in seen or not key[1]:
            continue
        seen.add(key)
        walked = HistoryFigures(workflow_id=key[0], run_id=key[1])
        async for event in client.get_workflow_handle(key[0], run_id=key[1]).fetch_history_events():
            walked.add(event)
        figures.append(walked)
        if save is not None:
            save.mkdir(parents=True, exist_ok=True)
            history = await client.get_workflow_handle(key[0], run_id=key[1]).fetch_history()
            (save / f"{key[0].replace('/', '%2F')}-{key[1]}.json").write_text(history.to_json())
        queue.extend(walked.children)
        if walked.next_run_id:
            queue.append((key[0], walked.next_run_id))
    return figures


async def terminate_all(client: Any, workflow_id: str) -> int:
    from temporalio.client import WorkflowExecutionStatus

    ended = 0
    for wid, rid in await executions(client, workflow_id):
        handle = client.get_workflow_handle(wid, run_id=rid)
        with suppress(Exception):
            if (await handle.describe()).status == WorkflowExecutionStatus.RUNNING:
                await handle.terminate("node-scale benchmark: run did not finish in time")
                ended += 1
    return ended


def relaunch_times(incidents: list[Any], workflow_id: str, nodes: Any) -> list[list[float]]:
    """Per recovered incident: for each node of the next attempt, seconds from detection to its launch."""
    per_incident = []
    for incident in incidents:
        if incident.action.value == "report" or not incident.detected_at:
            continue
        launched = nodes.launch_times(workflow_id, incident.attempt + 1)
        per_incident.append([max(0.0, at - incident.detected_at) for at in launched.values()])
    return per_incident


def summarize(size: Size, histories: list[HistoryFigures], workflow_id: str, commits: list[dict[str, Any]]) -> None:
    root = [h for h in histories if h.workflow_id == workflow_id]
    size.histories = len(histories)
    size.events_total = sum(h.events for h in histories)
    size.events_root = sum(h.events for h in root)
    size.commits = len(commits)
    marks = [(c["at"], c["attempt"]) for c in commits]
    size.events_per_commit_avg = {
        "all": round(size.events_total / len(commits), 1) if commits else None,
        "root": round(size.events_root / len(commits), 1) if commits else None}
    marginal = {"all": marginal_per_checkpoint(marks, histories), "root": marginal_per_checkpoint(marks, root)}
    if marginal["all"] is None:  # no two commits in one attempt (few checkpoints): the plain average it is
        size.events_per_checkpoint = {**size.events_per_commit_avg, "method": "average"}
    else:
        size.events_per_checkpoint = {**marginal, "method": "marginal"}
    if histories:
        worst = max(histories, key=lambda h: h.max_pending)
        size.max_pending, size.max_pending_execution = worst.max_pending, f"{worst.workflow_id} {worst.run_id}"
        biggest = max(histories, key=lambda h: h.largest_payload_bytes)
        size.largest_payload_bytes = biggest.largest_payload_bytes
        size.largest_payload_event = f"{biggest.workflow_id}: event {biggest.largest_payload_event}"
    size.continue_as_new = sum(h.continued_as_new for h in histories)
    from trainguard import TASK_QUEUE

    waits: dict[str, list[float]] = {"node": [], "controller": []}
    for h in histories:
        for queue, found in h.start_waits.items():
            waits["controller" if queue == TASK_QUEUE else "node"].extend(found)
    for side, found in waits.items():
        p95 = percentile(found, 0.95)
        size.start_wait_s[f"{side}_p95"] = None if p95 is None else round(p95, 3)
        size.start_wait_s[f"{side}_max"] = round(max(found), 3) if found else None
    for h in histories:
        for name, count in h.activity_counts.items():
            size.activities[name] = size.activities.get(name, 0) + count
        for cause, count in h.workflow_task_failures.items():
            size.workflow_task_failures[cause] = size.workflow_task_failures.get(cause, 0) + count
        for trouble, count in h.activity_troubles.items():
            size.activity_troubles[trouble] = size.activity_troubles.get(trouble, 0) + count


@asynccontextmanager
async def standin_workers(client: Any, nodes: Any, num_queues: int, per_queue: int) -> AsyncIterator[None]:
    """A worker per shared queue serving the stand-in nodes' activities, polled before it yields."""
    from temporalio.worker import Worker

    from infra.bench.standins import shared_queues

    async with AsyncExitStack() as workers:
        for queue in shared_queues(num_queues):
            await workers.enter_async_context(Worker(
                client, task_queue=queue, activities=nodes.activities(),
                max_concurrent_activities=max(200, 8 * per_queue),
                max_concurrent_activity_task_polls=min(MAX_POLLS_PER_QUEUE, 5 * per_queue,
                                                       max(1, NAMESPACE_POLLS // num_queues)),
                max_heartbeat_throttle_interval=STANDIN_HEARTBEAT_INTERVAL,
                default_heartbeat_throttle_interval=STANDIN_HEARTBEAT_INTERVAL,
                graceful_shutdown_timeout=timedelta(seconds=1)))
        await wait_for_standins(client, shared_queues(num_queues))
        yield


async def measure(size: Size, plan: Plan, home: Path, num_queues: int, timeout_s: float, server_pid: int,
                  save_histories: Path | None = None) -> None:
    from infra.bench.standins import NodeRecords, StandinNodes, install_routing
    from trainguard.connect import connect

    install_routing(num_queues)
    client = await connect()
    await seed_pool(client, plan)
    controller = Controller(home, num_queues)
    workflow_id = f"bench-nodes-{secrets.token_hex(3)}-n{len(plan.nodes)}"
    nodes = StandinNodes(runs=[workflow_id], records=NodeRecords(controller.commits_file.parent / "records"))
    per_queue = math.ceil((len(plan.nodes) + len(plan.spares)) / num_queues)
    try:
        await wait_for_controller(client, controller)
        async with standin_workers(client, nodes, num_queues, per_queue):
            cpu_before, began = (controller.cpu_s(), cpu_s(server_pid), cpu_s(os.getpid())), time.monotonic()
            _, incidents = await drive(client, plan, workflow_id, controller, size, timeout_s)
            size.wall_s = round(time.monotonic() - began, 2)
            size.controller_cpu_s = round(controller.cpu_s() - cpu_before[0], 2)
            size.server_cpu_s = round(cpu_s(server_pid) - cpu_before[1], 2)
            size.standins_cpu_s = round(cpu_s(os.getpid()) - cpu_before[2], 2)
            size.controller_peak_rss_mb = controller.peak_rss_mb()
            if not size.completed:
                ended = await terminate_all(client, workflow_id)
                if ended:
                    size.notes.append(f"terminated {ended} execution(s) still running")
                size.notes.append(f"controller log: {BENCH_DIR.name}/nodes-logs/n{len(plan.nodes)}/"
                                  f"{controller.log_path.name}")
        size.incidents = [f"{i.kind.value} on {i.node} (attempt {i.attempt}): {i.action.value}; {i.detail}"[:240]
                          for i in incidents]
        per_incident = relaunch_times(incidents, workflow_id, nodes)
        every = [s for times in per_incident for s in times]
        p95 = percentile(every, 0.95)
        size.relaunch_p95_s = None if p95 is None else round(p95, 3)
        size.relaunch_max_s = round(max(every), 3) if every else None
        for kind in dict.fromkeys(i.kind.value for i in incidents):
            alone = percentile([s for times in relaunch_times([i for i in incidents if i.kind.value == kind],
                                                              workflow_id, nodes) for s in times], 0.95)
            size.relaunch_p95_by_kind[kind] = None if alone is None else round(alone, 3)
        commits = [c for c in controller.commits() if str(c.get("workflow_id", "")).startswith(workflow_id)]
        summarize(size, await read_histories(client, workflow_id, save_histories), workflow_id, commits)
        size.hang = hang_figures(incidents, plan, relaunch_times([i for i in incidents if i.kind.value == "hang"],
                                                                 workflow_id, nodes), size.activities)
    finally:
        controller.stop()


def hang_figures(incidents: list[Any], plan: Plan, relaunch: list[list[float]],
                 activities: dict[str, int]) -> dict[str, Any]:
    """The hang's incident: whom it named (against the rank the benchmark stopped), how soon, how many nodes the
    run had to ask for evidence, and its own relaunch."""
    hang = next((i for i in incidents if i.kind.value == "hang"), None)
    if hang is None:
        return {"note": "no hang incident"}
    stopped = (plan.hang_node, plan.nodes.index(plan.hang_node) * plan.ranks_per_node)
    times = [s for per in relaunch for s in per]
    p95 = percentile(times, 0.95)
    return {"culprit": f"rank {hang.rank} on {hang.node}", "culprit_right": (hang.node, hang.rank) == stopped,
            "attribution_s": hang.attribution_s, "detection_s": hang.detection_s,
            "evidence_asked_of_nodes": activities.get("collect_evidence", 0),
            "relaunch_p95_s": None if p95 is None else round(p95, 3),
            "relaunch_max_s": round(max(times), 3) if times else None, "evidence": (hang.evidence or "")[:200]}


def queues_for(num_nodes: int, asked: int | None) -> int:
    """`--queues` if given, else a shared queue per `NODES_PER_QUEUE` nodes, 16 to `MAX_QUEUES`."""
    return asked if asked is not None else min(MAX_QUEUES, max(16, math.ceil(num_nodes / NODES_PER_QUEUE)))


def step_s_for(num_nodes: int, asked: float) -> float:
    """`--step-time`, longer in proportion past `LARGE_RUN_NODES` nodes."""
    return round(asked * max(1.0, num_nodes / LARGE_RUN_NODES), 4)


def run_size(num_nodes: int, opts: argparse.Namespace) -> Size:
    from infra.bench.stack import private_stack

    size = Size(nodes=num_nodes, ranks_per_node=opts.ranks_per_node)
    plan = Plan.of(num_nodes, opts.ranks_per_node, opts.checkpoints, opts.every_steps,
                   step_s_for(num_nodes, opts.step_time))
    size.queues = queues = queues_for(num_nodes, opts.queues)
    size.step_s = plan.step_s
    timeout_s = opts.timeout_s if opts.timeout_s is not None else 120 + 0.15 * num_nodes
    timings: dict[str, float] = {}
    logs = BENCH_DIR / "nodes-logs" / f"n{num_nodes}"
    shutil.rmtree(logs, ignore_errors=True)
    with private_stack("nodes", (), PORT_SEARCH_START, timings=timings, temporal_only=True, keep_logs=logs,
                       temporal_args=SERVER_ARGS) as stack:
        size.stack_up_s = timings.get("stack_up_s")
        server_pid = json.loads((stack.run_dir / "temporal.json").read_text())["pid"]
        asyncio.run(measure(size, plan, stack.home, queues, timeout_s, server_pid, opts.save_histories))
    return size


# ------------------------------------------------------------------------------------------- report


def _fmt(value: float | int | None, pattern: str = "{:.0f}") -> str:
    return "-" if value is None else pattern.format(value)


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("pass" if ok else "FAIL")


def targets(size: Size) -> dict[str, bool | None]:
    per_checkpoint = size.events_per_checkpoint.get("all")
    return {
        "completed": size.completed,
        "max_pending": None if size.max_pending is None else size.max_pending <= TARGET_PENDING,
        "events_per_checkpoint": None if per_checkpoint is None
        else per_checkpoint <= target_events_per_checkpoint(size.nodes),
        "payload": None if size.largest_payload_bytes is None else size.largest_payload_bytes <= TARGET_PAYLOAD_BYTES,
        "relaunch_p95": None if size.relaunch_p95_s is None else size.relaunch_p95_s <= TARGET_RELAUNCH_P95_S,
    }


def report(sizes: list[Size]) -> list[str]:
    lines = [f"{'nodes':>5} {'done':>4} {'wall_s':>7} {'events all/root':>15} {'ev/ckpt all/root':>16} "
             f"{'avg/ckpt':>8} {'pending':>7} {'payload_KB':>10} {'relaunch p95/max':>16} {'CAN':>3} "
             f"{'commits':>7} {'ctl_cpu_s':>9} {'ctl_MB':>6}"]
    for s in sizes:
        per = s.events_per_checkpoint
        lines.append(
            f"{s.nodes:>5} {'yes' if s.completed else 'NO':>4} {_fmt(s.wall_s, '{:.1f}'):>7} "
            f"{_fmt(s.events_total) + ' / ' + _fmt(s.events_root):>15} "
            f"{_fmt(per.get('all'), '{:.0f}') + ' / ' + _fmt(per.get('root'), '{:.0f}'):>16} "
            f"{_fmt(s.events_per_commit_avg.get('all')):>8} {_fmt(s.max_pending):>7} "
            f"{_fmt(None if s.largest_payload_bytes is None else s.largest_payload_bytes / 1024, '{:.1f}'):>10} "
            f"{_fmt(s.relaunch_p95_s, '{:.2f}') + ' / ' + _fmt(s.relaunch_max_s, '{:.2f}'):>16} "
            f"{_fmt(s.continue_as_new):>3} {s.commits:>7} {_fmt(s.controller_cpu_s, '{:.1f}'):>9} "
            f"{_fmt(s.controller_peak_rss_mb):>6}")
    lines += ["", "issue 12 targets: pending <= 1000, events/checkpoint (all) <= 50 + N/10, payload <= 256 KB, "
              "relaunch p95 <= 15 s",
              f"{'nodes':>5} {'completed':>9} {'pending':>16} {'events/ckpt':>22} {'payload':>18} {'relaunch':>16}"]
    for s in sizes:
        ok = targets(s)
        per = s.events_per_checkpoint.get("all")
        lines.append(
            f"{s.nodes:>5} {_verdict(ok['completed']):>9} "
            f"{_fmt(s.max_pending) + ' <= 1000 ' + _verdict(ok['max_pending']):>16} "
            f"{_fmt(per) + ' <= ' + _fmt(target_events_per_checkpoint(s.nodes)) + ' ' + _verdict(ok['events_per_checkpoint']):>22} "
            f"{_fmt(None if s.largest_payload_bytes is None else s.largest_payload_bytes / 1024, '{:.0f}KB') + ' <= 256KB ' + _verdict(ok['payload']):>18} "
            f"{_fmt(s.relaunch_p95_s, '{:.1f}s') + ' <= 15s ' + _verdict(ok['relaunch_p95']):>16}")
    for s in sizes:
        h = s.hang or {"note": "not measured"}
        lines.append(f"  {s.nodes}: hang: " + (h.get("note") or (
            f"named {h['culprit']} ({'right' if h['culprit_right'] else 'WRONG'}) in {_fmt(h['attribution_s'])} s, "
            f"evidence asked of {h['evidence_asked_of_nodes']} node(s), relaunch p95 "
            f"{_fmt(h['relaunch_p95_s'])} s / max {_fmt(h['relaunch_max_s'])} s")))
        if s.relaunch_p95_by_kind:
            lines.append(f"  {s.nodes}: relaunch p95 by incident: " + ", ".join(
                f"{kind} {_fmt(p95, '{:.1f}')} s" for kind, p95 in s.relaunch_p95_by_kind.items()))
        for note in [*s.incidents, *s.notes]:
            lines.append(f"  {s.nodes}: {note}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=list(DEFAULT_NODES),
                        help="sizes to run, in nodes (default 16 256 1024 4096)")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="ranks per node (default 8)")
    parser.add_argument("--checkpoints", type=int, default=6, help="checkpoints the run commits (default 6)")
    parser.add_argument("--every-steps", type=int, default=60, help="steps between checkpoints (default 60)")
    parser.add_argument("--step-time", type=float, default=0.05,
                        help="simulated seconds per step (default 0.05; x N/1,024 past 1,024 nodes)")
    parser.add_argument("--queues", type=int, default=None, help="shared task queues the nodes are routed onto "
                                                                  "(default one per 16 nodes, 16 to 64)")
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="give up on a size after this long (default 120 + 0.15 s per node)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    parser.add_argument("--save-histories", type=Path, default=None,
                        help="write every history of each run here as JSON (to replay or profile it)")
    parser.add_argument("--serve-controller", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--commits-file", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.serve_controller:
        asyncio.run(serve_controller(queues_for(0, opts.queues), opts.commits_file))
        return 0
    if min(opts.nodes) < 3 or max(opts.nodes) > 4096:
        parser.error("--nodes: each size between 3 and 4096 (the spec's limit)")
    if opts.checkpoints < 2:
        parser.error("--checkpoints must be at least 2 (a crash and a lost node come between them)")
    if opts.queues is not None and not 1 <= opts.queues <= 100:
        parser.error("--queues must be between 1 and 100")

    from infra.bench.recovery_report import say, write_results

    # A SIGTERM (a CI job's timeout, `kill PID`) stops it as Ctrl-C does: the run's private Temporal server and
    # controller are stopped by PID and its folder under .bench removed, not left running.
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # A lost node's calls are cancelled when Temporal gives up on them: expected here, not worth a traceback.
    logging.getLogger("temporalio.activity").setLevel(logging.ERROR)
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    say(f"node-scale benchmark: {opts.nodes} nodes x {opts.ranks_per_node} ranks, {opts.checkpoints} checkpoints "
        f"every {opts.every_steps} steps of {opts.step_time}s, a crash, a hang and a lost node; {os.cpu_count()} CPUs, "
        f"load {load_before[0]:.2f}")
    say(f"queues: node activities routed onto {opts.queues or 'one per 16 nodes (16 to 64)'} shared queues by crc32(node) % "
        f"queues (trainguard.node_task_queue replaced in the controller and the stand-ins' process); an "
        f"activity's Temporal cost does not depend on its queue")
    sizes = []
    for count in opts.nodes:
        say(f"{count} nodes:")
        try:
            size = run_size(count, opts)
        except Exception as error:  # noqa: BLE001 - one failed size must not lose the others
            size = Size(nodes=count, ranks_per_node=opts.ranks_per_node, notes=[f"error: {error!r}"[:300]])
        say("  " + report([size])[1].strip())
        sizes.append(size)
    lines = report(sizes)
    say("")
    for line in lines:
        say(line)
    write_results(opts.json, [asdict(s) for s in sizes])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
