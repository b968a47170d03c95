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
The processes it runs live in `infra/bench/nodes_processes.py`, its figures and report in
`infra/bench/nodes_report.py`.
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
import time
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from infra.bench.history import percentile
from infra.bench.nodes_processes import (SERVER_ARGS, Controller, cpu_s, read_histories, seed_pool, serve_controller,
                                         standin_workers, terminate_all, wait_for_controller)
from infra.bench.nodes_report import Size, hang_figures, relaunch_times, report, summarize

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

FAULT_UPDATE_TIMEOUT_S = 60.0

log = logging.getLogger("trainguard.bench.nodes")


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



# -------------------------------------------------------------------------------------------- a run



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





async def measure(size: Size, plan: Plan, home: Path, num_queues: int, timeout_s: float, server_pid: int,
                  save_histories: Path | None = None) -> None:
    from infra.bench.standins import NodeRecords, StandinNodes, install_routing
    from trainguard.connect import connect

    install_routing(num_queues)
    client = await connect()
    await seed_pool(client, [*plan.nodes, *plan.spares])
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
