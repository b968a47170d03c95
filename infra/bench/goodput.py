"""Goodput under a fault schedule: one run, four faults, under trainguard, torchrun and ft_launcher.

    python -m infra.bench.goodput [--steps 600] [--launchers torchrun,ft_launcher] [--json .bench/goodput.json]

The job is the recovery benchmark's (a 2-rank gloo run of `examples/train.py`, 0.1 s steps, a checkpoint every
50 steps), longer, and the same faults strike it in turn once training passes each step of the schedule:

    step 100: crash of rank 1          step 200: hang of rank 1
    step 300: rank 1 slowed to a fifth (a throttled GPU; it stays slow)
    step 450: the node of rank 0 goes down (its agent and ranks killed)

trainguard runs with a spare node (`node-2`) and `min_nodes: 1`: the straggler is replaced by the spare, and
the lost node's run shrinks to the node left. torchrun (`--max-restarts 3`, 60 s process-group timeout) and
ft_launcher (5 s heartbeat timeout) resume from the script's own local checkpoints; on one machine a lost
node takes the launcher with it, so their run ends there (a multi-node torchrun would wait at rendezvous for
the node to come back).

Goodput = useful training time / wall time, where useful time is the steps completed times the step time of
a fault-free run measured first (the same for every system), so a run slowed by a straggler, a stalled one,
and steps redone after a restart all count as lost. The table gives each system's goodput, wall time, steps
completed and what happened at each fault; the ratios are trainguard's goodput over each baseline's.

A benchmark, not a test: it prints figures and writes JSON, never asserts one. Every process it starts is
stopped and its files removed, also on errors.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infra.bench.recovery import PORT_SEARCH_START, SPARE, repair
from infra.bench.recovery_baselines import TORCHRUN_MAX_RESTARTS, Torchrun, duty_cycle, find_worker, train_args
from infra.bench.recovery_report import BENCH_DIR, LAUNCHERS, NODES, SLOW_DUTY, machine, say, write_results

DEFAULT_JSON = BENCH_DIR / "goodput.json"
SCHEDULE = ((100, "crash"), (200, "hang"), (300, "slow"), (450, "node-down"))
"""(step, fault): crash, hang and slow hit rank 1 (node-1); node-down hits rank 0's node (node-0)."""


@dataclass(slots=True)
class Outcome:
    system: str
    goodput: float | None = None
    wall_s: float | None = None
    steps_completed: int | None = None
    completed: bool = False
    events: list[str] = field(default_factory=list)
    """What happened at each fault, in the system's own words."""
    timeline: list[list[float]] = field(default_factory=list)
    """[seconds since the job started, step] samples: the goodput timeline's line."""
    faults: list[list[Any]] = field(default_factory=list)
    """[seconds since the job started, fault] as each was sent."""


def _goodput(steps: int | None, step_s: float, wall_s: float | None) -> float | None:
    if not steps or not wall_s:
        return None
    return round(min(1.0, steps * step_s / wall_s), 4)


# -------------------------------------------------------------------------------------------- trainguard


def trainguard_spec(opts: argparse.Namespace, prefix: str, steps: int) -> dict[str, Any]:
    return {
        "entrypoint": ["python", "examples/train.py", "--steps", str(steps), "--step-time", "0.1", "--hidden", "64"],
        "nodes": list(NODES), "spare_nodes": [SPARE], "min_nodes": 1, "ranks_per_node": 1,
        "checkpoint": {"prefix": prefix, "every_steps": 50},
    }


async def trainguard_schedule(opts: argparse.Namespace, dev: Any) -> tuple[Outcome, float]:
    """The schedule under trainguard, after a fault-free run that gives the step time goodput is reckoned in."""
    from trainguard.client import TrainguardClient

    client = await TrainguardClient.connect()
    tag = secrets.token_hex(3)
    clean = await client.start_run(trainguard_spec(opts, f"bench-goodput-{tag}", 200), workflow_id=f"bg-clean-{tag}")
    reference = await client.result(clean)
    step_s = reference.mean_step_s or 0.1
    say(f"  fault-free step time {step_s:.4f} s (trainguard, 200 steps)")

    outcome = Outcome(system="trainguard")
    run_id = await client.start_run(trainguard_spec(opts, f"bench-goodput-{tag}", opts.steps),
                                    workflow_id=f"bg-schedule-{tag}")
    started = time.monotonic()
    pending = list(SCHEDULE)
    result_task = asyncio.ensure_future(client.result(run_id))
    deadline = started + 900
    while not result_task.done() and time.monotonic() < deadline:
        view = await client.status(run_id)
        step_now = progress_step(dev.config.home, run_id)
        current = view.live_step if step_now is None else step_now
        outcome.timeline.append([round(time.monotonic() - started, 2), current])
        if pending:
            step, fault = pending[0]
            if view.status.phase.value == "running" and current >= step:
                node = "node-0" if fault == "node-down" else "node-1"
                await client.inject_fault(run_id, fault, node, slow_duty=SLOW_DUTY)
                outcome.events.append(f"{fault} at step {current}")
                outcome.faults.append([round(time.monotonic() - started, 2), fault])
                say(f"  trainguard: {fault} on {node} at step {current}")
                pending.pop(0)
        await asyncio.sleep(0.25)
    result = await asyncio.wait_for(result_task, max(1.0, deadline - time.monotonic()))
    outcome.timeline.append([round(time.monotonic() - started, 2), result.steps_completed])
    outcome.wall_s = round(time.monotonic() - started, 2)
    outcome.steps_completed = result.steps_completed
    outcome.completed = result.steps_completed == opts.steps
    outcome.goodput = _goodput(result.steps_completed, step_s, outcome.wall_s)
    outcome.events += [f"{i.kind.value} on {i.node}: {i.action.value}" for i in result.incidents]
    for node in ("node-0", "node-1"):
        await repair(client, dev, node)
    return outcome, step_s


def progress_step(home: Path, run_id: str) -> int | None:
    """The run's step as its ranks last wrote it on the nodes' disks (every step, not the status query's
    throttled heartbeats): the lowest rank's step in the newest attempt any node has."""
    from trainguard.protocol import read_progress, safe_name

    newest: dict[int, list[int]] = {}
    for path in home.glob(f"nodes/*/runs/{safe_name(run_id)}/attempt-*/progress/rank-*.json"):
        progress = read_progress(path)
        if progress is not None:
            newest.setdefault(progress.attempt, []).append(progress.step)
    return min(newest[max(newest)]) if newest else None


def run_trainguard(opts: argparse.Namespace) -> tuple[Outcome, float]:
    from infra.bench.stack import private_stack

    with private_stack("goodput-stack", (*NODES, SPARE), PORT_SEARCH_START) as dev:
        return asyncio.run(trainguard_schedule(opts, dev))


# ---------------------------------------------------------------------------------------------- launchers


def launcher_schedule(opts: argparse.Namespace, system: str, step_s: float, work: Path) -> Outcome:
    outcome = Outcome(system=system)
    job = Torchrun(work / system, f"goodput-{system}", train_args(opts, steps=opts.steps), TORCHRUN_MAX_RESTARTS,
                   work / f"{system}.log", launcher=system)
    slowing = threading.Event()
    pending = list(SCHEDULE)
    deadline = time.time() + 600 + 3 * opts.steps * 0.1
    try:
        job.start()
        while time.time() < deadline and job.proc is not None and job.proc.poll() is None:
            rows = job.steps()
            if pending and rows and rows[-1][0] >= pending[0][0]:
                step, fault = pending[0]
                outcome.faults.append([round(time.time() - job.started, 2), fault])
                if fault == "node-down":
                    job.kill()  # the node goes, and the launcher on it
                    outcome.events.append(f"node-down at step {rows[-1][0]}: the job is lost with its node")
                    pending.pop(0)
                    break
                found = find_worker(job.mark, job.proc.pid, 1)
                if found is None:
                    time.sleep(0.05)
                    continue
                if fault == "slow":
                    threading.Thread(target=duty_cycle, args=(found[0], SLOW_DUTY, slowing), daemon=True).start()
                else:
                    os.kill(found[0], signal.SIGKILL if fault == "crash" else signal.SIGSTOP)
                outcome.events.append(f"{fault} at step {rows[-1][0]}")
                say(f"  {system}: {fault} at step {rows[-1][0]}")
                pending.pop(0)
            time.sleep(0.05)
        if job.proc is not None and job.proc.poll() is None:
            job.wait(max(1.0, deadline - time.time()))
        end = job.ended or time.time()
        outcome.wall_s = round(end - job.started, 2)
        rows = job.steps()
        outcome.timeline = [[round(at - job.started, 2), step] for step, at, _restart in rows]
        outcome.steps_completed = rows[-1][0] if rows else 0
        outcome.completed = bool(rows) and rows[-1][0] == opts.steps
        outcome.goodput = _goodput(outcome.steps_completed, step_s, outcome.wall_s)
        restarts = rows[-1][2] if rows else 0
        outcome.events.append(f"{restarts} restarts")
        return outcome
    finally:
        slowing.set()
        job.kill()


# ------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600, help="training steps of the scheduled run (default 600)")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS), help="baselines: torchrun, ft_launcher")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    opts = parser.parse_args(argv)
    opts.step_time, opts.hidden, opts.every = 0.1, 64, 50  # what train_args reads: the recovery benchmark's job
    if opts.steps <= SCHEDULE[-1][0] + 50:
        parser.error(f"--steps must leave room after the last fault (step {SCHEDULE[-1][0]})")
    launchers = [name.strip() for name in opts.launchers.split(",") if name.strip()]
    if unknown := [name for name in launchers if name not in LAUNCHERS]:
        parser.error(f"unknown launcher(s): {', '.join(unknown)} (known: {', '.join(LAUNCHERS)})")
    if "ft_launcher" in launchers and not (Path(sys.executable).parent / "ft_launcher").exists():
        say("ft_launcher not installed (pip install -e '.[bench]'): measuring torchrun only")
        launchers.remove("ft_launcher")

    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    work = BENCH_DIR / f"goodput-{secrets.token_hex(4)}"
    work.mkdir(parents=True)
    load_before = os.getloadavg()
    say(f"goodput benchmark: {opts.steps} steps x 0.1 s, 2 ranks gloo; schedule "
        f"{', '.join(f'{f}@{s}' for s, f in SCHEDULE)}; {os.cpu_count()} CPUs, load {load_before[0]:.2f}")
    outcomes: list[Outcome] = []
    try:
        say("trainguard: private dev stack, spare node-2, min_nodes 1")
        tg, step_s = run_trainguard(opts)
        outcomes.append(tg)
        for system in launchers:
            say(f"{system}: same schedule")
            outcomes.append(launcher_schedule(opts, system, step_s, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def fmt(value: float | None, pattern: str) -> str:
        return "-" if value is None else pattern.format(value)

    lines = [f"{'system':<11} {'goodput':>8} {'wall_s':>7} {'steps':>6} {'done':>4}  what happened"]
    for o in outcomes:
        lines.append(f"{o.system:<11} {fmt(None if o.goodput is None else o.goodput * 100, '{:.1f}%'):>8} "
                     f"{fmt(o.wall_s, '{:.1f}'):>7} {fmt(o.steps_completed, '{}'):>6} "
                     f"{'yes' if o.completed else 'no':>4}  {'; '.join(o.events)}")
    ratios = {o.system: round(tg.goodput / o.goodput, 3) for o in outcomes[1:] if tg.goodput and o.goodput}
    lines.append("goodput ratios (trainguard / baseline): "
                 + (", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()) or "-"))
    say("")
    for line in lines:
        say(line)
    payload = {
        "benchmark": "goodput",
        "config": {"steps": opts.steps, "step_time": 0.1, "checkpoint_every": 50, "schedule": SCHEDULE,
                   "reference_step_s": step_s, "launchers": launchers},
        "machine": machine(load_before),
        "outcomes": [asdict(o) for o in outcomes],
        "ratios": ratios,
        "table": lines,
    }
    write_results(opts.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
