"""What the nodes write of their ranks' pace and what the committer answers the run (`activities.pace` holds
the logic): plain models, so the run's workflows can import them."""

from __future__ import annotations

from pydantic import BaseModel, Field


class PaceRecord(BaseModel):
    """A node's ranks' pace over its last window, written by its watch once a window (overwritten). The node
    agent writes it and the committer reads it; both import this model."""

    node: str
    attempt: int
    """The attempt whose ranks were measured: only the run's current attempts count."""
    chain_id: str = ""
    """The run's chain (its first execution's run id): a rerun under the same workflow id is another chain."""
    window_end: float
    """Unix time (the node's clock) the window ended: when the record was written."""
    window_s: float
    rank_compute_s: dict[int, float] = Field(default_factory=dict)
    """Rank -> mean compute per step over the window, seconds."""
    step: int = -1
    """The node's slowest rank's step at the window's end."""


class PaceVerdict(BaseModel):
    """The committer's answer when some rank computed slower than `straggler_ratio` times its peers' median over
    a window of training."""

    slow: dict[int, float]
    """Rank -> how many times slower than its peers' median."""
    window_end: float
    """Unix time the newest window compared ended: the run asks only for windows ending after the next one."""
    window_s: float
    step: int = -1
    """The lowest step any compared node had reached by its window's end."""
