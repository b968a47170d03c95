"""A hang is a rank that makes no progress of any kind: the verdict table (`judge_rank`), the activity window, the
learned gaps, and the watch's eyes (`AttemptActivity`) over a fake /proc and fake ranks' answers."""

from __future__ import annotations

import asyncio

import pytest

from activities.progress import (
    NAMED_PHASE_SAFETY,
    RankActivity,
    RankReport,
    RankSignals,
    Usage,
    activity_busy,
    judge_rank,
)
from activities.models import merge_gaps
from activities.rank_activity import AttemptActivity, GapBook, describe, hung
from trainguard.evidence import Position
from trainguard.spec import HealthSpec

HEALTH = HealthSpec(hang_floor_s=2.0, hang_max_s=300.0, startup_grace_s=180.0)
T0 = 1_000.0
"""Launch time; every report here is of step 100 at T0 + 10, a rank stepping every 0.1 s (bound 2 s)."""


def _report(**fields: object) -> RankReport:
    base: dict[str, object] = {"rank": 0, "step": 100, "time": T0 + 10, "step_time_s": 0.1}
    return RankReport(**{**base, **fields})  # type: ignore[arg-type]


BUSY = RankSignals(busy=True)
IDLE_IN_COLLECTIVE = RankSignals(busy=False, in_collective=True, asked=True)
IDLE_OUTSIDE = RankSignals(busy=False, in_collective=False, asked=True)
IDLE_NO_ANSWER = RankSignals(busy=False, in_collective=None, asked=True)
IDLE_NOT_ASKED = RankSignals(busy=False)


@pytest.mark.parametrize(
    ("report", "signals", "state", "silent_s", "expected"),
    [
        pytest.param(_report(), IDLE_OUTSIDE, "S", 1.9, RankActivity.STEPPING, id="within-its-step-bound"),
        pytest.param(_report(), IDLE_OUTSIDE, "T", 2.1, RankActivity.HUNG, id="stopped-is-hung-at-its-bound"),
        pytest.param(_report(), BUSY, "T", 2.1, RankActivity.HUNG, id="stopped-is-hung-whatever-it-did-before"),
        pytest.param(_report(), IDLE_OUTSIDE, "S", 2.1, RankActivity.HUNG, id="idle-on-a-lock-is-hung-at-its-bound"),
        pytest.param(_report(), IDLE_NOT_ASKED, "S", 2.1, RankActivity.STEPPING, id="idle-not-asked-yet-is-asked"),
        pytest.param(_report(), IDLE_NO_ANSWER, "S", 2.5, RankActivity.STEPPING, id="no-answer-gets-the-grace"),
        pytest.param(_report(), IDLE_NO_ANSWER, "S", 3.1, RankActivity.HUNG, id="no-answer-hung-after-the-grace"),
        pytest.param(_report(), BUSY, "R", 12.0, RankActivity.BUSY, id="an-evaluation-is-a-long-phase"),
        pytest.param(_report(), BUSY, "R", 299.0, RankActivity.BUSY, id="busy-is-never-killed-before-hang-max"),
        pytest.param(_report(), BUSY, "R", 301.0, RankActivity.HUNG, id="busy-forever-costs-hang-max"),
        pytest.param(_report(), IDLE_IN_COLLECTIVE, "S", 60.0, RankActivity.WAITING,
                     id="peers-waiting-for-a-rank-0-save-are-waiting"),
        pytest.param(_report(), IDLE_IN_COLLECTIVE, "S", 301.0, RankActivity.HUNG, id="waiting-past-hang-max-is-hung"),
        pytest.param(_report(), IDLE_OUTSIDE, "D", 30.0, RankActivity.BUSY, id="storage-io-is-a-long-phase"),
        pytest.param(_report(phase="save", phase_expected_s=20.0), IDLE_OUTSIDE, "S", 39.0, RankActivity.PHASE,
                     id="idle-in-a-named-phase-within-twice-its-length"),
        pytest.param(_report(phase="save", phase_expected_s=20.0), IDLE_OUTSIDE, "S", 41.0, RankActivity.HUNG,
                     id="idle-in-a-named-phase-past-twice-its-length"),
        pytest.param(_report(phase="data"), IDLE_OUTSIDE, "S", 299.0, RankActivity.PHASE,
                     id="idle-in-a-named-phase-without-a-length-until-hang-max"),
        pytest.param(_report(phase="eval", phase_expected_s=400.0), BUSY, "R", 700.0, RankActivity.BUSY,
                     id="a-named-phase-longer-than-hang-max"),
        pytest.param(_report(phase="eval"), IDLE_OUTSIDE, "T", 2.1, RankActivity.HUNG,
                     id="a-named-phase-does-not-shield-a-stopped-rank"),
        pytest.param(_report(step=0), BUSY, "R", 250.0, RankActivity.BUSY, id="a-first-step-of-minutes"),
        pytest.param(_report(step=0), IDLE_OUTSIDE, "S", 179.0, RankActivity.STEPPING,
                     id="before-the-first-step-the-startup-grace"),
    ],
)
def test_a_rank_is_hung_only_when_it_makes_no_progress_of_any_kind(
        report: RankReport, signals: RankSignals, state: str, silent_s: float, expected: RankActivity) -> None:
    verdict = judge_rank(report, signals, state, 0, T0, report.time + silent_s, HEALTH)

    assert verdict.activity is expected, verdict


def test_an_idle_rank_not_asked_yet_needs_its_position() -> None:
    verdict = judge_rank(_report(), IDLE_NOT_ASKED, "S", 0, T0, T0 + 13, HEALTH)

    assert verdict.needs_position
    assert not judge_rank(_report(), IDLE_OUTSIDE, "S", 0, T0, T0 + 13, HEALTH).needs_position


def test_a_learned_gap_covers_the_step_it_follows() -> None:
    assert judge_rank(_report(), IDLE_OUTSIDE, "S", 0, T0, T0 + 20, HEALTH, expected_gap_s=15).activity \
        is RankActivity.STEPPING
    assert judge_rank(_report(), IDLE_OUTSIDE, "S", 0, T0, T0 + 26, HEALTH, expected_gap_s=15).activity \
        is RankActivity.HUNG


@pytest.mark.parametrize(
    ("report", "expected_gap_s"),
    [
        # make bench-attribution: 2 of 20 ranks stopped mid-save were found at 62 s (the 60 s checkpoint grace).
        pytest.param(_report(saving=True), 0.0, id="stopped-while-saving"),
        pytest.param(_report(step=100), 0.0, id="stopped-before-its-first-step"),
        pytest.param(_report(), 15.0, id="stopped-at-a-learned-gap"),
        pytest.param(None, 0.0, id="stopped-before-any-report"),
    ],
)
def test_a_stopped_rank_gets_no_grace_for_work_it_cannot_do(report: RankReport | None,
                                                            expected_gap_s: float) -> None:
    start = 100 if report is not None and report.step == 100 and not report.saving and not expected_gap_s else 0
    stopped = judge_rank(report, IDLE_NOT_ASKED, "T", start, T0 + 10, T0 + 12.5, HEALTH,
                         expected_gap_s=expected_gap_s)
    assert stopped.activity is RankActivity.HUNG, stopped
    # ...while a rank that can work through them gets them.
    sleeping = judge_rank(report, IDLE_NOT_ASKED, "S", start, T0 + 10, T0 + 12.5, HEALTH,
                          expected_gap_s=expected_gap_s)
    assert sleeping.activity is RankActivity.STEPPING, sleeping


def test_the_named_phase_safety_is_what_the_docs_say() -> None:
    assert NAMED_PHASE_SAFETY == 2.0


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        pytest.param([Usage(0.0, 5.0, 0)], None, id="one-sample-says-nothing"),
        pytest.param([Usage(0.0, 5.0, 0), Usage(0.2, 5.2, 0)], None, id="too-short-a-window"),
        pytest.param([Usage(0.0, 5.0, 0), Usage(1.0, 5.9, 0)], True, id="computing"),
        pytest.param([Usage(0.0, 5.0, 0), Usage(1.0, 5.01, 100)], False, id="asleep-in-a-lock"),
        pytest.param([Usage(0.0, 5.0, 0), Usage(1.0, 5.0, 50_000_000)], True, id="writing-a-checkpoint"),
        pytest.param([Usage(0.0, 5.0, None), Usage(1.0, 5.0, None)], False, id="io-unreadable-and-no-cpu"),
        pytest.param([Usage(t / 4, 5.0 + min(t, 4) * 0.25, 0) for t in range(9)], False,
                     id="busy-earlier-idle-in-the-last-window"),
        # Measured under Slurm: the agent's polls stalled 2 s, so the last 1 s held two samples 0.22 s apart, and
        # a rank computing its evaluation was judged unsampled, then idle outside any collective, then hung.
        pytest.param([Usage(13259.79, 5.90, 0, 11.68, True), Usage(13261.81, 6.20, 0, 13.40, True),
                      Usage(13262.03, 6.24, 0, 13.58, True)], True, id="a-late-poll-leaves-a-gap"),
        pytest.param([Usage(0.0, 5.0, 0), Usage(2.0, 5.0, 0), Usage(2.2, 5.0, 0)], False,
                     id="a-gap-before-an-idle-window"),
    ],
)
def test_the_activity_window(samples: list[Usage], expected: bool | None) -> None:
    assert activity_busy(samples) is expected


def test_a_gap_that_recurs_every_100_steps_is_expected_the_next_time() -> None:
    book = GapBook()
    book.add(100, 12.0)
    assert book.expected_s(200) == 0.0  # once is not a pattern
    book.add(200, 11.0)

    assert book.expected_s(300) == pytest.approx(18.0)
    assert book.expected_s(250) == 0.0
    assert book.expected_s(100) == pytest.approx(18.0)  # a relaunch replays step 100


def test_learned_gaps_merge_keep_the_longest_and_the_newest() -> None:
    merged = merge_gaps({100: 12.0, 200: 9.0}, {200: 11.0, 300: 5.0}, keep=2)

    assert merged == {200: 11.0, 300: 5.0}


class FakeProc:
    """A fake /proc: each rank's CPU seconds and bytes, advanced by the test."""

    def __init__(self) -> None:
        self.cpu: dict[int, float] = {}
        self.io: dict[int, int] = {}
        self.wait: dict[int, float] = {}

    def usage(self, pid: int) -> tuple[float, int | None, float, bool] | None:
        if pid not in self.cpu:
            return None
        return self.cpu.get(pid, 0.0), self.io.get(pid, 0), self.wait.get(pid, 0.0), False


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _watch(activity: AttemptActivity, clock: Clock, proc: FakeProc, reports: dict[int, RankReport],
           answers: dict[int, bool | None], seconds: float, cpu_per_s: dict[int, float]) -> dict[int, object]:
    """Poll as the watch does, every 0.2 s for `seconds`, burning `cpu_per_s` per rank; the last verdicts."""
    asked: list[set[int]] = []

    def positions(ranks: set[int]) -> dict[int, Position | None]:
        asked.append(set(ranks))
        return {r: (None if answers.get(r) is None else Position(request="x", in_collective=answers[r]))
                for r in ranks}

    verdicts: dict[int, object] = {}
    for _ in range(round(seconds / 0.2)):
        clock.now += 0.2
        for rank, rate in cpu_per_s.items():
            proc.cpu[100 + rank] = proc.cpu.get(100 + rank, 0.0) + rate * 0.2
        verdicts = asyncio.run(activity.judge(reports, {r: 100 + r for r in reports}, {r: "S" for r in reports},
                                              0, T0, T0 + 10 + clock.now, HEALTH, positions, grace_s=0.0))
    return verdicts


def test_a_rank_0_save_while_its_peers_wait_in_the_all_reduce_is_a_long_phase_not_a_hang() -> None:
    clock, proc = Clock(), FakeProc()
    activity = AttemptActivity(GapBook(), clock=clock, usage=proc.usage)
    reports = {r: _report(rank=r) for r in range(2)}

    verdicts = _watch(activity, clock, proc, reports, {1: True}, 12.0, {0: 0.9, 1: 0.002})

    assert hung(verdicts) is None  # type: ignore[arg-type]
    assert {r: v.activity for r, v in activity.long_phases().items()} == {0: RankActivity.BUSY,
                                                                          1: RankActivity.WAITING}
    assert describe(activity.long_phases()[1]).startswith("waiting 12.")


def test_a_rank_blocked_on_a_lock_while_its_peer_waits_is_found_at_its_bound() -> None:
    clock, proc = Clock(), FakeProc()
    activity = AttemptActivity(GapBook(), clock=clock, usage=proc.usage)
    reports = {r: _report(rank=r) for r in range(2)}

    verdicts = _watch(activity, clock, proc, reports, {0: False, 1: True}, 2.4, {0: 0.002, 1: 0.002})

    assert hung(verdicts) == (0, pytest.approx(2.4))  # type: ignore[arg-type]


def test_a_gap_a_rank_went_on_after_is_learned() -> None:
    clock, proc = Clock(), FakeProc()
    gaps = GapBook()
    activity = AttemptActivity(gaps, clock=clock, usage=proc.usage)
    _watch(activity, clock, proc, {0: _report()}, {}, 0.4, {0: 1.0})
    _watch(activity, clock, proc, {0: _report(step=101, time=T0 + 22.0)}, {}, 0.2, {0: 1.0})

    assert gaps.gaps == {100: pytest.approx(12.0)}


def test_without_the_ddp_hook_a_rank_behind_its_peers_in_collectives_is_not_waiting_for_them() -> None:
    # Flight Recorder alone: both ranks read as inside (DDP's all-reduce is never waited on), but rank 1 entered
    # one collective fewer: it hangs outside the all-reduce rank 0 waits in.
    clock, proc = Clock(), FakeProc()
    activity = AttemptActivity(GapBook(), clock=clock, usage=proc.usage)
    reports = {r: _report(rank=r) for r in range(2)}

    def positions(ranks: set[int]) -> dict[int, Position | None]:
        return {r: Position(request="x", in_collective=True, collectives_enqueued=41 if r == 1 else 42)
                for r in ranks}

    verdicts = {}
    for _ in range(12):
        clock.now += 0.2
        verdicts = asyncio.run(activity.judge(reports, {0: 100, 1: 101}, {0: "S", 1: "S"}, 0, T0, T0 + 10 + clock.now,
                                              HEALTH, positions, grace_s=0.0))
        proc.cpu.update({100: 0.0, 101: 0.0})

    assert hung(verdicts) == (1, pytest.approx(2.4))
    assert verdicts[0].activity is RankActivity.WAITING


def test_a_rank_whose_gpu_runs_kernels_is_busy_though_its_cpu_sleeps() -> None:
    clock, proc = Clock(), FakeProc()
    activity = AttemptActivity(GapBook(), clock=clock, usage=proc.usage, gpu_busy=lambda: {100})
    reports = {0: _report(rank=0)}

    verdicts = _watch(activity, clock, proc, reports, {0: False}, 12.0, {0: 0.0})

    assert hung(verdicts) is None  # type: ignore[arg-type]
    assert activity.long_phases()[0].activity is RankActivity.BUSY


class FakeNvml:
    """pynvml's shape: one GPU whose samples name the processes that used it."""

    class NVMLError(Exception):
        pass

    def __init__(self, samples: list[tuple[int, int]], available: bool = True) -> None:
        self.samples = samples
        self.available = available
        self.inits = 0

    def nvmlInit(self) -> None:
        self.inits += 1
        if not self.available:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:
        return index

    def nvmlDeviceGetProcessUtilization(self, handle: object, since_us: int) -> list[object]:
        from types import SimpleNamespace
        return [SimpleNamespace(pid=pid, smUtil=sm, memUtil=0) for pid, sm in self.samples]


def test_gpu_activity_names_the_processes_nvml_saw_computing_and_gives_up_without_a_driver() -> None:
    from activities.health import GpuActivity

    assert GpuActivity(FakeNvml([(100, 87), (101, 0)])).busy_pids() == {100}
    absent = FakeNvml([(100, 87)], available=False)
    gpu = GpuActivity(absent)
    assert gpu.busy_pids() == set() and gpu.busy_pids() == set()
    assert absent.inits == 1  # not asked again


def test_a_rank_not_sampled_over_a_window_yet_is_never_judged_idle_on_nothing() -> None:
    # The agent's polls ran late (a loaded machine): two samples 0.3 s apart say nothing, and the rank, asked,
    # happened to be between collectives. It must not be hung for that.
    unsampled = RankSignals(busy=None, in_collective=False, asked=True)
    assert judge_rank(_report(), unsampled, "R", 0, T0, T0 + 12.2, HEALTH).activity is RankActivity.STEPPING
    # ...but a rank whose /proc never answers is judged by its position after the grace.
    assert judge_rank(_report(), unsampled, "S", 0, T0, T0 + 17.5, HEALTH).activity is RankActivity.HUNG


def test_a_rank_starved_of_cpu_on_a_loaded_machine_is_busy_not_idle() -> None:
    # Four evaluating ranks on an oversubscribed machine got 2% of a core each; they waited for one the rest.
    starved = [Usage(0.0, 5.0, 0, 10.0), Usage(1.0, 5.02, 0, 10.9)]
    asleep = [Usage(0.0, 5.0, 0, 10.0), Usage(1.0, 5.02, 0, 10.0)]

    assert activity_busy(starved) is True
    assert activity_busy(asleep) is False


def test_a_rank_seen_running_in_its_window_is_busy_whatever_its_counters_say() -> None:
    counted_nothing = [Usage(0.0, 5.0, 0, 1.0, running=True), Usage(1.0, 5.0, 0, 1.0)]
    asleep = [Usage(0.0, 5.0, 0, 1.0), Usage(1.0, 5.0, 0, 1.0)]

    assert activity_busy(counted_nothing) is True
    assert activity_busy(asleep) is False
