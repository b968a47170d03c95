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
    evidence: TieEvidence | None = None
    """With no majority: what the replay after the rollback is compared with to tell the two apart."""


class TieEvidence(BaseModel):
    """What two replicas that differed with no majority held and reported at the step they differed at, for the
    replay after the rollback to be compared with (`activities.fingerprints.settle`): the fault-free run
    computes the same (training here is deterministic: the fault-free digest rests on it)."""

    step: int
    """The step their fingerprints first differed at."""
    last_good_step: int = -1
    group: str = ""
    values: dict[int, str] = Field(default_factory=dict)
    """Each of the two ranks' fingerprint at `step`."""
    agreed: str | None = None
    """Their common fingerprint at `last_good_step`: a replay that does not reach it is not deterministic."""
    nodes: dict[str, list[int]] = Field(default_factory=dict)
    """The two suspects' nodes -> every rank on them (a replica's ranks see a flipped shard at once)."""
    trails: dict[int, dict[int, str]] = Field(default_factory=dict)
    """Rank (on those nodes) -> the losses it reported after `last_good_step` up to `step`, exactly, by step."""


class TieSettlement(BaseModel):
    """The replay's answer to a `TieEvidence`: the node that computed wrong, or None with why none can be named."""

    node: str | None = None
    rank: int | None = None
    """The rank of the two on `node`, the one whose replica computed wrong."""
    why: str


class Tie(BaseModel):
    """Two replicas that differed with no majority to say which is wrong (`CorruptionVerdict.certain` False). A
    one-off flip of either is the same to their states (both diverged from the fault-free state at the next
    all-reduce), so the run rolls back and compares the replay with what they held and reported (`evidence`):
    the replica whose fingerprint the replay reaches, or whose loss went wrong a step later, was right. When the
    replay cannot say, it tells them apart only if the fault comes back: again on the same two nodes, one of them
    leaves for a spare; again on the other, that one is sick; not again, the one that left is."""

    step: int
    """The step the replicas first differed at."""
    nodes: list[str]
    """The two suspects' nodes."""
    attempt: int
    """The attempt that found it (or swapped a suspect out): only a later one can show the fault back or gone."""
    swapped_out: str | None = None
    """The suspect that left the run for a spare, uncordoned, when the tie came back on the same two nodes."""
    evidence: TieEvidence | None = None
    """What the replay is compared with; None once it was (or when there is none)."""

    @property
    def kept(self) -> str | None:
        """The suspect still in the run once the other was swapped out."""
        return next((n for n in self.nodes if n != self.swapped_out), None) if self.swapped_out else None


CorruptionVerdict.model_rebuild()  # its evidence is defined after it
