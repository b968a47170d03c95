"""`Supervisor`: watch an attempt until something ends it, and say what (`Outcome`).

The loop waits on the attempt's watch groups, its committer, the standing groups' reports, a straggler's timer
and the operator's pause. What arrives goes to the pure reducer (`workflows.supervision.observe`), which holds
every rule; this class only carries out the actions it returns, in order, and feeds their answers back. When
the attempt ends, a hang's culprit is named before its ranks are stopped (`HangCulprit`), the watch groups stop
(or stand, for a relaunch in place), and checkpoints already saved still commit.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from activities.models import DownloadShardsInput, LaunchRanksInput
    from trainguard.error_types import ErrorType
    from trainguard.faults import FaultKind
    from trainguard.models import IncidentKind, Phase
    from workflows.node_group_models import NodeGroupWatchResult
    from workflows.policy import may_change_world_size
    from workflows.run_core import RunCore, cause_text, injected_key
    from workflows.run_decisions import Ending
    from workflows.run_hang import HangCulprit
    from workflows.run_nodes import LIVENESS_MAX_NODES, RunNodes
    from workflows.run_recovery import Recovery
    from workflows.run_watch import Groups, Watches
    from workflows.supervision import Outcome, Seen, observe
    from workflows.supervision_events import (AgentRestarting, AskCheckpoint, CheckHistory, Committed, Event,
                                              CordonSpare, ForgetTie, Found, History, HoldTie, JoinAnswer,
                                              JoinSpare, JudgeStorage, KeepEvidence,
                                              Learn, LoseNode, Reclaim, Reclaimed, ReclaimSpares, RecordIncident,
                                              Release, Reported, SetStreaks, Settle, Settled, StartTimer,
                                              StragglerAsked, StragglerWaitOver, SupervisionAction, Tell,
                                              WatchAgain)

INCIDENT_SETTLE = timedelta(seconds=1)
"""After the first group reports an incident, how long the others may take to report theirs: a crash's
peers fail in their collective within milliseconds, and the earliest failure of all is the cause."""

GROW_SETTLE = timedelta(seconds=2)
"""A commit with lost nodes back: how long the watches may take to say the ranks finished (a rank exits right
after its last checkpoint, its watch sees it within a poll) before the run grows onto them. Finishing wins."""


@dataclass
class _Attempt:
    """The attempt being supervised: what its actions act on."""

    number: int
    launch: LaunchRanksInput | None
    download: DownloadShardsInput | None
    watches: Groups
    timer: asyncio.Task[None] | None = None
    """The straggler's checkpoint on demand: the straggler is replaced even if it never commits."""


class Supervisor:
    def __init__(self, core: RunCore, nodes: RunNodes, watches: Watches, recovery: Recovery,
                 hang: HangCulprit) -> None:
        self.core, self.nodes, self.watches, self.recovery, self.hang = core, nodes, watches, recovery, hang

    async def supervise(self, attempt: int, launch: LaunchRanksInput | None = None,
                        download: DownloadShardsInput | None = None) -> Outcome:
        core, live, intents = self.core, self.core.live, self.core.state.intents
        at = _Attempt(attempt, launch, download, await self.watches.take_up(attempt, launch, download))
        reports = asyncio.ensure_future(workflow.wait_condition(lambda: bool(live.reports)))
        committer = self.watches.committer(attempt)
        control = asyncio.ensure_future(workflow.wait_condition(lambda: intents.pause))
        live.event_evidence = {}
        seen = Seen(watched=len(at.watches))
        while (ending := seen.ending(paused=control.done())) is None:
            pending: list[asyncio.Task[Any]] = [*(t for g, t in at.watches.items() if g not in seen.finished),
                                                committer, control, reports, *([at.timer] if at.timer else [])]
            await workflow.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            seen = await self._act(at, seen, await self._reported(at, seen, reports.done()))
            if reports.done():
                reports = asyncio.ensure_future(workflow.wait_condition(lambda: bool(live.reports)))
            if at.timer is not None and at.timer.done() and seen.incident is None:
                at.timer = None
                seen = await self._act(at, seen, StragglerWaitOver())
            if committer.done():
                seen = await self._act(at, seen, self._committed(attempt, committer))
                if seen.incident is None and not (seen.drain or seen.grow or seen.continue_as_new):
                    committer = self.watches.committer(attempt)  # else the attempt ends: the last pass follows

        incident = seen.incident
        if incident is not None and incident.kind is IncidentKind.CRASH:
            # Asked now, answered while the watches close: a node lost with its ranks is found before the relaunch.
            nodes = core.status.nodes if len(core.status.nodes) <= LIVENESS_MAX_NODES else [incident.node or ""]
            core.live.liveness = asyncio.ensure_future(self.nodes.unanswered([n for n in nodes if n]))
        if incident is not None and incident.kind is IncidentKind.HANG:
            await self.hang.attribute(attempt, incident)  # first: the ranks are still where they hung
        waits = [t for t in (control, committer, reports, at.timer) if t is not None]
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)  # a cancel is not waited on
        if ending is Ending.INCIDENT and self.watches.stands():
            self.watches.keep_standing(at.watches, set(seen.reporting))
        else:
            await self.watches.stop(at.watches)
        if ending is Ending.SPEC_FAULT:
            assert seen.spec_fault is not None
            raise core.fail(f"launch failed on {seen.spec_fault.node}: {seen.spec_fault.detail}",
                            ErrorType.INVALID_SPEC)
        if ending is Ending.CORRUPT:
            assert seen.corrupt is not None
            await self.recovery.pass_over_corrupt(attempt, seen.corrupt)
            return Outcome(Ending.RELAUNCH)
        if ending is Ending.CONTINUE:
            return Outcome(ending)
        # Shards already saved may still commit: a checkpoint is valid whoever crashed after it.
        await self.watches.commit_the_rest(attempt, finished=ending is Ending.FINISHED)
        if ending is not Ending.FINISHED:
            return Outcome(ending, incident=incident, grow=seen.grow)
        core.set_phase(Phase.FINISHING)
        return Outcome(ending, final_events=[e for g in sorted(seen.finished) for e in seen.finished[g].finished])

    async def _act(self, at: _Attempt, seen: Seen, event: Event) -> Seen:
        """Fold `event` into `seen` and carry out the actions that come back; an action's answer is folded in
        turn, and the actions it brings run before those queued after it."""
        seen, actions = observe(seen, event)
        queue = list(reversed(actions))
        while queue:
            answer = await self._do(at, seen, queue.pop())
            if answer is not None:
                seen, more = observe(seen, answer)
                queue.extend(reversed(more))
        return seen

    async def _do(self, at: _Attempt, seen: Seen, action: SupervisionAction) -> Event | None:
        core, live, state = self.core, self.core.live, self.core.state
        match action:
            case Learn(events=events, step=step):
                core.learn(events, step)
            case AgentRestarting(node=node, at=since):
                live.restarting[node] = since
            case KeepEvidence(node=node, ranks=ranks, overwrite=overwrite):
                if overwrite or node not in live.event_evidence:
                    live.event_evidence[node] = ranks
            case LoseNode(node=node, detail=detail, group=group, join=join):
                return Found(core.lost_at_launch(node, at.number, detail), group, join)
            case Settle():
                return Settled(frozenset(g for g, t in at.watches.items() if not t.done() and g in live.group_requests
                                         and live.group_requests[g].standing))
            case JoinSpare(group=group, incident=incident):
                return JoinAnswer(group, incident, await self.recovery.join_spare(at.number, incident))
            case Tell(group=group):
                await self.watches.tell(self.watches.inputs(at.number, at.launch, at.download, True)[group])
            case WatchAgain(group=group):
                at.watches.update(self.watches.start_again(at.number, group, at.launch, at.download))
            case SetStreaks(window_end=end, streaks=streaks):
                state.slow_window_end, state.straggler_streak = end, streaks
            case RecordIncident(incident=incident):
                core.record_incident(incident)
            case AskCheckpoint(ahead_s=ahead):
                try:
                    return StragglerAsked(await self.nodes.checkpoint_soon(at.number, ahead_s=ahead))
                except (ActivityError, ApplicationError, ChildWorkflowError) as error:
                    workflow.logger.warning("checkpoint before replacing a straggler failed: %s", cause_text(error))
                    return StragglerAsked(None)
            case StartTimer(seconds=seconds):
                at.timer = asyncio.ensure_future(workflow.sleep(seconds))
            case Reclaim():
                return await self._reclaim(at, seen)
            case Release(node=node):
                await self.nodes.release(node)
            case ReclaimSpares():
                if state.replaced:
                    await self.nodes.reclaim_spares()
            case CheckHistory():
                info = workflow.info()
                return History(suggested=info.is_continue_as_new_suggested(),
                               bytes=info.get_current_history_size(), events=info.get_current_history_length(),
                               max_events=core.the_spec.max_history_events)
            case JudgeStorage(store_error=store_error):
                self.watches.judge_storage(at.number, store_error)
            case HoldTie(tie=tie):
                state.tie = tie
            case ForgetTie():
                state.tie = None
            case CordonSpare(node=node, reason=reason):
                await self.nodes.cordon_spare(node, reason)
        return None

    async def _reported(self, at: _Attempt, seen: Seen, by_signal: bool) -> Reported:
        """What the groups that returned and the standing groups' reports say, in group order."""
        watches = at.watches
        done = [g for g, t in watches.items() if g not in seen.finished and t.done()]
        if any(not watches[g].result().finished for g in done) or self.core.live.reports:
            # Give the other groups a moment to report theirs: the earliest failure of all is the cause.
            others = [t for g, t in watches.items() if g not in seen.finished and not t.done()]
            if others:
                await workflow.wait(others, timeout=INCIDENT_SETTLE.total_seconds())
            done = [g for g, t in watches.items() if g not in seen.finished and t.done()]
        results: list[tuple[int, NodeGroupWatchResult]] = [(g, watches[g].result()) for g in done]
        signalled: frozenset[int] = frozenset()
        if by_signal:
            reported = await self.watches.take_reports(at.number)
            signalled = frozenset(g for g, _ in reported if g not in done)
            results += reported
            self.hang.fold_late()
        return Reported(sorted(results, key=lambda found: found[0]),  # a fixed order: deterministic
                        at.number, launching=at.launch is not None, now=workflow.now().timestamp(),
                        by_signal=signalled)

    def _committed(self, attempt: int, committer: asyncio.Task[Any]) -> Committed:
        """The committer's answer, its commits recorded on the run, with what the reducer's rules read."""
        core, spec, state = self.core, self.core.the_spec, self.core.state
        try:
            result = committer.result()
            commits, store_error, pace = result.commits, result.store_error, result.pace
            corruption, settled = result.corruption, result.settled
        except ActivityError as error:
            workflow.logger.warning("committer failed: %s", cause_text(error))
            commits, store_error, pace, corruption, settled = [], cause_text(error), None, None, None
        for commit in commits:
            core.committed(commit.ref)
            core.status.step = max(core.status.step, commit.step)
        nodes = core.status.nodes
        slowed = {} if pace is None else {n: state.injected_at[injected_key(FaultKind.SLOW, n)] for n in nodes
                                          if injected_key(FaultKind.SLOW, n) in state.injected_at}
        return Committed(
            steps=[c.ref.step for c in commits], pace=pace, store_error=store_error, attempt=attempt,
            now=workflow.now().timestamp(), draining=any(n in nodes for n in state.intents.draining),
            may_grow=bool(state.lost) and may_change_world_size(state.status.latest_checkpoint),
            streaks=state.straggler_streak, slow_window_end=state.slow_window_end,
            straggler_windows=spec.health.straggler_windows, have_spare=bool(state.spares), nodes=list(nodes),
            ranks_per_node=spec.ranks_per_node, slowed_at=slowed, corruption=corruption,
            flipped_at={n: state.injected_at[injected_key(FaultKind.BITFLIP, n)] for n in nodes
                        if corruption is not None and injected_key(FaultKind.BITFLIP, n) in state.injected_at},
            tie=state.tie, settled=settled, resumed_step=core.status.resumed_step or 0,
            fingerprint_every=spec.health.fingerprint_every_steps, heals_from_peers=spec.in_replica_group)

    async def _reclaim(self, at: _Attempt, seen: Seen) -> Reclaimed:
        """Nodes a shrink left behind, leased again if the pool has them back; the groups' ends settle first."""
        back = await self.nodes.reclaim(self.core.state.lost)
        if not back:
            return Reclaimed([], 0)
        unfinished = [t for g, t in at.watches.items() if g not in seen.finished and not t.done()]
        if unfinished:
            await workflow.wait(unfinished, timeout=GROW_SETTLE.total_seconds())
        ended = len(seen.finished) + sum(1 for g, t in at.watches.items() if g not in seen.finished and t.done())
        return Reclaimed(back, ended)
