"""The node-scale benchmark's figures (`infra/bench/nodes.py`): what one size measured (`Size`), summed up from the
run's histories and commits, judged against issue 12's targets and printed as a table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from infra.bench.history import HistoryFigures, marginal_per_checkpoint, percentile

if TYPE_CHECKING:
    from infra.bench.nodes import Plan

TARGET_PENDING = 1000
TARGET_PAYLOAD_BYTES = 256 * 1024
TARGET_RELAUNCH_P95_S = 15.0


def target_events_per_checkpoint(nodes: int) -> float:
    """Issue 12: history events per committed checkpoint, all histories together, at most 50 + N/10."""
    return 50 + nodes / 10


@dataclass(slots=True)
class Size:
    """The figures of one N."""

    nodes: int
    ranks_per_node: int = 8
    completed: bool = False
    wall_s: float | None = None
    events_total: int | None = None
    events_root: int | None = None
    events_per_checkpoint: dict[str, Any] = field(default_factory=dict)
    """`all`, `root`: marginal events per checkpoint (`method` says `marginal`, or `average` where no attempt
    committed twice)."""
    events_per_commit_avg: dict[str, float | None] = field(default_factory=dict)
    max_pending: int | None = None
    max_pending_execution: str | None = None
    largest_payload_bytes: int | None = None
    largest_payload_event: str | None = None
    relaunch_p95_s: float | None = None
    relaunch_max_s: float | None = None
    relaunch_p95_by_kind: dict[str, float | None] = field(default_factory=dict)
    """The same p95 for each kind of incident on its own (crash, hang, node_unresponsive): a hang's relaunch waits
    for its evidence, so it is told apart from the others'."""
    continue_as_new: int | None = None
    controller_cpu_s: float | None = None
    controller_peak_rss_mb: float | None = None
    server_cpu_s: float | None = None
    """The Temporal dev server's CPU seconds during the run."""
    standins_cpu_s: float | None = None
    """This process's (the stand-in nodes') CPU seconds during the run."""
    hang: dict[str, Any] = field(default_factory=dict)
    """The hang's incident (`hang` above)."""
    histories: int | None = None
    commits: int = 0
    incidents: list[str] = field(default_factory=list)
    activities: dict[str, int] = field(default_factory=dict)
    """Activities scheduled across all histories, by type."""
    workflow_task_failures: dict[str, int] = field(default_factory=dict)
    activity_troubles: dict[str, int] = field(default_factory=dict)
    """Activities that timed out or failed, by type and how."""
    start_wait_s: dict[str, float | None] = field(default_factory=dict)
    """p95 and max seconds from scheduled to started, node-pinned activities (`node_p95`, `node_max`: the
    stand-ins keeping up, or not) and the controller's (`controller_p95`, `controller_max`)."""
    stack_up_s: float | None = None
    queues: int | None = None
    """Shared queues the stand-ins were served on (`queues_for`)."""
    step_s: float | None = None
    """Simulated seconds per step (`step_s_for`)."""
    notes: list[str] = field(default_factory=list)



def relaunch_times(incidents: list[Any], workflow_id: str, nodes: Any) -> list[list[float]]:
    """Per recovered incident: for each node of the next attempt, seconds from detection to its launch."""
    per_incident = []
    for incident in incidents:
        if incident.action.value == "report" or not incident.detected_at:
            continue
        launched = nodes.launch_times(workflow_id, incident.attempt + 1)
        per_incident.append([max(0.0, at - incident.detected_at) for at in launched.values()])
    return per_incident


def summarize(size: Size, histories: list[HistoryFigures], workflow_id: str, commits: list[dict[str, Any]]) -> None:
    root = [h for h in histories if h.workflow_id == workflow_id]
    size.histories = len(histories)
    size.events_total = sum(h.events for h in histories)
    size.events_root = sum(h.events for h in root)
    size.commits = len(commits)
    marks = [(c["at"], c["attempt"]) for c in commits]
    size.events_per_commit_avg = {
        "all": round(size.events_total / len(commits), 1) if commits else None,
        "root": round(size.events_root / len(commits), 1) if commits else None}
    marginal = {"all": marginal_per_checkpoint(marks, histories), "root": marginal_per_checkpoint(marks, root)}
    if marginal["all"] is None:  # no two commits in one attempt (few checkpoints): the plain average it is
        size.events_per_checkpoint = {**size.events_per_commit_avg, "method": "average"}
    else:
        size.events_per_checkpoint = {**marginal, "method": "marginal"}
    if histories:
        worst = max(histories, key=lambda h: h.max_pending)
        size.max_pending, size.max_pending_execution = worst.max_pending, f"{worst.workflow_id} {worst.run_id}"
        biggest = max(histories, key=lambda h: h.largest_payload_bytes)
        size.largest_payload_bytes = biggest.largest_payload_bytes
        size.largest_payload_event = f"{biggest.workflow_id}: event {biggest.largest_payload_event}"
    size.continue_as_new = sum(h.continued_as_new for h in histories)
    from trainguard import TASK_QUEUE

    waits: dict[str, list[float]] = {"node": [], "controller": []}
    for h in histories:
        for queue, found in h.start_waits.items():
            waits["controller" if queue == TASK_QUEUE else "node"].extend(found)
    for side, found in waits.items():
        p95 = percentile(found, 0.95)
        size.start_wait_s[f"{side}_p95"] = None if p95 is None else round(p95, 3)
        size.start_wait_s[f"{side}_max"] = round(max(found), 3) if found else None
    for h in histories:
        for name, count in h.activity_counts.items():
            size.activities[name] = size.activities.get(name, 0) + count
        for cause, count in h.workflow_task_failures.items():
            size.workflow_task_failures[cause] = size.workflow_task_failures.get(cause, 0) + count
        for trouble, count in h.activity_troubles.items():
            size.activity_troubles[trouble] = size.activity_troubles.get(trouble, 0) + count



def hang_figures(incidents: list[Any], plan: Plan, relaunch: list[list[float]],
                 activities: dict[str, int]) -> dict[str, Any]:
    """The hang's incident: whom it named (against the rank the benchmark stopped), how soon, how many nodes the
    run had to ask for evidence, and its own relaunch."""
    hang = next((i for i in incidents if i.kind.value == "hang"), None)
    if hang is None:
        return {"note": "no hang incident"}
    stopped = (plan.hang_node, plan.nodes.index(plan.hang_node) * plan.ranks_per_node)
    times = [s for per in relaunch for s in per]
    p95 = percentile(times, 0.95)
    return {"culprit": f"rank {hang.rank} on {hang.node}", "culprit_right": (hang.node, hang.rank) == stopped,
            "attribution_s": hang.attribution_s, "detection_s": hang.detection_s,
            "evidence_asked_of_nodes": activities.get("collect_evidence", 0),
            "relaunch_p95_s": None if p95 is None else round(p95, 3),
            "relaunch_max_s": round(max(times), 3) if times else None, "evidence": (hang.evidence or "")[:200]}



def _fmt(value: float | int | None, pattern: str = "{:.0f}") -> str:
    return "-" if value is None else pattern.format(value)


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("pass" if ok else "FAIL")


def targets(size: Size) -> dict[str, bool | None]:
    per_checkpoint = size.events_per_checkpoint.get("all")
    return {
        "completed": size.completed,
        "max_pending": None if size.max_pending is None else size.max_pending <= TARGET_PENDING,
        "events_per_checkpoint": None if per_checkpoint is None
        else per_checkpoint <= target_events_per_checkpoint(size.nodes),
        "payload": None if size.largest_payload_bytes is None else size.largest_payload_bytes <= TARGET_PAYLOAD_BYTES,
        "relaunch_p95": None if size.relaunch_p95_s is None else size.relaunch_p95_s <= TARGET_RELAUNCH_P95_S,
    }


def report(sizes: list[Size]) -> list[str]:
    lines = [f"{'nodes':>5} {'done':>4} {'wall_s':>7} {'events all/root':>15} {'ev/ckpt all/root':>16} "
             f"{'avg/ckpt':>8} {'pending':>7} {'payload_KB':>10} {'relaunch p95/max':>16} {'CAN':>3} "
             f"{'commits':>7} {'ctl_cpu_s':>9} {'ctl_MB':>6}"]
    for s in sizes:
        per = s.events_per_checkpoint
        lines.append(
            f"{s.nodes:>5} {'yes' if s.completed else 'NO':>4} {_fmt(s.wall_s, '{:.1f}'):>7} "
            f"{_fmt(s.events_total) + ' / ' + _fmt(s.events_root):>15} "
            f"{_fmt(per.get('all'), '{:.0f}') + ' / ' + _fmt(per.get('root'), '{:.0f}'):>16} "
            f"{_fmt(s.events_per_commit_avg.get('all')):>8} {_fmt(s.max_pending):>7} "
            f"{_fmt(None if s.largest_payload_bytes is None else s.largest_payload_bytes / 1024, '{:.1f}'):>10} "
            f"{_fmt(s.relaunch_p95_s, '{:.2f}') + ' / ' + _fmt(s.relaunch_max_s, '{:.2f}'):>16} "
            f"{_fmt(s.continue_as_new):>3} {s.commits:>7} {_fmt(s.controller_cpu_s, '{:.1f}'):>9} "
            f"{_fmt(s.controller_peak_rss_mb):>6}")
    lines += ["", "issue 12 targets: pending <= 1000, events/checkpoint (all) <= 50 + N/10, payload <= 256 KB, "
              "relaunch p95 <= 15 s",
              f"{'nodes':>5} {'completed':>9} {'pending':>16} {'events/ckpt':>22} {'payload':>18} {'relaunch':>16}"]
    for s in sizes:
        ok = targets(s)
        per = s.events_per_checkpoint.get("all")
        lines.append(
            f"{s.nodes:>5} {_verdict(ok['completed']):>9} "
            f"{_fmt(s.max_pending) + ' <= 1000 ' + _verdict(ok['max_pending']):>16} "
            f"{_fmt(per) + ' <= ' + _fmt(target_events_per_checkpoint(s.nodes)) + ' ' + _verdict(ok['events_per_checkpoint']):>22} "
            f"{_fmt(None if s.largest_payload_bytes is None else s.largest_payload_bytes / 1024, '{:.0f}KB') + ' <= 256KB ' + _verdict(ok['payload']):>18} "
            f"{_fmt(s.relaunch_p95_s, '{:.1f}s') + ' <= 15s ' + _verdict(ok['relaunch_p95']):>16}")
    for s in sizes:
        h = s.hang or {"note": "not measured"}
        lines.append(f"  {s.nodes}: hang: " + (h.get("note") or (
            f"named {h['culprit']} ({'right' if h['culprit_right'] else 'WRONG'}) in {_fmt(h['attribution_s'])} s, "
            f"evidence asked of {h['evidence_asked_of_nodes']} node(s), relaunch p95 "
            f"{_fmt(h['relaunch_p95_s'])} s / max {_fmt(h['relaunch_max_s'])} s")))
        if s.relaunch_p95_by_kind:
            lines.append(f"  {s.nodes}: relaunch p95 by incident: " + ", ".join(
                f"{kind} {_fmt(p95, '{:.1f}')} s" for kind, p95 in s.relaunch_p95_by_kind.items()))
        for note in [*s.incidents, *s.notes]:
            lines.append(f"  {s.nodes}: {note}")
    return lines
