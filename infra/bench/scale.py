"""Controller scale: N concurrent runs on one controller worker and the dev server, N = 1, 10, 50, ...

    python -m infra.bench.scale [--runs 1,10,50,100] [--steps 600] [--json .bench/scale.json]

For each N, a private dev stack (Temporal dev server, SeaweedFS, one controller) with N node agents, and N
runs of the lightweight stand-in rank (`examples/standin.py`: the rank helper's progress heartbeat, 0.1 s
steps, no torch), one node and one rank each. Once every run trains, each gets a hang (its rank SIGSTOPped by
its agent, all within a second or two): the agents detect it, the controller decides and relaunches. Measured
per N, side by side in one benchmark run:

- hang detection latency p50/p95 (fault to detection, from the incidents) and time to the first step of the
  relaunch p50/p95 (detection to first new step: the controller's decision, the stop and the relaunch);
- workflow-task schedule-to-start latency p50/p95, read from every run's history: how long decisions waited
  for a free controller;
- the controller's CPU seconds and peak resident memory, and the node agents' median peak resident memory
  (sampled from /proc every 0.5 s);
- history events per run (a 30 s run with one hang and its relaunch; at steady state a run adds about 25
  events per checkpoint and 6 per node every 10 minutes, when an idle watch renews).

Where a level fails (runs not finishing, the stack not coming up) the table says so: that is where it stops
scaling on this machine. A benchmark, not a test: it prints figures and writes them to JSON, never asserts one.
Every process it starts is stopped and its files removed, also on errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infra.bench.recovery_report import machine, say, write_results
from trainguard.procs import stat_fields

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / ".bench"
DEFAULT_JSON = BENCH_DIR / "scale.json"
PORT_SEARCH_START = 34000
SAMPLE_S = 0.5
CLOCK_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(slots=True)
class Level:
    """The figures of one N."""

    runs: int
    stack_up_s: float | None = None
    wall_s: float | None = None
    completed: int = 0
    detection_s_p50: float | None = None
    detection_s_p95: float | None = None
    recovery_s_p50: float | None = None
    recovery_s_p95: float | None = None
    task_wait_ms_p50: float | None = None
    task_wait_ms_p95: float | None = None
    controller_cpu_s: float | None = None
    controller_peak_rss_mib: float | None = None
    agent_peak_rss_mib_median: float | None = None
    events_per_run: float | None = None
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


def spec(node: str, steps: int) -> dict[str, Any]:
    return {
        "entrypoint": ["python", "examples/standin.py", "--steps", str(steps), "--step-time", "0.1"],
        "nodes": [node],
        "checkpoint": {"every_steps": 10_000_000},
        "health": {"startup_grace_s": 120.0},
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


def _p(values: list[float], q: float, digits: int = 3) -> float | None:
    found = _percentile(values, q)
    return None if found is None else round(found, digits)


async def measure(level: Level, stack: Any, steps: int) -> None:
    from trainguard.client import TrainguardClient

    client = await TrainguardClient.connect()
    pids = {"controller": json.loads((stack.run_dir / "controller.json").read_text())["pid"]}
    for node in stack.config.nodes:
        pids[f"agent-{node}"] = json.loads((stack.run_dir / f"agent-{node}.json").read_text())["pid"]
    sampler = Sampler(pids)
    tag = secrets.token_hex(3)
    started = time.monotonic()
    ids = await asyncio.gather(*(
        client.start_run(spec(node, steps), workflow_id=f"bench-scale-{tag}-{level.runs}-{index}")
        for index, node in enumerate(stack.config.nodes)))
    results = [asyncio.ensure_future(client.result(i)) for i in ids]
    deadline = time.monotonic() + 300 + level.runs * 3 + steps * 0.1 * 2

    def training(workflow_id: str) -> bool:
        """Read from the rank's progress file on its node: a status query per run and poll would load the very
        controller being measured (at 100 runs, more than the runs themselves)."""
        from trainguard.protocol import RunLayout, read_progress

        node = stack.config.nodes[ids.index(workflow_id)]
        progress = read_progress(RunLayout.of(stack.config.home / "nodes" / node, workflow_id).progress_file(1, 0))
        return progress is not None and progress.step >= 30

    hung: set[str] = set()
    while not all(r.done() for r in results) and time.monotonic() < deadline:
        sampler.sample()
        waiting = [i for i in ids if i not in hung]
        if waiting:
            due = [i for i in waiting if training(i)]
            if len(due) == len(waiting):  # every run trains: hang them all, together
                outcome = await asyncio.gather(*(client.inject_fault(i, "hang", stack.config.nodes[ids.index(i)])
                                                 for i in due), return_exceptions=True)
                failed = [str(o) for o in outcome if isinstance(o, BaseException)]
                if failed:
                    level.notes.append(f"{len(failed)} fault injections failed: {failed[0][:120]}")
                hung.update(due)
        await asyncio.sleep(SAMPLE_S)
    sampler.sample()
    level.wall_s = round(time.monotonic() - started, 2)
    outcomes = []
    for workflow_id, result in zip(ids, results):
        if not result.done():
            result.cancel()
            with suppress(Exception):
                await client.cancel(workflow_id)
            continue
        try:
            outcomes.append(result.result())
        except Exception as error:  # noqa: BLE001 - report the failed run, keep the others' figures
            level.notes.append(f"{workflow_id} failed: {error}"[:200])
    unfinished = len(ids) - len(outcomes)
    if unfinished:
        level.notes.append(f"{unfinished} runs did not finish in time")
    level.completed = sum(1 for o in outcomes if o.steps_completed == steps)
    hangs = [i for o in outcomes for i in o.incidents if i.kind.value == "hang"]
    detections = [i.detection_s for i in hangs if i.detection_s is not None]
    recoveries = [i.recovery_s for i in hangs if i.recovery_s is not None]
    level.detection_s_p50, level.detection_s_p95 = _p(detections, 0.5), _p(detections, 0.95)
    level.recovery_s_p50, level.recovery_s_p95 = _p(recoveries, 0.5), _p(recoveries, 0.95)
    level.controller_cpu_s = round(sampler.cpu_end["controller"] - sampler.cpu_start["controller"], 2)
    level.controller_peak_rss_mib = round(sampler.peak_rss["controller"] / 2**20, 1)
    agents = [v for k, v in sampler.peak_rss.items() if k.startswith("agent-")]
    level.agent_peak_rss_mib_median = round(statistics.median(agents) / 2**20, 1) if agents else None

    events, waits = [], []
    for workflow_id in [o.workflow_id for o in outcomes]:
        count, task_waits = await history_figures(client.client, workflow_id)
        events.append(count)
        waits.extend(task_waits)
    if events:
        level.events_per_run = round(statistics.mean(events), 1)
    level.task_wait_ms_p50, level.task_wait_ms_p95 = _p(waits, 0.5, 1), _p(waits, 0.95, 1)


def run_level(runs: int, steps: int) -> Level:
    from infra.bench.stack import private_stack

    level = Level(runs=runs)
    timings: dict[str, float] = {}
    with private_stack("scale", tuple(f"node-{i}" for i in range(runs)), PORT_SEARCH_START,
                       timings=timings) as stack:
        level.stack_up_s = round(timings["stack_up_s"], 1)
        asyncio.run(measure(level, stack, steps))
    return level


def report(levels: list[Level]) -> list[str]:
    def fmt(value: float | None, pattern: str = "{:.2f}") -> str:
        return "-" if value is None else pattern.format(value)

    def pair(low: float | None, high: float | None, pattern: str = "{:.2f}") -> str:
        return f"{fmt(low, pattern)} / {fmt(high, pattern)}"

    lines = [f"{'runs':>4} {'done':>4} {'detect_s p50/p95':>16} {'recover_s p50/p95':>17} "
             f"{'task_wait_ms p50/p95':>20} {'ctl_cpu_s':>9} {'ctl_MiB':>7} {'agent_MiB':>9} "
             f"{'events/run':>10}"]
    for lv in levels:
        lines.append(
            f"{lv.runs:>4} {lv.completed:>4} {pair(lv.detection_s_p50, lv.detection_s_p95):>16} "
            f"{pair(lv.recovery_s_p50, lv.recovery_s_p95):>17} "
            f"{pair(lv.task_wait_ms_p50, lv.task_wait_ms_p95, '{:.0f}'):>20} "
            f"{fmt(lv.controller_cpu_s, '{:.1f}'):>9} {fmt(lv.controller_peak_rss_mib, '{:.0f}'):>7} "
            f"{fmt(lv.agent_peak_rss_mib_median, '{:.0f}'):>9} {fmt(lv.events_per_run, '{:.0f}'):>10}"
            + (f"  {'; '.join(lv.notes)}" if lv.notes else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="1,10,50,100", help="concurrent runs per level, comma-separated "
                                                              "(default 1,10,50,100)")
    parser.add_argument("--steps", type=int, default=600, help="stand-in steps per run, 0.1 s each (default 600: "
                                                               "long enough that no run ends before every run "
                                                               "is training and can be hung)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    opts = parser.parse_args(argv)
    try:
        counts = [int(n) for n in opts.runs.split(",") if n.strip()]
    except ValueError:
        parser.error("--runs takes comma-separated whole numbers, e.g. 1,2,4")
    if not counts or min(counts) < 1 or max(counts) > 200:
        parser.error("--runs: each level between 1 and 200 runs")
    if opts.steps < 100:
        parser.error("--steps must be at least 100 (the hang comes after step 30)")

    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    say(f"scale benchmark: levels {counts} concurrent runs, {opts.steps} stand-in steps x 0.1 s, one hang each; "
        f"{os.cpu_count()} CPUs, load {load_before[0]:.2f}")
    levels = []
    for count in counts:
        say(f"{count} run(s): stack with {count} node agents")
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
        "config": {"runs": counts, "steps": opts.steps, "step_time": 0.1, "rank": "examples/standin.py"},
        "machine": machine(load_before),
        "levels": [asdict(level) for level in levels],
        "table": lines,
    }
    write_results(opts.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
