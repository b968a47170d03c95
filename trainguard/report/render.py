"""Report -> what a person reads: the table, the PNG, the hang stacks, and `trainguard run report`."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainguard.models import Incident
from trainguard.report.compute import build_report
from trainguard.report.model import PHASE_COLORS, RunReport, StepPoint


MATPLOTLIB_HINT = "drawing PNGs needs matplotlib: pip install matplotlib (or pip install 'trainguard[bench]')"


def render_stacks(hangs: Sequence[tuple[int, Incident]], read: Any) -> str:
    """Each hang's evidence and every rank's full stacks, stored with the run. `read(url)` lists and reads
    the texts under an `s3://bucket/prefix/` URL: (key, text) pairs."""
    lines: list[str] = []
    for index, incident in hangs:
        lines += ["", f"incident {index}: hang, culprit rank {incident.rank} on {incident.node} "
                      f"(stacks: {incident.evidence_key})"]
        lines += [f"  {part}" for part in incident.evidence.splitlines()]
        try:
            texts = read(incident.evidence_key)
        except Exception as error:  # noqa: BLE001 - the store's any failure: say so, the table stands
            lines.append(f"  stacks not readable: {error}")
            continue
        for key, text in texts:
            lines += ["", f"--- {key}", text.rstrip()]
    return "\n".join(lines)


def read_store_texts(url: str, client: Any = None) -> list[tuple[str, str]]:
    """Every object under an `s3://bucket/prefix/` URL, as text (the store's client from the environment)."""
    from trainguard.settings import s3_client

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = client or s3_client()
    keys = sorted(o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
                  for o in page.get("Contents", []))
    return [(key, client.get_object(Bucket=bucket, Key=key)["Body"].read().decode(errors="replace")) for key in keys]


def _f(value: float | None, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


LOG_LINES_SHOWN = 8
"""Lines of a rank incident's log tail the table shows: a traceback's last frames and its exception."""


def render_table(report: RunReport) -> str:
    wall = report.wall_s or 1e-9
    lines = [
        f"run {report.workflow_id}: {report.status.lower()}, {report.attempts} attempt(s), "
        f"{len(report.incidents)} incident(s), wall {report.wall_s:.2f} s"
        + (f" (workflow clock {report.result_wall_s:.2f} s)" if report.result_wall_s else ""),
        "",
        f"{'phase':<13} {'seconds':>9} {'share':>7}",
    ]
    for phase, seconds in report.phases.items():
        lines.append(f"{phase:<13} {seconds:>9.2f} {100 * seconds / wall:>6.1f}%")
    lines.append(f"{'total':<13} {sum(report.phases.values()):>9.2f} "
                 f"{100 * sum(report.phases.values()) / wall:>6.1f}%")
    by_attempt: dict[int, dict[str, float]] = {}
    for segment in report.segments:
        if segment.phase in ("restoring", "launching", "running") and segment.attempt:
            spent = by_attempt.setdefault(segment.attempt, {})
            spent[segment.phase] = spent.get(segment.phase, 0.0) + segment.seconds
    if len(by_attempt) > 1:
        lines.append("")
        for attempt, spent in sorted(by_attempt.items()):
            lines.append(f"attempt {attempt}: " + ", ".join(f"{p} {s:.2f} s" for p, s in spent.items()))
    lines += ["", "goodput"]
    steps = "-" if report.steps_completed is None else str(report.steps_completed)
    named = "".join(f" + {name} {seconds:.2f} s" for name, seconds in report.named_phases.items())
    lines.append(f"  useful training   {_f(report.useful_s):>9} s  ({steps} steps x "
                 f"{_f(report.mean_step_s, '{:.4f}')} s{named})")
    lines.append(f"  lost to incidents {report.lost_s:>9.2f} s")
    lines.append(f"  other overhead    {_f(report.overhead_s):>9} s  (first start, checkpoints, finishing)")
    percent = None if report.goodput is None else 100 * report.goodput
    lines.append(f"  goodput           {_f(percent, '{:.1f}'):>9} %")
    if report.incidents:
        lines += ["", f"{'#':>2} {'kind':<18} {'node':<8} {'rank':>4} {'att':>3} {'action':<12} {'at_s':>7} "
                      f"{'detect_s':>8} {'recover_s':>9} {'steps':>11} {'redone_s':>8} {'lost_s':>7}  note"]
        for index, loss in enumerate(report.incidents, 1):
            steps_text = "-" if loss.step_at_detection is None else (
                f"{loss.resumed_step}..{loss.step_at_detection}" if loss.resumed_step is not None
                else str(loss.step_at_detection))
            lines.append(
                f"{index:>2} {loss.kind:<18} {loss.node or '-':<8} {_f(loss.rank, '{}'):>4} "
                f"{loss.attempt:>3} "
                f"{loss.action:<12} {_f(loss.at_s, '{:.1f}'):>7} {_f(loss.detection_s):>8} "
                f"{_f(loss.recovery_s):>9} {steps_text:>11} {_f(loss.redone_s):>8} {loss.lost_s:>7.2f}  "
                f"{loss.note}")
    for index, loss in enumerate(report.incidents, 1):
        if loss.log_path or loss.log_tail:
            lines += ["", f"#{index} {loss.kind} rank {_f(loss.rank, '{}')} on {loss.node or '-'}: "
                          f"log {loss.log_path or '-'}"]
            lines += [f"   | {line}" for line in loss.log_tail.splitlines()[-LOG_LINES_SHOWN:]]
    for note in report.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def pyplot() -> Any:
    """matplotlib's pyplot on the headless Agg backend, or an error saying how to install it."""
    try:
        import matplotlib
    except ImportError as error:
        raise RuntimeError(MATPLOTLIB_HINT) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def render_png(report: RunReport, path: str | Path) -> None:
    """Two panels: step against wall time over the phases (incidents marked), and the time lost per
    incident split into detection, recovery and redone work. Needs matplotlib."""
    plt = pyplot()
    from matplotlib.patches import Patch

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7.5), gridspec_kw={"height_ratios": [3, 2]})
    for segment in report.segments:
        top.axvspan(segment.start, segment.end, color=PHASE_COLORS.get(segment.phase, "#dddddd"), alpha=0.45,
                    lw=0)
    by_attempt: dict[int, list[StepPoint]] = {}
    for point in report.points:
        by_attempt.setdefault(point.attempt, []).append(point)
    for attempt, points in sorted(by_attempt.items()):
        top.plot([p.at_s for p in points], [p.step for p in points], marker="o", ms=3, lw=1.8,
                 label=f"attempt {attempt}")
    top_step = max((p.step for p in report.points), default=1)
    for index, loss in enumerate(report.incidents, 1):
        if loss.at_s is None:
            continue
        top.axvline(loss.at_s, color="#a50f15", ls="--", lw=1)
        top.annotate(f"#{index} {loss.kind}", (loss.at_s, top_step), xytext=(3, -12),
                     textcoords="offset points", color="#a50f15", fontsize=8)
        if loss.detection_s:
            top.axvline(loss.at_s - loss.detection_s, color="#a50f15", ls=":", lw=1)
    top.set_xlim(0, max(report.wall_s, 1e-3))
    top.set_ylim(bottom=0)
    top.set_xlabel("seconds since the run started")
    top.set_ylabel("training step")
    goodput = "-" if report.goodput is None else f"{100 * report.goodput:.1f}%"
    top.set_title(f"{report.workflow_id}: {report.status.lower()}, wall {report.wall_s:.1f} s, "
                  f"goodput {goodput}")
    phase_handles = [Patch(color=PHASE_COLORS[p], alpha=0.45, label=f"{p} {s:.1f}s")
                     for p, s in report.phases.items() if s > 0]
    line_handles, _ = top.get_legend_handles_labels()
    top.legend(handles=[*line_handles, *phase_handles], fontsize=8, loc="upper left", ncol=2)

    if report.incidents:
        labels = [f"#{i} {loss.kind}\n{loss.node or ''}" for i, loss in enumerate(report.incidents, 1)]
        parts = [("detection", "#fdae6b", [loss.detection_s or 0.0 for loss in report.incidents]),
                 ("recovery (to first new step)", "#fb6a4a",
                  [loss.recovery_s or 0.0 for loss in report.incidents]),
                 ("redone steps", "#9e9ac8", [loss.redone_s or 0.0 for loss in report.incidents])]
        left = [0.0] * len(labels)
        for name, color, values in parts:
            bottom.barh(labels, values, left=left, color=color, label=name, height=0.6)
            left = [a + b for a, b in zip(left, values)]
        for y, loss in enumerate(report.incidents):
            bottom.annotate(f"{loss.lost_s:.2f} s", (left[y], y), xytext=(4, 0), textcoords="offset points",
                            va="center", fontsize=8)
        pad = max(0, 2 - len(labels)) * 0.5  # a lone bar stays bar-sized
        bottom.set_ylim(len(labels) - 0.4 + pad, -0.6 - pad)
        bottom.set_xlim(0, max(left) * 1.12 or 1.0)
        bottom.set_xlabel("seconds lost")
        bottom.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
        bottom.set_title(f"time lost per incident (total {report.lost_s:.2f} s)", pad=24)
    else:
        names = [p for p, s in report.phases.items() if s > 0]
        bottom.barh(names, [report.phases[p] for p in names], color=[PHASE_COLORS[p] for p in names])
        bottom.invert_yaxis()
        bottom.set_xlabel("seconds")
        bottom.set_title("time per phase (no incidents)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def main_report(workflow_id: str, png: str | None) -> int:
    """`trainguard run report ID [--png FILE]`: print the breakdown, optionally draw it."""
    from temporalio.service import RPCError

    from trainguard.connect import connect

    try:
        client = await connect()
    except RuntimeError as error:  # the SDK's "Failed client connect: ..."
        print(f"report: {error}", file=sys.stderr)
        return 1
    try:
        report = await build_report(client, workflow_id)
    except RPCError as error:  # no such workflow, or no permission to read it
        print(f"report: {workflow_id}: {error.message}", file=sys.stderr)
        return 1
    print(render_table(report))
    if report.hangs:
        print(render_stacks(report.hangs, read_store_texts))
    if png:
        try:
            render_png(report, png)
        except RuntimeError as error:
            print(f"report: {error}", file=sys.stderr)
            return 1
        print(f"wrote {png}")
    return 0
