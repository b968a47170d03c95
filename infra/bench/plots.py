"""Pictures of the benchmarks: what `infra.bench.recovery` and `infra.bench.checkpoint` wrote, side by side.

    python -m infra.bench.plots [--recovery .bench/recovery.json] [--checkpoint .bench/checkpoint.json]
                                [--goodput .bench/goodput.json] [--paths .bench/paths.json] [--out .bench]

Writes, for whichever JSON files exist:

- `recovery-timeline.png`: the goodput timeline, training step against wall time for trainguard and
  torchrun, one chart per fault, with the fault, its detection and the first step of the next attempt
  marked, and the time between the fault and that step shaded.
- `recovery-lost.png`: time lost per incident, per fault and system, split into detection, restart
  (detection to the first new step) and the steps redone since the checkpoint resumed from; the cold-start
  floor as a line.
- `checkpoint.png`: every checkpoint figure, trainguard against its baseline (and floor).
- `goodput-timeline.png` (from `infra.bench.goodput`): the fault schedule under trainguard, torchrun and
  ft_launcher on one chart, training step against wall time, each fault marked where it was sent.
- `recovery-paths.png` (from `infra.bench.paths`): time to recover by recovery path, split into detection,
  teardown, restore and relaunch, against the cold-start floor.

Where a measurement carries a per-step `timeline` (rows of `[seconds since the job started, step,
attempt]`) and `fault_at_s`, the timeline chart draws it as measured. Otherwise it is reconstructed from the
measured figures alone (start-up, then the mean step time, the fault at `fault_step`, a flat line until the
first new step at `resumed_step`), and the chart says so.

Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.report import pyplot

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / ".bench"
SYSTEM_COLORS = {"trainguard": "#1f77b4", "torchrun": "#ff7f0e", "ft_launcher": "#2ca02c"}
PART_COLORS = {"detection": "#fdae6b", "restart": "#fb6a4a", "redone": "#9e9ac8"}
FAULT_TITLES = {"crash": "crash (SIGKILL of a rank)", "hang": "hang (SIGSTOP of a rank)"}


# ------------------------------------------------------------------------------------ the data


@dataclass
class Timeline:
    """Step against seconds since the job started, and the recovery's moments on the same clock."""

    system: str
    points: list[tuple[float, int]] = field(default_factory=list)
    """(seconds, step); a drop in step is the restart going back to its checkpoint."""
    fault_s: float | None = None
    detected_s: float | None = None
    recovered_s: float | None = None
    """First training step of the next attempt."""
    fault_step: int | None = None
    resumed_step: int | None = None
    measured: bool = False
    """True: from the benchmark's per-step timeline; False: reconstructed from its figures."""
    note: str = ""


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def measured_timeline(m: dict[str, Any]) -> Timeline | None:
    """The benchmark's own per-step rows, when it wrote them."""
    rows = m.get("timeline")
    fault = _num(m.get("fault_at_s"))
    if not rows or fault is None:
        return None
    rows = sorted((float(r[0]), int(r[1]), int(r[2]) if len(r) > 2 else 0)
                  for r in rows if isinstance(r, (list, tuple)) and len(r) >= 2)
    points: list[tuple[float, int]] = []
    for index, (at, step, attempt) in enumerate(rows):
        if index and attempt != rows[index - 1][2]:
            points.append((at, rows[index - 1][1]))  # flat until the next attempt's first step, then the drop
        points.append((at, step))
    detection, recover = _num(m.get("detection_s")), _num(m.get("time_to_recover_s"))
    return Timeline(system=m.get("system", "?"), points=points, fault_s=fault,
                    detected_s=None if detection is None else fault + detection,
                    recovered_s=None if recover is None else fault + recover,
                    fault_step=m.get("fault_step"), resumed_step=m.get("resumed_step"), measured=True)


def reconstructed_timeline(m: dict[str, Any], config: dict[str, Any]) -> Timeline | None:
    """A timeline that reproduces the measured figures: start-up, steps at the mean step time up to the
    fault, nothing until the first new step, then steps again from the resumed step to the end."""
    wall, step_s = _num(m.get("wall_s")), _num(m.get("mean_step_s")) or _num(config.get("step_time"))
    steps = m.get("steps_completed") or config.get("steps")
    fault_step = m.get("fault_step") or config.get("fault_step")
    resumed = m.get("resumed_step")
    detection, recover = _num(m.get("detection_s")), _num(m.get("time_to_recover_s"))
    if None in (wall, step_s, steps, fault_step, resumed, recover):
        return None
    assert wall is not None and step_s is not None and recover is not None
    training = (fault_step + steps - resumed) * step_s
    startup = max(0.0, wall - training - recover)
    fault = startup + fault_step * step_s
    back = fault + recover
    done = back + (steps - resumed) * step_s
    points = [(0.0, 0), (startup, 0), (fault, fault_step), (back, fault_step), (back, resumed), (done, steps)]
    if wall > done:
        points.append((wall, steps))
    return Timeline(system=m.get("system", "?"), points=points, fault_s=fault,
                    detected_s=None if detection is None else fault + detection, recovered_s=back,
                    fault_step=fault_step, resumed_step=resumed, measured=False,
                    note=f"start-up {startup:.1f} s inferred")


def timeline_of(m: dict[str, Any], config: dict[str, Any]) -> Timeline | None:
    return measured_timeline(m) or reconstructed_timeline(m, config)


def lost_parts(m: dict[str, Any], config: dict[str, Any]) -> dict[str, float]:
    """Seconds lost to one fault: detection, restart (detection to first new step), redone steps."""
    step_s = _num(m.get("mean_step_s")) or _num(config.get("step_time")) or 0.0
    fault_step, resumed = m.get("fault_step"), m.get("resumed_step")
    redone = max(0, fault_step - resumed) * step_s if fault_step is not None and resumed is not None else 0.0
    return {"detection": _num(m.get("detection_s")) or 0.0, "restart": _num(m.get("restart_s")) or 0.0,
            "redone": redone}


# ----------------------------------------------------------------------------------- the charts


def _faults(data: dict[str, Any]) -> list[str]:
    configured = data.get("config", {}).get("faults", [])
    return list(dict.fromkeys([*configured, *(m["fault"] for m in data["results"])]))


def plot_timeline(data: dict[str, Any], path: Path) -> list[str]:
    """One chart per fault: step against seconds since the job started, trainguard and torchrun."""
    plt = pyplot()
    config = data.get("config", {})
    faults = _faults(data)
    fig, axes = plt.subplots(len(faults), 1, figsize=(11, 4.2 * len(faults)), squeeze=False)
    notes: list[str] = []
    reconstructed = False
    for ax, fault in zip(axes[:, 0], faults):
        lines: list[tuple[Timeline, str]] = []
        for m in (r for r in data["results"] if r["fault"] == fault):
            line = timeline_of(m, config)
            if line is None:
                why = m.get("note") or "no data"
                notes.append(f"{fault}/{m['system']}: not enough figures to draw ({why})")
                continue
            reconstructed |= not line.measured
            goodput = m.get("goodput")
            recovered = _num(m.get("time_to_recover_s"))
            label = line.system
            if recovered is not None:
                label += f": first new step {recovered:.1f} s after the fault"
            if goodput is not None:
                label += f", goodput {100 * goodput:.0f}%"
            lines.append((line, label))
            _draw_timeline(ax, line, label)
        # A close-up of the recoveries when they are small against the whole run.
        window = [t for line, _ in lines for t in (line.fault_s, line.recovered_s) if t is not None]
        span = max((x for line, _ in lines for x, _ in line.points), default=0.0)
        zoom = bool(window and span and (max(window) - min(window)) < 0.25 * span)
        if zoom:
            inset = ax.inset_axes((0.6, 0.05, 0.38, 0.42))
            for line, label in lines:
                _draw_timeline(inset, line, None)
            low, high = min(window), max(window)
            pad = max(1.0, 0.3 * (high - low))
            steps = [s for line, _ in lines for s in (line.fault_step, line.resumed_step) if s is not None]
            inset.set_xlim(low - pad, high + pad)
            inset.set_ylim(min(steps) - 30, max(steps) + 30)
            inset.set_title("close-up of the recovery", fontsize=8)
            inset.tick_params(labelsize=7)
            inset.grid(alpha=0.3)
            ax.indicate_inset_zoom(inset, edgecolor="#777777")
        # One legend entry per kind of marker, whatever the system.
        ax.plot([], [], "x", color="#a50f15", ms=9, mew=2.5, label="fault sent")
        ax.plot([], [], "v", color="#cccccc", ms=8, mec="black", label="detected")
        ax.plot([], [], "o", color="#cccccc", ms=8, mec="black", label="first step of the next attempt")
        ax.set_title(f"{FAULT_TITLES.get(fault, fault)} at step {config.get('fault_step', '?')}: "
                     f"training step against wall time")
        ax.set_xlabel("seconds since the job started")
        ax.set_ylabel("training step (rank 0)")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left" if zoom else "best")
    if reconstructed:
        fig.text(0.01, 0.005, "Lines reconstructed from the measured figures (start-up, mean step time, "
                 "fault, detection, first new step): recovery.json has no per-step timeline.",
                 fontsize=8, color="#555555")
    _caption(fig, data)
    fig.tight_layout(rect=(0, 0.02, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return notes


def _draw_timeline(ax: Any, line: Timeline, label: str | None) -> None:
    color = SYSTEM_COLORS.get(line.system, "#555555")
    xs, ys = zip(*line.points)
    ax.plot(xs, ys, color=color, lw=2, label=label)
    if line.fault_s is not None and line.recovered_s is not None:
        ax.axvspan(line.fault_s, line.recovered_s, color=color, alpha=0.12, lw=0)
    if line.fault_s is not None:
        ax.plot([line.fault_s], [line.fault_step], "x", color="#a50f15", ms=10, mew=2.5)
    if line.detected_s is not None:
        ax.plot([line.detected_s], [line.fault_step], "v", color=color, ms=9, mec="black")
    if line.recovered_s is not None:
        ax.plot([line.recovered_s], [line.resumed_step], "o", color=color, ms=8, mec="black")


def plot_lost(data: dict[str, Any], path: Path) -> None:
    """Per fault: seconds lost by each system, split into detection, restart and redone steps."""
    plt = pyplot()
    config = data.get("config", {})
    faults = _faults(data)
    floor = (data.get("floor") or {}).get("cold_start_s")
    fig, axes = plt.subplots(1, len(faults), figsize=(5.5 * len(faults), 5), squeeze=False)
    for ax, fault in zip(axes[0], faults):
        runs = [m for m in data["results"] if m["fault"] == fault]
        names = [m["system"] for m in runs]
        bottoms = [0.0] * len(runs)
        scale = max([sum(lost_parts(m, config).values()) for m in runs] + [1e-3])
        labels = {"detection": "detection (fault to detected)",
                  "restart": "restart (detected to first new step)",
                  "redone": "redone steps (checkpoint to fault)"}
        for part, label in labels.items():
            values = [lost_parts(m, config)[part] for m in runs]
            ax.bar(names, values, bottom=bottoms, color=PART_COLORS[part], label=label, width=0.55)
            for x, (value, bottom) in enumerate(zip(values, bottoms)):
                if value >= 0.07 * scale:
                    ax.annotate(f"{value:.1f}", (x, bottom + value / 2), ha="center", va="center", fontsize=8)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        for x, (m, total) in enumerate(zip(runs, bottoms)):
            goodput = m.get("goodput")
            text = f"{total:.1f} s" + (f"\ngoodput {100 * goodput:.0f}%" if goodput is not None else "")
            ax.annotate(text, (x, total), xytext=(0, 4), textcoords="offset points", ha="center", fontsize=9)
        if floor:
            ax.axhline(floor, color="black", ls="--", lw=1,
                       label=f"floor: cold start of the job from a checkpoint, {floor:.1f} s "
                             f"(compare with restart)")
        top = max([*bottoms, floor or 0.0, 1e-3])
        ax.set_ylim(0, top * 1.2)
        ax.set_title(FAULT_TITLES.get(fault, fault))
        ax.set_ylabel("seconds lost to the fault")
        ax.grid(axis="y", alpha=0.3)
    handles, labels_ = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels_, loc="lower center", ncol=2, fontsize=8, frameon=False)
    _caption(fig, data)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_checkpoint(data: dict[str, Any], path: Path) -> None:
    """Every checkpoint figure: trainguard, its baseline and its floor, seconds and MB/s apart."""
    plt = pyplot()
    figures = [f for f in data.get("figures", []) if _num(f.get("trainguard")) is not None]
    units = list(dict.fromkeys(f["unit"] for f in figures))
    fig, axes = plt.subplots(1, max(1, len(units)), figsize=(6.5 * max(1, len(units)), 5), squeeze=False)
    series = [("trainguard", "#1f77b4", "trainguard"),
              ("baseline", "#ff7f0e", "baseline (sync torch.save + fsync; raw boto3 for transfers)"),
              ("floor", "#7f7f7f", "floor (in-memory copy)")]
    for ax, unit in zip(axes[0], units):
        rows = [f for f in figures if f["unit"] == unit]
        width = 0.8 / len(series)
        for index, (key, color, label) in enumerate(series):
            xs = [i + (index - 1) * width for i in range(len(rows))]
            values = [_num(f.get(key)) or 0.0 for f in rows]
            if not any(values):
                continue
            bars = ax.bar(xs, values, width=width, color=color, label=label)
            for bar, value in zip(bars, values):
                if value:
                    ax.annotate(f"{value:.3g}", (bar.get_x() + bar.get_width() / 2, value), xytext=(0, 2),
                                textcoords="offset points", ha="center", fontsize=7)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([_wrap(f["name"]) for f in rows], fontsize=8)
        ax.set_ylabel(unit + (" (lower is better)" if unit == "s" else " (higher is better)"))
        ax.grid(axis="y", alpha=0.3)
    legend: dict[str, Any] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=3, fontsize=8, frameon=False)
    context = data.get("context", {})
    fig.suptitle(f"checkpoint cost, a {context.get('size_mib', '?')} MiB state, medians of "
                 f"{context.get('repeats', '?')} ({context.get('cpus', '?')} CPUs)", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


FAULT_MARKS = {"crash": "x", "hang": "s", "slow": "^", "node-down": "D"}


def plot_goodput(data: dict[str, Any], path: Path) -> None:
    """The fault schedule: step against wall time for every system on one chart, faults marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 5.5))
    for outcome in data.get("outcomes", []):
        points = outcome.get("timeline") or []
        if not points:
            continue
        color = SYSTEM_COLORS.get(outcome["system"], "#555555")
        xs, ys = zip(*points)
        goodput = outcome.get("goodput")
        ending = "completed" if outcome.get("completed") else f"lost at step {outcome.get('steps_completed')}"
        label = f"{outcome['system']}: goodput {100 * goodput:.1f}%, {ending}" if goodput is not None \
            else outcome["system"]
        ax.plot(xs, ys, color=color, lw=2, label=label, drawstyle="steps-post")
        for at, fault in outcome.get("faults") or []:
            step = max((y for x, y in points if x <= at), default=0)
            ax.plot([at], [step], FAULT_MARKS.get(fault, "o"), color="#a50f15", ms=9, mec=color, mew=1.5)
    for fault, mark in FAULT_MARKS.items():
        ax.plot([], [], mark, color="#a50f15", ms=8, label=f"{fault} sent")
    config, machine = data.get("config", {}), data.get("machine", {})
    ax.set_title(f"goodput under a fault schedule: {config.get('steps', '?')} steps, "
                 f"{', '.join(f'{f} at {s}' for s, f in config.get('schedule', []))}; "
                 f"{machine.get('cpus', '?')} CPUs", fontsize=10)
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("training step")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_paths(data: dict[str, Any], path: Path) -> None:
    """Time to recover per recovery path, as stacked bars of its parts, with the cold-start floor."""
    plt = pyplot()
    rows = [r for r in data.get("summary", []) if r.get("time_to_recover_s") is not None]
    parts = {"detection_s": ("detection", "#fdae6b"), "teardown_s": ("teardown", "#fb6a4a"),
             "restore_s": ("restore", "#9e9ac8"), "relaunch_s": ("relaunch / rejoin", "#6baed6")}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [r["path"] for r in rows]
    lefts = [0.0] * len(rows)
    for key, (label, color) in parts.items():
        values = [r.get(key) or 0.0 for r in rows]
        ax.barh(names, values, left=lefts, color=color, label=label, height=0.55)
        lefts = [a + b for a, b in zip(lefts, values)]
    for y, r in enumerate(rows):
        ax.annotate(f"{r['time_to_recover_s']:.2f} s", (lefts[y], y), xytext=(4, 0), textcoords="offset points",
                    va="center", fontsize=9)
    floor = (data.get("floor") or {}).get("cold_start_s")
    if floor:
        ax.axvline(floor, color="black", ls="--", lw=1, label=f"floor: cold start from a checkpoint, {floor:.2f} s")
    config = data.get("config", {})
    ax.set_title(f"time to recover a crash by path (medians of {config.get('repeats', '?')} runs each; "
                 f"hidden {config.get('hidden', '?')})", fontsize=10)
    ax.set_xlabel("seconds from the fault to the first training step after it")
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _wrap(text: str, width: int = 16) -> str:
    words, lines, line = text.split(), [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "\n".join([*lines, line])


def _caption(fig: Any, data: dict[str, Any]) -> None:
    config, machine = data.get("config", {}), data.get("machine", {})
    fig.suptitle(f"recovery: 2-rank gloo job, {config.get('steps', '?')} steps x "
                 f"{config.get('step_time', '?')} s, "
                 f"checkpoint every {config.get('checkpoint_every', '?')}; {machine.get('cpus', '?')} CPUs; "
                 f"torchrun --max-restarts {config.get('torchrun', {}).get('max_restarts', '?')}, "
                 f"pg timeout {config.get('torchrun', {}).get('pg_timeout_s', '?')} s", fontsize=10)


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recovery", type=Path, default=BENCH_DIR / "recovery.json")
    parser.add_argument("--checkpoint", type=Path, default=BENCH_DIR / "checkpoint.json")
    parser.add_argument("--goodput", type=Path, default=BENCH_DIR / "goodput.json")
    parser.add_argument("--paths", type=Path, default=BENCH_DIR / "paths.json")
    parser.add_argument("--out", type=Path, default=BENCH_DIR, help="where the PNGs go (default .bench)")
    opts = parser.parse_args(argv)
    try:
        pyplot()
    except RuntimeError as error:
        print(f"plots: {error}", file=sys.stderr)
        return 1
    opts.out.mkdir(parents=True, exist_ok=True)
    wrote: list[Path] = []
    if opts.recovery.exists():
        data = json.loads(opts.recovery.read_text())
        for note in plot_timeline(data, opts.out / "recovery-timeline.png"):
            print(f"plots: {note}")
        plot_lost(data, opts.out / "recovery-lost.png")
        wrote += [opts.out / "recovery-timeline.png", opts.out / "recovery-lost.png"]
    else:
        print(f"plots: no {opts.recovery} (make bench-recovery writes it)")
    if opts.checkpoint.exists():
        plot_checkpoint(json.loads(opts.checkpoint.read_text()), opts.out / "checkpoint.png")
        wrote.append(opts.out / "checkpoint.png")
    else:
        print(f"plots: no {opts.checkpoint} (make bench-checkpoint writes it)")
    for source, name, draw in ((opts.goodput, "goodput-timeline.png", plot_goodput),
                               (opts.paths, "recovery-paths.png", plot_paths)):
        if source.exists():
            draw(json.loads(source.read_text()), opts.out / name)
            wrote.append(opts.out / name)
        else:
            print(f"plots: no {source} (make bench writes it)")
    for path in wrote:
        print(f"wrote {path}")
    return 0 if wrote else 1


if __name__ == "__main__":
    raise SystemExit(main())
