"""Time to recover by recovery path: the same crash, recovered three ways, side by side in one run.

    python -m infra.bench.paths [--repeats 2] [--steps 300] [--hidden 512] [--json .bench/paths.json]

The job is the recovery benchmark's (`examples/train.py`, 2 ranks on `node-0` and `node-1`, gloo, 0.1 s
steps, a checkpoint every 50 steps) on a private dev stack; rank 1 is SIGKILLed once training passes step
`--fault-step` (120). The paths:

1. `s3`: every rank stopped and relaunched from the newest committed checkpoint, read from the store
   (`checkpoint.local_tier: false`).
2. `local`: the same relaunch, each node reading its own verified copy of the shards it wrote (the default).
3. `in-process`: the live rank keeps its state; rank 1 is started again and takes it from rank 0 over the
   new process group (`restarts.in_process: true`); no checkpoint is read.

For each run the incident gives detection and time to recover (fault to the first step of the next
attempt), and the run's history (`trainguard run report`) splits the recovery into teardown (detection to
the restore: the policy's decision and stopping the ranks), restore (finding and fetching the checkpoint)
and relaunch (starting the ranks, or rejoining them, to their first step). The floor is a cold start of the
same two ranks from a local checkpoint under plain torchrun, with no orchestration at all. Every run must
end with the same final_state_digest; the table says whether they did.

A benchmark, not a test: it prints figures and writes JSON; it asserts no time. It cleans up as the
recovery benchmark does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from infra.bench.recovery import PORT_SEARCH_START, trainguard_fault
from infra.bench.recovery_baselines import torchrun_floor
from infra.bench.recovery_report import (
    BENCH_DIR,
    NODES,
    Floor,
    Measurement,
    fmt,
    machine,
    say,
    summary,
    write_results,
)

DEFAULT_JSON = BENCH_DIR / "paths.json"
PATHS: dict[str, dict[str, Any]] = {
    "s3": {"checkpoint": {"local_tier": False}},
    "local": {},
    "in-process": {"restarts": {"in_process": True}},
}
"""Spec changes per path, on top of the recovery benchmark's job."""


async def breakdown(client: Any, workflow_id: str) -> dict[str, float]:
    """Teardown, restore and relaunch seconds after the first incident, from the run's history."""
    from trainguard.report import build_report

    report = await build_report(client.client, workflow_id)
    after = [s for s in report.segments if s.attempt >= 2 or s.phase == "recovering"]
    return {
        "teardown_s": round(sum(s.seconds for s in after if s.phase == "recovering"), 3),
        "restore_s": round(sum(s.seconds for s in after if s.phase == "restoring"), 3),
        "relaunch_s": round(sum(s.seconds for s in after if s.phase == "launching"), 3),
    }


async def measure(opts: argparse.Namespace, dev: Any) -> list[tuple[str, Measurement, dict[str, float]]]:
    from trainguard.client import TrainguardClient

    client = await TrainguardClient.connect()
    rows: list[tuple[str, Measurement, dict[str, float]]] = []
    for repeat in range(opts.repeats):
        for path, changes in PATHS.items():  # interleaved: drift in the machine's load hits every path alike
            say(f"{path} (run {repeat + 1} of {opts.repeats})")
            try:
                measured = await trainguard_fault(client, opts, "crash", dev.config.home, f"trainguard/{path}",
                                                  changes)
                parts = await breakdown(client, measured.workflow_id) if measured.workflow_id else {}
            except Exception as error:  # noqa: BLE001 - one failed measurement must not lose the others
                measured, parts = Measurement(fault="crash", system=f"trainguard/{path}",
                                              note=f"error: {error!r}"[:300]), {}
            say(f"  -> {summary(measured)}; tier {measured.restore_tier}, path {measured.recovery_path}, {parts}")
            rows.append((path, measured, parts))
    return rows


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def table(rows: list[tuple[str, Measurement, dict[str, float]]], floor: Floor) -> tuple[list[str], list[dict]]:
    digests = {m.digest for _, m, _ in rows if m.digest}
    lines = [
        f"{'path':<11} {'runs':>4} {'detect s':>8} {'teardown s':>10} {'restore s':>9} {'relaunch s':>10} "
        f"{'recover s':>9} {'x floor':>7}  tier / path taken",
    ]
    summary_rows = []
    for path in PATHS:
        mine = [(m, parts) for p, m, parts in rows if p == path]
        ok = [(m, parts) for m, parts in mine if m.completed and m.time_to_recover_s is not None]
        row = {
            "path": path, "runs": len(mine), "completed": len(ok),
            "detection_s": _median([m.detection_s for m, _ in ok]),
            "teardown_s": _median([parts.get("teardown_s") for _, parts in ok]),
            "restore_s": _median([parts.get("restore_s") for _, parts in ok]),
            "relaunch_s": _median([parts.get("relaunch_s") for _, parts in ok]),
            "time_to_recover_s": _median([m.time_to_recover_s for m, _ in ok]),
            "tiers": sorted({f"{m.restore_tier} / {m.recovery_path}" for m, _ in ok}),
        }
        row["vs_floor"] = (round(row["time_to_recover_s"] / floor.cold_start_s, 2)
                           if row["time_to_recover_s"] and floor.cold_start_s else None)
        summary_rows.append(row)
        lines.append(
            f"{path:<11} {len(ok):>2}/{len(mine):<1} {fmt(row['detection_s']):>8} {fmt(row['teardown_s']):>10} "
            f"{fmt(row['restore_s']):>9} {fmt(row['relaunch_s']):>10} {fmt(row['time_to_recover_s']):>9} "
            f"{fmt(row['vs_floor'], '{:.2f}x'):>7}  {', '.join(row['tiers'])}")
    lines.append(f"{'floor':<11} {'':>4} {'':>8} {'':>10} {'':>9} {'':>10} {fmt(floor.cold_start_s):>9} "
                 f"{'1.00x':>7}  cold start of the same ranks from a local checkpoint, plain torchrun")
    by_path = {row["path"]: row["time_to_recover_s"] for row in summary_rows}
    if by_path.get("s3") and by_path.get("in-process"):
        lines.append(f"in-process recovers {by_path['s3'] / by_path['in-process']:.1f}x faster than a relaunch "
                     f"from S3, {by_path['local'] / by_path['in-process']:.1f}x faster than one from the local tier"
                     if by_path.get("local") else "")
    lines.append(f"final_state_digest: {'the same in every run' if len(digests) == 1 else f'{len(digests)} different'}"
                 f" ({len([m for _, m, _ in rows if m.digest])} runs)")
    return lines, summary_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="runs per path, interleaved (default 2)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    parser.add_argument("--step-time", type=float, default=0.1, help="trainer --step-time (default 0.1)")
    parser.add_argument("--hidden", type=int, default=512, help="trainer --hidden (default 512: 2 MB shards)")
    parser.add_argument("--every", type=int, default=50, help="checkpoint every N steps (default 50)")
    parser.add_argument("--fault-step", type=int, default=120, help="crash once training passes this step")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    opts = parser.parse_args(argv)
    if opts.repeats < 1 or not 0 < opts.fault_step < opts.steps:
        parser.error("--repeats must be at least 1 and --fault-step between 0 and --steps")

    from infra.bench.stack import private_stack

    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    work = BENCH_DIR / f"paths-{secrets.token_hex(4)}"
    work.mkdir(parents=True)
    started, load_before = time.monotonic(), os.getloadavg()
    say(f"recovery paths benchmark: crash of rank 1 after step {opts.fault_step}, 2 ranks gloo, {opts.steps} steps "
        f"x {opts.step_time:g}s, hidden {opts.hidden}, checkpoint every {opts.every}, {opts.repeats} run(s) per "
        f"path; {os.cpu_count()} CPUs, load {load_before[0]:.2f}")
    try:
        with private_stack("stack", NODES, PORT_SEARCH_START, echo=lambda line: say(f"  stack: {line}")) as dev:
            rows = asyncio.run(measure(opts, dev))
        say("floor: cold start from a local checkpoint under plain torchrun")
        floor = torchrun_floor(opts, work, work / "torchrun.log")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines, summary_rows = table(rows, floor)
    say("")
    for line in lines:
        say(line)
    load_after = os.getloadavg()
    say(f"total {time.monotonic() - started:.0f}s; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    payload = {
        "benchmark": "paths",
        "config": {"steps": opts.steps, "step_time": opts.step_time, "hidden": opts.hidden,
                   "checkpoint_every": opts.every, "fault_step": opts.fault_step, "repeats": opts.repeats,
                   "paths": PATHS},
        "machine": machine(load_before, load_after),
        "runs": [{"path": p, **asdict(m), **parts} for p, m, parts in rows],
        "summary": summary_rows,
        "floor": asdict(floor),
        "table": lines,
        "total_s": round(time.monotonic() - started, 3),
    }
    write_results(opts.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
