"""Goodput counts each attempt's own steps at its own step time (issue 31, messages): `workflows/goodput.py`."""

from __future__ import annotations

import pytest

from workflows.goodput import Goodput


def test_a_run_without_incidents_counts_its_steps_at_its_mean() -> None:
    goodput = Goodput()
    goodput.launched(0)
    goodput.started(1, first_step_at=100.0)
    goodput.committed(50, at=110.0)
    assert goodput.useful(1, 100, 0.2) == pytest.approx(20.0)


def test_after_a_shrink_each_world_counts_its_steps_at_its_own_pace() -> None:
    """Two nodes at 0.1 s a step to the commit of step 100, one node at 0.3 s after: the smaller world's steps
    are not counted at its slower pace, nor the larger world's redone steps at all."""
    goodput = Goodput()
    goodput.launched(0)
    goodput.started(1, first_step_at=1000.0)
    goodput.committed(100, at=1010.0)  # 100 steps in 10 s: 0.1 s a step
    goodput.launched(100)  # attempt 1 trained past 100, lost a node: attempt 2 restores step 100
    goodput.started(2, first_step_at=1030.0)
    goodput.committed(150, at=1045.0)
    useful = goodput.useful(2, 200, 0.3)
    assert useful == pytest.approx(100 * 0.1 + 100 * 0.3)
    assert useful != pytest.approx(200 * 0.3), "the last attempt's step time alone"


def test_an_attempt_that_never_committed_past_its_start_is_counted_at_the_final_pace() -> None:
    goodput = Goodput()
    goodput.launched(0)
    goodput.started(1, first_step_at=0.0)
    goodput.launched(0)  # crashed before its first checkpoint: nothing of it kept
    goodput.started(2, first_step_at=20.0)
    assert goodput.useful(2, 40, 0.5) == pytest.approx(40 * 0.5)


def test_an_in_process_restart_keeps_the_live_ranks_steps() -> None:
    goodput = Goodput()
    goodput.launched(0)
    goodput.started(1, first_step_at=0.0)
    goodput.committed(20, at=4.0)  # 0.2 s a step
    goodput.launched(27)  # the live ranks rejoined at step 27: no step redone
    goodput.started(2, first_step_at=6.0)
    assert goodput.useful(2, 50, 0.25) == pytest.approx(27 * 0.2 + 23 * 0.25)


def test_a_final_attempt_whose_first_step_was_not_signalled_starts_where_it_launched() -> None:
    goodput = Goodput()
    goodput.launched(0)
    goodput.started(1, first_step_at=0.0)
    goodput.committed(10, at=1.0)
    goodput.launched(10)
    assert goodput.useful(2, 30, 0.2) == pytest.approx(10 * 0.1 + 20 * 0.2)
    assert goodput.useful(2, 30, 0.2) == goodput.useful(2, 30, 0.2), "asking twice changes nothing"


def test_a_repeated_start_signal_changes_nothing() -> None:
    goodput = Goodput()
    goodput.launched(0)
    goodput.started(1, first_step_at=0.0)
    goodput.started(1, first_step_at=5.0)  # a spare joining the attempt
    assert goodput.current is not None and goodput.current.first_step_at == 0.0


def test_no_final_mean_counts_the_earlier_attempts_alone() -> None:
    goodput = Goodput()
    goodput.launched(0)
    goodput.started(1, first_step_at=0.0)
    goodput.committed(10, at=2.0)
    goodput.launched(10)
    goodput.started(2, first_step_at=3.0)
    assert goodput.useful(2, 30, None) == pytest.approx(2.0)
