"""What the Temporal Web UI shows of a run at a glance: its current details (workflow metadata), a short
markdown summary of its status, refreshed as the phase, the committed step or the incidents change.

Pure: a function of the status, tested without a server. The workflow sets it with
`workflow.set_current_details`, which is metadata (a built-in query), not a command: replay-safe.
"""

from __future__ import annotations

from trainguard.models import RunStatus

DETAIL_MAX_CHARS = 300
"""An incident's detail, cut: the Web UI's summary is a glance, the status query has the rest."""


def run_details(status: RunStatus, spares: list[str]) -> str:
    """`**running**, attempt 2, step 120 (checkpoint 100)` and the nodes, the spares, the last incident."""
    committed = status.latest_checkpoint.step if status.latest_checkpoint else None
    lines = [f"**{status.phase.value}**, attempt {status.attempt}, step {status.step}"
             + (f" (checkpoint {committed})" if committed is not None else " (no checkpoint yet)")]
    if status.nodes:
        lines.append(f"nodes: {', '.join(status.nodes)} ({status.world_size} ranks)"
                     + (f"; spares: {', '.join(spares)}" if spares else ""))
    if status.cordoned:
        lines.append(f"taken out: {', '.join(status.cordoned)}")
    if status.replaced_at_start:
        lines.append("cordoned at start: " + ", ".join(f"{named} (spare {spare} in its place)"
                                                       for named, spare in status.replaced_at_start.items()))
    if status.reason:
        lines.append(f"reason: {status.reason[:DETAIL_MAX_CHARS]}")
    trouble = status.store_error or "; ".join(f"{n}: {e}" for n, e in sorted(status.upload_errors.items())[:2])
    if trouble:
        lines.append(f"checkpoints not committing: {trouble[:DETAIL_MAX_CHARS]}")
    if status.incidents:
        last = status.incidents[-1]
        where = f"{last.node or '-'}" + (f" rank {last.rank}" if last.rank is not None else "")
        lines.append(f"incidents: {len(status.incidents)}; last: {last.kind.value} on {where} "
                     f"(attempt {last.attempt}, {last.action.value}): {last.detail[:DETAIL_MAX_CHARS]}")
        if last.log_path:
            lines.append(f"rank log: `{last.log_path}` on {last.node}")
    return "\n\n".join(lines)
