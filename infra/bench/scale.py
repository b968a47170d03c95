"""Controller scale and footprint: N concurrent runs on one controller, side by side with a single run.

    python -m infra.bench.scale [--runs 1,2,4] [--steps 200] [--json .bench/scale.json]

For each N, a private dev stack (Temporal dev server, SeaweedFS, one controller) with 2N node agents; N runs of
the example trainer start together, each on its own two nodes (one gloo rank each, 0.05 s steps, a checkpoint
every 20 steps). Measured per N, in one benchmark run:

- wall time until every run finished, against the single run's (the ranks share this machine's 2 CPUs, so
  part of any slowdown is theirs, not the controller's);
- the controller's CPU seconds and peak resident memory, and the node agents' median peak resident memory
  (sampled from /proc every 0.5 s);
- history events per run and per committed checkpoint, and the events a run at this cadence writes per hour of
  training;
- workflow-task schedule-to-start latency, median and p95, read from every run's history: how long decisions
  waited for a free controller.

A benchmark, not a test: it prints figures and writes them to JSON, never asserts one. Every process it starts
is stopped and its files removed, also on errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import shutil
import statistics
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainguard.procs import stat_fields

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / ".bench"
DEFAULT_JSON = BENCH_DIR / "scale.json"
PORT_SEARCH_START = 34000
SAMPLE_S = 0.5
CLOCK_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def say(line: str) -> None:
    print(line, flush=True)


@dataclass(slots=True)
class Level:
    """The figures of one N."""

    runs: int
    wall_s: float | None = None
    completed: int = 0
    controller_cpu_s: float | None = None
    controller_peak_rss_mib: float | None = None
    agent_peak_rss_mib_median: float | None = None
    events_per_run: float | None = None
    checkpoints_per_run: float | None = None
    events_per_checkpoint: float | None = None
    events_per_training_hour: float | None = None
    task_latency_ms_median: float | None = None
    task_latency_ms_p95: float | None = None
    notes: list[str] = field(default_factory=list)


class Sampler:
    """Peak RSS and CPU time of the stack's long-lived processes, read from /proc."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.peak_rss: dict[str, int] = dict.fromkeys(pids, 0)
        self.cpu_start = {name: self._cpu(pid) or 0.0 for name, pid in pids.items()}
        self.cpu_end = dict(self.cpu_start)

    @staticmethod
    def _cpu(pid: int) -> float | None:
        fields = stat_fields(pid)
        return None if fields is None else (int(fields[11]) + int(fields[12])) * CLOCK_TICK_S

    @staticmethod
    def _rss(pid: int) -> int:
        with suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def sample(self) -> None:
        for name, pid in self.pids.items():
            self.peak_rss[name] = max(self.peak_rss[name], self._rss(pid))
            cpu = self._cpu(pid)
            if cpu is not None:
                self.cpu_end[name] = cpu


def spec(prefix: str, nodes: list[str], steps: int) -> dict[str, Any]:
    return {
        "entrypoint": ["python", "examples/train.py", "--steps", str(steps), "--step-time", "0.05",
                       "--hidden", "32"],
        "nodes": nodes,
        "checkpoint": {"prefix": prefix, "every_steps": 20, "keep_last": 2},
        "health": {"hang_floor_s": 10.0},
    }


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def history_figures(client: Any, workflow_id: str) -> tuple[int, list[float]]:
    """Events in every history of the run (across continue-as-new), and its workflow tasks' waits (ms)."""
    from temporalio.api.enums.v1 import EventType

    events, waits = 0, []
    async for execution in client.list_workflows(f"WorkflowId = '{workflow_id}'"):
        history = await client.get_workflow_handle(workflow_id, run_id=execution.run_id).fetch_history()
        scheduled: dict[int, float] = {}
        for event in history.events:
            events += 1
            at = event.event_time.ToDatetime().timestamp()
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED:
                scheduled[event.event_id] = at
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
                started_from = event.workflow_task_started_event_attributes.scheduled_event_id
                if started_from in scheduled:
                    waits.append((at - scheduled[started_from]) * 1000)
    return events, waits


async def measure(level: Level, stack: Any, steps: int) -> None:
    from trainguard.client import TrainguardClient

    client = await TrainguardClient.connect()
    pids = {"controller": json.loads((stack.run_dir / "controller.json").read_text())["pid"]}
    for node in stack.config.nodes:
        pids[f"agent-{node}"] = json.loads((stack.run_dir / f"agent-{node}.json").read_text())["pid"]
    sampler = Sampler(pids)
    tag = secrets.token_hex(3)
    ids = []
    started = time.monotonic()
    for index in range(level.runs):
        nodes = [f"node-{2 * index}", f"node-{2 * index + 1}"]
        ids.append(await client.start_run(spec(f"bench-scale-{tag}", nodes, steps),
                                          workflow_id=f"bench-scale-{tag}-{level.runs}-{index}"))
    results = [asyncio.ensure_future(client.result(i)) for i in ids]
    deadline = time.monotonic() + 600 + 5 * steps * 0.05 * level.runs
    while not all(r.done() for r in results) and time.monotonic() < deadline:
        sampler.sample()
        await asyncio.sleep(SAMPLE_S)
    sampler.sample()
    level.wall_s = round(time.monotonic() - started, 2)
    outcomes = []
    for workflow_id, result in zip(ids, results):
        if not result.done():
            result.cancel()
            level.notes.append(f"{workflow_id} did not finish in time")
            with suppress(Exception):
                await client.cancel(workflow_id)
            continue
        try:
            outcomes.append(result.result())
        except Exception as error:  # noqa: BLE001 - report the failed run, keep the others' figures
            level.notes.append(f"{workflow_id} failed: {error}"[:200])
    level.completed = sum(1 for o in outcomes if o.steps_completed == steps)
    level.controller_cpu_s = round(sampler.cpu_end["controller"] - sampler.cpu_start["controller"], 2)
    level.controller_peak_rss_mib = round(sampler.peak_rss["controller"] / 2**20, 1)
    agents = [v for k, v in sampler.peak_rss.items() if k.startswith("agent-")]
    level.agent_peak_rss_mib_median = round(statistics.median(agents) / 2**20, 1) if agents else None

    events, waits, checkpoints, training_s = [], [], [], []
    for workflow_id, outcome in zip(ids, outcomes):
        count, task_waits = await history_figures(client.client, workflow_id)
        events.append(count)
        waits.extend(task_waits)
        if outcome.final_checkpoint is not None:
            checkpoints.append(outcome.final_checkpoint.step // 20)
        if outcome.mean_step_s:
            training_s.append(outcome.steps_completed * outcome.mean_step_s)
    if events:
        level.events_per_run = round(statistics.mean(events), 1)
    if checkpoints and events:
        level.checkpoints_per_run = round(statistics.mean(checkpoints), 1)
        level.events_per_checkpoint = round(statistics.mean(events) / statistics.mean(checkpoints), 1)
    if training_s and events:
        level.events_per_training_hour = round(statistics.mean(events) / statistics.mean(training_s) * 3600)
    if waits:
        level.task_latency_ms_median = round(statistics.median(waits), 1)
        level.task_latency_ms_p95 = round(_percentile(waits, 0.95) or 0.0, 1)


def run_level(runs: int, steps: int) -> Level:
    from trainguard.devstack import DevStack, Ports, StackConfig, free_port_base

    level = Level(runs=runs)
    nodes = tuple(f"node-{i}" for i in range(2 * runs))
    home = BENCH_DIR / f"scale-{secrets.token_hex(4)}"
    config = StackConfig(home=home, ports=Ports.from_base(free_port_base(PORT_SEARCH_START, len(nodes))),
                         nodes=nodes, code_dir=REPO)
    stack = DevStack(config)
    saved = os.environ.get("TRAINGUARD_TEMPORAL_ADDRESS")
    try:
        os.environ["TRAINGUARD_TEMPORAL_ADDRESS"] = config.temporal_address
        stack.up(echo=lambda _line: None)
        asyncio.run(measure(level, stack, steps))
    finally:
        try:
            stack.down(echo=lambda _line: None)
        finally:
            if saved is None:
                os.environ.pop("TRAINGUARD_TEMPORAL_ADDRESS", None)
            else:
                os.environ["TRAINGUARD_TEMPORAL_ADDRESS"] = saved
            shutil.rmtree(home, ignore_errors=True)
    return level


def report(levels: list[Level]) -> list[str]:
    def fmt(value: float | None, pattern: str = "{:.1f}") -> str:
        return "-" if value is None else pattern.format(value)

    lines = [f"{'runs':>4} {'done':>4} {'wall_s':>7} {'wall/1':>6} {'ctl_cpu_s':>9} {'cpu/run':>7} "
             f"{'ctl_rss_MiB':>11} {'agent_rss_MiB':>13} {'events/run':>10} {'events/ckpt':>11} "
             f"{'events/h':>8} {'task_wait_ms p50/p95':>20}"]
    single = levels[0].wall_s if levels else None
    for lv in levels:
        per_run = None if lv.controller_cpu_s is None else lv.controller_cpu_s / lv.runs
        ratio = None if not single or lv.wall_s is None else lv.wall_s / single
        lines.append(
            f"{lv.runs:>4} {lv.completed:>4} {fmt(lv.wall_s):>7} {fmt(ratio, '{:.2f}'):>6} "
            f"{fmt(lv.controller_cpu_s, '{:.2f}'):>9} {fmt(per_run, '{:.2f}'):>7} "
            f"{fmt(lv.controller_peak_rss_mib):>11} {fmt(lv.agent_peak_rss_mib_median):>13} "
            f"{fmt(lv.events_per_run):>10} {fmt(lv.events_per_checkpoint):>11} "
            f"{fmt(lv.events_per_training_hour, '{:.0f}'):>8} "
            f"{fmt(lv.task_latency_ms_median) + ' / ' + fmt(lv.task_latency_ms_p95):>20}"
            + (f"  {'; '.join(lv.notes)}" if lv.notes else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="1,2,4", help="concurrent runs per level, comma-separated (default 1,2,4)")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (default 200)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    opts = parser.parse_args(argv)
    try:
        counts = [int(n) for n in opts.runs.split(",") if n.strip()]
    except ValueError:
        parser.error("--runs takes comma-separated whole numbers, e.g. 1,2,4")
    if not counts or min(counts) < 1 or max(counts) > 16:
        parser.error("--runs: each level between 1 and 16 runs")
    if opts.steps < 20:
        parser.error("--steps must be at least 20 (one checkpoint)")

    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    say(f"scale benchmark: levels {counts} concurrent runs, {opts.steps} steps x 0.05 s, 2 ranks each; "
        f"{os.cpu_count()} CPUs, load {load_before[0]:.2f}")
    levels = []
    for count in counts:
        say(f"{count} run(s): stack with {2 * count} node agents")
        try:
            level = run_level(count, opts.steps)
        except Exception as error:  # noqa: BLE001 - one failed level must not lose the others
            level = Level(runs=count, notes=[f"error: {error!r}"[:300]])
        say(f"  -> {report([level])[1].strip()}")
        levels.append(level)
    lines = report(levels)
    say("")
    for line in lines:
        say(line)
    payload = {
        "benchmark": "scale",
        "config": {"runs": counts, "steps": opts.steps, "step_time": 0.05, "checkpoint_every": 20},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "levels": [asdict(level) for level in levels],
        "table": lines,
    }
    opts.json.write_text(json.dumps(payload, indent=2) + "\n")
    say(f"wrote {opts.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
