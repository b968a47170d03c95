"""What a quiet rank is doing: the watch's eyes beyond `step_done` (`activities.rank_watch`).

A rank that has not reported a step within its bound is not hung yet. For each such rank the agent samples its
process tree's CPU time and bytes moved (/proc), and asks an idle one where it waits (its helper's evidence
thread: inside a collective or not). The rules that turn those into a verdict are pure, in
`activities.progress.judge_rank`; this module gathers what they need, and remembers the gaps a run's healthy
ranks take between steps (`GapBook`), so a gap that recurs is expected the next time.

A healthy run pays nothing for it: a rank is sampled only once it is quiet for half its bound, and asked only
once it is idle past it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from activities.models import merge_gaps
from activities.progress import (
    ACTIVITY_WINDOW_S,
    COLLECTIVE_WAIT_GRACE_S,
    LONG_PHASES,
    RankActivity,
    RankReport,
    RankSignals,
    Usage,
    Verdict,
    activity_busy,
    judge_ranks,
    silence_bound_s,
    silent_for_s,
)
from trainguard.evidence import Position
from trainguard.procs import tree_usage
from trainguard.spec import HealthSpec

SAMPLE_FROM_BOUND = 0.5
"""A rank is sampled once it is quiet for this share of its bound, so its window is full when the bound passes."""

POSITION_RECHECK_S = 2.0
"""An idle rank found inside a collective is asked again after this long: it may have left it, and hung."""

GAP_MARGIN = 1.5
"""A learned gap is expected up to this many times its longest length seen."""

Positions = Callable[[set[int]], "dict[int, Position | None]"]
"""Asks ranks where they wait (`activities.evidence.ask_positions`, bound to an attempt); blocking."""


@dataclass(slots=True)
class GapBook:
    """The gaps between steps that a run's healthy ranks took: step it followed -> its longest length in seconds.
    A gap after a step seen before (a relaunch replays its steps) or at the period the recorded gaps recur at
    (an evaluation every 100 steps) is expected next time (`expected_s`)."""

    gaps: dict[int, float] = field(default_factory=dict)

    def add(self, step: int, gap_s: float) -> None:
        self.merge({step: gap_s})

    def merge(self, other: dict[int, float]) -> None:
        self.gaps = merge_gaps(self.gaps, other)

    def period(self) -> int | None:
        """The steps between the last recorded gaps, when the last three agree (or the only two give one)."""
        steps = sorted(self.gaps)
        if len(steps) < 2:
            return None
        diffs = [b - a for a, b in zip(steps[-3:], steps[-3:][1:], strict=False)]
        return diffs[-1] if diffs[-1] > 0 and all(d == diffs[-1] for d in diffs) else None

    def expected_s(self, step: int) -> float:
        """How long a gap after `step` may be expected to last (0: none expected)."""
        if step in self.gaps:
            return GAP_MARGIN * self.gaps[step]
        period = self.period()
        steps = sorted(self.gaps)
        if period is not None and step > steps[-1] and (step - steps[-1]) % period == 0:
            return GAP_MARGIN * max(self.gaps[s] for s in steps[-3:])
        return 0.0


@dataclass(slots=True)
class _Rank:
    samples: deque[Usage] = field(default_factory=lambda: deque(maxlen=64))
    position: tuple[float, Position | None] | None = None
    """(monotonic time asked, its answer)."""
    step: int | None = None
    step_seen_at: float | None = None
    """Unix time of the first report of `step`."""
    quiet_since_bound: float | None = None


class AttemptActivity:
    """The activity of one attempt's ranks on this node, judged at each of the watch's polls."""

    def __init__(self, gaps: GapBook, clock: Callable[[], float] = time.monotonic,
                 usage: Callable[[int], tuple[float, int | None, float, bool] | None] = tree_usage,
                 gpu_busy: Callable[[], set[int]] | None = None) -> None:
        self.gaps = gaps
        self.clock = clock
        self.usage = usage
        """A process tree's (CPU seconds, bytes moved, seconds waiting for a CPU, running now), None once it is
        gone (`trainguard.procs.tree_usage`)."""
        self.gpu_busy = gpu_busy
        """The pids NVML saw using a GPU lately (`activities.health.GpuActivity.busy_pids`); None: not asked."""
        self._gpu: set[int] = set()
        self.ranks: dict[int, _Rank] = {}
        self.pids: dict[int, int] = {}
        self.verdicts: dict[int, Verdict] = {}

    def _learn(self, rank: int, report: RankReport | None, health: HealthSpec, start_step: int) -> None:
        """A step after a gap longer than its bound: the gap was healthy (the rank went on), and is learned."""
        kept = self.ranks.setdefault(rank, _Rank())
        if report is None or report.step == kept.step:
            return
        if kept.step is not None and kept.step_seen_at is not None and kept.step > start_step:
            gap = report.time - kept.step_seen_at
            previous = RankReport(rank=rank, step=kept.step, time=kept.step_seen_at, step_time_s=report.step_time_s)
            if gap > silence_bound_s(previous, start_step, health):
                self.gaps.add(kept.step, gap)
        kept.step, kept.step_seen_at = report.step, report.time
        kept.samples.clear()
        kept.position = None

    async def judge(self, reports: dict[int, RankReport | None], pids: dict[int, int], states: dict[int, str],
                    start_step: int, launched_at: float, now: float, health: HealthSpec, positions: Positions | None,
                    grace_s: float = COLLECTIVE_WAIT_GRACE_S) -> dict[int, Verdict]:
        """Every running rank's verdict (`pids`: each running rank's process); the quiet ones sampled, the idle
        ones asked where they wait."""
        running = set(pids)
        for rank, pid in pids.items():
            if self.pids.get(rank) != pid:  # a rank replaced in place (a rejoin): its samples are another's
                self.ranks[rank], self.pids[rank] = _Rank(), pid
        expected: dict[int, float] = {}
        for rank in running:
            report = reports.get(rank)
            self._learn(rank, report, health, start_step)
            expected[rank] = self.gaps.expected_s(report.step) if report is not None else 0.0
            bound = silence_bound_s(report, start_step, health, expected[rank])
            if silent_for_s(report, launched_at, now) >= SAMPLE_FROM_BOUND * bound:
                used = self.usage(self.pids[rank])
                if used is not None:
                    self.ranks[rank].samples.append(Usage(self.clock(), *used))
        sampled = [rank for rank in running if self.ranks[rank].samples]
        self._gpu = await asyncio.to_thread(self.gpu_busy) if sampled and self.gpu_busy is not None else set()
        signals = {rank: self._signals(rank) for rank in running}
        verdicts = judge_ranks(reports, running, start_step, launched_at, now, health, states, signals, expected,
                               grace_s)
        ask = {rank for rank, verdict in verdicts.items() if verdict.needs_position}
        if ask and positions is not None:
            answers = await asyncio.to_thread(positions, ask)
            asked_at = self.clock()
            for rank in ask:
                self.ranks[rank].position = (asked_at, answers.get(rank))
            signals.update({rank: self._signals(rank) for rank in ask})
            verdicts = judge_ranks(reports, running, start_step, launched_at, now, health, states, signals,
                                   expected, grace_s)
        self.verdicts = verdicts
        return verdicts

    def _signals(self, rank: int) -> RankSignals:
        kept = self.ranks[rank]
        busy = activity_busy(list(kept.samples), ACTIVITY_WINDOW_S)
        if self.pids.get(rank) in self._gpu:
            busy = True  # its kernels run: a GPU-bound phase, whatever its CPU does
        position = kept.position
        if position is not None and self.clock() - position[0] > POSITION_RECHECK_S:
            position = kept.position = None
        if position is None:
            return RankSignals(busy=busy)
        answer = position[1]
        if answer is None:
            return RankSignals(busy=busy, in_collective=None, asked=True)
        return RankSignals(busy=busy, in_collective=self._inside(answer), asked=True)

    def _inside(self, answer: Position) -> bool | None:
        """Whether an answer puts its rank inside a collective. The DDP hook's count is exact. The Flight
        Recorder's alone is not for DDP (it marks DDP's all-reduce complete only once waited on, which DDP never
        does, so every DDP rank soon reads as inside): a rank that entered fewer collectives than a local peer
        that answered too is behind it, outside the collective its peers wait in, and is not waiting for them."""
        if answer.in_collective is not True or answer.extra.get("ddp_hooked") or answer.collectives_enqueued is None:
            return answer.in_collective
        peers = [kept.position[1].collectives_enqueued for kept in self.ranks.values()
                 if kept.position is not None and kept.position[1] is not None
                 and kept.position[1].collectives_enqueued is not None]
        return not any(entered > answer.collectives_enqueued for entered in peers)

    def long_phases(self) -> dict[int, Verdict]:
        """The ranks in a long phase now (busy, waiting in a collective, or in a named phase)."""
        return {rank: v for rank, v in self.verdicts.items() if v.activity in LONG_PHASES}


def hung(verdicts: dict[int, Verdict]) -> tuple[int, float] | None:
    """The rank judged hung that is silent the longest (the lowest on a tie), with its silence; None if none."""
    found = [(v.rank, v.silent_s) for v in verdicts.values() if v.activity is RankActivity.HUNG]
    return max(found, key=lambda item: (item[1], -item[0])) if found else None


def describe(verdict: Verdict) -> str:
    """A long phase in words, for status and the Web UI: `busy 12.3s (eval)`."""
    where = f" ({verdict.where})" if verdict.where else ""
    return f"{verdict.activity.value} {verdict.silent_s:.1f}s{where}"
