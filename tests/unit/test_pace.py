"""Stragglers over a sliding window of training time (activities/pace.py): the windows a node's watch writes, and
the committer's comparison of every node's newest window. Clocks are arguments: no sleeping."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from activities.pace import PaceWindow, judge_window, window_means
from activities.pace_models import PaceRecord


@dataclass
class _Report:
    step: int
    compute_s: float | None


def _ranks_training(compute: dict[int, list[float]], step_s: float = 0.1, window_s: float = 10.0,
                    start: float = 1000.0) -> list[dict[int, float]]:
    """Each rank's watch samples of a run whose ranks step together every `step_s`, rank r computing
    `compute[r][i]` in step i and reporting the moving average the rank helper reports (0.8 / 0.2): the means of
    every window the node writes."""
    window = PaceWindow(window_s, start)
    ema: dict[int, float] = {}
    written = []
    for i in range(len(next(iter(compute.values())))):
        now = start + (i + 1) * step_s
        for rank, steps in compute.items():
            ema[rank] = steps[i] if rank not in ema else 0.8 * ema[rank] + 0.2 * steps[i]
        window.observe(now, {rank: _Report(step=i + 1, compute_s=ema[rank]) for rank in compute})
        if (means := window.due(now)) is not None:
            written.append(means)
    return written


def _jittered(rng: random.Random, steps: int, base: float = 0.1, jitter: float = 0.2) -> list[float]:
    return [base * rng.uniform(1 - jitter, 1 + jitter) for _ in range(steps)]


def test_healthy_ranks_whose_step_times_jitter_by_20_percent_are_never_stragglers() -> None:
    rng = random.Random(7)
    for _ in range(20):  # 20 runs of 8 ranks, 5 minutes of 0.1 s steps each
        windows = _ranks_training({rank: _jittered(rng, 3000) for rank in range(8)})
        assert len(windows) == 30  # a window written every 10 s
        records = [PaceRecord(node=f"node-{i}", attempt=1, window_end=1000.0 + 10 * (i + 1), window_s=10.0,
                              rank_compute_s=means) for i, means in enumerate(windows)]
        assert [judge_window([r], ratio=1.5, after=0.0) for r in records] == [None] * len(records)


def test_a_rank_at_a_fifth_of_its_speed_is_slow_in_every_window_after_its_onset() -> None:
    rng = random.Random(3)
    healthy = _jittered(rng, 600)
    slowed = healthy[:200] + [5 * c for c in healthy[200:]]  # from step 200 (20 s in) at a fifth of its speed
    windows = _ranks_training({0: _jittered(rng, 600), 1: slowed, 2: _jittered(rng, 600)})
    verdicts = [judge_window([PaceRecord(node="n", attempt=1, window_end=1000.0 + 10 * (i + 1), window_s=10.0,
                                         rank_compute_s=means)], ratio=1.5, after=0.0)
                for i, means in enumerate(windows)]
    assert [v is not None for v in verdicts] == [False, False, True, True, True, True]  # slow from 20 s
    assert all(set(v.slow) == {1} and v.slow[1] > 3 for v in verdicts if v is not None)


TEN = [990.5 + n for n in range(10)]
"""Ten steps inside the window ending at 1000 (`MIN_SAMPLES`)."""


@pytest.mark.parametrize(("since", "times", "expected"), [
    (990.0, TEN, {1: 0.55}),  # a whole window watched: the median of its samples
    (985.0, [989.0, *TEN], {1: 0.65}),  # the sample before the window is out of it
    (995.0, TEN, {}),  # watched for half a window only (just launched)
    (990.0, TEN[:5], {}),  # too few steps to say (a window that was mostly an evaluation)
    (970.0, [972.0 + 2 * n for n in range(14)], {1: 0.95}),  # 2 s steps: back to the newest ten (980-998)
])
def test_a_window_mean_needs_a_window_watched_and_enough_steps(since: float, times: list[float],
                                                                expected: dict[int, float]) -> None:
    samples = {1: [(t, 0.1 * (n + 1)) for n, t in enumerate(times)]}
    assert window_means(samples, {1: since}, 1000.0, 10.0) == pytest.approx(expected)


def test_a_rank_stepping_slower_than_ten_steps_a_window_is_still_judged() -> None:
    """With 1 s steps a 10 s window held ten of a healthy rank's steps and five of a rank slowed 2x: the slow one,
    the only one that mattered, never had a figure, and no straggler was ever found."""
    window = PaceWindow(10.0, started=1000.0)
    for tick in range(1, 41):  # 40 s: rank 0 steps every second, rank 1 every two
        reports = {0: _Report(tick, 0.9), 1: _Report(tick // 2, 1.8)}
        window.observe(1000.0 + tick, reports)
        if (means := window.due(1000.0 + tick)) is not None:
            figures = means
    assert figures == {0: 0.9, 1: 1.8}
    assert judge_window([PaceRecord(node="n", attempt=1, window_end=1040.0, window_s=10.0, rank_compute_s=figures)],
                        ratio=1.5, after=0.0) is not None


def _record(node: str, compute: dict[int, float], end: float, attempt: int = 2, chain: str = "c1") -> PaceRecord:
    return PaceRecord(node=node, attempt=attempt, chain_id=chain, window_end=end, window_s=10.0,
                      rank_compute_s=compute, step=int(end))


@pytest.mark.parametrize(("records", "after", "slow"), [
    ([_record("a", {0: 0.1}, 100.0), _record("b", {1: 0.5}, 101.0)], 0.0, {1: 5.0}),
    ([_record("a", {0: 0.1}, 100.0), _record("b", {1: 0.5}, 101.0)], 101.0, None),  # judged already
    ([_record("a", {0: 0.1}, 100.0), _record("b", {1: 0.12}, 101.0)], 0.0, None),  # keeps pace
    ([_record("a", {0: 0.1}, 100.0), _record("b", {1: 0.5}, 101.0, attempt=1)], 0.0, None),  # an older attempt's
    ([_record("a", {0: 0.1}, 100.0), _record("b", {1: 0.5}, 101.0, chain="c0")], 0.0, None),  # another chain's
    ([_record("a", {0: 0.1}, 70.0), _record("b", {1: 0.5}, 101.0),
      _record("c", {2: 0.5}, 100.0)], 0.0, None),  # node a stopped writing: its old window is left out
])
def test_the_committer_compares_every_nodes_newest_window_of_this_attempt(
        records: list[PaceRecord], after: float, slow: dict[int, float] | None) -> None:
    verdict = judge_window(records, ratio=1.5, after=after, chain_id="c1", min_attempt=2, attempt=2)
    assert (verdict.slow if verdict else None) == slow
    if verdict is not None:
        assert (verdict.window_end, verdict.step) == (101.0, 100)


def test_a_rank_0_only_evaluation_counted_as_compute_makes_no_straggler() -> None:
    # Rank 0 reports a 12 s evaluation as the compute of one step; the helper's moving average (0.8/0.2) carries it
    # for a dozen steps. Every rank's steps vary +-50%.
    rng = random.Random(7)
    compute = {rank: _jittered(rng, 100, jitter=0.5) for rank in range(4)}
    ema, smoothed = None, []
    for step, own in enumerate(compute[0]):
        own = 12.0 if step == 50 else own
        ema = own if ema is None else 0.8 * ema + 0.2 * own
        smoothed.append(ema)
    compute[0] = smoothed
    samples = {rank: [(990.0 + 0.1 * (n + 1), c) for n, c in enumerate(values)] for rank, values in compute.items()}

    means = window_means(samples, {rank: 985.0 for rank in samples}, 1000.0, 10.0)

    assert judge_window([PaceRecord(node="n", attempt=1, window_end=1000.0, window_s=10.0, rank_compute_s=means)],
                        ratio=1.5, after=0.0) is None


def test_a_ranks_compute_the_nodes_own_clock_contradicts_makes_no_straggler() -> None:
    """Issue 40 finding 10: the committer took each rank's reported `compute_s` as it came. A rank cannot compute
    longer per step than its node takes per step (its records' steps over its clock): such a claim is refused."""
    before = {"a": PaceRecord(node="a", attempt=2, chain_id="c1", window_end=1000.0, window_s=10.0,
                              rank_compute_s={0: 0.1, 1: 0.1}, step=100),
              "b": PaceRecord(node="b", attempt=2, chain_id="c1", window_end=1000.0, window_s=10.0,
                              rank_compute_s={2: 0.1, 3: 0.1}, step=100)}
    # 100 steps in 10 s: 0.1 s a step. Rank 1 claims 5 s of compute a step, rank 3 0.09 (plausible, not slow).
    now = [before["a"].model_copy(update={"window_end": 1010.0, "step": 200, "rank_compute_s": {0: 0.05, 1: 5.0}}),
           before["b"].model_copy(update={"window_end": 1010.0, "step": 200, "rank_compute_s": {2: 0.05, 3: 0.05}})]

    assert judge_window(now, ratio=1.5, after=0.0, chain_id="c1") is not None  # unchecked: taken as it comes
    assert judge_window(now, ratio=1.5, after=0.0, chain_id="c1", before=before) is None
    # A rank that is slow within what a step takes stays a straggler.
    slowed = [now[0].model_copy(update={"rank_compute_s": {0: 0.02, 1: 0.09}}), now[1]]
    verdict = judge_window(slowed, ratio=1.5, after=0.0, chain_id="c1", before=before)
    assert verdict is not None and set(verdict.slow) == {1}
