"""The node-scale benchmark's processes and plumbing (`infra/bench/nodes.py`, `infra/bench/pool.py`): the controller
subprocess, the stand-in nodes' workers on shared queues, the node pool seeded with every node, and the run's
histories read back (or its executions terminated) when it is over.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

from infra.bench.history import HistoryFigures

REPO = Path(__file__).resolve().parents[2]
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
MAX_POLLS_PER_QUEUE = 20
"""Activity polls a shared queue's worker keeps open: as many as its nodes' agents would (5 each, the SDK's
default), up to this. A burst of one activity per node (a watch each after a checkpoint) must start well within
the node-pinned schedule-to-start timeout (10 s); `start_wait_s` shows whether it did. Measured here at 64
nodes: 5 polls a queue, node activities waited up to 5.3 s to start; 20, up to 1.2 s; 50 (at 256 nodes) loads
the dev server more and helps nothing."""
CLOCK_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


async def serve_controller(num_queues: int, commits_file: Path) -> None:
    """The controller worker as `workers.controller` builds it, with the stand-in store and shared queues."""
    import workers.controller as controller
    from infra.bench.standins import NodeRecords, StandinStore, install_routing
    from trainguard.connect import connect
    from trainguard.settings import Settings
    from workers.common import setup_logging, stop_event

    setup_logging("bench-controller")
    StandinStore.commits_file = commits_file
    StandinStore.records = NodeRecords(commits_file.parent / "records")
    controller.StoreActivities = StandinStore  # type: ignore[misc]
    install_routing(num_queues)
    client = await connect()
    stop = stop_event()
    async with controller.build_worker(client):
        await controller.take_first_version(client, controller.deployment_config(Settings.from_env()))
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
            self.proc = subprocess.Popen(  # argv list
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



async def seed_pool(client: Any, nodes: list[str]) -> None:
    """The node pool with every node and spare registered (as their agents would have on start), started packed
    as the pool continues as new: 4,098 nodes are 790 KB of plain JSON, over Temporal's 512 KB payload warning,
    and about 60 KB packed."""
    from trainguard import TASK_QUEUE
    from trainguard.models import PoolNode, PoolStatus
    from trainguard import POOL_WORKFLOW_ID, POOL_WORKFLOW_TYPE

    registered = [PoolNode(node=n, host=f"{n}.sim", healthy=True) for n in nodes]
    await client.start_workflow(POOL_WORKFLOW_TYPE, PoolStatus.pack(registered), id=POOL_WORKFLOW_ID,
                                task_queue=TASK_QUEUE)



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
