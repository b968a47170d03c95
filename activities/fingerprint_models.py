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


class Tie(BaseModel):
    """Two replicas that differed with no majority to say which is wrong (`CorruptionVerdict.certain` False). A
    one-off flip of either is the same to the run (both diverged from the fault-free state at the next all-reduce),
    so it rolls back and tells them apart only if the fault comes back: again on the same two nodes, one of them
    leaves for a spare; again on the other, that one is sick; not again, the one that left is."""

    step: int
    """The step the replicas first differed at."""
    nodes: list[str]
    """The two suspects' nodes."""
    attempt: int
    """The attempt that found it (or swapped a suspect out): only a later one can show the fault back or gone."""
    swapped_out: str | None = None
    """The suspect that left the run for a spare, uncordoned, when the tie came back on the same two nodes."""

    @property
    def kept(self) -> str | None:
        """The suspect still in the run once the other was swapped out."""
        return next((n for n in self.nodes if n != self.swapped_out), None) if self.swapped_out else None
