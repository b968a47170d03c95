"""The run's useful training time, attempt by attempt: what `RunResult.goodput` divides by the wall time.

Each attempt counts the steps of it the final state kept (from the step it started from to the step the next
attempt started from; the final attempt's up to the end) at its own step time: the final attempt's mean as rank
0 reports it, an earlier attempt's from its first step to its newest commit. After a shrink the steps the
smaller world trained count at its step time, not at the larger world's (or the reverse), and steps redone
after a failure count once. Pure: the workflow feeds it what it already sees (a launch's start step, the
attempt's first step, each commit) and carries one `Goodput` across continue-as-new.
"""

from __future__ import annotations

from pydantic import BaseModel


class AttemptPace(BaseModel):
    """What the run saw of the attempt training now."""

    attempt: int
    from_step: int
    """The step it started from (a restore's checkpoint, or the live ranks' step after an in-process restart)."""
    first_step_at: float
    """Unix time of its first step, on the master node's clock."""
    commit_step: int | None = None
    """Its newest committed step; None before it committed one."""
    commit_at: float | None = None
    """Workflow-clock time of that commit."""

    def step_s(self) -> float | None:
        """Its step time from its first step to its newest commit (checkpoint stalls and the upload before the
        commit included); None before it committed a step past its start."""
        if self.commit_step is None or self.commit_at is None or self.commit_step <= self.from_step:
            return None
        elapsed = self.commit_at - self.first_step_at
        return elapsed / (self.commit_step - self.from_step) if elapsed > 0 else None


class Goodput(BaseModel):
    """Useful training time so far, carried across continue-as-new. Default: a run with no attempt yet."""

    useful_s: float = 0.0
    """Earlier attempts' kept steps x their own step time, seconds."""
    unpaced_steps: int = 0
    """Earlier attempts' kept steps whose step time is unknown (no commit past their start): counted at the final
    attempt's step time."""
    current: AttemptPace | None = None
    """The attempt whose first step was seen last."""
    from_step: int = 0
    """The step the newest launch (or in-process rejoin) started from."""

    def launched(self, from_step: int) -> None:
        """An attempt starts from `from_step` (restored or rejoined); its first step is still to come."""
        self.from_step = from_step

    def started(self, attempt: int, first_step_at: float) -> None:
        """`attempt` made its first step: the attempt before it is over, and kept its steps up to this one's
        start. A repeated signal (a spare joining the attempt) changes nothing."""
        if self.current is not None and self.current.attempt >= attempt:
            return
        self._close(self.from_step)
        self.current = AttemptPace(attempt=attempt, from_step=self.from_step, first_step_at=first_step_at)

    def committed(self, step: int, at: float) -> None:
        if self.current is not None:
            self.current.commit_step, self.current.commit_at = step, at

    def useful(self, final_attempt: int, final_steps: int, final_mean_s: float | None) -> float:
        """Seconds of useful training once `final_attempt` finished at `final_steps` with a mean step time of
        `final_mean_s` (rank 0's own; None: unknown, its steps and the unpaced ones count nothing)."""
        closed = self.model_copy(deep=True)
        if closed.current is None or closed.current.attempt != final_attempt:
            closed._close(closed.from_step)  # the final attempt's first step was not signalled: it began here
            closed.current = None
        own = final_steps - (closed.current.from_step if closed.current is not None else closed.from_step)
        if not final_mean_s:
            return closed.useful_s
        return closed.useful_s + (closed.unpaced_steps + max(0, own)) * final_mean_s

    def _close(self, next_from: int) -> None:
        current = self.current
        if current is None:
            return
        kept = max(0, next_from - current.from_step)
        step_s = current.step_s()
        if step_s is None:
            self.unpaced_steps += kept
        else:
            self.useful_s += kept * step_s
        self.current = None
