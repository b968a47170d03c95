"""The report's model: phases, spans read from a history, and the report computed from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainguard.models import Incident


PHASES = ("earlier runs", "reserving", "restoring", "launching", "running", "recovering", "paused",
          "finishing")
"""Report order. `earlier runs` only appears when older runs of a continued chain could not be read."""

PHASE_COLORS = {
    "earlier runs": "#bbbbbb", "reserving": "#9ecae1", "restoring": "#6baed6", "launching": "#fdae6b",
    "running": "#74c476", "recovering": "#fb6a4a", "paused": "#bcbddc", "finishing": "#969696",
}


@dataclass
class Span:
    """One activity of the run: scheduled at `start`, closed at `end` (None while open or abandoned)."""

    name: str
    start: float
    end: float | None = None
    summary: str = ""
    attempt: int | None = None
    """The launch attempt it belongs to (from its input, else its summary), when it has one."""
    outcome: str = "completed"
    """completed, failed, timed_out, canceled, or open."""
    input: dict[str, Any] | None = None
    result: Any = None
    """The decoded JSON result (a dict for `watch_ranks`: kind, step, first_step_at, detected_at, ...)."""


@dataclass
class RunHistory:
    """One run (one history) of a workflow id, reduced to what the report needs."""

    start: float
    end: float | None = None
    """Close time; None while running."""
    status: str = "RUNNING"
    spans: list[Span] = field(default_factory=list)
    run_id: str = ""
    continued_from: str = ""
    """Run id this one continued from (continue-as-new), empty for the first run."""
    input: Any = None
    result: Any = None
    """Decoded result of a completed run (a RunResult as JSON)."""
    failure: str = ""
    encrypted: bool = False
    """Payloads are encrypted and were not decoded (no codec key here): summaries and results are missing."""
    children: list[str] = field(default_factory=list)
    """Workflow ids of the child workflows it started (node groups): their activities are the run's too."""


@dataclass
class Segment:
    phase: str
    start: float
    """Seconds after the run's start."""
    end: float
    attempt: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class IncidentLoss:
    kind: str
    node: str | None
    rank: int | None
    attempt: int
    action: str
    at_s: float | None
    """Detection, seconds after the run's start."""
    detection_s: float | None
    recovery_s: float | None
    step_at_detection: int | None
    resumed_step: int | None
    redone_steps: int | None
    redone_s: float | None
    lost_s: float
    """detection + recovery + redone work (unknown parts count as 0; see `note`)."""
    note: str = ""
    log_path: str | None = None
    """A rank incident's log on its node."""
    log_tail: str = ""
    """The last lines of that log when the incident was seen (its traceback)."""


@dataclass
class StepPoint:
    at_s: float
    """Seconds after the run's start."""
    step: int
    attempt: int


@dataclass
class RunReport:
    workflow_id: str
    status: str
    """COMPLETED, RUNNING, FAILED, ... of the newest run of the chain."""
    runs: int
    """Histories read (more than one when the run continued as new)."""
    started_at: float
    """Unix time the run started (the first history's start event)."""
    wall_s: float
    phases: dict[str, float]
    segments: list[Segment]
    incidents: list[IncidentLoss]
    steps_completed: int | None
    mean_step_s: float | None
    useful_s: float | None
    """steps completed x mean step time."""
    goodput: float | None
    lost_s: float
    """Total time lost to incidents."""
    attempts: int
    points: list[StepPoint] = field(default_factory=list)
    """Step against time, from the watch events (first step of each attempt, checkpoints, the end)."""
    result_wall_s: float | None = None
    """The run's own wall time (RunResult.wall_s, workflow clock), when it completed."""
    notes: list[str] = field(default_factory=list)
    hangs: list[tuple[int, Incident]] = field(default_factory=list)
    """Hang incidents (numbered as in the table) whose evidence is stored with the run."""
    named_phases: dict[str, float] = field(default_factory=dict)
    """Seconds in each phase the script named (`RunResult.phase_s`): part of the useful time, not badput."""

    @property
    def overhead_s(self) -> float | None:
        """Wall time that is neither useful training nor lost to incidents: the first start, checkpoints,
        finishing, step-time jitter."""
        if self.useful_s is None:
            return None
        return self.wall_s - self.useful_s - self.lost_s
