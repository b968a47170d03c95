"""`Watches`: a run's watch groups (`NodeGroupWatch` children) and its checkpoint committer.

Each attempt is watched by a group per `WATCH_NODES_PER_GROUP` nodes. Runs of more nodes than one call group
(`STANDING_GROUPS_MIN_NODES`) relaunch in place: their groups stand across attempts, the run writes each
relaunch's `AttemptDecision` to the store, and every node still watching takes it up there; only nodes without
a watch launch from a new one. At 4,096 nodes a relaunch of new groups cost the run's history 4 events per
group, each its own workflow task: 46-53 s from the incident to the last node launched on this machine.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError
from temporalio.exceptions import TimeoutError as TemporalTimeout
from temporalio.workflow import ActivityCancellationType

with workflow.unsafe.imports_passed_through():
    from activities import names
    from activities.fingerprint_models import TieEvidence
    from activities.models import (AttemptDecision, CommitCheckpointsInput, CommitCheckpointsResult,
                                   DownloadShardsInput, LaunchRanksInput, PublishAttemptInput, WatchCheckpoints,
                                   WatchEvent, WatchEventKind, WatchRanksInput)
    from workflows.node_calls import BURST_SCHEDULE_TO_START, NODE_SCHEDULE_TO_START, NODES_PER_GROUP, groups_of
    from workflows.node_group import (WATCH_MAX_DURATION_S, WATCH_NODES_PER_GROUP, NodeGroupWatch, launch_wait_s,
                                      watch_heartbeat_every_s)
    from workflows.node_group_models import GroupReport, NodeGroupWatchInput, NodeGroupWatchResult
    from workflows.run_core import RunCore, cause_text
    from trainguard.models import Action, Incident, IncidentKind
    from workflows.run_decisions import decision_every_s, pace_window_s, stale_after_s, storage_trouble
    from workflows.run_nodes import FAN_OUT_GROUPS, STORE_HEARTBEAT_TIMEOUT, STORE_RETRY, STORE_TIMEOUT

STANDING_GROUPS_MIN_NODES = NODES_PER_GROUP + 1
"""Runs of more nodes than one call group relaunch in place (see the module's docstring); a small run's
relaunch is a group or two and starts them anew."""

DRAIN_TIMEOUT = timedelta(seconds=30)
"""After an incident, pause or drain: how long uploads already under way may take to finish and commit."""
DRAIN_MARGIN = timedelta(seconds=10)
"""What the last pass may take beyond `DRAIN_TIMEOUT`: its final look at the store and a manifest write."""
DRAIN_QUIET_S = 3.0
"""...and the drain ends sooner once no node has reported a new upload for this long."""
FINISH_DRAIN_TIMEOUT = timedelta(minutes=5)
"""A finished run's last passes wait this long for a store or controller that is restarting: its last
checkpoints are what it trained for, and its result names the newest. (A recovery's drain does not wait:
it can do without a checkpoint.)"""
COMMITTER_MAX_DURATION_S = 600.0
"""The committer returns after this long even if nothing was committed, so no activity runs unbounded."""
COMMITTER_MIN_DURATION_S = 1.0
"""...and at least this long (a run already past its staleness bound still gives the store a moment)."""
COMMITTER_TIMEOUT = timedelta(seconds=COMMITTER_MAX_DURATION_S + 120)
"""Its last pass may still be writing a manifest (pages first) when the duration ends."""

Groups = dict[int, "asyncio.Task[NodeGroupWatchResult]"]


class Watches:
    def __init__(self, core: RunCore) -> None:
        self.core = core

    def stands(self) -> bool:
        """Whether this run's watch groups stand across attempts (`STANDING_GROUPS_MIN_NODES`)."""
        return len(self.core.status.nodes) >= STANDING_GROUPS_MIN_NODES

    def inputs(self, attempt: int, launch: LaunchRanksInput | None, download: DownloadShardsInput | None,
               standing: bool) -> list[NodeGroupWatchInput]:
        """Each watch group's input: with `launch`, each node but the master launches from its first watch."""
        core, spec = self.core, self.core.the_spec
        nodes = core.status.nodes
        window = pace_window_s(spec.health.straggler_window_s, len(nodes))
        watch = WatchRanksInput(
            workflow_id=core.wid(), attempt=attempt, node="",
            health=spec.health.model_copy(update={"straggler_window_s": window}),
            # Steps up to the newest commit need no upload again (after continue-as-new too).
            reported_step=max(core.status.resumed_step, core.state.last_committed_step),
            evidence=True, evidence_with_event=True, learned_gaps=core.state.learned_gaps,
            max_duration_s=WATCH_MAX_DURATION_S,
            heartbeat_every_s=watch_heartbeat_every_s(len(nodes)),
            checkpoints=WatchCheckpoints(bucket=spec.checkpoint.bucket, run_prefix=core.run_prefix()),
            follow_decisions=standing, decision_every_s=decision_every_s(len(nodes)))
        master = nodes[:1]
        second_chance = len(nodes) > FAN_OUT_GROUPS * NODES_PER_GROUP
        # A run of one call group: its launching watches are a burst of at most 64, matched in well under the
        # stop's 10 s even on a loaded machine, and that, with its check 10 s more (`_silent_but_there`), is how
        # fast a node lost with its ranks (its peers' crash seen first) is found. Larger relaunches wait 30 s (at
        # 256 nodes, load 16, 10 s read a live node as lost); past 3,000 nodes the wait grows with the burst
        # (`launch_wait_s`).
        launch_wait: float | None = NODE_SCHEDULE_TO_START.total_seconds() if len(nodes) <= NODES_PER_GROUP else None
        if launch_wait is None and launch_wait_s(len(nodes)) > BURST_SCHEDULE_TO_START.total_seconds():
            launch_wait = launch_wait_s(len(nodes))
        return [NodeGroupWatchInput(run_workflow_id=core.wid(), group=index, watch=watch, nodes=group,
                                    starters=[n for n in group if n in master], launch=launch, download=download,
                                    first_node_rank=index * WATCH_NODES_PER_GROUP,
                                    launched=[n for n in group if n in master] if launch else [],
                                    launch_second_chance=second_chance, launch_wait_s=launch_wait,
                                    standing=standing)
                for index, group in enumerate(groups_of(nodes, WATCH_NODES_PER_GROUP))]

    def start(self, attempt: int, inputs: list[NodeGroupWatchInput]) -> Groups:
        live = self.core.live
        tag = str(workflow.uuid4())[:8]
        for request in inputs:
            live.group_ids[request.group] = f"{self.core.wid()}/watch-{attempt}-{tag}-{request.group}"
            live.group_requests[request.group] = request
        # result_type: the SDK's typed overloads leave it out for a method, which it decodes alike
        return {request.group: asyncio.ensure_future(workflow.execute_child_workflow(  # type: ignore[call-overload]  # result_type
            NodeGroupWatch.run, request,
            id=live.group_ids[request.group], result_type=NodeGroupWatchResult,
            static_summary=f"watch {request.nodes[0]}..{request.nodes[-1]} ({len(request.nodes)} nodes, "
                           f"attempt {attempt})",
        )) for request in inputs}

    def start_again(self, attempt: int, group: int, launch: LaunchRanksInput | None,
                    download: DownloadShardsInput | None) -> Groups:
        """One group's watch started anew (a spare joined it)."""
        inputs = self.inputs(attempt, launch, download, self.stands())
        return self.start(attempt, [r for r in inputs if r.group == group])

    async def take_up(self, attempt: int, launch: LaunchRanksInput | None,
                      download: DownloadShardsInput | None) -> Groups:
        """The attempt's watch groups. A run that stands relaunches in place: the groups still watching go on
        (those with a node left without a watch, or a spare joining, are told the attempt), the decision goes to
        the store for their nodes to take up, and only groups that closed start again."""
        core, live = self.core, self.core.live
        standing = self.stands()
        kept, live.standing = live.standing, {}
        reported, live.reported_groups = live.reported_groups, set()
        inputs = self.inputs(attempt, launch, download, standing)
        for request in inputs:
            live.group_requests[request.group] = request
        if not standing or launch is None or len(core.status.nodes) != len(live.standing_nodes):
            await self.stop(kept)
            return self.start(attempt, inputs)
        before = groups_of(live.standing_nodes, WATCH_NODES_PER_GROUP)
        groups: Groups = {}
        told: list[NodeGroupWatchInput] = []
        for request in inputs:
            task = kept.get(request.group)
            if task is None or task.done():
                continue
            groups[request.group] = task
            if request.group in reported or before[request.group] != request.nodes:
                told.append(request)
        fresh = self.start(attempt, [r for r in inputs if r.group not in groups])
        spec = core.the_spec
        decision = AttemptDecision(
            workflow_id=core.wid(), chain_id=workflow.info().first_execution_run_id, attempt=attempt, launch=launch,
            download=download, starters=core.status.nodes[:1], launched=core.status.nodes[:1],
            leaving=[n for n in live.standing_nodes if n not in core.status.nodes])
        await asyncio.gather(
            *(self.tell(request) for request in told),
            workflow.execute_activity(
                names.PUBLISH_ATTEMPT,
                PublishAttemptInput(bucket=spec.checkpoint.bucket, run_prefix=core.run_prefix(), decision=decision),
                start_to_close_timeout=STORE_TIMEOUT, heartbeat_timeout=STORE_HEARTBEAT_TIMEOUT,
                retry_policy=STORE_RETRY, summary=f"publish attempt {attempt} for the nodes to take up"))
        return {**groups, **fresh}

    async def take_reports(self, attempt: int) -> list[tuple[int, NodeGroupWatchResult]]:
        """The standing groups' reports, less what their nodes reported of attempts before `attempt`: a group
        not yet told of it is told now, and its nodes that reported launch from a new watch."""
        live = self.core.live
        taken, live.reports = live.reports, []
        results, behind = [], []
        for report in taken:
            result = report.result
            late = self._late_evidence(report)
            current = [e for e in result.incidents if (e.attempt or report.attempt) >= attempt or e in late]
            if (report.attempt < attempt or len(current) < len(result.incidents)) and report.group not in behind:
                behind.append(report.group)
            if current or result.lost:
                results.append((report.group, result.model_copy(update={"incidents": current})))
        # Together: each signal's confirmation is a workflow task of the run's, and a fault every node reports
        # after the decision brings one report per group.
        await asyncio.gather(*(self.tell(live.group_requests[g]) for g in behind if g in live.group_requests))
        return results

    def _late_evidence(self, report: GroupReport) -> list[WatchEvent]:
        """A report of the hang the run relaunched before every node's evidence was in (`live.attributing`):
        its nodes' evidence goes to the attribution. Returns its GPU faults on nodes still in the run: a sick
        GPU found in the hung attempt is an incident of the attempt now running (its node goes to a spare)."""
        hang = self.core.live.attributing
        if hang is None:
            return []
        sick = []
        for event in report.result.incidents:
            if (event.attempt or report.attempt) != hang.attempt:
                continue
            if event.evidence and event.node not in hang.evidence:
                hang.evidence[event.node] = event.evidence
                hang.fresh = True
            if event.kind is WatchEventKind.GPU_UNHEALTHY and event.node in self.core.status.nodes:
                sick.append(event)
        return sick

    def keep_standing(self, watches: Groups, reporting: set[int]) -> None:
        """The groups stand for the relaunch to take up; `drop_standing` ends them if it decides otherwise."""
        live = self.core.live
        live.standing = {g: t for g, t in watches.items() if not t.done()}
        live.standing_nodes, live.reported_groups = list(self.core.status.nodes), reporting

    async def drop_standing(self) -> None:
        """End the standing groups: what comes next is no relaunch in place."""
        kept, self.core.live.standing = self.core.live.standing, {}
        await self.stop(kept)

    async def tell(self, request: NodeGroupWatchInput) -> None:
        """A standing group's next attempt (its nodes without a watch launch from a new one)."""
        live = self.core.live
        live.group_requests[request.group] = request
        try:
            await workflow.get_external_workflow_handle(live.group_ids[request.group]).signal("next_attempt", request)
        except Exception as error:  # noqa: BLE001 - the group closed meanwhile: its result says how, and the run goes by that
            workflow.logger.warning("could not tell watch group %d of attempt %d: %s", request.group,
                                    request.watch.attempt, error)

    @staticmethod
    async def stop(watches: Groups) -> None:
        """Cancel the groups still watching (their ranks keep running) and wait until they have ended."""
        running = [t for t in watches.values() if not t.done()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    # ------------------------------------------------------------------------------------- committer
    def _settle(self, attempt: int) -> TieEvidence | None:
        """A tie's evidence, for the replay (an attempt after the tie's) to be compared with until it answers."""
        tie = self.core.state.tie
        if tie is None or tie.swapped_out is not None or attempt <= tie.attempt:
            return None
        return tie.evidence

    def committer(self, attempt: int, quiet_s: float | None = None, drain: timedelta = DRAIN_TIMEOUT,
                  finished: bool = False) -> asyncio.Task[CommitCheckpointsResult]:
        """`quiet_s`: a last pass, bounded by `drain`; a finished run's waits through store errors."""
        core, spec = self.core, self.core.the_spec
        state = core.state
        window = pace_window_s(spec.health.straggler_window_s, len(core.status.nodes))
        return asyncio.ensure_future(workflow.execute_activity(
            names.COMMIT_CHECKPOINTS,
            CommitCheckpointsInput(bucket=spec.checkpoint.bucket, run_prefix=core.run_prefix(),
                                   workflow_id=core.wid(), attempt=attempt,
                                   chain_id=workflow.info().first_execution_run_id,
                                   min_attempt=min(state.state_since_attempt, attempt),
                                   world_size=core.status.world_size, num_nodes=len(core.status.nodes),
                                   after_step=state.last_committed_step, keep_last=spec.checkpoint.keep_last,
                                   straggler_ratio=spec.health.straggler_ratio,
                                   pace_window_s=None if quiet_s else window,
                                   pace_after=state.slow_window_end + 0.5 * window,
                                   max_duration_s=drain.total_seconds() if quiet_s else self._until_stale(),
                                   quiet_s=quiet_s, wait_for_store=finished,
                                   settle=None if quiet_s else self._settle(attempt)),
            start_to_close_timeout=COMMITTER_TIMEOUT,
            # The last pass is bounded whatever the store does: with the store down its retries would hold
            # recovery for minutes, for a checkpoint the run can do without.
            schedule_to_close_timeout=drain + DRAIN_MARGIN if quiet_s else None,
            heartbeat_timeout=STORE_HEARTBEAT_TIMEOUT,
            retry_policy=STORE_RETRY,
            result_type=CommitCheckpointsResult,
            summary=(f"commit the checkpoints left (attempt {attempt})" if quiet_s else
                     f"commit checkpoints after step {state.last_committed_step} (attempt {attempt})"),
            # Given up without a cancel request: a cancel racing the committer's own return is refused
            # (ACTIVITY_UNKNOWN) and fails the workflow task. An abandoned committer is harmless (its commits
            # are idempotent, and the next pass finds them), and stops at its next heartbeat once the run closes.
            cancellation_type=ActivityCancellationType.ABANDON,
        ))

    def _until_stale(self) -> float:
        """The committer comes back by the time checkpoints would go stale, so the run notices within the bound
        (`Supervisor._judge_storage`), and within `COMMITTER_MAX_DURATION_S` in any case."""
        core = self.core
        if core.open_storage_incidents():  # noticed already: a long outage costs the history no more passes
            return COMMITTER_MAX_DURATION_S
        bound = stale_after_s(core.the_spec.checkpoint.stale_after_s, core.state.commit_times)
        age = core.checkpoint_age_s() or 0.0
        return round(min(COMMITTER_MAX_DURATION_S, max(COMMITTER_MIN_DURATION_S, bound - age)), 3)

    def judge_storage(self, attempt: int, store_error: str | None) -> None:
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

    async def commit_the_rest(self, attempt: int, finished: bool = False) -> None:
        """One last committer pass, bounded by `DRAIN_TIMEOUT` and ending once uploads go quiet: with the
        store down, an upload retries for hours, and recovery must not wait on a checkpoint it can do without.

        `finished`: the run trained to its end. Passes follow one another until one commits nothing with the
        store answering, within `FINISH_DRAIN_TIMEOUT` (a pass returns at its first commits; a store or
        controller restarting is waited for), so the result names the store's newest commit."""
        until = workflow.now() + FINISH_DRAIN_TIMEOUT
        while True:
            drain = max(DRAIN_TIMEOUT, until - workflow.now()) if finished else DRAIN_TIMEOUT
            try:
                result = await self.committer(attempt, quiet_s=DRAIN_QUIET_S, drain=drain, finished=finished)
            except ActivityError as error:
                workflow.logger.warning("last commit pass failed: %s", cause_text(error))
                # A controller that stayed away past the pass's retries: asked again while time is left.
                if finished and isinstance(error.cause, TemporalTimeout) and workflow.now() < until:
                    continue
                return
            for commit in result.commits:
                self.core.committed(commit.ref)
            if not finished or workflow.now() >= until or not (result.commits or result.store_error):
                return
