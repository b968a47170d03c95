"""The recovery benchmark's common ground: the job and the fault every system gets, the record of one fault
under one system, and how the results are printed and written (the table, the ratios, the JSON).

`infra.bench.recovery` drives trainguard and writes the report; `infra.bench.recovery_baselines` runs the
launchers it is compared with. The other benchmarks print and write their JSON with `say`, `machine` and
`write_results` too.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / ".bench"
NODES = ("node-0", "node-1")
FAULT_NODE = "node-1"
FAULT_RANK = 1
LAUNCHERS = ("torchrun", "ft_launcher")
"""The baselines trainguard is compared with (`infra.bench.recovery_baselines`)."""
SLOW_DUTY = 0.8
"""`slow`: rank 1 is stopped 80% of every 0.1 s (a GPU running at a fifth of its speed)."""


def say(line: str) -> None:
    print(line, flush=True)


def machine(load_before: tuple[float, float, float],
            load_after: tuple[float, float, float] | None = None) -> dict[str, Any]:
    """What every benchmark's JSON says of the machine it ran on (the load shows what else shared it)."""
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "loadavg_before": load_before, "loadavg_after": load_after or os.getloadavg()}


def write_results(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    say(f"wrote {path}")


# ------------------------------------------------------------------------------------------- results


@dataclass(slots=True)
class Measurement:
    """One fault under one system."""

    fault: str
    system: str
    detection_s: float | None = None
    """Fault to detection (trainguard: the incident; torchrun: its agent's first reaction in its log, the
    `closing signal SIGTERM` to the surviving workers, or `Worker group FAILED`)."""
    restart_s: float | None = None
    """Detection to the first training step of the next attempt."""
    time_to_recover_s: float | None = None
    """Fault to the first training step of the next attempt (detection_s + restart_s)."""
    goodput: float | None = None
    wall_s: float | None = None
    steps_completed: int | None = None
    completed: bool = False
    fault_step: int | None = None
    """Step the job had reached when the fault was sent."""
    resumed_step: int | None = None
    attempts: int | None = None
    mean_step_s: float | None = None
    note: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)
    """torchrun's log lines about the failure and restart, seconds after the fault."""
    workflow_id: str | None = None
    """trainguard: the run, for its history (`trainguard run report`)."""
    restore_tier: str | None = None
    recovery_path: str | None = None
    digest: str | None = None
    """trainguard: the run's final_state_digest."""
    parked_wait_s: float | None = None
    """trainguard: how long the fault waited, once the run passed `--fault-step`, for every node's agent to have
    its processes parked for the next relaunch (None: it did not wait, or they never parked)."""


@dataclass(slots=True)
class Floor:
    cold_start_s: float | None = None
    """Launch of plain torchrun to the first training step, with a local checkpoint present."""
    resumed_step: int | None = None
    note: str = ""

# ----------------------------------------------------------------------------------------- report


def fmt(value: float | None, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def summary(m: Measurement) -> str:
    goodput = None if m.goodput is None else m.goodput * 100
    return (f"{m.system} {m.fault}: detection {fmt(m.detection_s)} s, restart {fmt(m.restart_s)} s, "
            f"time to recover {fmt(m.time_to_recover_s)} s, goodput {fmt(goodput, '{:.1f}%')}, "
            f"wall {fmt(m.wall_s, '{:.1f}')} s{'; ' + m.note if m.note else ''}")


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return round(numerator / denominator, 3)


def report(results: list[Measurement], floor: Floor | None) -> tuple[list[str], dict[str, Any]]:
    lines = [f"{'fault':<9} {'system':<16} {'detection_s':>11} {'restart_s':>9} {'time_to_recover_s':>17} "
             f"{'goodput':>8} {'wall_s':>7} {'fault@':>6} {'resumed':>7} {'done':>4}  note"]
    for m in results:
        lines.append(
            f"{m.fault:<9} {m.system:<16} {fmt(m.detection_s):>11} {fmt(m.restart_s):>9} "
            f"{fmt(m.time_to_recover_s):>17} "
            f"{fmt(None if m.goodput is None else m.goodput * 100, '{:.1f}%'):>8} "
            f"{fmt(m.wall_s, '{:.1f}'):>7} {fmt(m.fault_step, '{}'):>6} {fmt(m.resumed_step, '{}'):>7} "
            f"{'yes' if m.completed else 'no':>4}  {m.note}")
    ratios: dict[str, Any] = {}
    floor_s = floor.cold_start_s if floor else None
    if floor is not None:
        lines.append(f"floor: cold start of the 2 ranks from a local checkpoint (plain torchrun, launch to "
                     f"first "
                     f"step) {fmt(floor_s)} s{'  ' + floor.note if floor.note else ''}")
    lines.append("ratios (baseline / trainguard for times: >1 means trainguard is faster; "
                 "trainguard / baseline for goodput):")
    for fault in dict.fromkeys(m.fault for m in results):
        tg = next((m for m in results if m.fault == fault and m.system == "trainguard"), None)
        entry: dict[str, Any] = {}
        for base in [m for m in results if m.fault == fault and m.system in LAUNCHERS]:
            if tg is None:
                continue
            versus = {
                "detection": _ratio(base.detection_s, tg.detection_s),
                "time_to_recover": _ratio(base.time_to_recover_s, tg.time_to_recover_s),
                "restart": _ratio(base.restart_s, tg.restart_s),
                "wall": _ratio(base.wall_s, tg.wall_s),
                "goodput": _ratio(tg.goodput, base.goodput),
            }
            entry[base.system] = versus
            lines.append(f"  {fault} vs {base.system}: detection {fmt(versus['detection'])}x, time to recover "
                         f"{fmt(versus['time_to_recover'])}x, restart {fmt(versus['restart'])}x, wall "
                         f"{fmt(versus['wall'])}x, goodput {fmt(versus['goodput'])}x")
        for m in [m for m in results if m.fault == fault]:
            if floor_s and m.time_to_recover_s is not None:
                entry[f"{m.system}_restart_over_floor"] = _ratio(m.restart_s, floor_s)
                entry[f"{m.system}_time_to_recover_over_floor"] = _ratio(m.time_to_recover_s, floor_s)
                lines.append(f"  {fault}: {m.system} restart / floor "
                             f"{fmt(entry[f'{m.system}_restart_over_floor'])}x, time to recover / floor "
                             f"{fmt(entry[f'{m.system}_time_to_recover_over_floor'])}x")
        ratios[fault] = entry
    return lines, ratios
