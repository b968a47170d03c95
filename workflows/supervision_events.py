"""The events the supervision reducer folds and the actions it asks for (`workflows.supervision.observe`).

An event is what the `Supervisor` saw (a group's result, a committer's answer, a timer) or the answer to an
action that asked a question (`LoseNode` -> `Found`, `JoinSpare` -> `JoinAnswer`, `Settle` -> `Settled`,
`Reclaim` -> `Reclaimed`, `CheckHistory` -> `History`, `AskCheckpoint` -> `StragglerAsked`). Plain frozen
dataclasses: nothing here acts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from activities.fingerprint_models import CorruptionVerdict, Tie, TieSettlement
from activities.models import RankEvidence, WatchEvent
from activities.pace_models import PaceVerdict
from trainguard.models import Incident
from workflows.node_group_models import NodeGroupWatchResult


# ------------------------------------------------------------------------------------------------ events
@dataclass(frozen=True)
class Reported:
    """What the groups that returned and the standing groups' reports say, in group order."""

    results: list[tuple[int, NodeGroupWatchResult]]
    attempt: int
    launching: bool
    """The attempt's nodes still launch from their watches: a node that never took up its watch may be joined."""
    now: float
    by_signal: frozenset[int] = frozenset()
    """Groups among `results` that reported by signal (standing groups)."""


@dataclass(frozen=True)
class Found:
    """The incident the run made of a lost node (`LoseNode`)."""

    incident: Incident
    group: int
    join: bool


@dataclass(frozen=True)
class JoinAnswer:
    group: int
    incident: Incident
    joined: bool


@dataclass(frozen=True)
class Settled:
    """Every node of the look is accounted for; `running_standing`: groups whose standing watch still runs."""

    running_standing: frozenset[int]


@dataclass(frozen=True)
class Committed:
    """A committer's answer (its commits already recorded on the run), with what the rules read of the run."""

    steps: list[int]
    pace: PaceVerdict | None
    store_error: str | None
    attempt: int
    now: float
    draining: bool
    """A node of the run is being drained."""
    may_grow: bool
    """Nodes a shrink left behind may come back at this checkpoint."""
    streaks: dict[int, int]
    slow_window_end: float
    straggler_windows: int
    have_spare: bool
    nodes: list[str]
    ranks_per_node: int
    slowed_at: dict[str, float] = field(default_factory=dict)
    """Nodes chaos slowed, with when: a straggler's detection is timed from it."""
    corruption: CorruptionVerdict | None = None
    """Replicas whose fingerprints differ (`activities.fingerprints`): a silent data corruption."""
    flipped_at: dict[str, float] = field(default_factory=dict)
    """Nodes `chaos bitflip` hit, with when: a corruption's detection is timed from it."""
    tie: Tie | None = None
    """Two replicas that differed with no majority, held until an attempt tells them apart (`RunState.tie`)."""
    settled: TieSettlement | None = None
    """The replay's answer to the tie's evidence (`activities.fingerprints.settle`), when the committer has it."""
    resumed_step: int = 0
    """The step this attempt resumed from."""
    fingerprint_every: int = 0
    """`health.fingerprint_every_steps`."""
    heals_from_peers: bool = False
    """The run is one replica group of several (`RunSpec.in_replica_group`): a relaunch heals from a live group."""


@dataclass(frozen=True)
class Reclaimed:
    back: list[str]
    """Nodes a shrink left behind that the pool leased again."""
    groups_ended: int


@dataclass(frozen=True)
class History:
    suggested: bool
    bytes: int
    events: int
    max_events: int


@dataclass(frozen=True)
class StragglerAsked:
    step: int | None
    """The step every rank checkpoints at; None: the request failed."""


@dataclass(frozen=True)
class StragglerWaitOver:
    pass


Event = (Reported | Found | JoinAnswer | Settled | Committed | Reclaimed | History | StragglerAsked
         | StragglerWaitOver)


# ----------------------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class Learn:
    """The events' gaps and restore tiers go to the run (`RunCore.learn`), and `step` (the furthest a failing
    rank reached) to its status."""

    events: list[WatchEvent]
    step: int | None


@dataclass(frozen=True)
class AgentRestarting:
    node: str
    at: float


@dataclass(frozen=True)
class KeepEvidence:
    """A node's hang evidence in hand: its ranks are not asked for it again before the relaunch."""

    node: str
    ranks: list[RankEvidence]
    overwrite: bool
    """The hang's own watch brought it (newest); else a group-mate's, kept only where none is in hand."""


@dataclass(frozen=True)
class LoseNode:
    """Make the incident of a lost node (`RunCore.lost_at_launch`): answered with `Found`."""

    node: str
    detail: str
    group: int
    join: bool


@dataclass(frozen=True)
class Settle:
    """Answered with `Settled`."""


@dataclass(frozen=True)
class JoinSpare:
    """The policy may put a spare in the node's place in this attempt: answered with `JoinAnswer`."""

    group: int
    incident: Incident


@dataclass(frozen=True)
class Tell:
    """A standing group's watch still runs: tell it of the spare that joined."""

    group: int


@dataclass(frozen=True)
class WatchAgain:
    """Start the group's watch again, the spare's launch in it."""

    group: int


@dataclass(frozen=True)
class SetStreaks:
    window_end: float
    streaks: dict[int, int]


@dataclass(frozen=True)
class RecordIncident:
    incident: Incident


@dataclass(frozen=True)
class AskCheckpoint:
    """Every rank checkpoints this far ahead: answered with `StragglerAsked`, then the timer starts."""

    ahead_s: float


@dataclass(frozen=True)
class StartTimer:
    seconds: float


@dataclass(frozen=True)
class Reclaim:
    """Ask the pool for the nodes a shrink left behind: answered with `Reclaimed`."""


@dataclass(frozen=True)
class Release:
    node: str


@dataclass(frozen=True)
class ReclaimSpares:
    pass


@dataclass(frozen=True)
class CheckHistory:
    """Answered with `History`."""


@dataclass(frozen=True)
class JudgeStorage:
    """Nothing committed: past the staleness bound, an incident naming the store."""

    store_error: str | None


@dataclass(frozen=True)
class HoldTie:
    """Hold a tie (`RunState.tie`) until an attempt tells its two nodes apart."""

    tie: Tie


@dataclass(frozen=True)
class ForgetTie:
    pass


@dataclass(frozen=True)
class CordonSpare:
    """A suspect the run set aside as a spare is the sick one: cordoned, and no longer the run's spare."""

    node: str
    reason: str


SupervisionAction = (Learn | AgentRestarting | KeepEvidence | LoseNode | Settle | JoinSpare | Tell | WatchAgain
                     | SetStreaks | RecordIncident | AskCheckpoint | StartTimer | Reclaim | Release
                     | ReclaimSpares | CheckHistory | JudgeStorage | HoldTie | ForgetTie | CordonSpare)
Actions = list[SupervisionAction]
