"""`Attempts`: one attempt of a run, from restore to launch; the run's loop then supervises it (`Supervisor`).

Restore finds the newest committed checkpoint whose manifest verifies (passing over ones found corrupt), the
master node downloads and launches first (it picks the attempt's fresh rendezvous), and every other node
downloads and launches from its first watch. A crash with `restarts.in_process` is recovered without a
relaunch: the live ranks rejoin the crashed ones started again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from pydantic import BaseModel
from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities import names
    from activities.models import (DownloadShardsInput, DownloadShardsResult, FindCheckpointInput,
                                   FindCheckpointResult, LaunchRanksInput, LaunchRanksResult, RejoinRanksInput,
                                   RejoinRanksResult)
    from trainguard.error_types import SPEC_FAULTS, ErrorType
    from trainguard.models import Action, Incident, IncidentKind, Phase, StopReason
    from workflows.node_group_models import NodeCallKind
    from workflows.run_core import RunCore, cause_text, error_type
    from workflows.run_decisions import Ending
    from workflows.run_nodes import STORE_HEARTBEAT_TIMEOUT, STORE_RETRY, STORE_TIMEOUT, NodeAnswer, RunNodes
    from workflows.supervision import Outcome

G = TypeVar("G", LaunchRanksResult, RejoinRanksResult)


class StoreUnavailable(Exception):
    """The checkpoint store could not be read within `checkpoint.restore_timeout_s`."""


class NodeFailed(Exception):
    """A node could not do its part of a restore or launch: an incident, not the end of the run."""

    def __init__(self, node: str, detail: str) -> None:
        super().__init__(detail)
        self.node = node


class CheckpointCorrupt(Exception):
    def __init__(self, step: int, detail: str) -> None:
        super().__init__(detail)
        self.step = step


@dataclass
class Launched:
    """An attempt whose ranks launched: the run supervises it. Nodes but the master launch from their first
    watch (`launch`, `download`); None where every node launched already (one node, an in-process restart)."""

    launch: LaunchRanksInput | None = None
    download: DownloadShardsInput | None = None
    in_process: Incident | None = None
    """The crash an in-process restart recovers: a new incident before the first step falls back to a relaunch
    (`Attempts.settle`)."""


class Attempts:
    def __init__(self, core: RunCore, nodes: RunNodes) -> None:
        self.core, self.nodes = core, nodes

    async def run(self, attempt: int) -> Launched | Outcome:
        """Restore and launch attempt `attempt`: launched, or the outcome that ended it first."""
        core = self.core
        if core.state.warm is not None:
            return await self._in_process(attempt, core.state.warm)
        spec, status = core.the_spec, core.status
        try:
            found, restore_dirs = await self._restore(attempt)
        except NodeFailed as failed:
            return Outcome(Ending.INCIDENT, core.lost_at_launch(failed.node, attempt, str(failed)))
        except StoreUnavailable as unavailable:
            return Outcome(Ending.INCIDENT, Incident(kind=IncidentKind.STORAGE_UNAVAILABLE, attempt=attempt,
                                                     detail=str(unavailable), detected_at=workflow.now().timestamp()))
        restore_step = found.manifest.step if found.manifest else 0
        status.resumed_step = restore_step
        status.step = max(status.step, restore_step)
        core.state.goodput.launched(restore_step)
        core.state.state_since_attempt = attempt  # a relaunch: only this attempt's shards make its checkpoints
        core.live.restored_by = []
        for incident in status.incidents:
            if incident.resumed_step is None and incident.action is not Action.REPORT:
                incident.resumed_step = restore_step
                incident.restore_tier = core.state.restore_tier if found.manifest else None
                incident.recovery_path = incident.recovery_path or "relaunch"
                if found.manifest:
                    core.live.restored_by.append(incident)

        core.set_phase(Phase.LAUNCHING)
        core.state.launched = True
        wid, chain = core.wid(), workflow.info().first_execution_run_id
        nodes = status.nodes

        def launch(index: int, master: LaunchRanksResult | None) -> LaunchRanksInput:
            return LaunchRanksInput(
                workflow_id=wid, attempt=attempt, node=nodes[index], node_rank=index, chain_id=chain,
                num_nodes=len(nodes), ranks_per_node=spec.ranks_per_node,
                master_addr=master.master_addr if master else None,
                master_port=master.master_port if master else None,
                entrypoint=spec.entrypoint, env=spec.env, working_dir=spec.working_dir,
                restore_dir=restore_dirs.get(nodes[index]), restore_step=restore_step,
                checkpoint_every=spec.checkpoint.every_steps, fingerprint_every=spec.health.fingerprint_every_steps,
                loss_spike_ratio=spec.health.loss_spike_ratio,
                rejoin_timeout_s=spec.restarts.rejoin_timeout_s if spec.restarts.in_process else None,
            )

        # The master picks the rendezvous; every other node launches from its first watch, given it.
        summary = f"launch ranks on {{node}} (attempt {attempt}, from step {restore_step})"
        [first] = await self.nodes.fan_out(NodeCallKind.LAUNCH, [(nodes[0], launch(0, None))], summary,
                                           LaunchRanksResult)
        if first.result is None:
            if first.error_type in SPEC_FAULTS:
                raise core.fail(first.error or "bad spec", ErrorType.INVALID_SPEC)
            return Outcome(Ending.INCIDENT, core.lost_at_launch(first.node, attempt, f"launch failed: {first.error}"))
        core.set_phase(Phase.RUNNING)
        core.start_commit_clock()
        if len(nodes) == 1:
            return Launched()
        template = launch(0, first.result).model_copy(update={"node": "", "node_rank": 0, "restore_dir": None})
        download = None
        if found.manifest is not None and found.manifest_key is not None:
            download = DownloadShardsInput(workflow_id=wid, attempt=attempt, node="", bucket=spec.checkpoint.bucket,
                                           manifest_key=found.manifest_key, manifest_sha256=found.manifest_sha256,
                                           local_tier=spec.checkpoint.local_tier)
        return Launched(launch=template, download=download)

    async def _master_first(self, kind: NodeCallKind, make: Callable[[int, Any], BaseModel], result_type: type[G],
                            summary: str) -> list[NodeAnswer[G]]:
        """`kind` on every node of the attempt: the master node first (it picks the process group's fresh
        port, `master` None), then the others together, given the master's answer. Every node's answer;
        only the master's when it failed."""
        nodes: list[str] = self.core.status.nodes
        first: NodeAnswer[G]
        [first] = await self.nodes.fan_out(kind, [(nodes[0], make(0, None))], summary, result_type)
        if first.result is None:
            return [first]
        return [first, *await self.nodes.fan_out(  # type: ignore[list-item]  # mypy loses a constrained G here
            kind, [(nodes[i], make(i, first.result)) for i in range(1, len(nodes))], summary, result_type)]

    async def _in_process(self, attempt: int, incident: Incident) -> Launched | Outcome:
        """Recover from a crash without a relaunch: the live ranks form attempt `attempt`'s process group with
        the crashed ranks started again, which take a live peer's state. Any failure before the attempt's
        first step falls back to a full relaunch from the newest checkpoint, and the incident says so."""
        core, spec = self.core, self.core.the_spec
        core.state.warm = None
        core.set_phase(Phase.LAUNCHING)
        nodes = core.status.nodes
        core.state.launched = True
        wid, chain = core.wid(), workflow.info().first_execution_run_id

        def rejoin(index: int, master: RejoinRanksResult | None) -> RejoinRanksInput:
            return RejoinRanksInput(
                workflow_id=wid, chain_id=chain, attempt=attempt, from_attempt=attempt - 1, node=nodes[index],
                node_rank=index, num_nodes=len(nodes), ranks_per_node=spec.ranks_per_node,
                master_addr=master.master_addr if master else None,
                master_port=master.master_port if master else None,
                entrypoint=spec.entrypoint, env=spec.env, working_dir=spec.working_dir,
                checkpoint_every=spec.checkpoint.every_steps, fingerprint_every=spec.health.fingerprint_every_steps,
                loss_spike_ratio=spec.health.loss_spike_ratio, rejoin_timeout_s=spec.restarts.rejoin_timeout_s,
            )

        answers = await self._master_first(NodeCallKind.REJOIN, rejoin, RejoinRanksResult,
                                           f"rejoin ranks on {{node}} in process (attempt {attempt})")
        failed = [f"{a.node}: {a.error}" for a in answers if a.result is None]
        steps = [a.result.step for a in answers if a.result is not None and a.result.step is not None]
        why = "; ".join(failed) or ("" if steps else "no rank survived the crash")
        if why:
            return await self._fall_back(attempt, incident, why)
        # The run's resumed_step stays: shards the live ranks saved after the newest commit are still theirs
        # to report and commit.
        incident.resumed_step, incident.restore_tier, incident.recovery_path = min(steps), "peers", "in-process"
        core.state.goodput.launched(min(steps))
        core.set_phase(Phase.RUNNING)
        return Launched(in_process=incident)

    async def settle(self, attempt: int, launched: Launched, outcome: Outcome) -> Outcome:
        """An in-process restart that met a new incident before its first step falls back to a relaunch;
        whatever else ends an attempt is news, as it is."""
        incident = launched.in_process
        if incident is None or outcome.incident is None or incident.recovery_s is not None:
            return outcome
        return await self._fall_back(
            attempt, incident, f"{outcome.incident.kind.value} before the first step: {outcome.incident.detail}")

    async def _fall_back(self, attempt: int, incident: Incident, why: str) -> Outcome:
        workflow.logger.warning("in-process restart of attempt %d failed, relaunching: %s", attempt, why)
        incident.recovery_path = f"relaunch after failed in-process: {why}"
        incident.resumed_step = incident.restore_tier = None
        self.core.set_phase(Phase.RECOVERING)
        await self.nodes.stop_everywhere(self.core.status.nodes, attempt, "in-process restart failed: relaunch",
                                         StopReason.IN_PROCESS_FAILED)
        return Outcome(Ending.RELAUNCH)

    async def _restore(self, attempt: int) -> tuple[FindCheckpointResult, dict[str, str]]:
        """The newest usable checkpoint, downloaded to the master node (the others download from their
        launching watch). A corrupt one is passed over for the one before, by this restore and every later one."""
        core = self.core
        core.set_phase(Phase.RESTORING)
        while True:
            try:
                found = await self._find_checkpoint(attempt, list(core.state.corrupt_steps))
            except ActivityError as error:
                if error_type(error) == ErrorType.BAD_SPEC:  # e.g. the bucket does not exist: no wait fixes that
                    raise core.fail(cause_text(error), ErrorType.INVALID_SPEC) from None
                raise StoreUnavailable(
                    f"no answer from the checkpoint store within checkpoint.restore_timeout_s="
                    f"{core.the_spec.checkpoint.restore_timeout_s:.0f}: {cause_text(error)}") from None
            if found.manifest is None or found.manifest_key is None:
                return found, {}
            try:
                return found, await self._download(attempt, found.manifest.step, found.manifest_key,
                                                   found.manifest_sha256)
            except CheckpointCorrupt as corrupt:
                core.state.corrupt_steps.append(corrupt.step)
                core.record_incident(Incident(kind=IncidentKind.CHECKPOINT_CORRUPT, attempt=attempt,
                                              detail=str(corrupt), action=Action.RESTART,
                                              detected_at=workflow.now().timestamp()))

    async def _find_checkpoint(self, attempt: int, excluded: list[int]) -> FindCheckpointResult:
        """The run owns its namespace and restores only what it committed, or, while it has nothing of its
        own, what the run it names in `checkpoint.resume_from` committed."""
        core, spec = self.core, self.core.the_spec
        source = spec.checkpoint.resume_from
        return await workflow.execute_activity(
            names.FIND_CHECKPOINT,
            FindCheckpointInput(bucket=spec.checkpoint.bucket, run_prefix=core.run_prefix(),
                                world_size=core.status.world_size, exclude_steps=excluded, attempt=attempt,
                                before_step=core.state.restore_before,
                                workflow_id=core.wid(), resume_from=source,
                                resume_prefix=f"{spec.checkpoint.prefix}/{source}" if source else None,
                                chain_id=workflow.info().first_execution_run_id,
                                allow_resume=spec.checkpoint.allow_resume,
                                min_world_size=None if spec.min_nodes is None else spec.min_nodes * spec.ranks_per_node,
                                max_world_size=None if spec.min_nodes is None else spec.world_size),
            start_to_close_timeout=STORE_TIMEOUT,
            schedule_to_close_timeout=timedelta(seconds=spec.checkpoint.restore_timeout_s),
            heartbeat_timeout=STORE_HEARTBEAT_TIMEOUT,
            retry_policy=STORE_RETRY,
            result_type=FindCheckpointResult,
            summary=f"find newest checkpoint (attempt {attempt})",
        )

    async def _download(self, attempt: int, step: int, manifest_key: str,
                        manifest_sha256: str | None = None) -> dict[str, str]:
        """The master node reads the shards its ranks restore from the manifest itself (rank r: shard r mod the
        checkpoint's world size): no shard list passes through history, only the sha256 of the manifest's bytes
        the controller verified."""
        core, spec = self.core, self.core.the_spec
        nodes, per_node, wid = core.status.nodes[:1], spec.ranks_per_node, core.wid()
        answers = await self.nodes.fan_out(NodeCallKind.DOWNLOAD, [
            (node, DownloadShardsInput(workflow_id=wid, attempt=attempt, node=node, bucket=spec.checkpoint.bucket,
                                       manifest_key=manifest_key, manifest_sha256=manifest_sha256,
                                       ranks=list(range(index * per_node, (index + 1) * per_node)),
                                       local_tier=spec.checkpoint.local_tier))
            for index, node in enumerate(nodes)], f"download step {step} to {{node}} (attempt {attempt})",
            DownloadShardsResult)
        for answer in answers:
            if answer.error_type == ErrorType.CORRUPT_CHECKPOINT:
                raise CheckpointCorrupt(step, f"step {step}: {answer.error}")
        for answer in answers:
            if answer.result is None:
                raise NodeFailed(answer.node, f"download failed: {answer.error}")
        results = [a.result for a in answers if a.result is not None]
        tiers = {tier for r in results for tier in r.tiers.values()}
        core.state.restore_tier = "+".join(sorted(tiers)) or None
        return {node: result.restore_dir for node, result in zip(nodes, results)}
