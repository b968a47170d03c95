"""`HangCulprit`: before a hung attempt's ranks are stopped, every node's evidence, and the rank it names.

The evidence is each node's ranks' stacks and collective positions (`activities.evidence`); the culprit is picked
by the pure rules of `workflows.culprit`. Nodes whose watch judged the hang brought theirs with the event, a
small run's group asked its other nodes at once, and only the rest are asked here. A run whose groups stand does
not wait: the standing groups' later reports add their evidence and the culprit is named again.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.models import CollectEvidenceInput, CollectEvidenceResult
    from trainguard.models import Incident
    from workflows.culprit import pick_culprit
    from workflows.node_calls import NODES_PER_GROUP
    from workflows.node_group_models import NodeCallKind
    from workflows.run_core import RunCore
    from workflows.run_nodes import RunNodes
    from workflows.run_state import HangAttribution
    from workflows.run_watch import Watches


class HangCulprit:
    def __init__(self, core: RunCore, nodes: RunNodes, watches: Watches) -> None:
        self.core, self.nodes, self.watches = core, nodes, watches

    async def attribute(self, attempt: int, incident: Incident) -> None:
        """Before anything is stopped: every node's evidence (its ranks' stacks and collective positions),
        and the culprit it names (`workflows.culprit`). The full stacks go to the store with the run.

        A run whose groups stand does not wait for evidence still on its way: at thousands of nodes every node's
        watch judges the hang and its group reports it, and taking those reports in before the relaunch cost a
        4,096-node run 24 s. The culprit is named from the evidence in hand, the relaunch is decided and
        published at once, and each group's later report of the hung attempt adds its nodes' evidence and names
        the culprit again (`fold_late`); no node is asked (its report is on its way)."""
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
        if calls:
            # Up to one group's worth from the run itself: the recovery waits on this, and a child workflow's
            # start and end cost it two more workflow tasks.
            answered = await self.nodes.fan_out(NodeCallKind.COLLECT_EVIDENCE, calls, summary, CollectEvidenceResult,
                                                direct=len(calls) <= NODES_PER_GROUP)
            hang.evidence.update({a.node: a.result.ranks for a in answered if a.result is not None})
        self._name_culprit(hang)

    def fold_late(self) -> None:
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
        rest = incident.cause[len(hang.prefix):] if incident.cause.startswith(hang.prefix) else incident.cause
        hang.prefix = "" if culprit.rank == hang.watch_rank or culprit.rank is None else (
            f"rank {culprit.rank} hung ({culprit.rule}); the watch first saw rank {hang.watch_rank} silent: ")
        incident.cause = hang.prefix + rest
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
