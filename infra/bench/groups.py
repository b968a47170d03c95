"""Replica groups under faults (issue 42): the healthy groups' longest step gap while one group recovers, the
failed group's time back, and goodput with groups against the same job without them, in one run.

What it simulates: examples/ft.json's shape (3 replica groups of 1 node x 2 ranks under TorchFT) on stand-in nodes
(node agents on this machine, one per node, as the dev stack runs them), one spare per group. Five faults, one
after the other, each in one group and each through the path a real one takes: a rank SIGKILLed (crash), a
rank SIGSTOPped (hang), an XID through the stand-in NVML (gpu, infra/bench/nvml_standin), the node's agent and
ranks gone (node-down), a rank stopped half the time (slow: a straggler). The same five hit the same job without
groups (examples/train.py, 3 nodes x 2 ranks of DDP: every fault relaunches every rank). The cold-start floor is
bench-recovery's: the job started cold by plain torchrun from a local checkpoint.

    python -m infra.bench.groups [--steps 300] [--step-time 0.5]     (.bench/groups.json)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infra.bench.recovery_report import BENCH_DIR, fmt, machine, say

DEFAULT_JSON = BENCH_DIR / "groups.json"
PORT_SEARCH_START = 33000
NODES = ("node-0", "node-1", "node-2")
SPARES = ("node-3", "node-4", "node-5")
FAULTS = ("crash", "hang", "gpu", "node-down", "slow")
"""In this order, fault i in group i % 3: each fault that takes a spare (gpu, node-down, slow) in another group."""
INCIDENT_KINDS = {"crash": "crash", "hang": "hang", "gpu": "gpu_unhealthy", "node-down": "node_unresponsive",
                  "slow": "straggler"}
SLOW_DUTY = 0.5
SETTLE_S = 5.0
"""After a group is back, the run steps this long before the next fault: each window holds one fault."""
HEALTH: dict[str, Any] = {}
"""Both runs judge pace by the defaults (10 s windows, a straggler replaced after two slow ones in a row). A 10 s
window holds five of a 2x-slowed rank's 1 s steps: a window reaches back to a rank's newest ten
(`activities.pace.MIN_SAMPLES`), without which no straggler was found at this step time."""
RESTARTS = {"max_restarts_without_checkpoint": 10}
"""Five faults come faster than checkpoints here: the default 3 stopped the run without groups (3 relaunches in a
row with no new commit), which is a budget, not a recovery, to compare."""
STEP_LINE = re.compile(r"^step (\d+) at ([\d.]+)$", re.MULTILINE)
DIGEST_LINE = re.compile(r"finished \d+ steps, loss \S+, digest (\w+)")


def rank_logs(home: Path, run_id: str, group: int) -> dict[tuple[str, int], list[str]]:
    """(node, attempt) -> the text of each rank's log there, for one group's run (a stack's node folders)."""
    found: dict[tuple[str, int], list[str]] = {}
    for log in sorted(home.glob(f"nodes/*/runs/{run_id}-group-{group}/attempt-*/logs/rank-*.log")):
        node, attempt = log.parents[4].name, int(log.parents[1].name.split("-")[1])
        found.setdefault((node, attempt), []).append(log.read_text(errors="replace"))
    return found


def steps(text: str) -> list[tuple[int, float]]:
    """Each `step N at T` line a rank of examples/train_ft.py --log-steps printed."""
    return [(int(step), float(at)) for step, at in STEP_LINE.findall(text)]


@dataclass
class GroupFault:
    fault: str
    group: int
    node: str
    injected_at: float = 0.0
    detected_at: float | None = None
    detection_s: float | None = None
    back_s: float | None = None
    """From the incident's detection to the group's first step in its new attempt (the incident's recovery_s)."""
    healthy_gap_s: float | None = None
    """The longest time any rank of the other groups went without a step during the recovery: from the fault's
    detection to the group's return (a pause under way at detection counts from detection)."""
    undetected_gap_s: float | None = None
    """...and before it, from the injection to the detection: a straggler holds every group to its pace until it
    is found (synchronous training), a hang or a lost node until TorchFT's timeout drops its group. A pause that
    spans the detection is split at it: a 2x straggler's step under way when it is found is 2x by itself."""
    healthy_step_s: float | None = None
    """The other groups' median step time over the same window."""
    gap_ratio: float | None = None
    note: str = ""


@dataclass
class GroupsRun:
    system: str
    workflow_id: str = ""
    completed: bool = False
    goodput: float | None = None
    wall_s: float | None = None
    attempts: int | None = None
    faults: list[GroupFault] = field(default_factory=list)
    incidents: list[str] = field(default_factory=list)
    note: str = ""


def group_spec(opts: argparse.Namespace, prefix: str) -> dict[str, Any]:
    return {
        "entrypoint": ["python", "examples/train_ft.py", "--steps", str(opts.steps), "--step-time",
                       f"{opts.step_time:g}", "--log-steps", "--pg-timeout-s", f"{opts.heartbeat_timeout:g}"],
        "nodes": list(NODES), "spare_nodes": list(SPARES), "ranks_per_node": 2,
        "replica_groups": {"groups": 3, "heartbeat_timeout_s": opts.heartbeat_timeout},
        "checkpoint": {"prefix": prefix, "every_steps": opts.every}, "health": HEALTH, "restarts": RESTARTS,
    }


def plain_spec(opts: argparse.Namespace, prefix: str) -> dict[str, Any]:
    return {
        "entrypoint": ["python", "examples/train.py", "--steps", str(opts.steps), "--step-time", f"{opts.step_time:g}"],
        "nodes": list(NODES), "spare_nodes": list(SPARES), "ranks_per_node": 2,
        "checkpoint": {"prefix": prefix, "every_steps": opts.every}, "health": HEALTH, "restarts": RESTARTS,
    }


async def _wait(predicate: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (found := await predicate()) is not None:
            return found
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{what} not within {timeout_s:.0f}s")


def _stepping(ranks: dict[int, int | None], size: int, min_step: int = 1) -> bool:
    live = [s for s in ranks.values() if s is not None]
    return len(live) == size and min(live) >= min_step


async def run_job(client: Any, opts: argparse.Namespace, home: Path, grouped: bool) -> GroupsRun:
    """The job with the five faults in turn, each once the run (or the fault's group) is back from the last:
    fault i hits group i % 3 in a grouped run, the run's node i % 3 in the other."""
    tag = secrets.token_hex(4)
    name = "groups" if grouped else "plain"
    run = GroupsRun(system="trainguard, 3 replica groups" if grouped else "trainguard, one world (no groups)")
    spec = group_spec(opts, f"bench-{name}-{tag}") if grouped else plain_spec(opts, f"bench-{name}-{tag}")
    rid = run.workflow_id = await client.start_run(spec, workflow_id=f"bench-{name}-{tag}")

    def units(view: Any) -> list[Any]:  # what recovers alone: each group, or the one world (all six ranks)
        return list(view.groups) if grouped else [view]

    def stepping(unit: Any, min_step: int = 1) -> bool:
        return unit.status.phase.value == "running" and _stepping(unit.rank_steps, 2 if grouped else 6, min_step)

    async def ready() -> Any:
        view = await client.status(rid)
        found = units(view)
        return view if len(found) == (3 if grouped else 1) and all(stepping(u, opts.warmup) for u in found) else None

    await _wait(ready, 240, "every rank stepping")

    async def parked() -> Any:  # the steady state: each relaunch it measures is served by parked processes
        from infra.bench.recovery import parked_ready

        runs = [(f"{rid}-group-{g}", (NODES[g],)) for g in range(3)] if grouped else [(rid, NODES)]
        return True if all(parked_ready(home, run_id, nodes) for run_id, nodes in runs) else None

    try:
        await _wait(parked, 120, "parked processes")
    except TimeoutError as error:
        run.note = str(error)
    try:
        await _inject_each(client, rid, run, grouped, units, stepping)
    except Exception as error:  # noqa: BLE001 - a group gone before its fault: what it says is the finding
        run.note = f"{error!r}; {await _unfinished(client, rid, grouped)}"[:1500]
        _keep_rank_logs(home, rid)
        return run
    try:
        result = await asyncio.wait_for(client.result(rid), 180 + 3 * opts.steps * opts.step_time)
    except Exception as error:  # noqa: BLE001 - the run's own reason says more than the client's error
        run.note = f"{error!r}: {await _unfinished(client, rid, grouped)}"[:1500]
        _keep_rank_logs(home, rid)
        return run
    run.completed = result.steps_completed == opts.steps
    run.note = await _unfinished(client, rid, grouped)
    if run.note:
        _keep_rank_logs(home, rid)
    run.goodput, run.wall_s, run.attempts = result.goodput, result.wall_s, result.attempts
    run.incidents = [f"group {i.group} {i.kind.value} {i.action.value} on {i.node}: detection {i.detection_s} s, "
                     f"back {i.recovery_s} s" for i in result.incidents]
    for measured in run.faults:  # each fault's incident, from the result: its group's, of its kind, in order
        kind = INCIDENT_KINDS[measured.fault]
        found = [i for i in result.incidents if i.kind.value == kind and i.detected_at >= measured.injected_at - 1
                 and (not grouped or i.group == measured.group) and i.action.value != "report"]
        if found:
            measured.detection_s, measured.back_s = found[0].detection_s, found[0].recovery_s
            measured.detected_at = found[0].detected_at
    if grouped:
        _gaps(run, home, rid)
    return run


async def _unfinished(client: Any, rid: str, grouped: bool) -> str:
    """The run's reason, and each group's that did not complete: phase, reason and last incident."""
    view = await client.status(rid)
    said = [view.status.reason] if view.status.reason else []
    for g, unit in enumerate(view.groups if grouped else []):
        status = unit.status
        if status.phase.value != "completed":
            last = status.incidents[-1] if status.incidents else None
            said.append(f"group {g}: {status.phase.value} at step {status.step} ({status.reason})" + (
                f", last incident {last.kind.value} {last.action.value}: {last.decision}" if last else ""))
    return "; ".join(said)


def _keep_rank_logs(home: Path, rid: str) -> None:
    """A run that did not finish: its ranks' logs kept beside the benchmark's output (the stack's are removed)."""
    import shutil

    kept = DEFAULT_JSON.parent / f"groups-ranks-{rid}"
    for log in home.glob(f"nodes/*/runs/{rid}*/attempt-*/logs/*.log"):
        target = kept / log.relative_to(home / "nodes")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(log, target)
    say(f"  ranks' logs of {rid} kept in {kept}")


async def _inject_each(client: Any, rid: str, run: GroupsRun, grouped: bool, units: Any, stepping: Any) -> None:
    """The five faults in turn, each once its group (or the run) is back from the one before."""
    name = "groups" if grouped else "plain"
    for index, fault in enumerate(FAULTS):
        group = index % 3 if grouped else 0
        before = units(await client.status(rid))[group].status
        node = before.nodes[0] if grouped else before.nodes[index % 3]
        measured = GroupFault(fault=fault, group=group if grouped else -1, node=node, injected_at=time.time())
        run.faults.append(measured)
        await client.inject_fault(rid, fault, node, slow_duty=SLOW_DUTY)
        say(f"  {name}: {fault} on {node}")

        async def back(group: int = group, attempt: int = before.attempt) -> Any:
            unit = units(await client.status(rid))[group]
            return unit if unit.status.attempt > attempt and stepping(unit) else None

        try:
            await _wait(back, 180, f"{f'group {group}' if grouped else 'the run'} back after {fault}")
        except TimeoutError as error:
            measured.note = str(error)
            break
        await asyncio.sleep(SETTLE_S)


def _gaps(run: GroupsRun, home: Path, rid: str) -> None:
    """Each fault's window, from its injection to its group's first step back, split at the fault's detection:
    the other groups' longest gap in each part."""
    taken = {g: [steps(text) for texts in rank_logs(home, rid, g).values() for text in texts] for g in range(3)}
    returns = {}
    for measured in run.faults:
        starts = [s[0][1] for (node, attempt), texts in rank_logs(home, rid, measured.group).items()
                  for s in map(steps, texts) if s and s[0][1] > measured.injected_at]
        returns[id(measured)] = min(starts) if starts else None
    for measured in run.faults:
        end = returns[id(measured)]
        if end is None:
            continue
        detected = max(measured.injected_at, min(measured.detected_at or measured.injected_at, end))
        recovering, undetected, intervals = [], [0.0], []
        for group, ranks in taken.items():
            if group == measured.group:
                continue
            for rank in ranks:
                for (_, a), (_, b) in zip(rank, rank[1:]):
                    if b > measured.injected_at and a < detected:  # the part of a pause before detection
                        undetected.append(min(b, detected) - a)
                    if b > detected and a < end:  # ...and the part after it, the recovery's own
                        recovering.append(b - max(a, detected))
                    if measured.injected_at - 10 < a < measured.injected_at:
                        intervals.append(b - a)
        if recovering and intervals:
            step = sorted(intervals)[len(intervals) // 2]
            measured.healthy_step_s = round(step, 3)
            measured.healthy_gap_s = round(max(recovering), 3)
            measured.undetected_gap_s = round(max(undetected), 3)
            measured.gap_ratio = round(measured.healthy_gap_s / step, 2)


async def measure(opts: argparse.Namespace, dev: Any) -> list[GroupsRun]:
    from infra.bench.recovery import repair
    from trainguard.client import TrainguardClient
    from trainguard.settings import Settings

    client = await TrainguardClient.connect(Settings.from_env({**os.environ, **dev.client_env()}))
    runs = []
    for grouped in (True, False):
        name = "groups" if grouped else "plain"
        say(f"{name}: {opts.steps} steps of {opts.step_time:g} s, faults {', '.join(FAULTS)}")
        try:
            runs.append(await run_job(client, opts, dev.home, grouped))
        except Exception as error:  # noqa: BLE001 - one failed run must not lose the other
            runs.append(GroupsRun(system=name, note=f"error: {error!r}"[:300]))
        for node in (*NODES, *SPARES):  # the next run starts on fresh agents (no injected XID), none cordoned
            await repair(client, dev, node)
    return runs


def report(runs: list[GroupsRun], floor_s: float | None) -> list[str]:
    lines = ["fault      group  detection  back after detection  healthy step  healthy gap (recovery)  gap/step"
             "  healthy gap (undetected)"]
    grouped = runs[0] if runs else None
    for f in grouped.faults if grouped else []:
        lines.append(f"{f.fault:<10} {f.group:>5}  {fmt(f.detection_s):>9}  {fmt(f.back_s):>20}  "
                     f"{fmt(f.healthy_step_s):>12}  {fmt(f.healthy_gap_s):>22}  {fmt(f.gap_ratio):>8}  "
                     f"{fmt(f.undetected_gap_s):>24}" + (f"  ({f.note})" if f.note else ""))
    lines.append(f"cold-start floor (plain torchrun from a local checkpoint): {fmt(floor_s)} s")
    for run in runs:
        lines.append(f"{run.system}: goodput {fmt(run.goodput)}, wall {fmt(run.wall_s)} s, attempts {run.attempts}, "
                     f"completed {run.completed}" + (f" ({run.note})" if run.note else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (default 200)")
    parser.add_argument("--step-time", type=float, default=1.0,
                        help="simulated compute per step, seconds (default 1: a step of a real model is seconds)")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps (default 10)")
    parser.add_argument("--warmup", type=int, default=10, help="steps every rank takes before the first fault")
    parser.add_argument("--heartbeat-timeout", type=float, default=0.5,
                        help="replica_groups.heartbeat_timeout_s and the cross-group collectives' timeout (0.5)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    opts = parser.parse_args(argv)
    load_before = os.getloadavg()
    from infra.bench.recovery import _nvml_standin
    from infra.bench.recovery_baselines import torchrun_floor
    from infra.bench.stack import private_stack

    work = BENCH_DIR / f"groups-{secrets.token_hex(4)}"
    work.mkdir(parents=True, exist_ok=True)
    say("floor: cold start from a local checkpoint under plain torchrun")
    floor = torchrun_floor(argparse.Namespace(steps=opts.steps, step_time=opts.step_time, hidden=opts.hidden,
                                              every=opts.every), work, work / "floor.log")
    info: dict[str, Any] = {}
    with _nvml_standin(True), private_stack("groups-stack", (*NODES, *SPARES), PORT_SEARCH_START,
                                            echo=lambda line: say(f"  stack: {line}"), timings=info,
                                            keep_logs=work / "stack-logs") as dev:
        runs = asyncio.run(measure(opts, dev))
    lines = report(runs, floor.cold_start_s)
    for line in lines:
        print(line, flush=True)
    grouped = runs[0]
    ok_gaps = len(grouped.faults) == len(FAULTS) and all(f.gap_ratio is not None and f.gap_ratio <= 2.0
                                                          for f in grouped.faults)
    ok_back = floor.cold_start_s is not None and all(
        f.back_s is not None and f.back_s <= floor.cold_start_s for f in grouped.faults)
    ok_goodput = len(runs) == 2 and None not in (runs[0].goodput, runs[1].goodput) and \
        runs[0].goodput > runs[1].goodput  # type: ignore[operator]
    verdicts = {"healthy gap during the recovery <= 2x step, every fault": ok_gaps,
                "failed group back within the floor": ok_back, "goodput with groups above without": ok_goodput}
    for name, ok in verdicts.items():
        print(f"{'PASS' if ok else 'MISS'}: {name}", flush=True)
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps({
        "benchmark": "groups", "machine": machine(load_before, os.getloadavg()),
        "args": {k: str(v) for k, v in vars(opts).items()},
        "floor_s": floor.cold_start_s, "runs": [asdict(r) for r in runs], "verdicts": verdicts,
        "stack": info, "report": lines}, indent=2))
    say(f"wrote {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
