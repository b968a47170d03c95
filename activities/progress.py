"""Pure judgments on rank progress, the watch's (`activities.rank_watch`): is this rank hung? Which
checkpoints are complete on this node? Which exit is a failure, and when did the fault happen?

The clock is an argument, so every rule is tested with tables and no sleeping. A hang is seen from the
rank's own progress reports, never from a collective timeout (gloo waits 30 min, NCCL 10 min).
"""

from __future__ import annotations

import bisect

from dataclasses import dataclass

from trainguard.spec import HealthSpec


@dataclass(frozen=True, slots=True)
class RankReport:
    """What a rank last wrote to its progress file (see `trainguard.rank`)."""

    rank: int
    step: int
    time: float
    """Unix time of the report."""
    step_time_s: float | None = None
    """Moving average of the rank's recent step times; None before its second step."""
    saving: bool = False
    """The rank is taking its in-memory checkpoint snapshot."""
    finished: bool = False
    compute_s: float | None = None
    """Moving average of the rank's own compute per step, outside collectives, when the script reports it."""
    error: str | None = None
    """Why the rank stopped itself (the rank helper's own checks, e.g. a checkpoint step it did not save)."""


def silence_bound_s(report: RankReport | None, start_step: int, health: HealthSpec) -> float:
    """How long this rank may stay silent before it is hung.

    Before the first step of the attempt: the start-up grace (imports, rendezvous, restore). After it: the
    larger of the floor and `hang_step_multiplier` of its own step time, capped by `hang_max_s`, plus the
    checkpoint grace while a snapshot is being taken.
    """
    if report is None or report.step <= start_step:
        return health.startup_grace_s
    learned = health.hang_step_multiplier * report.step_time_s if report.step_time_s is not None else 0.0
    bound = min(max(health.hang_floor_s, learned), health.hang_max_s)
    if report.step_time_s is None:
        # Only one step seen: the first step is often much slower (lazy init, warm-up): give it time.
        bound = min(max(bound, 3 * health.hang_floor_s), health.hang_max_s)
    if report.saving:
        bound += health.checkpoint_grace_s
    return bound


def silent_for_s(report: RankReport | None, launched_at: float, now: float) -> float:
    last = report.time if report is not None else launched_at
    return max(0.0, now - max(last, launched_at))


COLLECTIVE_WAIT_GRACE_S = 1.0
"""When one rank stalls, its healthy peers soon stall too, asleep in the next collective. A sleeping rank is
reported this much later than a stopped one, so the node holding the culprit reports first and the
incident names the rank that actually hung."""

# /proc/<pid>/stat states of a process that cannot be making progress by itself.
STUCK_STATES = frozenset({"T", "t", "D", "Z"})


EXITING_GRACE_S = 60.0
"""A rank that reported why it stops itself (an uncaught exception, a checkpoint step it skipped) may take this
much longer to exit before it counts as hung: its process is tearing down (torch's shutdown can take seconds
on a loaded machine), and its exit is the crash to report, with its traceback."""


def find_hung_rank(
    reports: dict[int, RankReport | None],
    running_ranks: set[int],
    start_step: int,
    launched_at: float,
    now: float,
    health: HealthSpec,
    states: dict[int, str] | None = None,
    grace_s: float = COLLECTIVE_WAIT_GRACE_S,
) -> tuple[int, float] | None:
    """The running rank silent the longest past its bound, with its silence in seconds; None if none.

    `states` holds each rank's process state letter from /proc (`S` sleeping, `T` stopped, ...). `grace_s` is
    added to the bound of a rank that is not stuck by its state (0 where the run names the culprit from evidence).
    """
    worst: tuple[int, float] | None = None
    for rank in sorted(running_ranks):
        report = reports.get(rank)
        if report is not None and report.finished:
            continue
        silent = silent_for_s(report, launched_at, now)
        bound = silence_bound_s(report, start_step, health)
        if report is not None and report.error is not None:
            bound += EXITING_GRACE_S  # it said why it is stopping: exiting, not hung
        if (states or {}).get(rank, "S") not in STUCK_STATES and report is not None and report.step > start_step:
            bound += grace_s
        if silent > bound and (worst is None or silent > worst[1]):
            worst = (rank, silent)
    return worst


def complete_steps(saved: dict[int, set[int]], local_ranks: set[int], after_step: int) -> list[int]:
    """Checkpoint steps newer than `after_step` for which every local rank has a finished shard."""
    return sorted(step for step, ranks in saved.items() if step > after_step and local_ranks <= ranks)


def first_step_time(reports: dict[int, RankReport | None], start_step: int) -> float | None:
    """When the attempt's first new step was reported (unix time): the earliest report past `start_step`;
    None while no rank has reported one."""
    times = [rep.time for rep in reports.values() if rep is not None and rep.step > start_step]
    return min(times) if times else None


def slowest_step(reports: dict[int, RankReport | None], start_step: int) -> int:
    """The node's step: its slowest rank's, a rank yet to report counting at `start_step`; -1 with no ranks."""
    steps = [rep.step if rep else start_step for rep in reports.values()]
    return min(steps) if steps else -1


def failed_rank(exit_codes: dict[int, int | None], reports: dict[int, RankReport | None]) -> int | None:
    """The lowest rank whose exit is a failure, or None. `exit_codes` holds the ranks that have exited, with
    their codes (None: unknown, the agent restarted since). Any exit but 0 fails, unless the rank reported
    itself finished first (its training is done; how it left does not matter)."""
    for rank in sorted(exit_codes):
        report = reports.get(rank)
        if exit_codes[rank] != 0 and not (report is not None and report.finished):
            return rank
    return None


def fault_time(injected_at: float | None, report: RankReport | None, launched_at: float) -> float:
    """When a rank's fault happened, as near as the agent knows (unix time): when chaos injected it, else the
    rank's last report, else the launch."""
    return injected_at or (report.time if report is not None else launched_at)


PROCESS_STATE_WORDS = {"T": "stopped", "t": "stopped", "D": "in uninterruptible I/O", "Z": "defunct"}
"""/proc/<pid>/stat states, as a hang's detail names them."""


def process_state_words(state: str | None) -> str:
    """A rank's process state in words (`alive` for a running or sleeping one, or one with no state)."""
    return PROCESS_STATE_WORDS.get(state or "", "alive")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def find_stragglers(compute_s: dict[int, float], ratio: float) -> dict[int, float]:
    """Ranks whose compute time per step is above `ratio` times the median of their peers': rank -> ratio.

    Step wall times cannot show a straggler: in data-parallel training every rank waits for the slowest at
    each collective, so all step times are equal. The compute time outside collectives differs.
    """
    # The median of the peers of each rank, from one sort: O(n log n), so 32,768 ranks take milliseconds.
    ordered = sorted(compute_s.values())
    count = len(ordered) - 1  # peers of each rank

    def peers_median(own: float) -> float:
        skip = bisect.bisect_left(ordered, own)  # an equal value at this index stands for `own`

        def peer(j: int) -> float:
            return ordered[j] if j < skip else ordered[j + 1]

        middle = count // 2
        return peer(middle) if count % 2 else (peer(middle - 1) + peer(middle)) / 2

    found: dict[int, float] = {}
    if count < 1:
        return found
    for rank, own in sorted(compute_s.items()):
        median = peers_median(own)
        if median > 0 and own > ratio * median:
            found[rank] = round(own / median, 3)
    return found
