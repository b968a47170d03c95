"""What supervising an attempt decides, as one pure reducer: `observe(seen, event) -> (seen, actions)`.

`Supervisor` (workflows/run_supervise.py) waits on the attempt's watch groups, its committer, the standing
groups' reports, a straggler's timer and the operator's pause. Whatever arrives becomes an event here; the
actions that come back are carried out in order, and an action whose answer matters comes back as an event of
its own (depth first: its actions run before the ones queued after it). The rules live here and nowhere else:
whose fault a lost node is, when a spare joins the attempt instead of a relaunch, which of several failures is
the incident, the straggler's checkpoint on demand, and what a commit allows (a drain, a grow back,
continue-as-new). No clock, no I/O: times and history sizes come in the events, and
tests/unit/test_supervision.py tables the rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

from activities.fingerprint_models import CorruptionVerdict, Tie, TieSettlement
from activities.models import WatchEvent, WatchEventKind
from trainguard.error_types import SPEC_FAULTS, ErrorType
from trainguard.models import Action, Incident, IncidentKind, short_cause
from workflows.node_group_models import LostNode, NodeGroupWatchResult
from workflows.policy import classify_exit
from workflows.run_decisions import (Ending, attempt_ending, continue_as_new_due, earliest_incident,
                                     grow_or_finish, judge_pace)
from workflows.supervision_events import (Actions, AgentRestarting, AskCheckpoint, CheckHistory, Committed,
                                          CordonSpare, Event, ForgetTie, Found, History, HoldTie, JoinAnswer,
                                          JoinSpare, JudgeStorage, KeepEvidence, Learn,
                                          LoseNode, Reclaim, ReclaimSpares, Reclaimed, RecordIncident, Release,
                                          Reported, SetStreaks, Settle, Settled, StartTimer, StragglerAsked,
                                          StragglerWaitOver, Tell, WatchAgain)

STRAGGLER_CHECKPOINT_AHEAD_S = 4.0
"""A persistent straggler's checkpoint on demand asks for a step this far ahead of the master's (the operator's
`checkpoint_now` asks 2 s): a request that reaches a rank past its step is never taken, and on a loaded
machine (load 18 on two cores) two round trips of request activities took longer than 2 s."""
STRAGGLER_CHECKPOINT_ASKS = 2
"""...asked this many times, each further ahead, before the straggler is replaced without it."""
STRAGGLER_CHECKPOINT_WAIT_S = 20.0
"""How long a persistent straggler's checkpoint on demand may take to commit before it is asked again (or its
node is replaced from the newest checkpoint there is): the slow rank must reach the step (about 4 s of the run's
pace ahead), save it, and every node upload it; a store that is out must not keep a slow rank in the job."""


@dataclass
class Outcome:
    """How an attempt ended, for the run's loop (`TrainingRun`): its `Ending`, with what the ending concerns."""

    ending: Ending
    incident: Incident | None = None
    """`Ending.INCIDENT`: what the recovery decides on."""
    grow: list[str] = field(default_factory=list)
    """`Ending.GROW`: nodes a shrink left behind, back and leased again: relaunch onto them."""
    final_events: list[WatchEvent] = field(default_factory=list)
    """`Ending.FINISHED`: every node's last event (steps, the state digest, phases)."""

    @property
    def finished(self) -> bool:
        return self.ending is Ending.FINISHED


class LostAs(str, Enum):
    """Whose fault a node that left its watch is, and what the run does about it."""

    SPEC_FAULT = "spec_fault"
    """Its launch failed on the spec: the run fails, naming the node's error."""
    CORRUPT = "corrupt"
    """Its download found the restored checkpoint corrupt: the one before is restored."""
    AGENT_RESTART = "agent_restart"
    """Its agent is shutting down gracefully (an upgrade): an incident, but the node is coming back."""
    JOIN = "join"
    """It never took up its launching watch: a spare may take its place in the attempt's rendezvous."""
    LOST = "lost"


def classify_lost(lost: LostNode, *, launching: bool) -> LostAs:
    if lost.error_type in SPEC_FAULTS:
        return LostAs.SPEC_FAULT
    if lost.error_type == ErrorType.CORRUPT_CHECKPOINT:
        return LostAs.CORRUPT
    if lost.error_type == ErrorType.AGENT_SHUTDOWN:
        return LostAs.AGENT_RESTART
    if lost.never_started and launching:
        return LostAs.JOIN
    return LostAs.LOST


def incident_time(event: WatchEvent, incident: Incident) -> float:
    """When a watch event's failure happened, for picking the earliest: a GPU fault when it was found (its
    `occurred_at` is the NVML event's, which a node may report long after), anything else when it occurred."""
    if incident.kind is IncidentKind.GPU_UNHEALTHY:
        return event.detected_at
    return event.occurred_at or event.detected_at


@dataclass
class Straggler:
    """A rank slow for `health.straggler_windows` windows in a row: every rank checkpoints on demand, then its
    node is replaced (without the checkpoint once it has been asked `STRAGGLER_CHECKPOINT_ASKS` times, and at
    once in a replica group, `asks` 0: its relaunch heals from a live group)."""

    incident: Incident
    step: int = 0
    """The step the checkpoint on demand was asked for."""
    asks: int = 0


@dataclass
class Seen:
    """What an attempt's supervision has learnt so far."""

    watched: int
    """Watch groups of the attempt: it has finished when every one returned its ranks finished."""
    finished: dict[int, NodeGroupWatchResult] = field(default_factory=dict)
    incident: Incident | None = None
    spec_fault: LostNode | None = None
    corrupt: LostNode | None = None
    reporting: frozenset[int] = frozenset()
    """Standing groups that reported in this attempt (their reporting nodes have no watch left)."""
    drain: bool = False
    grow: list[str] = field(default_factory=list)
    continue_as_new: bool = False
    straggler: Straggler | None = None
    candidates: list[tuple[float, Incident]] = field(default_factory=list)
    """This look's failures with when each happened; the earliest is the incident (`Settled`)."""
    joining: list[tuple[int, Incident]] = field(default_factory=list)
    """Nodes of this look that never took up their launch, by group, for a spare to join in their place."""
    rejoined: list[int] = field(default_factory=list)
    """Groups a spare joined in this look: each gets one new watch however many of its nodes were replaced."""

    def ending(self, *, paused: bool) -> Ending | None:
        """What ends the attempt; None while supervision goes on."""
        if not (paused or self.incident or self.continue_as_new or self.drain or self.grow or self.spec_fault
                or self.corrupt or len(self.finished) >= self.watched):
            return None
        return attempt_ending(spec_fault=self.spec_fault is not None, corrupt=self.corrupt is not None,
                              incident=self.incident is not None, continue_as_new=self.continue_as_new,
                              paused=paused, drain=self.drain, grow=bool(self.grow))

    def settled(self) -> bool:
        """Nothing is due at a commit: no drain, grow back or incident, no straggler being replaced."""
        return not (self.drain or self.grow or self.incident is not None or self.straggler is not None)


# ------------------------------------------------------------------------------------------------ reducer
def observe(seen: Seen, event: Event) -> tuple[Seen, Actions]:
    """Fold one event into what supervision has seen, and say what the supervisor must do about it."""
    match event:
        case Reported():
            return _reported(seen, event)
        case Found(incident=incident, group=group, join=join):
            if join:
                return replace(seen, joining=[*seen.joining, (group, incident)]), []
            return replace(seen, candidates=[*seen.candidates, (incident.detected_at, incident)]), []
        case JoinAnswer(group=group, incident=incident, joined=joined):
            if joined:
                rejoined = seen.rejoined if group in seen.rejoined else [*seen.rejoined, group]
                return replace(seen, rejoined=rejoined), [Settle()]
            return replace(seen, candidates=[*seen.candidates, (incident.detected_at, incident)]), [Settle()]
        case Settled():
            return _settled(seen, event)
        case Committed():
            return _committed(seen, event)
        case Reclaimed(back=back, groups_ended=ended):
            grow = grow_or_finish(back, groups_ended=ended)
            releases: Actions = [Release(node) for node in back if not grow]  # leased again for nothing
            return replace(seen, grow=grow), [*releases, ReclaimSpares(), CheckHistory()]
        case History():
            due = continue_as_new_due(suggested=event.suggested, history_bytes=event.bytes,
                                      history_events=event.events, max_events=event.max_events)
            return replace(seen, continue_as_new=seen.settled() and len(seen.finished) < seen.watched and due), []
        case StragglerAsked(step=step):
            return _straggler_asked(seen, step)
        case StragglerWaitOver():
            return _straggler_wait_over(seen)
    raise TypeError(f"not a supervision event: {event!r}")


def _reported(seen: Seen, event: Reported) -> tuple[Seen, Actions]:
    actions: Actions = []
    candidates = list(seen.candidates)
    spec_fault, corrupt, finished = seen.spec_fault, seen.corrupt, dict(seen.finished)
    joins: Actions = []
    for group, result in event.results:
        actions.append(Learn([*result.incidents, *result.finished],
                             step=max((e.step for e in result.incidents), default=None)))
        for lost in result.lost:
            match classify_lost(lost, launching=event.launching):
                case LostAs.SPEC_FAULT:
                    spec_fault = spec_fault or lost
                case LostAs.CORRUPT:
                    corrupt = corrupt or lost
                case LostAs.AGENT_RESTART:  # coming back: not a lost node
                    at = lost.away_since or event.now
                    actions.append(AgentRestarting(lost.node, at))
                    candidates.append((at, _agent_restart(lost, event.attempt, at)))
                case LostAs.JOIN:
                    joins.append(LoseNode(lost.node, lost.detail, group, join=True))
                case LostAs.LOST:
                    actions.append(LoseNode(lost.node, lost.detail, group, join=False))
        # Asked by its group at once, or brought by the hang's own watch: not asked again.
        actions += [KeepEvidence(node, ranks, overwrite=False) for node, ranks in result.evidence.items()]
        for watched in result.incidents:
            if watched.evidence:
                actions.append(KeepEvidence(watched.node, watched.evidence, overwrite=True))
            incident = rank_incident(watched, event.attempt)
            candidates.append((incident_time(watched, incident), incident))
        if result.finished:
            finished[group] = result
    seen = replace(seen, candidates=candidates, spec_fault=spec_fault, corrupt=corrupt, finished=finished,
                   reporting=seen.reporting | event.by_signal)
    return seen, [*actions, *joins, Settle()]


def _agent_restart(lost: LostNode, attempt: int, at: float) -> Incident:
    return Incident(kind=IncidentKind.AGENT_RESTART, node=lost.node, attempt=attempt, detail=lost.detail,
                    detected_at=at)


def _settled(seen: Seen, event: Settled) -> tuple[Seen, Actions]:
    """Spares join one node at a time, and only while no failure asks for a relaunch anyway (it relaunches
    every node, spares joined included); then the groups they joined watch again, and the earliest failure of
    the look is the incident."""
    if seen.joining:
        (group, lost), rest = seen.joining[0], seen.joining[1:]
        if seen.candidates:
            candidates = [*seen.candidates, *((i.detected_at, i) for _, i in seen.joining)]
            return replace(seen, joining=[], candidates=candidates), [Settle()]
        return replace(seen, joining=rest), [JoinSpare(group, lost)]
    actions: Actions = []
    if seen.rejoined and not seen.candidates:
        actions = [Tell(g) if g in event.running_standing else WatchAgain(g) for g in seen.rejoined]
    incident = earliest_incident(seen.candidates)
    return replace(seen, incident=incident, candidates=[], rejoined=[]), actions


def rank_incident(event: WatchEvent, attempt: int) -> Incident:
    """The incident a watch's event of a rank or a GPU is."""
    detection = None if event.fault_at is None else round(max(0.0, event.detected_at - event.fault_at), 3)
    if event.kind is WatchEventKind.GPU_UNHEALTHY:
        return Incident(kind=IncidentKind.GPU_UNHEALTHY, node=event.node, attempt=attempt, detail=event.detail,
                        detection_s=None if event.fault_at is None else round(event.detected_at - event.fault_at, 3),
                        detected_at=event.detected_at)
    if event.kind is WatchEventKind.NUMERICAL_FAULT:
        return Incident(kind=IncidentKind.NUMERICAL_FAULT, node=event.node, rank=event.rank, attempt=attempt,
                        detail=event.detail, detection_s=detection, detected_at=event.detected_at,
                        bad_step=event.fault_step, log_path=event.log_path)
    kind = IncidentKind.HANG if event.kind is WatchEventKind.HANG else classify_exit(event.exit_code)
    return Incident(kind=kind, node=event.node, rank=event.rank, attempt=attempt, detail=event.detail,
                    detection_s=detection, detected_at=event.detected_at, log_path=event.log_path,
                    log_tail=event.log_tail, signature=event.failure_signature)


# ------------------------------------------------------------------------------------------------ commits
def _committed(seen: Seen, event: Committed) -> tuple[Seen, Actions]:
    actions: Actions = []
    straggler, incident = seen.straggler, seen.incident
    found, more = tie_verdict(event, incident)
    incident, actions = incident or found, [*actions, *more]
    if straggler is not None:
        step = next((s for s in event.steps if s >= straggler.step), None)
        if step is not None:  # its checkpoint is in: now the spare
            replaced = _noted(straggler.incident, f"replaced after a checkpoint on demand at step {step}")
            straggler = replace(straggler, incident=replaced)
            incident = incident or replaced
    elif event.pace is not None:  # one being checkpointed is judged already
        straggler, more = _judge_pace(event)
        actions += more
        if straggler is not None and not straggler.asks:  # replaced at once
            incident = incident or straggler.incident
    seen = replace(seen, straggler=straggler, incident=incident)
    if not event.steps:
        return seen, [*actions, JudgeStorage(event.store_error), CheckHistory()]
    seen = replace(seen, drain=event.draining)
    if event.may_grow:
        return seen, [*actions, Reclaim()]
    return seen, [*actions, ReclaimSpares(), CheckHistory()]


def _judge_pace(event: Committed) -> tuple[Straggler | None, Actions]:
    """A window of training in which some rank was slow: reported when first seen; one that persists has every
    rank checkpoint on demand, and its node is replaced once that checkpoint commits."""
    pace = event.pace
    assert pace is not None
    verdict = judge_pace(event.streaks, event.slow_window_end, pace.slow, window_end=pace.window_end,
                         window_s=pace.window_s, windows=event.straggler_windows, have_spare=event.have_spare)
    actions: Actions = [SetStreaks(pace.window_end, verdict.streaks)]
    actions += [RecordIncident(straggler_incident(event, rank, verdict.counts[rank])) for rank in verdict.first_seen]
    if verdict.persisted is None:
        return None, actions
    persisted = straggler_incident(event, verdict.persisted, verdict.counts[verdict.persisted])
    if event.heals_from_peers:  # a checkpoint would only hold the slow group up: a live group has its state
        return Straggler(_noted(persisted, "replaced at once: its replica group heals from a live one")), actions
    return Straggler(persisted, asks=1), [*actions, AskCheckpoint(STRAGGLER_CHECKPOINT_AHEAD_S)]


def straggler_incident(event: Committed, rank: int, windows: int) -> Incident:
    pace = event.pace
    assert pace is not None
    node = event.nodes[rank // event.ranks_per_node]
    slowed_at = event.slowed_at.get(node)
    return Incident(kind=IncidentKind.STRAGGLER, node=node, rank=rank, attempt=event.attempt,
                    detail=f"rank {rank} computes {pace.slow[rank]:.2f}x slower than its peers' median "
                           f"over {pace.window_s:g}s of training (to step {pace.step}; {windows} window(s) in a row)",
                    detection_s=None if slowed_at is None else round(max(0.0, event.now - slowed_at), 3),
                    action=Action.REPORT, detected_at=event.now)


def tie_verdict(event: Committed, incident: Incident | None) -> tuple[Incident | None, Actions]:
    """Replicas that differ end the attempt, rolled back past the step they differed at (`corruption_incident`).
    Two of them with no majority are a tie (`Tie`): a one-off flip of either is the same to the run, so it tells
    them apart only if the fault comes back. Back on the same two nodes: the one of the higher rank leaves for a
    spare, uncordoned (the run holds it as a spare). Back on the one kept: that one is sick. Not back by a verified
    commit two fingerprints past the restore (and past the tie's step): the one that left is sick, and cordoned;
    or, with none swapped out, it was a one-off nobody can be blamed for."""
    verdict, tie = event.corruption, event.tie
    later = tie is not None and event.attempt > tie.attempt
    if verdict is None:
        if later and tie is not None and tie.swapped_out is None and event.settled is not None:
            return _tie_settled(event, tie, event.settled)
        return None, _tie_gone(event) if later else []
    if verdict.certain:
        return corruption_incident(event), []
    suspects = sorted({verdict.nodes.get(r) or "?" for r in verdict.ranks})
    if len(suspects) == 1:  # both replicas on one node: wrong whichever of them is
        return corruption_incident(event, named=suspects[0], why="both replicas that differ run on it"), []
    if later and tie is not None and tie.swapped_out is not None and tie.kept in suspects:
        return corruption_incident(event, named=tie.kept, why=(
            f"replicas differed at step {tie.step} on {' and '.join(tie.nodes)}, and again once "
            f"{tie.swapped_out} had left the run for a spare")), [ForgetTie()]
    if later and tie is not None and tie.swapped_out is None and suspects == sorted(tie.nodes):
        out = verdict.nodes.get(max(verdict.ranks)) or suspects[-1]
        swapped = Incident(kind=IncidentKind.SILENT_DATA_CORRUPTION, node=out, rank=max(verdict.ranks),
                           attempt=event.attempt, detected_at=event.now, bad_step=_bad_step(verdict),
                           cause=(f"silent data corruption again on {' and '.join(suspects)} ({verdict.group}, step "
                                  f"{verdict.step}; first at step {tie.step}): one of the two is sick; {out} leaves "
                                  f"for a spare, uncordoned, to tell which"))
        return swapped, [HoldTie(tie.model_copy(update={"swapped_out": out, "attempt": event.attempt}))]
    found = corruption_incident(event)
    if incident is not None:
        return found, []  # another fault ends the attempt: its relaunch need not show this one again
    return found, [HoldTie(Tie(step=verdict.step, nodes=suspects, attempt=event.attempt, evidence=verdict.evidence))]


def _tie_settled(event: Committed, tie: Tie, settled: TieSettlement) -> tuple[Incident | None, Actions]:
    """The replay after a tie's rollback told the two replicas apart: the one that computed wrong is named, and
    replaced and cordoned as any corrupt node is (the replay is the fault-free run: no further rollback). It
    could not: the tie waits for the fault to come back, as with no evidence."""
    if settled.node is None:
        return None, [HoldTie(tie.model_copy(update={"evidence": None}))]
    other = " and ".join(n for n in tie.nodes if n != settled.node) or "its replica"
    return Incident(kind=IncidentKind.SILENT_DATA_CORRUPTION, node=settled.node, rank=settled.rank,
                    attempt=event.attempt,
                    detected_at=event.now,
                    cause=(f"silent data corruption: {settled.node} computes wrong: replicas on it and on {other} "
                           f"differed at step {tie.step} with no majority; {settled.why}")), [ForgetTie()]


def _tie_gone(event: Committed) -> Actions:
    """A tie's fault did not come back by a verified commit two fingerprints past the restore (a flip after the
    first one shows at the second) and past the step it first showed at."""
    tie = event.tie
    assert tie is not None
    due = max(tie.step, event.resumed_step + 2 * event.fingerprint_every)
    if not event.steps or max(event.steps) < due:
        return []
    if tie.swapped_out is None:
        return [ForgetTie()]
    out, kept = tie.swapped_out, tie.kept
    cause = (f"silent data corruption: {out} computes wrong: replicas differed at step {tie.step} on {out} and "
             f"{kept}, again on the same two after a rollback, and not since {out} left the run for a spare "
             f"(verified to step {max(event.steps)})")
    incident = Incident(kind=IncidentKind.SILENT_DATA_CORRUPTION, node=out, attempt=event.attempt, cause=cause,
                        decision=f"{out} cordoned", action=Action.REPORT, detected_at=event.now)
    return [ForgetTie(), CordonSpare(out, short_cause(cause)), RecordIncident(incident)]


def _bad_step(verdict: CorruptionVerdict) -> int:
    return verdict.last_good_step + 1 if verdict.last_good_step >= 0 else verdict.step


def corruption_incident(event: Committed, named: str | None = None, why: str = "") -> Incident:
    """The incident of replicas whose fingerprints differ: the outvoted rank and its node; with two replicas
    (no majority) both are named in the cause and no node is blamed (the rollback is the remedy), unless `named`
    is the node a tie's history showed sick (`why`)."""
    verdict = event.corruption
    assert verdict is not None
    suspects = ", ".join(f"rank {r} ({verdict.nodes.get(r) or '?'})" for r in verdict.ranks)
    good = verdict.last_good_step
    since = f"they agreed at step {good}" if good >= 0 else "no earlier agreement seen"
    if named is not None:
        rank = next((r for r in verdict.ranks if verdict.nodes.get(r) == named), None)
        return Incident(kind=IncidentKind.SILENT_DATA_CORRUPTION, node=named, rank=rank, attempt=event.attempt,
                        cause=(f"silent data corruption: {named} computes wrong: {suspects} hold different state at "
                               f"step {verdict.step} ({verdict.group}); {why}"),
                        detected_at=event.now, bad_step=_bad_step(verdict))
    if verdict.certain:
        cause = (f"silent data corruption: {suspects} hold other state than the majority of their replicas "
                 f"({verdict.group}) at step {verdict.step}; {since}")
    else:
        cause = (f"silent data corruption: {suspects} hold different state at step {verdict.step} ({verdict.group}; "
                 f"{since}); with two replicas no majority says which is wrong, so no node is blamed unless it "
                 f"happens again")
    node = verdict.nodes.get(verdict.ranks[0]) if verdict.certain and len(verdict.ranks) == 1 else None
    flipped = [at for n, at in event.flipped_at.items() if n == node] if node else []
    return Incident(kind=IncidentKind.SILENT_DATA_CORRUPTION, node=node,
                    rank=verdict.ranks[0] if node else None, attempt=event.attempt, cause=cause,
                    detection_s=round(max(0.0, event.now - flipped[0]), 3) if flipped else None,
                    detected_at=event.now, bad_step=_bad_step(verdict))


def _straggler_asked(seen: Seen, step: int | None) -> tuple[Seen, Actions]:
    assert seen.straggler is not None
    if step is None:  # the request failed: replaced from the newest checkpoint there is
        return replace(seen, incident=seen.incident or seen.straggler.incident), []
    return replace(seen, straggler=replace(seen.straggler, step=step)), [StartTimer(STRAGGLER_CHECKPOINT_WAIT_S)]


def _straggler_wait_over(seen: Seen) -> tuple[Seen, Actions]:
    """The checkpoint did not commit in time (the request reached a rank past its step, a store that is out):
    asked once more, further ahead; then the straggler is replaced from the newest checkpoint there is."""
    straggler = seen.straggler
    if straggler is None or seen.incident is not None:
        return seen, []
    if straggler.asks < STRAGGLER_CHECKPOINT_ASKS:
        asks = straggler.asks + 1
        return replace(seen, straggler=replace(straggler, asks=asks)), [
            AskCheckpoint(STRAGGLER_CHECKPOINT_AHEAD_S * asks)]
    missed = _noted(straggler.incident, f"the checkpoint on demand at step {straggler.step} did not commit "
                                        f"within {STRAGGLER_CHECKPOINT_WAIT_S:.0f}s")
    return replace(seen, straggler=replace(straggler, incident=missed), incident=missed), []


def _noted(incident: Incident, note: str) -> Incident:
    return incident.model_copy(update={"notes": [*incident.notes, note]})
