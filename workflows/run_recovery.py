"""`Recovery`: what the run does between attempts.

On an incident the pure policy (`workflows/policy.py`) decides; the decision is recorded first, then carried
out by idempotent activities: relaunch (each staying node's launch stops its old ranks, fenced by attempt),
replace a node with a spare, shrink, pause for an operator, or stop. At a committed checkpoint the run also
moves off drained nodes and grows back onto returned ones; a paused run waits for `resume` or `abort`.
"""

from __future__ import annotations

from collections.abc import Callable

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from trainguard.error_types import ErrorType
    from trainguard.models import Action, Incident, IncidentKind, Phase, StopReason
    from workflows.node_group_models import LostNode
    from workflows.policy import (NODE_FAULTS, RANK_FAULTS, Decision, RecoveryBudget, decide,
                                  numerical_fault_recurs, same_failure_streak, straggler_replaced_at)
    from workflows.run_core import RunCore
    from workflows.run_decisions import stop_reason
    from workflows.run_nodes import LIVENESS_SCHEDULE_TO_START, RunNodes
    from workflows.run_watch import Watches

HEAL_POLL_MAX_S = 300.0
HEAL_POLLS_FAST = 40
"""A run paused for a lost node asks the pool whether it is back every `restarts.heal_poll_s` for its first 40
asks (10 minutes by default), then every 5 minutes: about 12 activities an hour of a long pause."""


def heal_poll_s(first_s: float, polls: int) -> float:
    return first_s if polls < HEAL_POLLS_FAST else max(first_s, HEAL_POLL_MAX_S)


AGENT_CLOCK_SKEW_S = 10.0
"""A restarting agent counts as back once it registered after it went away, by its own clock, less this: a
node's clock ahead of Temporal's must not keep the run waiting for an agent already back."""

RELAUNCHES = frozenset({Action.RESTART, Action.REPLACE_NODE, Action.SHRINK})
"""Decisions after which every node of the run launches the next attempt."""


class Recovery:
    def __init__(self, core: RunCore, nodes: RunNodes, watches: Watches) -> None:
        self.core, self.nodes, self.watches = core, nodes, watches

    async def recover(self, attempt: int, incident: Incident) -> None:
        core, spec, state = self.core, self.core.the_spec, self.core.state
        core.set_phase(Phase.RECOVERING)
        core.live.symptom = None
        if incident.kind is IncidentKind.AGENT_RESTART:
            await self._agent_restart(attempt, incident)
            return
        incident = await self._cause_of_crash(incident)
        now = workflow.now().timestamp()
        same = same_failure_streak(incident, core.status.incidents)
        decision: Decision = decide(
            incident.kind, incident.node, spec, core.status.nodes, state.spares,
            RecoveryBudget(tuple(state.restart_times), state.restarts_without_checkpoint, same,
                           straggler_replaced_at(core.status.incidents),
                           numerical_fault_recurs(incident, core.status.incidents)), now,
            persisted=incident.kind is IncidentKind.STRAGGLER, newest=core.status.latest_checkpoint,
            suspect=incident.kind is IncidentKind.SILENT_DATA_CORRUPTION and state.tie is not None
            and state.tie.swapped_out == incident.node and state.tie.attempt == incident.attempt,
        )
        seen_as = incident.detail
        incident.action = decision.action
        incident.decision = decision.reason
        decision = stop_reason(decision, incident, seen_as, same_failures=same,
                               max_same_failure=spec.restarts.max_same_failure,
                               rank_fault=incident.kind in RANK_FAULTS)
        core.record_incident(incident)
        workflow.logger.info("incident %s on %s rank %s: %s", incident.kind.value, incident.node, incident.rank,
                             decision.reason)
        if decision.action is Action.RESTART and incident.kind is IncidentKind.CRASH and spec.restarts.in_process:
            # The live ranks stay up: the next attempt rejoins them with the crashed ones started again.
            state.warm = incident
            await self.watches.drop_standing()
            core.count_restart(now)
            core.set_phase(Phase.RESTORING)
            return
        reachable = [n for n in core.status.nodes if
                     not (incident.kind is IncidentKind.NODE_UNRESPONSIVE and n == incident.node)]
        if decision.action not in RELAUNCHES:  # a relaunch stops the old ranks as it launches (fenced)
            await self.watches.drop_standing()
            await self.nodes.stop_everywhere(
                reachable, attempt, f"{incident.kind.value}: {decision.action.value}",
                StopReason.INCIDENT_PAUSE if decision.action is Action.PAUSE else StopReason.INCIDENT)
        if decision.action is Action.STOP:
            raise core.fail(decision.reason, ErrorType.RUN_STOPPED)
        if incident.bad_step is not None:  # roll back past the first wrong step, whichever attempt restores
            state.restore_before = min(incident.bad_step, state.restore_before or incident.bad_step)
        if decision.action is Action.PAUSE:
            core.say(decision.reason)
            await self.wait_for_operator(StopReason.INCIDENT_PAUSE,
                                         heal=incident if incident.kind in NODE_FAULTS else None)
            return
        if decision.action is Action.REPLACE_NODE and incident.node and decision.replacement:
            await self.nodes.swap_in_spare(incident, decision.replacement, cordon=decision.cordon,
                                           hold=decision.hold)
        if decision.action is Action.SHRINK and incident.node:
            await self.nodes.cordon_lost(incident)
            core.shrink(incident.node)
        # Every node staying in the run stops this attempt's ranks as it launches the next one; those leaving
        # it (a straggler or a sick GPU replaced) are stopped here. A lost node is found by the relaunch.
        leaving = [n for n in reachable if n not in core.status.nodes]
        if leaving:
            await self.nodes.stop_everywhere(leaving, attempt, f"{incident.kind.value}: {decision.action.value}")
        if decision.action is Action.RESTART and incident.kind in RANK_FAULTS:
            core.live.symptom = (incident, seen_as)
        core.count_restart(now)
        core.set_phase(Phase.RESTORING)

    async def _cause_of_crash(self, incident: Incident) -> Incident:
        """A crash whose node or a peer's did not answer its liveness check (`RunNodes.unanswered`): the lost
        node is the incident, the crash its symptom, and a spare takes its place in this relaunch."""
        check, self.core.live.liveness = self.core.live.liveness, None
        if check is None:
            return incident
        lost = await check
        if not lost or incident.kind is not IncidentKind.CRASH:
            return incident
        return self.core.symptom_of_lost_node(
            incident, lost[0], incident.detail,
            missed=f"a liveness check within {LIVENESS_SCHEDULE_TO_START.total_seconds():g}s")

    async def _agent_restart(self, attempt: int, incident: Incident) -> None:
        """An agent shut down gracefully (its ranks stopped with it): wait for every node of the run to be back
        (a whole stack restarting too), then relaunch on the same nodes. No node, spare or restart budget is
        spent; a node whose agent stays away past the bound is a lost node after all."""
        core = self.core
        incident.action = Action.RESTART
        core.record_incident(incident)
        restarting, core.live.restarting = core.live.restarting or {incident.node or "": incident.detected_at}, {}
        away = await self.nodes.wait_for_agents(sorted(restarting),
                                                since=min(restarting.values()) - AGENT_CLOCK_SKEW_S)
        if not away:
            incident.notes.append("its agent is back: relaunch on the same nodes")
            core.set_phase(Phase.RESTORING)
            return
        bound = core.the_spec.restarts.agent_return_timeout_s
        incident.notes.append(f"not back within {bound:.0f}s")
        lost = core.node_lost(away[0], attempt, f"node agent shut down and did not come back within {bound:.0f}s "
                                                f"(restarts.agent_return_timeout_s)")
        await self.recover(attempt, lost)

    async def pass_over_corrupt(self, attempt: int, corrupt: LostNode) -> None:
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

    async def join_spare(self, attempt: int, incident: Incident) -> bool:
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
        incident.decision = decision.reason
        incident.notes.append(f"it joined attempt {attempt} in the node's place")
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

    async def move_off_drained(self, attempt: int) -> None:
        """At a checkpoint boundary: stop the attempt, put spares in the drained nodes' places, relaunch."""
        core, intents = self.core, self.core.state.intents
        core.set_phase(Phase.RECOVERING)
        # The nodes that stay are stopped by their own launch of the next attempt (fenced by attempt).
        leaving = [n for n in core.status.nodes if n in intents.draining]
        await self.nodes.stop_everywhere(leaving, attempt, f"drain {', '.join(intents.draining)}", StopReason.DRAIN)
        for node in [n for n in intents.draining if n in core.status.nodes]:
            core.replace(node, core.state.spares.pop(0))
            await self.nodes.release(node)
        intents.draining.clear()
        core.set_phase(Phase.RESTORING)

    def grow_back(self, attempt: int, returned: list[str]) -> None:
        """At a checkpoint boundary: relaunch with the returned nodes in their places (each staying node's
        launch stops its shrunk attempt); the restore maps the smaller world's shards onto the larger one.
        A `GROW_BACK` incident of `attempt`, timed to the next attempt's first step; no restart budget spent."""
        core, spec = self.core, self.core.the_spec
        world = len([n for n in spec.nodes if n in core.status.nodes or n in returned]) * spec.ranks_per_node
        core.record_incident(Incident(
            kind=IncidentKind.GROW_BACK, node=returned[0], attempt=attempt, action=Action.RESTART,
            detected_at=workflow.now().timestamp(), detection_s=0.0,  # decided at a commit: nothing to detect
            detail=f"{', '.join(returned)} back: relaunch on world size {world} (was {core.status.world_size})",
        ), publish=False)  # the phase change publishes it
        core.set_phase(Phase.RECOVERING)
        core.grow_back(returned)
        workflow.logger.info("grow back onto %s: %d nodes", ", ".join(returned), len(core.status.nodes))
        core.set_phase(Phase.RESTORING)

    async def wait_for_operator(self, reason: StopReason, heal: Incident | None = None) -> None:
        """PAUSED until an operator resumes (relaunch, budgets afresh) or aborts (the run fails). Paused for a
        lost node (`heal`), the run also resumes by itself once that node's agent registers healthy again: the
        relaunch then counts against the restart budget like any other. No process of the run stays parked on
        its spares while it waits (`reason`: why, for their agents' reports); they park again as it resumes."""
        core, intents = self.core, self.core.state.intents
        await self.nodes.unpark_spares(reason)
        core.set_phase(Phase.PAUSED)
        # A resume accepted while the pause was on its way is kept: the run goes straight back.
        intents.pause = False
        decided = lambda: intents.resume or intents.abort_reason is not None  # noqa: E731 - one condition for both waits below
        healed = False
        if heal is not None and heal.node:
            core.say(f"{core.status.reason}; resumes by itself once {heal.node}'s agent registers healthy again")
            healed = await self._wait_for_node(heal, decided)
        else:
            await workflow.wait_condition(decided)
        if intents.abort_reason is not None:
            raise core.fail(intents.abort_reason, ErrorType.ABORTED)
        intents.resume = False
        core.say(None)
        core.start_commit_clock(restart=True)  # paused time put no training at risk
        if healed and heal is not None:
            heal.notes.append(f"{heal.node} came back: resumed by itself")
            core.count_restart(workflow.now().timestamp())
        else:
            core.state.restart_times.clear()
            core.state.restarts_without_checkpoint = 0
        self.nodes.park_spares()
        core.set_phase(Phase.RESTORING)

    async def _wait_for_node(self, heal: Incident, decided: Callable[[], bool]) -> bool:
        """Until an operator decides (False) or the lost node's agent is back (True), asking the pool at
        `heal_poll_s` intervals: often at first, then rarely, so a long pause costs its history little."""
        assert heal.node is not None
        polls = 0
        while True:
            try:
                await workflow.wait_condition(decided, timeout=heal_poll_s(
                    self.core.the_spec.restarts.heal_poll_s, polls))
                return False
            except TimeoutError:
                polls += 1
            away = await self.nodes.wait_for_agents([heal.node], since=heal.detected_at - AGENT_CLOCK_SKEW_S,
                                                    once=True)
            if not away:
                return True
