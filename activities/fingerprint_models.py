"""What the nodes write of their ranks' fingerprints and what the committer answers the run (`activities.fingerprints`
holds the logic): plain models, so the run's workflows can import them."""

from __future__ import annotations

from pydantic import BaseModel, Field


class FingerprintRecord(BaseModel):
    """A node's ranks' newest fingerprints of their replicated state (`trainguard.numerics.Fingerprint` as JSON),
    written by its watch when new ones come (overwritten, at most every `FINGERPRINT_WRITE_MIN_S`)."""

    node: str
    attempt: int
    chain_id: str = ""
    written_at: float
    """Unix time (the node's clock) the record was written."""
    ranks: dict[int, list[list[object]]] = Field(default_factory=dict)
    """Rank -> its newest fingerprints, oldest first: [step, value, group]."""


class CorruptionVerdict(BaseModel):
    """The committer's answer when replicas that must hold the same state do not: the first step they differ at."""

    step: int
    """The first fingerprinted step at which the replicas differ."""
    last_good_step: int = -1
    """The newest fingerprinted step before it at which the same replicas agreed (-1: none seen)."""
    ranks: list[int]
    """The ranks that differ from their replicas' majority; with two replicas (no majority), both."""
    nodes: dict[int, str] = Field(default_factory=dict)
    """Rank -> the node it runs on."""
    group: str = ""
    """The replicas compared (`replicated` under DDP, `shard i/n` under HSDP)."""
    certain: bool = True
    """A majority said which replicas are wrong; False: two replicas differ and either may be."""
    found_at: float = 0.0
    """Unix time the committer compared them."""
