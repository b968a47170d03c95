"""`Supervisor`: watch an attempt until something ends it, and say what (`Outcome`).

It waits on the watch groups, the committer, standing groups' reports and the operator's pause; takes the
earliest failure of what several nodes report at once as the incident; lets a spare join the attempt in the
place of a node that never took up its launch; commits checkpoints as they come; judges stragglers from the
windows of training the committer finds slow (a persistent one is checkpointed on demand, then replaced);
and at a commit moves off drained nodes, grows back onto returned ones, or continues as new. Before a hang's
ranks are stopped it asks the nodes for evidence and names the culprit.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from activities.pace_models import PaceVerdict
    from activities.models import merge_gaps
    from activities.models import (CollectEvidenceInput, CollectEvidenceResult, DownloadShardsInput,
                                   LaunchRanksInput, WatchEvent)
    from trainguard import node_task_queue
    from trainguard.error_types import ErrorType
    from trainguard.models import Action, Incident, IncidentKind, Phase, StopReason
    from workflows.culprit import pick_culprit
    from workflows.node_group import EVIDENCE_RETRY, EVIDENCE_TIMEOUT, NODE_SCHEDULE_TO_START, NODES_PER_GROUP
    from workflows.node_group_models import LostNode, NodeCallKind, NodeGroupWatchResult
    from workflows.policy import RecoveryBudget, decide, may_change_world_size, same_failure_streak
    from workflows.run_core import RunCore, cause_text, injected_key
    from workflows.run_decisions import (Ending, attempt_ending, continue_as_new_due, earliest_incident,
                                         grow_or_finish, judge_pace, stale_after_s, storage_trouble)
    from workflows.run_nodes import LIVENESS_MAX_NODES, RunNodes
    from workflows.run_state import HangAttribution
    from workflows.run_watch import Groups, Watches

INCIDENT_SETTLE = timedelta(seconds=1)
"""After the first group reports an incident, how long the others may take to report theirs: a crash's
peers fail in their collective within milliseconds, and the earliest failure of all is the cause."""

GROW_SETTLE = timedelta(seconds=2)
"""A commit with lost nodes back: how long the watches may take to say the ranks finished (a rank exits right
after its last checkpoint, its watch sees it within a poll) before the run grows onto them. Finishing wins."""

STRAGGLER_CHECKPOINT_WAIT = timedelta(seconds=20)
"""How long a persistent straggler's checkpoint on demand may take to commit before it is asked again (or its
node is replaced from the newest checkpoint there is): the slow rank must reach the step (about 4 s of the run's
pace ahead), save it, and every node upload it; a store that is out must not keep a slow rank in the job."""

STRAGGLER_CHECKPOINT_AHEAD_S = 4.0
"""A persistent straggler's checkpoint on demand asks for a step this far ahead of the master's (the operator's
`checkpoint_now` asks 2 s): a request that reaches a rank past its step is never taken, and on a loaded
machine (load 18 on two cores) two round trips of request activities took longer than 2 s."""
STRAGGLER_CHECKPOINT_ASKS = 2
"""...asked this many times, each further ahead, before the straggler is replaced without it."""

LAUNCH_SPEC_FAULTS = (ErrorType.BAD_SPEC, ErrorType.STALE_ATTEMPT, ErrorType.ENTRYPOINT_NOT_ALLOWED)
"""A launching watch's failures that are the spec's fault, not the node's."""


@dataclass
class Outcome:
    finished: bool
    incident: Incident | None = None
    final_events: list[WatchEvent] = field(default_factory=list)
    paused: bool = False
    """An operator asked for a pause."""
    drain: bool = False
    """A node being drained can leave now: a checkpoint was just committed."""
    grow: list[str] = field(default_factory=list)
    """Nodes a shrink left behind are back and leased again: relaunch on them at this checkpoint."""
    continue_as_new: bool = False
    """The history is long: continue as new, the ranks keep running."""
    fallback: bool = False
    """The attempt could not start as planned: relaunch from a checkpoint (no new incident)."""


@dataclass
class _Seen:
    """What an attempt's watches and committer brought so far."""

    finished: dict[int, NodeGroupWatchResult] = field(default_factory=dict)
    incident: Incident | None = None
    spec_fault: LostNode | None = None
    corrupt: LostNode | None = None
    """A launching watch's download found the restored checkpoint corrupt."""
    reporting: set[int] = field(default_factory=set)
    """Standing groups that reported in this attempt."""
    drain: bool = False
    grow: list[str] = field(default_factory=list)
    continue_as_new: bool = False
    straggler: Incident | None = None
    """A straggler that persisted: the run takes a checkpoint first (`straggler_step`), then replaces its node."""
    straggler_step: int = 0
    straggler_asks: int = 0
    straggler_wait: asyncio.Task[None] | None = None
    """Ends after `STRAGGLER_CHECKPOINT_WAIT`: the straggler is replaced even if that checkpoint never commits."""


class Supervisor:
    def __init__(self, core: RunCore, nodes: RunNodes, watches: Watches) -> None:
        self.core, self.nodes, self.watches = core, nodes, watches

    async def supervise(self, attempt: int, launch: LaunchRanksInput | None = None,
                        download: DownloadShardsInput | None = None) -> Outcome:
        core, live, intents = self.core, self.core.live, self.core.state.intents
        watches = await self.watches.take_up(attempt, launch, download)
        reports = asyncio.ensure_future(workflow.wait_condition(lambda: bool(live.reports)))
        committer = self.watches.committer(attempt)
        control = asyncio.ensure_future(workflow.wait_condition(lambda: intents.pause))
        live.event_evidence = {}
        seen = _Seen()
        while not control.done() and (seen.incident is None and not seen.continue_as_new and not seen.drain
                                      and not seen.grow and seen.spec_fault is None and seen.corrupt is None
                                      and len(seen.finished) < len(watches)):
            pending: list[asyncio.Task[Any]] = [*(t for g, t in watches.items() if g not in seen.finished),
                                                committer, control, reports,
                                                *([seen.straggler_wait] if seen.straggler_wait else [])]
            await workflow.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            results = await self._collect(watches, seen, reports.done(), attempt)
            if reports.done():
                reports = asyncio.ensure_future(workflow.wait_condition(lambda: bool(live.reports)))
            await self._judge(attempt, results, seen, watches, launch, download)
            if seen.straggler_wait is not None and seen.straggler_wait.done() and seen.incident is None:
                await self._straggler_checkpoint_missed(attempt, seen)
            if committer.done():
                await self._take_commits(attempt, committer, seen, watches)
                if seen.incident is None and not (seen.drain or seen.grow or seen.continue_as_new):
                    committer = self.watches.committer(attempt)  # else the attempt ends: the last pass follows

        paused = control.done()
        if seen.incident is not None and seen.incident.kind is IncidentKind.CRASH:
            # Asked now, answered while the watches close: a node lost with its ranks is found before the relaunch.
            crashed = [seen.incident.node] if seen.incident.node else []
            nodes = core.status.nodes if len(core.status.nodes) <= LIVENESS_MAX_NODES else crashed
            core.live.liveness = asyncio.ensure_future(self.nodes.unanswered(list(nodes)))
        if seen.incident is not None and seen.incident.kind is IncidentKind.HANG:
            await self._attribute_hang(attempt, seen.incident)  # first: the ranks are still where they hung
        waits = [t for t in (control, committer, reports, seen.straggler_wait) if t is not None]
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)  # a cancel is not waited on
        if (seen.incident is not None and seen.spec_fault is None and seen.corrupt is None
                and self.watches.stands()):
            self.watches.keep_standing(watches, seen.reporting)
        else:
            await self.watches.stop(watches)
        ending = attempt_ending(spec_fault=seen.spec_fault is not None, corrupt=seen.corrupt is not None,
                                incident=seen.incident is not None, continue_as_new=seen.continue_as_new,
                                paused=paused, drain=seen.drain, grow=bool(seen.grow))
        if ending is Ending.SPEC_FAULT:
            assert seen.spec_fault is not None
            raise core.fail(f"launch failed on {seen.spec_fault.node}: {seen.spec_fault.detail}",
                            ErrorType.INVALID_SPEC)
        if ending is Ending.CORRUPT:
            assert seen.corrupt is not None
            return await self._pass_over_corrupt(attempt, seen.corrupt)
        if ending is Ending.CONTINUE:
            return Outcome(False, continue_as_new=True)
        # Shards already saved may still commit: a checkpoint is valid whoever crashed after it.
        await self.watches.commit_the_rest(attempt, finished=ending is Ending.FINISHED)
        if ending is Ending.INCIDENT:
            return Outcome(False, seen.incident)
        if ending is Ending.PAUSE:
            return Outcome(False, paused=True)
        if ending is Ending.DRAIN:
            return Outcome(False, drain=True)
        if ending is Ending.GROW:
            return Outcome(False, grow=seen.grow)
        core.set_phase(Phase.FINISHING)
        return Outcome(True, final_events=[e for g in sorted(seen.finished) for e in seen.finished[g].finished])

    async def _collect(self, watches: Groups, seen: _Seen, reported_by_signal: bool,
                       attempt: int) -> list[tuple[int, NodeGroupWatchResult]]:
        """What the groups that returned and the standing groups' reports say, in group order."""
        done = [g for g, t in watches.items() if g not in seen.finished and t.done()]
        if any(not watches[g].result().finished for g in done) or self.core.live.reports:
            # Give the other groups a moment to report theirs: the earliest failure of all is the cause.
            others = [t for g, t in watches.items() if g not in seen.finished and not t.done()]
            if others:
                await workflow.wait(others, timeout=INCIDENT_SETTLE.total_seconds())
            done = [g for g, t in watches.items() if g not in seen.finished and t.done()]
        results = [(g, watches[g].result()) for g in done]
        if reported_by_signal:
            results += await self.watches.take_reports(attempt)
            seen.reporting.update(g for g, _ in results if g not in done)
            self.fold_late_evidence()
        return sorted(results, key=lambda found: found[0])  # a fixed order: deterministic

    async def _judge(self, attempt: int, results: list[tuple[int, NodeGroupWatchResult]], seen: _Seen,
                     watches: Groups, launch: LaunchRanksInput | None, download: DownloadShardsInput | None) -> None:
        core = self.core
        candidates: list[tuple[float, Incident]] = []
        joining: list[tuple[int, LostNode]] = []
        """Nodes that never took up their launching watch, by group: a spare may join in their place."""
        for group, result in results:
            self._add_restore_tiers([*result.incidents, *result.finished])
            self._learn_gaps([*result.incidents, *result.finished])
            for lost in result.lost:
                if lost.error_type in LAUNCH_SPEC_FAULTS:
                    seen.spec_fault = seen.spec_fault or lost
                elif lost.error_type == ErrorType.CORRUPT_CHECKPOINT:
                    seen.corrupt = seen.corrupt or lost
                elif lost.error_type == ErrorType.AGENT_SHUTDOWN:  # coming back: not a lost node
                    at = lost.away_since or workflow.now().timestamp()
                    core.live.restarting[lost.node] = at
                    candidates.append((at, Incident(kind=IncidentKind.AGENT_RESTART, node=lost.node,
                                                    attempt=attempt, detail=lost.detail, detected_at=at)))
                elif lost.never_started and launch is not None:
                    joining.append((group, lost))
                else:
                    found = core.lost_at_launch(lost.node, attempt, lost.detail)
                    candidates.append((found.detected_at, found))
            for node, ranks in result.evidence.items():  # asked by its group at once: not asked again
                core.live.event_evidence.setdefault(node, ranks)
            for event in result.incidents:
                core.status.step = max(core.status.step, event.step)
                if event.evidence:  # brought by its watch: not asked again
                    core.live.event_evidence[event.node] = event.evidence
                incident = core.rank_incident(event, attempt)
                candidates.append((event.detected_at if incident.kind is IncidentKind.GPU_UNHEALTHY
                                   else event.occurred_at or event.detected_at, incident))
            if result.finished:
                seen.finished[group] = result
        rejoined: list[int] = []
        for group, lost in joining:
            found = core.lost_at_launch(lost.node, attempt, lost.detail)
            if candidates or not await self._join_spare(attempt, found):
                candidates.append((found.detected_at, found))
            elif group not in rejoined:
                rejoined.append(group)
        if rejoined and not candidates:  # else the incident relaunches every node, spares joined included
            for group in rejoined:  # one new watch of the group however many of its nodes a spare replaced
                if group in watches and not watches[group].done() and core.live.group_requests[group].standing:
                    await self.watches.tell(self.watches.inputs(attempt, launch, download, True)[group])
                else:
                    watches.update(self.watches.start_again(attempt, group, launch, download))
        seen.incident = earliest_incident(candidates)

    async def _take_commits(self, attempt: int, committer: asyncio.Task[Any], seen: _Seen, watches: Groups) -> None:
        core, spec, state = self.core, self.core.the_spec, self.core.state
        try:
            result = committer.result()
            commits, store_error, pace = result.commits, result.store_error, result.pace
        except ActivityError as error:
            workflow.logger.warning("committer failed: %s", cause_text(error))
            commits, store_error, pace = [], cause_text(error), None
        for commit in commits:
            core.committed(commit.ref)
            core.status.step = max(core.status.step, commit.step)
            if seen.straggler is not None and commit.ref.step >= seen.straggler_step:
                seen.straggler.detail += f"; replaced after a checkpoint on demand at step {commit.ref.step}"
                seen.incident = seen.incident or seen.straggler  # its checkpoint is in: now the spare
        if pace is not None and seen.straggler is None:  # one being checkpointed is judged already
            await self._judge_pace(attempt, pace, seen)
        if commits:
            seen.drain = any(n in core.status.nodes for n in state.intents.draining)
            if state.lost and may_change_world_size(state.status.latest_checkpoint):
                back = await self.nodes.reclaim(state.lost)
                if back:
                    unfinished = [t for g, t in watches.items() if g not in seen.finished and not t.done()]
                    if unfinished:
                        await workflow.wait(unfinished, timeout=GROW_SETTLE.total_seconds())
                    ended = len(seen.finished) + sum(1 for g, t in watches.items()
                                                     if g not in seen.finished and t.done())
                    seen.grow = grow_or_finish(back, groups_ended=ended)
                    for node in back if not seen.grow else []:  # leased again for nothing: the pool's again
                        await self.nodes.release(node)
            if state.replaced:
                await self.nodes.reclaim_spares()
        if not commits:
            self._judge_storage(attempt, store_error)
        info = workflow.info()
        seen.continue_as_new = (not seen.drain and not seen.grow and seen.incident is None and seen.straggler is None
                                and len(seen.finished) < len(watches) and continue_as_new_due(
                                    suggested=info.is_continue_as_new_suggested(),
                                    history_bytes=info.get_current_history_size(),
                                    history_events=info.get_current_history_length(),
                                    max_events=spec.max_history_events))

    def _judge_storage(self, attempt: int, store_error: str | None) -> None:
        """A committer came back with nothing: past the staleness bound, checkpoints that stopped committing are
        an incident naming the store and the error (training goes on; the next commit closes it)."""
        core, spec, state = self.core, self.core.the_spec, self.core.state
        if store_error != core.status.store_error:
            core.status.store_error = store_error
            core.publish()  # the Web UI's details say so
        age = core.checkpoint_age_s()
        bound = stale_after_s(spec.checkpoint.stale_after_s, state.commit_times)
        if age is not None:
            workflow.metric_meter().create_gauge_float(
                "trainguard_checkpoint_age_seconds", "Seconds since the run's newest committed checkpoint", "s"
            ).set(age, {"workflow_id": core.wid()})
        if age is None or age < bound or core.open_storage_incidents():
            return
        why = storage_trouble(store_error=store_error, upload_errors=core.status.upload_errors)
        now = workflow.now().timestamp()
        core.record_incident(Incident(
            kind=IncidentKind.STORAGE_UNAVAILABLE, attempt=attempt, action=Action.REPORT, detected_at=now,
            detail=f"no checkpoint committed for {age:.0f}s (bound {bound:.0f}s) to "
                   f"s3://{spec.checkpoint.bucket}/{core.run_prefix()}: {why}; training goes on"))

    def _learn_gaps(self, events: list[WatchEvent]) -> None:
        state = self.core.state
        for event in events:
            state.learned_gaps = merge_gaps(state.learned_gaps, event.gaps)

    def _add_restore_tiers(self, events: list[WatchEvent]) -> None:
        state = self.core.state
        tiers = {tier for event in events for tier in event.restore_tiers}
        known = set((state.restore_tier or "").split("+")) - {""}
        if tiers - known:
            state.restore_tier = "+".join(sorted(known | tiers))
            for incident in self.core.live.restored_by:
                incident.restore_tier = state.restore_tier

    async def _judge_pace(self, attempt: int, pace: PaceVerdict, seen: _Seen) -> None:
        """A window of training in which some rank was slow: reported when first seen; one that persists has
        every rank checkpoint on demand, and its node is replaced once that checkpoint commits."""
        core, spec = self.core, self.core.the_spec
        verdict = judge_pace(core.state.straggler_streak, core.state.slow_window_end, pace.slow,
                             window_end=pace.window_end, window_s=pace.window_s,
                             windows=spec.health.straggler_windows, have_spare=bool(core.state.spares))
        core.state.slow_window_end, core.state.straggler_streak = pace.window_end, verdict.streaks
        now = workflow.now().timestamp()

        def incident(rank: int) -> Incident:
            node = core.status.nodes[rank // spec.ranks_per_node]
            slowed_at = core.state.injected_at.get(injected_key("slow", node))
            return Incident(kind=IncidentKind.STRAGGLER, node=node, rank=rank, attempt=attempt,
                            detail=f"rank {rank} computes {pace.slow[rank]:.2f}x slower than its peers' median "
                                   f"over {pace.window_s:g}s of training (to step {pace.step}; "
                                   f"{verdict.counts[rank]} window(s) in a row)",
                            detection_s=None if slowed_at is None else round(max(0.0, now - slowed_at), 3),
                            action=Action.REPORT, detected_at=now)

        for rank in verdict.first_seen:
            core.record_incident(incident(rank))
        if verdict.persisted is None or seen.straggler is not None:
            return
        seen.straggler = incident(verdict.persisted)
        await self._checkpoint_straggler(attempt, seen)

    async def _checkpoint_straggler(self, attempt: int, seen: _Seen) -> None:
        """Every rank checkpoints `STRAGGLER_CHECKPOINT_AHEAD_S` (twice that when asked again) ahead; the straggler
        is replaced once it commits. A request that fails replaces it from the newest checkpoint there is."""
        assert seen.straggler is not None
        seen.straggler_asks += 1
        try:
            seen.straggler_step = await self.nodes.checkpoint_soon(
                attempt, ahead_s=STRAGGLER_CHECKPOINT_AHEAD_S * seen.straggler_asks)
        except (ActivityError, ApplicationError, ChildWorkflowError) as error:
            workflow.logger.warning("checkpoint before replacing a straggler failed: %s", cause_text(error))
            seen.incident = seen.incident or seen.straggler
            return
        seen.straggler_wait = asyncio.ensure_future(workflow.sleep(STRAGGLER_CHECKPOINT_WAIT))

    async def _straggler_checkpoint_missed(self, attempt: int, seen: _Seen) -> None:
        """The straggler's checkpoint did not commit in time (the request reached a rank past its step, a store
        that is out): ask once more, further ahead; then replace it from the newest checkpoint there is."""
        assert seen.straggler is not None
        seen.straggler_wait = None
        if seen.straggler_asks < STRAGGLER_CHECKPOINT_ASKS:
            await self._checkpoint_straggler(attempt, seen)
            return
        seen.straggler.detail += (f"; the checkpoint on demand at step {seen.straggler_step} did not commit within "
                                  f"{STRAGGLER_CHECKPOINT_WAIT.total_seconds():.0f}s")
        seen.incident = seen.straggler

    async def _pass_over_corrupt(self, attempt: int, corrupt: LostNode) -> Outcome:
        """As a corrupt download before any launch: pass the checkpoint over and restore the one before."""
        core = self.core
        step = core.status.resumed_step
        core.state.corrupt_steps.append(step)
        for recovered in core.live.restored_by:  # not resumed from there after all: the next restore says where
            recovered.resumed_step = recovered.restore_tier = None
        core.record_incident(Incident(kind=IncidentKind.CHECKPOINT_CORRUPT, attempt=attempt, node=corrupt.node,
                                      detail=f"step {step}: {corrupt.detail}", action=Action.RESTART,
                                      detected_at=workflow.now().timestamp()))
        core.set_phase(Phase.RECOVERING)
        await self.nodes.stop_everywhere(core.status.nodes, attempt, f"checkpoint {step} is corrupt: restore older",
                                         StopReason.CORRUPT_CHECKPOINT)
        return Outcome(False, fallback=True)

    async def _join_spare(self, attempt: int, incident: Incident) -> bool:
        """A node never took up its launching watch of attempt `attempt`: it launched nothing, and its peers wait
        for its ranks in the attempt's rendezvous. Where the policy would replace it, a spare takes its place
        (its node rank, the same rendezvous and restore) and the attempt goes on: no relaunch of everyone, which
        would cost a lost node found this way (its peers' crash seen first) two relaunches for one fault.
        False: the policy decides otherwise (no spare, a spent budget), and the incident takes the usual path."""
        core, state = self.core, self.core.state
        now = workflow.now().timestamp()
        merged = incident.attempt < attempt  # the lost node is the previous incident, the relaunch its cost
        budget = RecoveryBudget(tuple(state.restart_times), state.restarts_without_checkpoint,
                                same_failure_streak(incident, core.status.incidents))
        decision = decide(incident.kind, incident.node, core.the_spec, core.status.nodes, state.spares, budget, now,
                          newest=core.status.latest_checkpoint)
        if decision.action is not Action.REPLACE_NODE or not incident.node or not decision.replacement:
            return False
        spare = decision.replacement
        incident.action = decision.action
        incident.detail = f"{incident.detail}; {decision.reason}; it joined attempt {attempt} in the node's place"
        incident.resumed_step, incident.restore_tier = core.status.resumed_step, state.restore_tier
        incident.recovery_path = "relaunch, a spare joining it"
        core.record_incident(incident)
        workflow.logger.info("incident %s on %s: %s joins attempt %d in its place", incident.kind.value,
                             incident.node, spare, attempt)
        if merged:  # the relaunch already made counts once, as it did before the symptom was taken back
            core.count_restart(now)
        # Before the swap's awaits: the attempt's first step may be signalled while the spare launches, and
        # this incident's recovery ends there too.
        core.live.joins.append(incident)
        await self.nodes.swap_in_spare(incident, spare)
        core.publish()
        return True

    async def _attribute_hang(self, attempt: int, incident: Incident) -> None:
        """Before anything is stopped: every node's evidence (its ranks' stacks and collective positions),
        and the culprit it names (`workflows.culprit`). The full stacks go to the store with the run.

        A run whose groups stand does not wait for evidence still on its way: at thousands of nodes every node's
        watch judges the hang and its group reports it, and taking those reports in before the relaunch cost a
        4,096-node run 24 s. The culprit is named from the evidence in hand, the relaunch is decided and
        published at once, and each group's later report of the hung attempt adds its nodes' evidence and names
        the culprit again (`fold_late_evidence`); no node is asked (its report is on its way)."""
        core, spec = self.core, self.core.the_spec
        have = core.live.event_evidence
        # Nodes whose watch judged the hang too brought their evidence with the event: only the others are asked.
        hang = HangAttribution(incident=incident, attempt=attempt, nodes=list(core.status.nodes),
                               evidence={n: have[n] for n in core.status.nodes if n in have},
                               watch_rank=incident.rank, watch_node=incident.node)
        calls = [(n, CollectEvidenceInput(workflow_id=core.wid(), attempt=attempt, node=n,
                                          bucket=spec.checkpoint.bucket, run_prefix=core.run_prefix()))
                 for n in core.status.nodes if n not in have]
        if calls and self.watches.stands():
            self._name_culprit(hang)
            core.live.attributing = hang
            return
        summary = f"collect hang evidence on {{node}} (attempt {attempt})"
        if calls and len(calls) <= NODES_PER_GROUP:
            # One group's worth of activities from the run itself: the recovery waits on this, and a child
            # workflow's start and end cost it two more workflow tasks.
            answers = await asyncio.gather(*(workflow.execute_activity(
                "collect_evidence", request, task_queue=node_task_queue(node),
                start_to_close_timeout=EVIDENCE_TIMEOUT, schedule_to_start_timeout=NODE_SCHEDULE_TO_START,
                retry_policy=EVIDENCE_RETRY, result_type=CollectEvidenceResult,
                summary=summary.replace("{node}", node)) for node, request in calls), return_exceptions=True)
            hang.evidence.update({a.node: a.ranks for a in answers if isinstance(a, CollectEvidenceResult)})
        elif calls:
            answered = await self.nodes.fan_out(NodeCallKind.COLLECT_EVIDENCE, calls, summary, CollectEvidenceResult)
            hang.evidence.update({a.node: a.result.ranks for a in answered if a.result is not None})
        self._name_culprit(hang)

    def fold_late_evidence(self) -> None:
        """The evidence standing groups reported of a hang the run relaunched before it was all in
        (`Watches.take_reports` adds it): the culprit named again; once every node's is in, the attribution ends."""
        hang = self.core.live.attributing
        if hang is None or not hang.fresh:
            return
        hang.fresh = False
        self._name_culprit(hang)
        if all(n in hang.evidence for n in hang.nodes):
            self.core.live.attributing = None

    def _name_culprit(self, hang: HangAttribution) -> None:
        """The culprit the evidence so far names, on the incident; `attribution_s` is when it was first named."""
        core, spec, incident = self.core, self.core.the_spec, hang.incident
        evidence = [item for n in hang.nodes for item in hang.evidence.get(n, [])]
        culprit = pick_culprit(evidence, hang.watch_rank, hang.watch_node)
        named = incident.attribution_s is None or (culprit.rank, culprit.node) != (incident.rank, incident.node)
        rest = incident.detail[len(hang.prefix):] if incident.detail.startswith(hang.prefix) else incident.detail
        hang.prefix = "" if culprit.rank == hang.watch_rank or culprit.rank is None else (
            f"rank {culprit.rank} hung ({culprit.rule}); the watch first saw rank {hang.watch_rank} silent: ")
        incident.detail = hang.prefix + rest
        incident.rank, incident.node = culprit.rank, culprit.node
        incident.evidence = culprit.evidence
        if any(item.stacks_key for item in evidence):
            incident.evidence_key = f"s3://{spec.checkpoint.bucket}/{core.run_prefix()}/incidents/{hang.attempt}/"
        if named:
            incident.attribution_s = round(max(0.0, workflow.now().timestamp() - incident.detected_at), 3)
        injected = [at for key, at in core.state.injected_at.items()
                    if key.rsplit("@", 1)[-1] == culprit.node and key.startswith("hang")]
        if injected:
            incident.detection_s = round(max(0.0, incident.detected_at - max(injected)), 3)
