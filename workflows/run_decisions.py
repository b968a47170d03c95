"""Pure decisions of a run's supervision loop, beside `workflows/policy.py`'s decision about an incident.

No I/O and no clock reads: times and history sizes are arguments, so each is tested with a table of cases
(tests/unit/test_run_decisions.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from trainguard.models import Action, Incident, IncidentKind
from workflows.policy import Decision

SUGGESTED_HISTORY_BYTES = 4 * 1024 * 1024
"""Temporal's default size past which it suggests continue-as-new (`limit.historySize.suggestContinueAsNew`,
4 MB; the limit is 50 MB): a suggestion from a history this large is the size's, and is taken. The server also
suggests at 4,096 events, which a 4,096-node run reaches in two relaunches (each continue-as-new starts every
node's watch again): the event count that decides is the spec's `max_history_events`."""

DECISION_READS_PER_S = 1000
"""Reads of the run's decision object a run's watches make each second, at most: each node reads it every
max(1, nodes / 1,000) s (a 4,096-node run: every 4.1 s, which bounds how late a node takes up a relaunch)."""


def decision_every_s(num_nodes: int) -> float:
    return max(1.0, round(num_nodes / DECISION_READS_PER_S, 3))


def earliest_incident(seen: Sequence[tuple[float, Incident]]) -> Incident | None:
    """Several nodes may report at once (a controller was down meanwhile, a crash's peers fail in their
    collective): the incident is the earliest failure by when it happened, so a peer that failed because of it
    is never blamed. Equal times keep the first reported, in the order the caller fixed."""
    if not seen:
        return None
    return min(seen, key=lambda found: found[0])[1]


def continue_as_new_due(*, suggested: bool, history_bytes: int, history_events: int, max_events: int) -> bool:
    """Whether a quiet run (nothing else to do at this commit) should continue as new."""
    if history_events >= max_events:
        return True
    return suggested and history_bytes >= SUGGESTED_HISTORY_BYTES


@dataclass(frozen=True, slots=True)
class StragglerVerdict:
    counts: dict[int, int]
    """Rank -> consecutive slow intervals, this one included (for the incident's words)."""
    streaks: dict[int, int]
    """What the run carries to the next interval: `counts`, or nothing once a straggler goes to the policy."""
    first_seen: list[int]
    """Ranks slow for the first time: reported, not acted on."""
    persisted: int | None
    """A rank slow for `windows` intervals in a row with a spare to take its node's place: the policy decides."""


def judge_stragglers(streaks: dict[int, int], slow: dict[int, float], *, windows: int,
                     have_spare: bool) -> StragglerVerdict:
    """`slow`: rank -> how many times slower than its peers' median over one pace window, in rank order as
    the pace judge (`PaceVerdict.slow`) reports them; `streaks`: the windows in a row each was slow in before
    this one."""
    counts = {rank: streaks.get(rank, 0) + 1 for rank in slow}
    first: list[int] = []
    for rank in slow:
        if counts[rank] == 1:
            first.append(rank)
        if counts[rank] >= windows and have_spare:
            return StragglerVerdict(counts=counts, streaks={}, first_seen=first, persisted=rank)
    return StragglerVerdict(counts=counts, streaks=counts, first_seen=first, persisted=None)


PACE_WRITES_PER_S = 100
"""Pace records a run's nodes write to the store each second, at most: a run of more than `PACE_WRITES_PER_S` x
`health.straggler_window_s` nodes widens its window to nodes / 100 s (4,096 nodes: 41 s), so the store and the
committer that reads every record see a bounded load."""

CONSECUTIVE_WINDOWS = 1.75
"""Two slow windows are in a row when the second ended within this many windows of the first: the nodes write
once a window, each on its own clock, so the next window ends about one window later; two or more means a
window in between kept pace (the committer returns only slow ones)."""


def pace_window_s(configured: float, num_nodes: int) -> float:
    """The straggler window a run of `num_nodes` nodes uses: the spec's, widened for a large run."""
    return max(configured, round(num_nodes / PACE_WRITES_PER_S, 3))


def judge_pace(streaks: dict[int, int], last_end: float, slow: dict[int, float], *, window_end: float,
               window_s: float, windows: int, have_spare: bool) -> StragglerVerdict:
    """A window of training in which `slow` ranks computed slower than their peers (the committer compared the
    nodes' pace, `activities.pace`): a rank slow in `windows` windows in a row, with a spare to take its node's
    place, goes to the policy; a rank slow for the first time is reported. `last_end`: when the previous slow
    window ended (0: none); a window that kept pace in between starts every streak again."""
    in_a_row = last_end > 0 and window_end - last_end <= CONSECUTIVE_WINDOWS * window_s
    return judge_stragglers(streaks if in_a_row else {}, slow, windows=windows, have_spare=have_spare)


def lost_since(incident: Incident, silence_s: float) -> float | None:
    """For a lost node: the earliest time the run may last have heard from it (`silence_s` before it was
    found: a watch's heartbeat timeout or a stop's schedule-to-start). An agent that registered after that is
    back, and is not cordoned; None for any other incident."""
    if incident.kind is not IncidentKind.NODE_UNRESPONSIVE or incident.detected_at <= 0:
        return None
    return incident.detected_at - silence_s


def same_failure_reason(incident: Incident, why: str) -> str:
    """A run stopped for a script that fails the same way every time: the reason names the failure, where
    the rank's log is, and ends with the traceback, so `run result`, `status` and the CLI show the cause."""
    where = f"rank {incident.rank} on {incident.node}" if incident.rank is not None else f"{incident.node}"
    log = f" (log: {incident.log_path} on {incident.node})" if incident.log_path else ""
    tail = f"\n{incident.log_tail}" if incident.log_tail else ""
    return f"{where}: {incident.signature}: {why}{log}{tail}"


def stop_reason(decision: Decision, incident: Incident, seen_as: str, *, same_failures: int,
                max_same_failure: int, rank_fault: bool) -> Decision:
    """A stop names its cause: a script failing the same way is quoted with its traceback; a spent budget
    names the fault that spent it and where its rank's log is. Other decisions pass unchanged."""
    if decision.action is not Action.STOP:
        return decision
    if max_same_failure and same_failures >= max_same_failure:
        return Decision(Action.STOP, same_failure_reason(incident, decision.reason))
    if seen_as and (rank_fault or incident.kind is IncidentKind.USER_ERROR):
        where = f" (log: {incident.log_path} on {incident.node})" if incident.log_path else ""
        return Decision(Action.STOP, f"{decision.reason}; the last incident: {seen_as}{where}")
    return decision


STALE_DEFAULT_S = 900.0
"""Before two commits have measured the interval: how long a run may go without one."""
STALE_FLOOR_S = 300.0
STALE_INTERVALS = 3


def stale_after_s(configured: float | None, commit_times: Sequence[float]) -> float:
    """How long a run may go without committing a checkpoint before it is a storage incident: the spec's
    `checkpoint.stale_after_s`, else three intervals as measured between the last two commits (at least
    `STALE_FLOOR_S`), else `STALE_DEFAULT_S`."""
    if configured is not None:
        return configured
    if len(commit_times) >= 2:
        return max(STALE_FLOOR_S, STALE_INTERVALS * (commit_times[-1] - commit_times[-2]))
    return STALE_DEFAULT_S


def storage_trouble(*, store_error: str | None, upload_errors: dict[str, str], shown: int = 3) -> str:
    """Why checkpoints are not committing, as the committer and the nodes saw it."""
    if store_error:
        return f"the committer: {store_error}"
    if upload_errors:
        named = "; ".join(f"{node}: {error}" for node, error in sorted(upload_errors.items())[:shown])
        more = f" (and {len(upload_errors) - shown} more nodes)" if len(upload_errors) > shown else ""
        return f"uploads failing on {named}{more}"
    return "no node finished uploading a checkpoint step"


def grow_or_finish(returned: Sequence[str], *, groups_ended: int) -> list[str]:
    """Nodes a shrink left behind are back: grow onto them at this checkpoint, unless a watch group has ended.
    Finishing wins: a group ends when its ranks all finished (the training is done, and growing would cancel
    finished ranks to relaunch from the last step) or with an incident (the loop must see it first); the
    next commit grows if the run is still training."""
    if groups_ended:
        return []
    return list(returned)


class Ending(str, Enum):
    """What ended an attempt's supervision, in the order the loop acts on them."""

    SPEC_FAULT = "spec_fault"
    CORRUPT = "corrupt"
    CONTINUE = "continue_as_new"
    PAUSE = "pause"
    DRAIN = "drain"
    GROW = "grow"
    INCIDENT = "incident"
    FINISHED = "finished"
    RELAUNCH = "relaunch"
    """Relaunch from the newest usable checkpoint with no new incident to decide on: a corrupt checkpoint was
    passed over, or an in-process restart fell back (each recorded already)."""


def attempt_ending(*, spec_fault: bool, corrupt: bool, incident: bool, continue_as_new: bool, paused: bool,
                   drain: bool, grow: bool) -> Ending:
    """Which of the things seen together ends the attempt: a fault of the spec or the checkpoint first (they
    explain any incident after them), then the incident; an operator's pause, a drain or a grow-back only in a
    healthy attempt, and continue-as-new only when nothing else is due (the caller asks for it only while some
    ranks still train)."""
    if spec_fault:
        return Ending.SPEC_FAULT
    if corrupt:
        return Ending.CORRUPT
    if incident:
        return Ending.INCIDENT
    if paused:
        return Ending.PAUSE
    if drain:
        return Ending.DRAIN
    if grow:
        return Ending.GROW
    if continue_as_new:
        return Ending.CONTINUE
    return Ending.FINISHED
