"""Stragglers over a sliding window of training time, whatever the checkpoint cadence.

Each node's watch keeps its ranks' compute per step (`compute_s`, outside collectives) as their progress reports
bring it, and once a window (`health.straggler_window_s`) writes each rank's mean over the last window to the
store (`PaceRecord`, `<run prefix>/pace/<node>.json`, overwritten). The committer, which watches the store anyway,
compares every rank's mean with its peers' median (`find_stragglers`) and returns the slow ranks of a window
(`PaceVerdict`) to the run, whose pure rule (`workflows.run_decisions.judge_pace`) reports a rank slow in one
window and replaces it once it stays slow for `health.straggler_windows` windows in a row. Nothing passes
through Temporal while every rank keeps pace: the per-step chatter stays between the agents and the store.

`window_means` and `judge_window` are pure (the clock is an argument): tests/unit/test_pace.py.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from activities.checkpoint_layout import PACE_TAG_CONTEXT
from activities.pace_models import PaceRecord, PaceVerdict
from activities.progress import find_stragglers
from activities.store_reads import read_signed_records

PACE_DIR = "pace"

MIN_SAMPLES = 10
"""A rank's figure is the median of at least this many of its steps: fewer say nothing of its pace. A window that
is mostly an evaluation, a save or a relaunch holds a handful of steps, and with step times that vary by +-50% per
step (different ranks slow on different ones) a median of five is 1.5x its peers' by chance. A window holding
fewer reaches back to the rank's newest `MIN_SAMPLES` steps: with steps of a second or more (a real model's) a
10 s window holds fewer than ten, most of all the slow rank's, which was never judged at all."""

COVERED = 0.8
"""...and once the watch has seen the rank step for this much of a window (a window just after a launch is
not a window of training)."""

FRESH_WINDOWS = 2.0
"""A node's record older than this many windows before the newest record is left out of a comparison: its
node stopped writing (lost, finished), and a mean of another stretch of training says nothing of this one."""


PLAUSIBLE_COMPUTE_SLACK = 1.5
"""A rank's compute per step (outside collectives) cannot exceed what a step of its node takes by the node's own
clock (`step_wall_s`); this much over it allows for a median of samples against a mean over a window. A figure
beyond it is one the rank made up (or a bug in how it counts): the rank is left out of the comparison, never
judged slow on it. Only a bound: a rank may still report any figure under its step time."""


def step_wall_s(record: PaceRecord, before: PaceRecord | None) -> float | None:
    """Wall time per step on `record`'s node between its previous record and this one: the agent's clock over the
    steps its slowest rank made; None without an earlier record of the same attempt, or without steps between."""
    if (before is None or before.attempt != record.attempt or before.chain_id != record.chain_id
            or record.step <= before.step or record.window_end <= before.window_end):
        return None
    return (record.window_end - before.window_end) / (record.step - before.step)


def plausible_compute(record: PaceRecord, before: PaceRecord | None) -> dict[int, float]:
    """`record`'s ranks' compute per step, less any a rank reports beyond its node's step wall time
    (`PLAUSIBLE_COMPUTE_SLACK`)."""
    wall = step_wall_s(record, before)
    if wall is None:
        return dict(record.rank_compute_s)
    return {rank: c for rank, c in record.rank_compute_s.items() if c <= wall * PLAUSIBLE_COMPUTE_SLACK}


def pace_key(run_prefix: str, node: str) -> str:
    return f"{run_prefix}/{PACE_DIR}/{node}.json"


def window_means(samples: Mapping[int, Iterable[tuple[float, float]]], first_seen: Mapping[int, float], now: float,
                 window_s: float) -> dict[int, float]:
    """Each rank's typical compute per step over the window ending `now`: the median of its (unix time, compute_s)
    samples, one per step the watch saw, reaching back to its newest `MIN_SAMPLES` when the window holds fewer.
    The median, not the mean: one long step (a rank-0-only evaluation or save the script counted as compute) must
    not make a healthy rank a straggler, while a rank slow on most of its steps is. A rank the watch has seen
    stepping for less than `COVERED` of a window, or for fewer than `MIN_SAMPLES` steps, has no figure yet."""
    means: dict[int, float] = {}
    for rank, taken in samples.items():
        since = first_seen.get(rank)
        if since is None or now - since < COVERED * window_s:
            continue
        until_now = [(at, compute) for at, compute in taken if at <= now]
        inside = sorted(compute for at, compute in until_now if now - window_s < at)
        if len(inside) < MIN_SAMPLES:
            inside = sorted(compute for _, compute in until_now[-MIN_SAMPLES:])
        if len(inside) >= MIN_SAMPLES:
            middle = len(inside) // 2
            means[rank] = round(inside[middle] if len(inside) % 2 else (inside[middle - 1] + inside[middle]) / 2, 6)
    return means


def judge_window(records: Iterable[PaceRecord], *, ratio: float, after: float, chain_id: str = "",
                 min_attempt: int = 0, attempt: int | None = None,
                 before: Mapping[str, PaceRecord] | None = None) -> PaceVerdict | None:
    """The ranks slower than `ratio` times their peers' median over the newest windows of the run's nodes,
    when that window ended after `after`; None when every rank keeps pace (or nothing new was written).
    Records of another chain, of attempts outside `min_attempt`..`attempt`, or stale (`FRESH_WINDOWS`) are left
    out. `before`: each node's previous record, against which a rank's figure is checked (`plausible_compute`)."""
    ours = [r for r in records if not (chain_id and r.chain_id and r.chain_id != chain_id)
            and min_attempt <= r.attempt and (attempt is None or r.attempt <= attempt) and r.rank_compute_s]
    if not ours:
        return None
    newest = max(r.window_end for r in ours)
    if newest <= after:
        return None
    fresh = [r for r in ours if newest - r.window_end <= FRESH_WINDOWS * r.window_s]
    earlier = before or {}
    compute = {rank: c for r in fresh for rank, c in plausible_compute(r, earlier.get(r.node)).items()}
    slow = find_stragglers(compute, ratio)
    if not slow:
        return None
    return PaceVerdict(slow=slow, window_end=newest, window_s=max(r.window_s for r in fresh),
                       step=min((r.step for r in fresh), default=-1))


class PaceWindow:
    """One attempt's samples on one node, as the watch reads its ranks' progress: when a window's record is
    due, and what it says. The clock is an argument."""

    def __init__(self, window_s: float, started: float) -> None:
        self.window_s = window_s
        self.samples: dict[int, deque[tuple[float, float]]] = {}
        self.first_seen: dict[int, float] = {}
        self._last_step: dict[int, int] = {}
        self._written = started

    def observe(self, now: float, reports: Mapping[int, Any]) -> None:
        """A sample of each rank that stepped since the last look and reports its compute."""
        for rank, report in reports.items():
            if report is None or report.compute_s is None or report.step <= self._last_step.get(rank, report.step - 1):
                continue
            self._last_step[rank] = report.step
            taken = self.samples.setdefault(rank, deque())
            taken.append((now, float(report.compute_s)))
            self.first_seen.setdefault(rank, now)
            while len(taken) > MIN_SAMPLES and taken[0][0] <= now - self.window_s:
                taken.popleft()

    def due(self, now: float) -> dict[int, float] | None:
        """The window's means when a record is due (once a window), else None."""
        if now - self._written < self.window_s:
            return None
        means = window_means(self.samples, self.first_seen, now, self.window_s)
        if not means:
            return None
        self._written = now
        return means


def read_pace(client: Any, bucket: str, run_prefix: str, cache: dict[str, tuple[str, PaceRecord | None]],
              token: str | None = None) -> list[PaceRecord]:
    """Every node's `PaceRecord` under the run's prefix (`read_signed_records`)."""
    return read_signed_records(client, bucket, f"{run_prefix}/{PACE_DIR}/", PaceRecord, PACE_TAG_CONTEXT, cache,
                               token)
