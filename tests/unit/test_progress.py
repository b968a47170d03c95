"""The watch's pure judgements: bounds on silence and which rank is hung (the clock passed in), complete steps,
which exit is a failure, and when a fault happened."""

from __future__ import annotations

import pytest

from activities.progress import (
    COLLECTIVE_WAIT_GRACE_S,
    EXITING_GRACE_S,
    RankReport,
    complete_steps,
    failed_rank,
    fault_time,
    find_hung_rank,
    find_stragglers,
    first_step_time,
    process_state_words,
    silence_bound_s,
    slowest_step,
)
from trainguard.spec import HealthSpec

HEALTH = HealthSpec(startup_grace_s=100.0, hang_floor_s=2.0, hang_step_multiplier=10.0, hang_max_s=50.0,
                    checkpoint_grace_s=30.0)
LAUNCHED_AT = 1_000.0


def _report(rank: int = 0, step: int = 5, time: float = LAUNCHED_AT, step_time_s: float | None = 1.0,
            saving: bool = False, finished: bool = False) -> RankReport:
    return RankReport(rank=rank, step=step, time=time, step_time_s=step_time_s, saving=saving,
                      finished=finished)


@pytest.mark.parametrize(
    ("report", "start_step", "bound_s"),
    [
        pytest.param(None, 0, 100.0, id="no-report-yet-startup-grace"),
        pytest.param(_report(step=0), 0, 100.0, id="no-step-yet-startup-grace"),
        pytest.param(_report(step=40, step_time_s=0.01), 40, 100.0, id="resumed-not-past-restore-step"),
        pytest.param(_report(step=40, saving=True), 40, 100.0, id="startup-grace-ignores-saving"),
        pytest.param(_report(step_time_s=0.01), 0, 2.0, id="fast-steps-hit-the-floor"),
        pytest.param(_report(step_time_s=1.0), 0, 10.0, id="multiplier-of-step-time"),
        pytest.param(_report(step_time_s=100.0), 0, 50.0, id="capped-at-hang-max"),
        pytest.param(_report(step_time_s=1.0, saving=True), 0, 40.0, id="checkpoint-grace-while-saving"),
        pytest.param(_report(step_time_s=100.0, saving=True), 0, 80.0, id="checkpoint-grace-above-the-cap"),
        pytest.param(_report(step=1, step_time_s=None), 0, 6.0, id="first-step-slack-three-floors"),
        pytest.param(_report(step=41, step_time_s=None), 40, 6.0, id="first-step-slack-after-restore"),
        pytest.param(_report(step=1, step_time_s=None, saving=True), 0, 36.0,
                     id="first-step-slack-and-saving"),
    ],
)
def test_silence_bound(report: RankReport | None, start_step: int, bound_s: float) -> None:
    assert silence_bound_s(report, start_step, HEALTH) == pytest.approx(bound_s)


def test_first_step_slack_is_capped_at_hang_max() -> None:
    health = HealthSpec(hang_floor_s=20.0, hang_max_s=30.0)

    assert silence_bound_s(_report(step=1, step_time_s=None), 0, health) == pytest.approx(30.0)


STOPPED, SLEEPING = "T", "S"
"""/proc states: a rank stopped by a signal, and one asleep (blocked in a collective, or healthy)."""


@pytest.mark.parametrize(
    ("reports", "running", "states", "now", "expected"),
    [
        pytest.param({0: _report(0, time=1_000.0), 1: _report(1, time=1_005.0)}, {0, 1}, {}, 1_010.5, None,
                     id="all-fresh"),
        pytest.param({0: _report(0, time=1_000.0), 1: _report(1, time=1_005.0)}, {0, 1}, {0: STOPPED},
                     1_010.5, (0, 10.5), id="stopped-rank-past-its-bound"),
        pytest.param({0: _report(0, time=1_000.0)}, {0}, {0: SLEEPING}, 1_010.5, None,
                     id="sleeping-rank-gets-collective-grace"),
        pytest.param({0: _report(0, time=1_000.0)}, {0}, {}, 1_011.5, (0, 11.5),
                     id="sleeping-rank-past-bound-and-grace"),
        pytest.param({0: _report(0, time=1_000.3), 1: _report(1, time=1_000.0)}, {0, 1},
                     {0: STOPPED, 1: SLEEPING}, 1_010.9, (0, 10.6),
                     id="stopped-culprit-named-before-its-peer"),
        pytest.param({0: _report(0, time=1_010.0), 1: _report(1, time=1_000.0), 2: _report(2, time=1_005.0)},
                     {0, 1, 2}, {}, 1_030.0, (1, 30.0), id="longest-silent-wins"),
        pytest.param({0: _report(0, time=1_000.0, finished=True), 1: _report(1, time=1_025.0)}, {0, 1},
                     {0: STOPPED}, 1_030.0, None, id="finished-rank-ignored"),
        pytest.param({0: _report(0, time=1_000.0), 1: _report(1, time=1_025.0)}, {1}, {0: STOPPED}, 1_030.0,
                     None, id="rank-not-running-ignored"),
        pytest.param({0: None, 1: _report(1, time=1_095.0)}, {0, 1}, {}, 1_099.0, None,
                     id="silent-since-launch-within-startup-grace"),
        pytest.param({0: None}, {0}, {}, 1_100.5, (0, 100.5), id="startup-grace-has-no-collective-grace"),
        pytest.param({}, {0}, {}, 1_101.0, (0, 101.0), id="missing-report-counts-from-launch"),
        pytest.param({0: _report(0, time=900.0)}, {0}, {0: STOPPED}, 1_009.0, None,
                     id="stale-report-counts-from-launch"),
        pytest.param({0: _report(0, time=1_000.0, saving=True)}, {0}, {0: SLEEPING}, 1_035.0, None,
                     id="saving-rank-gets-checkpoint-grace"),
        pytest.param({0: _report(0, time=1_000.0, saving=True)}, {0}, {0: STOPPED}, 1_035.0, (0, 35.0),
                     id="a-stopped-rank-is-not-saving"),
    ],
)
def test_find_hung_rank(reports: dict[int, RankReport | None], running: set[int], states: dict[int, str],
                        now: float, expected: tuple[int, float] | None) -> None:
    found = find_hung_rank(reports, running, 0, LAUNCHED_AT, now, HEALTH, states)

    if expected is None:
        assert found is None
    else:
        assert found is not None
        assert found[0] == expected[0]
        assert found[1] == pytest.approx(expected[1])


def test_unknown_process_state_counts_as_sleeping() -> None:
    report = {0: _report(0, time=1_000.0)}  # bound 10 s
    just_past = 1_000.0 + 10.0 + COLLECTIVE_WAIT_GRACE_S / 2

    assert find_hung_rank(report, {0}, 0, LAUNCHED_AT, just_past, HEALTH) is None
    assert find_hung_rank(report, {0}, 0, LAUNCHED_AT, just_past, HEALTH, {0: "?"}) is None
    # In storage I/O (an fsync, a network file system): the kernel works for it, a long phase until hang_max_s.
    assert find_hung_rank(report, {0}, 0, LAUNCHED_AT, just_past, HEALTH, {0: "D"}) is None
    assert find_hung_rank(report, {0}, 0, LAUNCHED_AT, 1_000.0 + HEALTH.hang_max_s + 1, HEALTH, {0: "D"}) is not None


@pytest.mark.parametrize(
    ("saved", "local_ranks", "after_step", "expected"),
    [
        pytest.param({}, {0, 1}, -1, [], id="nothing-saved"),
        pytest.param({10: {0, 1}, 20: {0}, 30: {0, 1}}, {0, 1}, -1, [10, 30], id="only-complete-steps"),
        pytest.param({10: {0, 1}, 20: {0, 1}}, {0, 1}, 10, [20], id="only-newer-than-reported"),
        pytest.param({30: {2, 3}, 10: {2, 3, 9}}, {2, 3}, 0, [10, 30], id="sorted-extra-ranks-fine"),
        pytest.param({10: {0, 1}}, {0, 1}, 10, [], id="already-reported"),
    ],
)
def test_complete_steps(saved: dict[int, set[int]], local_ranks: set[int], after_step: int,
                        expected: list[int]) -> None:
    assert complete_steps(saved, local_ranks, after_step) == expected


@pytest.mark.parametrize(
    ("compute_s", "ratio", "expected"),
    [
        pytest.param({}, 1.5, {}, id="no-reports"),
        pytest.param({0: 0.5}, 1.5, {}, id="a-single-rank-has-no-peers"),
        pytest.param({0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1}, 1.5, {}, id="all-even"),
        pytest.param({0: 0.1, 1: 0.1, 2: 0.1, 3: 0.3}, 1.5, {3: 3.0}, id="one-slow-rank"),
        pytest.param({0: 0.1, 1: 0.1, 2: 0.14}, 1.5, {}, id="within-ratio"),
        pytest.param({0: 0.1, 1: 0.1, 2: 0.14}, 1.2, {2: 1.4}, id="past-a-tighter-ratio"),
        pytest.param({0: 0.1, 1: 0.1, 2: 0.15}, 1.5, {}, id="exactly-at-ratio-is-not-slow"),
        pytest.param({0: 0.1, 1: 0.2}, 1.5, {1: 2.0}, id="two-ranks-the-slower-named"),
        pytest.param({0: 0.1, 1: 0.1, 2: 0.4, 3: 0.4}, 1.5, {2: 4.0, 3: 4.0}, id="median-of-the-other-ranks"),
        pytest.param({0: 0.0, 1: 0.0, 2: 0.3}, 1.5, {}, id="zero-median-ignored"),
    ],
)
def test_find_stragglers(compute_s: dict[int, float], ratio: float, expected: dict[int, float]) -> None:
    assert find_stragglers(compute_s, ratio) == pytest.approx(expected)


def test_a_rank_that_said_why_it_stops_is_exiting_not_hung_until_its_grace_runs_out() -> None:
    """A rank whose script raised is tearing down (torch's shutdown takes seconds on a loaded machine): its exit
    is the crash to report with its traceback, not a hang."""
    raised = RankReport(rank=0, step=5, time=1_000.0, step_time_s=1.0, error="ValueError: deliberate failure")
    past_its_hang_bound = 1_000.0 + 10.0 + COLLECTIVE_WAIT_GRACE_S + 1.0

    assert find_hung_rank({0: _report(0, time=1_000.0)}, {0}, 0, LAUNCHED_AT, past_its_hang_bound, HEALTH) is not None
    assert find_hung_rank({0: raised}, {0}, 0, LAUNCHED_AT, past_its_hang_bound, HEALTH) is None
    assert find_hung_rank({0: raised}, {0}, 0, LAUNCHED_AT, past_its_hang_bound + EXITING_GRACE_S, HEALTH) is not None


@pytest.mark.parametrize(
    ("exit_codes", "reports", "expected"),
    [
        pytest.param({}, {0: None, 1: None}, None, id="none-exited"),
        pytest.param({1: 0}, {0: None, 1: None}, None, id="a-clean-exit-is-no-failure"),
        pytest.param({1: -9}, {0: None, 1: None}, 1, id="killed"),
        pytest.param({0: None}, {0: None}, 0, id="unknown-code-after-an-agent-restart-fails"),
        pytest.param({1: 3}, {1: _report(rank=1, finished=True)}, None, id="finished-then-exited-badly"),
        pytest.param({2: 1, 1: -9}, {1: None, 2: None}, 1, id="the-lowest-failed-rank"),
        pytest.param({0: 0, 3: 1}, {0: None, 3: _report(rank=3)}, 3, id="past-a-clean-one"),
    ],
)
def test_failed_rank(exit_codes: dict[int, int | None], reports: dict[int, RankReport | None],
                     expected: int | None) -> None:
    assert failed_rank(exit_codes, reports) == expected


def test_first_step_and_slowest_step_count_only_steps_past_the_restore() -> None:
    reports: dict[int, RankReport | None] = {0: _report(rank=0, step=40, time=1_010.0),
                                             1: _report(rank=1, step=42, time=1_020.0), 2: None}
    assert first_step_time(reports, start_step=40) == 1_020.0
    assert first_step_time(reports, start_step=42) is None
    assert slowest_step(reports, start_step=40) == 40  # rank 2 has not reported: it is at the restore step
    assert slowest_step({0: reports[0], 1: reports[1]}, start_step=0) == 40
    assert slowest_step({}, start_step=40) == -1


def test_a_fault_happened_when_chaos_injected_it_else_at_the_last_report_else_at_launch() -> None:
    assert fault_time(1_005.0, _report(time=1_009.0), LAUNCHED_AT) == 1_005.0
    assert fault_time(None, _report(time=1_009.0), LAUNCHED_AT) == 1_009.0
    assert fault_time(None, None, LAUNCHED_AT) == LAUNCHED_AT


@pytest.mark.parametrize(("state", "words"), [("T", "stopped"), ("t", "stopped"), ("D", "in uninterruptible I/O"),
                                              ("Z", "defunct"), ("S", "alive"), ("R", "alive"), (None, "alive")])
def test_process_state_words(state: str | None, words: str) -> None:
    assert process_state_words(state) == words
