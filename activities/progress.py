"""Pure judgments on rank progress, the watch's (`activities.rank_watch`): is this rank hung? Which
checkpoints are complete on this node? Which exit is a failure, and when did the fault happen?

The clock is an argument, so every rule is tested with tables and no sleeping. A hang is seen from the
rank's own progress reports, never from a collective timeout (gloo waits 30 min, NCCL 10 min).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

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
    """The median of the rank's recent compute times per step, outside collectives, when the script reports it."""
    error: str | None = None
    """Why the rank stopped itself (the rank helper's own checks, e.g. a checkpoint step it did not save)."""
    phase: str | None = None
    """The phase the script named and is in (`RankRun.phase`), if any."""
    phase_since: float | None = None
    """Unix time the named phase began."""
    phase_expected_s: float | None = None
    """The named phase's expected length, when the script gave one."""
    fingerprints: list[list[Any]] | None = None
    """The rank's newest fingerprints of its replicated state (`trainguard.protocol.Progress.fingerprints`)."""
    numerical: dict[str, Any] | None = None
    """A numerical fault in the loss the rank reported: {"step", "loss", "detail"}."""


def silence_bound_s(report: RankReport | None, start_step: int, health: HealthSpec,
                    expected_gap_s: float = 0.0, stopped: bool = False) -> float:
    """How long this rank may go without a step before the agent looks at what else it does (its CPU, its
    I/O, where it waits): past this bound a rank is quiet, not yet hung (`judge_rank`).

    Before the first step of the attempt: the start-up grace (imports, rendezvous, restore). After it: the
    larger of the floor and `hang_step_multiplier` of its own step time, capped by `hang_max_s`, plus the
    checkpoint grace while a snapshot is being taken. `expected_gap_s`: a gap the run learned recurs after
    this step (`GapBook`), which the bound covers.

    `stopped`: the rank's process is stopped (`T`, `t`). The start-up and checkpoint graces and a learned gap are
    for a rank that works through them (imports, a save, an evaluation); a stopped process does no work of any
    kind, so its bound is its step bound alone (the floor before its first step).
    """
    if report is None or report.step <= start_step:
        return health.hang_floor_s if stopped else health.startup_grace_s
    learned = health.hang_step_multiplier * report.step_time_s if report.step_time_s is not None else 0.0
    bound = min(max(health.hang_floor_s, learned), health.hang_max_s)
    if report.step_time_s is None:
        # Only one step seen: the first step is often much slower (lazy init, warm-up): give it time.
        bound = min(max(bound, 3 * health.hang_floor_s), health.hang_max_s)
    if stopped:
        return bound
    bound = max(bound, min(expected_gap_s, health.hang_max_s))
    if report.saving:
        bound += health.checkpoint_grace_s
    return bound


def silent_for_s(report: RankReport | None, launched_at: float, now: float) -> float:
    last = report.time if report is not None else launched_at
    return max(0.0, now - max(last, launched_at))


COLLECTIVE_WAIT_GRACE_S = 1.0
"""When one rank stalls, its healthy peers soon stall too, asleep in the next collective. A sleeping rank whose
position is not known (no evidence channel, no answer) is reported this much later than a stopped one, so the
node holding the culprit reports first and the incident names the rank that actually hung."""

STOPPED_STATES = frozenset({"T", "t", "Z"})
"""/proc/<pid>/stat states of a process that cannot run at all: stopped, traced, defunct."""

STUCK_STATES = STOPPED_STATES | {"D"}
"""...and uninterruptible I/O: states the hang evidence names (`activities.evidence`)."""

IN_IO_STATE = "D"
"""Uninterruptible I/O (a write to a network file system, an fsync): the kernel is working for the rank."""


EXITING_GRACE_S = 60.0
"""A rank that reported why it stops itself (an uncaught exception, a checkpoint step it skipped) may take this
much longer to exit before it counts as hung: its process is tearing down (torch's shutdown can take seconds
on a loaded machine), and its exit is the crash to report, with its traceback."""

UNSAMPLED_GRACE_S = 5.0
"""A quiet rank whose activity window is not covered yet is given this much more before it can be judged idle:
the agent samples it from half its bound, so this is spent only when its polls run late (a loaded machine) or
its /proc cannot be read."""

NAMED_PHASE_SAFETY = 2.0
"""A phase the script named with an expected length (`RankRun.phase(name, expected_s)`) may run this many times
longer before an idle rank in it counts as hung: the length is the script's estimate, and a false kill costs far
more than a late detection."""


class RankActivity(StrEnum):
    """What a rank is doing, as the agent judges it from everything it sees (`judge_rank`)."""

    STEPPING = "stepping"
    """Within its step bound: nothing to look at."""
    BUSY = "busy"
    """Past its step bound, its process tree uses CPU or does I/O (or sits in storage I/O): a long phase (an
    evaluation, a save, a recompile, data loader workers starting). Hung only past `hang_max_s`."""
    WAITING = "waiting"
    """Past its step bound, idle inside a collective: it waits for a peer, and is not the one to blame. Hung only
    past `hang_max_s`, when no peer was found hung first."""
    PHASE = "phase"
    """Idle in a phase the script named, within the phase's bound."""
    HUNG = "hung"
    """No progress of any kind: stopped, or idle outside any collective past its bound."""


LONG_PHASES = frozenset({RankActivity.BUSY, RankActivity.WAITING, RankActivity.PHASE})
"""What `run status` and the watch's heartbeat show as a long phase."""


@dataclass(frozen=True, slots=True)
class RankSignals:
    """What the agent sees of a quiet rank besides its reports."""

    busy: bool | None = None
    """Its process tree used CPU or moved bytes over the last activity window (`activity_busy`); None when not
    sampled (or not readable)."""
    in_collective: bool | None = None
    """It answered from inside a collective (torch's Flight Recorder, or the DDP hook); None when not asked yet
    or it did not answer."""
    asked: bool = False
    """Its position was asked: `in_collective` None then means it did not answer."""


@dataclass(frozen=True, slots=True)
class Verdict:
    rank: int
    activity: RankActivity
    silent_s: float
    """Since its last report."""
    bound_s: float
    """The silence after which this verdict turns into a hang."""
    where: str = ""
    """The named phase, or what it waits in."""

    @property
    def needs_position(self) -> bool:
        """An idle quiet rank whose position must be asked before it can be judged."""
        return self.activity is RankActivity.STEPPING and self.where == _ASK


_ASK = "?position"


def judge_rank(report: RankReport | None, signals: RankSignals, state: str | None, start_step: int,
               launched_at: float, now: float, health: HealthSpec, *, expected_gap_s: float = 0.0,
               grace_s: float = COLLECTIVE_WAIT_GRACE_S) -> Verdict:
    """Is this rank making progress of any kind? The rules, in order:

    1. Within its step bound (`silence_bound_s`): stepping. A stopped process's bound is its step bound alone,
       without the start-up, checkpoint or learned-gap graces: it cannot be working through them.
    2. Its process is stopped (`T`, `t`, `Z`): hung at once, whatever else it says.
    3. Busy (CPU or I/O over the window, or in storage I/O): a long phase, hung past `hang_max_s` (at least
       `NAMED_PHASE_SAFETY` x a named phase's expected length, and the start-up grace before its first step).
       A rank that burns CPU forever while its peers wait costs the run `hang_max_s`, never a false kill.
    4. Idle in a named phase: hung past `NAMED_PHASE_SAFETY` x its expected length (`hang_max_s` without one).
    5. Idle: ask where it waits. Inside a collective: waiting for a peer, hung past `hang_max_s`. Outside any
       (a lock, a read that never returns, a skipped collective): hung now. No answer: hung after `grace_s`.
    """
    silent = silent_for_s(report, launched_at, now)
    stopped = (state or "S") in STOPPED_STATES
    bound = silence_bound_s(report, start_step, health, expected_gap_s, stopped=stopped)
    if report is not None and report.error is not None:
        bound += EXITING_GRACE_S  # it said why it is stopping: exiting, not hung
    rank = report.rank if report is not None else -1
    if silent <= bound:
        return Verdict(rank, RankActivity.STEPPING, silent, bound)
    if stopped:
        return Verdict(rank, RankActivity.HUNG, silent, bound, (report.phase or "") if report else "")
    started = report is not None and report.step > start_step
    long_bound = max(health.hang_max_s, bound if not started else 0.0)
    phase = report.phase if report is not None else None
    if phase and report is not None and report.phase_expected_s:
        long_bound = max(long_bound, NAMED_PHASE_SAFETY * report.phase_expected_s)
    if signals.busy or state == IN_IO_STATE:
        activity = RankActivity.BUSY if silent <= long_bound else RankActivity.HUNG
        return Verdict(rank, activity, silent, long_bound, phase or ("storage I/O" if state == IN_IO_STATE else ""))
    if phase:
        named = long_bound if report is None or not report.phase_expected_s else max(
            bound, NAMED_PHASE_SAFETY * report.phase_expected_s)
        activity = RankActivity.PHASE if silent <= named else RankActivity.HUNG
        return Verdict(rank, activity, silent, named, phase)
    if signals.busy is None and silent <= bound + UNSAMPLED_GRACE_S:
        # Not sampled over a window yet (the agent's polls ran late on a loaded machine): never judged idle
        # on nothing. A rank whose /proc cannot be read at all is judged by its position after the grace.
        return Verdict(rank, RankActivity.STEPPING, silent, bound + UNSAMPLED_GRACE_S)
    if not signals.asked:
        return Verdict(rank, RankActivity.STEPPING, silent, bound, _ASK)
    if signals.in_collective:
        activity = RankActivity.WAITING if silent <= long_bound else RankActivity.HUNG
        return Verdict(rank, activity, silent, long_bound, "a collective")
    if signals.in_collective is None and started and silent <= bound + grace_s:
        return Verdict(rank, RankActivity.STEPPING, silent, bound + grace_s)  # no answer: let a culprit go first
    return Verdict(rank, RankActivity.HUNG, silent, bound)


def judge_ranks(reports: dict[int, RankReport | None], running_ranks: set[int], start_step: int,
                launched_at: float, now: float, health: HealthSpec, states: dict[int, str] | None = None,
                signals: dict[int, RankSignals] | None = None, expected_gap_s: dict[int, float] | None = None,
                grace_s: float = COLLECTIVE_WAIT_GRACE_S) -> dict[int, Verdict]:
    """Each running, unfinished rank's verdict (`judge_rank`)."""
    verdicts: dict[int, Verdict] = {}
    for rank in sorted(running_ranks):
        report = reports.get(rank)
        if report is not None and report.finished:
            continue
        found = judge_rank(report, (signals or {}).get(rank, RankSignals()), (states or {}).get(rank),
                           start_step, launched_at, now, health,
                           expected_gap_s=(expected_gap_s or {}).get(rank, 0.0), grace_s=grace_s)
        verdicts[rank] = Verdict(rank, found.activity, found.silent_s, found.bound_s, found.where)
    return verdicts


def find_hung_rank(
    reports: dict[int, RankReport | None],
    running_ranks: set[int],
    start_step: int,
    launched_at: float,
    now: float,
    health: HealthSpec,
    states: dict[int, str] | None = None,
    grace_s: float = COLLECTIVE_WAIT_GRACE_S,
    signals: dict[int, RankSignals] | None = None,
) -> tuple[int, float] | None:
    """The running rank silent the longest among those judged hung, with its silence in seconds; None if none.

    `states` holds each rank's process state letter from /proc (`S` sleeping, `T` stopped, ...); `signals` what
    else the agent saw (`RankSignals`). A rank with no signals is judged as one that did not answer: hung past
    its bound plus `grace_s`. The watch itself asks positions first (`judge_ranks`).
    """
    asked = {r: RankSignals(busy=False, asked=True) for r in running_ranks}
    asked.update(signals or {})
    verdicts = judge_ranks(reports, running_ranks, start_step, launched_at, now, health, states, asked,
                           grace_s=grace_s)
    hung = [(v.rank, v.silent_s) for v in verdicts.values() if v.activity is RankActivity.HUNG]
    return max(hung, key=lambda found: (found[1], -found[0])) if hung else None


ACTIVITY_WINDOW_S = 1.0
"""A quiet rank is busy when its process tree used CPU or moved bytes over this long."""

BUSY_CPU_FRACTION = 0.05
"""...at least this share of one core. A rank asleep in a lock, a read or a gloo collective uses well under 1%
(the helper's evidence thread, idle threads); any real compute (a forward pass, serialization, a compile, data
loader workers starting) uses far more."""

BUSY_IO_BYTES = 256 * 1024
"""...or at least this many bytes read or written (files, sockets, pipes): a save, a download. The helper's own
evidence thread reads a few bytes a poll."""


@dataclass(frozen=True, slots=True)
class Usage:
    """One sample of a rank's process tree (the rank and every live descendant)."""

    at: float
    """Monotonic time of the sample."""
    cpu_s: float
    """User and system CPU seconds, the reaped children's included."""
    io_bytes: int | None = None
    """Bytes read and written (`rchar` + `wchar`); None when /proc does not let the agent read them."""
    wait_s: float = 0.0
    """Seconds its threads spent runnable but waiting for a CPU (/proc schedstat): a rank starved of CPU on a
    loaded machine computes as much as it is let, and is busy, not idle."""
    running: bool = False
    """Its main thread was running or runnable (`R`) when sampled: a rank blocked on a lock, a read or a collective
    sleeps (`S`). A second witness beside the CPU figures, which a loaded machine can starve."""


def activity_busy(samples: list[Usage], window_s: float = ACTIVITY_WINDOW_S) -> bool | None:
    """Whether the samples show the rank busy over the last `window_s`: None until they span half of it.

    The window starts at the newest sample at least `window_s` old (the oldest while none is): a poll that ran
    late on a loaded machine leaves a gap before the last sample, and a window cut at `window_s` would then hold
    too little to judge, so a computing rank would read as unsampled, then idle."""
    if len(samples) < 2:
        return None
    last = samples[-1]
    first = next((s for s in reversed(samples[:-1]) if last.at - s.at >= window_s), samples[0])
    elapsed = last.at - first.at
    if elapsed < window_s / 2:
        return None
    if (last.cpu_s - first.cpu_s) + (last.wait_s - first.wait_s) >= BUSY_CPU_FRACTION * elapsed:
        return True  # on a CPU, or waiting for one
    if any(s.running for s in samples if s.at >= first.at):
        return True  # seen running in the window: computing, whatever the counters say
    return (last.io_bytes is not None and first.io_bytes is not None
            and last.io_bytes - first.io_bytes >= BUSY_IO_BYTES * elapsed / window_s)


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


def numerical_fault(reports: dict[int, RankReport | None]) -> tuple[int, dict[str, Any]] | None:
    """The local rank whose reported loss was a numerical fault at the earliest step, with the fault (the rank
    helper judged it: `trainguard.numerics.judge_loss`); None when no rank reports one."""
    faulty = [(int(r.numerical.get("step", -1)), rank, r.numerical) for rank, r in reports.items()
              if r is not None and r.numerical]
    if not faulty:
        return None
    _, rank, fault = min(faulty, key=lambda item: (item[0], item[1]))
    return rank, fault


def new_fingerprints(reports: dict[int, RankReport | None],
                     written: dict[int, int]) -> dict[int, list[list[Any]]] | None:
    """Every local rank's newest fingerprints, when some rank has one newer than the step `written` last
    (rank -> step); None when nothing is new."""
    taken = {rank: r.fingerprints for rank, r in reports.items() if r is not None and r.fingerprints}
    newest = {rank: max(int(item[0]) for item in items) for rank, items in taken.items()}
    if not any(step > written.get(rank, -1) for rank, step in newest.items()):
        return None
    return taken

