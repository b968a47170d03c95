"""The node pool at size: one lease of 4,096 nodes, and 100 runs started at once, on the real workflows.

    python -m infra.bench.pool [--runs 100] [--nodes-per-run 2] [--lease 4096] [--timeout-s 300]
                               [--json .bench/pool.json]

A private Temporal dev server (`infra/bench/stack.py`, Temporal only), and on it, as `infra/bench/nodes.py`
sets them up (imported from there): the controller worker in its own process (the real `TrainingRun` and
`NodePool` workflows and the real controller activities, the store's stood in), and stand-ins for every
node-pinned activity served from this process on a few shared queues. The pool is started with
max(`--lease`, runs x nodes per run) nodes registered.

1. The lease: one `acquire` update of `--lease` named nodes on the pool, then its release, then the same count
   by `num_nodes`; each timed from the client.
2. The start-up: `--runs` TrainingRuns started at once (the start requests all in flight together), each on
   `--nodes-per-run` nodes of its own, by name (`--by-count`: by `num_nodes`). A run is training once every
   node of its first attempt has launched (the stand-ins' rendezvous), and its time to training is from the
   moment the starts were sent. p50 / p95 / max over the runs; a run not training by the timeout counts as
   missing.
3. The pool's cost: its history events and continue-as-new count, over every execution of `trainguard-node-pool`.

A benchmark, not a test: it prints a table and writes `.bench/pool.json`, never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infra.bench.history import percentile
from infra.bench.nodes import Plan
from infra.bench.nodes_processes import (SERVER_ARGS, Controller, seed_pool, standin_workers, terminate_all,
                                         wait_for_controller)

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / ".bench"
DEFAULT_JSON = BENCH_DIR / "pool.json"
PORT_SEARCH_START = 38000
TARGET_TRAINING_S = 60.0
"""Issue 12: 100 runs started at once all training within 60 s here."""
RUN_STEPS = 40
STEP_S = 0.05
"""Each run trains 2 s and ends: what is measured is its start, not its training."""
POLL_S = 0.25


@dataclass(slots=True)
class Figures:
    runs: int
    nodes_per_run: int
    by_count: bool
    pool_nodes: int = 0
    lease_nodes: int = 0
    lease_s: float | None = None
    """One `acquire` update of `lease_nodes` named nodes, from the client."""
    release_s: float | None = None
    lease_by_count_s: float | None = None
    """The same count by `num_nodes`."""
    lease_granted: bool = False
    training_s: list[float] = field(default_factory=list)
    """Per run that trained: seconds from the starts to its first attempt's rendezvous."""
    training_p50_s: float | None = None
    training_p95_s: float | None = None
    training_max_s: float | None = None
    leased_p50_s: float | None = None
    leased_p95_s: float | None = None
    leased_max_s: float | None = None
    """Per run, from the starts to its `acquire_nodes` completing (its history's own clock): how much of the
    time to training is the pool's."""
    lease_attempts_max: int = 0
    """The most attempts any run's `acquire_nodes` took (a timeout or a retried error each)."""
    trained: int = 0
    completed: int = 0
    pool_events: int = 0
    pool_updates: int = 0
    pool_continue_as_new: int = 0
    wall_s: float | None = None
    controller_cpu_s: float | None = None
    """CPU seconds the controller process used over `wall_s`: near `wall_s` x its share of the cores, the
    controller's CPU is what the runs wait for, not the pool."""
    load_avg_1m: float | None = None
    """The machine's 1-minute load average when the runs were started (other work on the same cores)."""
    notes: list[str] = field(default_factory=list)


def spec_of(nodes: list[str], by_count: bool) -> dict[str, Any]:
    where: dict[str, Any] = {"num_nodes": len(nodes)} if by_count else {"nodes": nodes}
    return {"entrypoint": ["standin", "--steps", str(RUN_STEPS), "--step-time", str(STEP_S)], **where,
            "ranks_per_node": 1, "checkpoint": {"every_steps": 20, "keep_last": 1, "prefix": "bench-pool"}}


async def time_lease(client: Any, figures: Figures, names: list[str]) -> None:
    from activities.nodes import pool_update
    from trainguard.models import AcquireNodesRequest, AcquireNodesResult, NodeRequest

    began = time.monotonic()
    lease = await pool_update(client, "acquire", AcquireNodesRequest(run_id="bench-lease", nodes=names),
                              AcquireNodesResult)
    figures.lease_s = round(time.monotonic() - began, 3)
    figures.lease_granted = lease.granted
    began = time.monotonic()
    await pool_update(client, "release", NodeRequest(run_id="bench-lease"), list[str])
    figures.release_s = round(time.monotonic() - began, 3)
    began = time.monotonic()
    by_count = await pool_update(client, "acquire", AcquireNodesRequest(run_id="bench-lease-count", nodes=[],
                                                                         num_nodes=len(names)), AcquireNodesResult)
    figures.lease_by_count_s = round(time.monotonic() - began, 3)
    if not by_count.granted:
        figures.notes.append(f"lease by count not granted: {by_count.unsatisfiable or by_count.busy}")
    await pool_update(client, "release", NodeRequest(run_id="bench-lease-count"), list[str])


async def start_runs(client: Any, figures: Figures, names: list[str], stand_ins: Any, run_ids: list[str],
                     timeout_s: float) -> None:
    from temporalio.client import WorkflowExecutionStatus

    from trainguard import TASK_QUEUE, WORKFLOW_TYPE

    k = figures.nodes_per_run
    began = time.time()
    await asyncio.gather(*(client.start_workflow(WORKFLOW_TYPE, spec_of(names[i * k:(i + 1) * k], figures.by_count),
                                                 id=rid, task_queue=TASK_QUEUE) for i, rid in enumerate(run_ids)))
    deadline = time.monotonic() + timeout_s
    started: dict[str, float] = {}
    while len(started) < len(run_ids) and time.monotonic() < deadline:
        for rid in run_ids:
            attempt = stand_ins.attempts.get((rid, 1))
            if rid not in started and attempt is not None and attempt.started_at is not None:
                started[rid] = attempt.started_at - began
        await asyncio.sleep(POLL_S)
    figures.training_s = sorted(round(s, 3) for s in started.values())
    await lease_times(client, figures, run_ids, began)
    figures.trained = len(started)
    if started:
        figures.training_p50_s = round(percentile(figures.training_s, 0.5) or 0, 3)
        figures.training_p95_s = round(percentile(figures.training_s, 0.95) or 0, 3)
        figures.training_max_s = figures.training_s[-1]
    if len(started) < len(run_ids):
        figures.notes.append(f"{len(run_ids) - len(started)} runs not training within {timeout_s:.0f}s")
    while time.monotonic() < deadline + 60:
        statuses = [(await client.get_workflow_handle(rid).describe()).status for rid in run_ids]
        figures.completed = sum(s == WorkflowExecutionStatus.COMPLETED for s in statuses)
        if all(s != WorkflowExecutionStatus.RUNNING for s in statuses):
            break
        await asyncio.sleep(1.0)


async def lease_times(client: Any, figures: Figures, run_ids: list[str], began: float) -> None:
    """From each run's history: when its lease came back, and in how many attempts."""
    done: list[float] = []
    for rid in run_ids:
        scheduled: set[int] = set()
        async for event in client.get_workflow_handle(rid).fetch_history_events():
            if event.HasField("activity_task_scheduled_event_attributes") and \
                    event.activity_task_scheduled_event_attributes.activity_type.name == "acquire_nodes":
                scheduled.add(event.event_id)
            elif event.HasField("activity_task_started_event_attributes") and \
                    event.activity_task_started_event_attributes.scheduled_event_id in scheduled:
                figures.lease_attempts_max = max(figures.lease_attempts_max,
                                                 event.activity_task_started_event_attributes.attempt)
            elif event.HasField("activity_task_completed_event_attributes") and \
                    event.activity_task_completed_event_attributes.scheduled_event_id in scheduled:
                done.append(event.event_time.ToDatetime().timestamp() - began)
                break
    done.sort()
    if done:
        figures.leased_p50_s = round(percentile(done, 0.5) or 0, 3)
        figures.leased_p95_s = round(percentile(done, 0.95) or 0, 3)
        figures.leased_max_s = round(done[-1], 3)


async def pool_cost(client: Any, figures: Figures) -> None:
    from trainguard import POOL_WORKFLOW_ID

    runs = [e.run_id async for e in client.list_workflows(f"WorkflowId = '{POOL_WORKFLOW_ID}'")]
    for run_id in runs:
        async for event in client.get_workflow_handle(POOL_WORKFLOW_ID, run_id=run_id).fetch_history_events():
            figures.pool_events += 1
            figures.pool_updates += event.HasField("workflow_execution_update_accepted_event_attributes")
    figures.pool_continue_as_new = max(0, len(runs) - 1)


async def measure(figures: Figures, home: Path, num_queues: int, timeout_s: float) -> None:
    from infra.bench.standins import NodeRecords, StandinNodes, install_routing
    from trainguard.connect import connect

    install_routing(num_queues)
    client = await connect()
    plan = Plan.of(figures.pool_nodes, 1, 1, 20, STEP_S)
    await seed_pool(client, [*plan.nodes, *plan.spares])
    controller = Controller(home, num_queues)
    tag = secrets.token_hex(3)
    run_ids = [f"bench-pool-{tag}-{i:03d}" for i in range(figures.runs)]
    stand_ins = StandinNodes(runs=run_ids, records=NodeRecords(controller.commits_file.parent / "records"))
    per_queue = math.ceil(figures.pool_nodes / num_queues)
    try:
        await wait_for_controller(client, controller)
        async with standin_workers(client, stand_ins, num_queues, per_queue):
            began, cpu_before = time.monotonic(), controller.cpu_s()
            figures.load_avg_1m = round(os.getloadavg()[0], 1)
            if figures.lease_nodes:
                await time_lease(client, figures, plan.nodes[:figures.lease_nodes])
            await start_runs(client, figures, plan.nodes, stand_ins, run_ids, timeout_s)
            figures.wall_s = round(time.monotonic() - began, 2)
            figures.controller_cpu_s = round(controller.cpu_s() - cpu_before, 2)
            ended = sum([await terminate_all(client, rid) for rid in run_ids if figures.completed < figures.runs])
            if ended:
                figures.notes.append(f"terminated {ended} run(s) still running")
        await pool_cost(client, figures)
    finally:
        controller.stop()


def run(opts: argparse.Namespace) -> Figures:
    from infra.bench.stack import private_stack

    figures = Figures(runs=opts.runs, nodes_per_run=opts.nodes_per_run, by_count=opts.by_count,
                      pool_nodes=max(opts.lease, opts.runs * opts.nodes_per_run), lease_nodes=opts.lease)
    logs = BENCH_DIR / "pool-logs"
    with private_stack("pool", (), PORT_SEARCH_START + int(os.environ.get("TRAINGUARD_PORT_SEARCH_OFFSET", "0")),
                       temporal_only=True, keep_logs=logs, temporal_args=SERVER_ARGS) as stack:
        asyncio.run(measure(figures, stack.home, opts.queues, opts.timeout_s))
    return figures


def report(figures: Figures) -> list[str]:
    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    ok = figures.trained == figures.runs and (figures.training_max_s or math.inf) <= TARGET_TRAINING_S
    how = "by num_nodes" if figures.by_count else "by name"
    return [
        "| figure | value | target |",
        "|---|---|---|",
        f"| one lease of {figures.lease_nodes} named nodes (s) | {fmt(figures.lease_s)} "
        f"({'granted' if figures.lease_granted else 'NOT granted'}) | works |",
        f"| its release (s) | {fmt(figures.release_s)} | |",
        f"| one lease of {figures.lease_nodes} nodes by num_nodes (s) | {fmt(figures.lease_by_count_s)} | works |",
        f"| {figures.runs} runs x {figures.nodes_per_run} nodes ({how}) training | {figures.trained} of "
        f"{figures.runs} | all |",
        f"| start to training p50 / p95 / max (s) | {fmt(figures.training_p50_s)} / {fmt(figures.training_p95_s)} / "
        f"{fmt(figures.training_max_s)} | max <= {TARGET_TRAINING_S:.0f} ({'pass' if ok else 'FAIL'}) |",
        f"| start to lease p50 / p95 / max (s) | {fmt(figures.leased_p50_s)} / {fmt(figures.leased_p95_s)} / "
        f"{fmt(figures.leased_max_s)} (most attempts of a lease: {figures.lease_attempts_max}) | |",
        f"| runs completed | {figures.completed} | |",
        f"| pool history events / updates / continue-as-new | {figures.pool_events} / {figures.pool_updates} / "
        f"{figures.pool_continue_as_new} | |",
        f"| controller CPU (s) over wall (s); load average at start | {fmt(figures.controller_cpu_s)} over "
        f"{fmt(figures.wall_s)}; {fmt(figures.load_avg_1m)} | |",
        *(f"note: {n}" for n in figures.notes),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--nodes-per-run", type=int, default=2)
    parser.add_argument("--lease", type=int, default=4096, help="nodes in the single big lease (0: skip it)")
    parser.add_argument("--by-count", action="store_true", help="runs ask for num_nodes instead of naming nodes")
    parser.add_argument("--queues", type=int, default=8, help="shared queues the stand-in nodes poll")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    opts = parser.parse_args(argv)
    figures = run(opts)
    print("\n".join(report(figures)))
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(asdict(figures), indent=2))
    print(f"wrote {opts.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
