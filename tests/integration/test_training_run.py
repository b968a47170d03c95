"""A TrainingRun end to end on the real stack: Temporal dev server, SeaweedFS, node agents, torch ranks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError

from activities.models import Manifest
from trainguard import TASK_QUEUE, WORKFLOW_TYPE
from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.models import Action, IncidentKind, RunResult

from .conftest import (REPO, RUN_TIMEOUT_S, checkpointed, history_text, live_rank_pids, make_spec, restart_agent,
                       wait_until)


async def test_run_completes_and_commits_checkpoints_to_s3(baseline: RunResult, stack: DevStack) -> None:
    assert baseline.steps_completed == 60
    assert baseline.attempts == 1
    assert baseline.incidents == []
    assert baseline.final_state_digest and len(baseline.final_state_digest) == 64
    assert 0 < baseline.goodput <= 1
    ref = baseline.final_checkpoint
    assert ref is not None and ref.step == 60 and ref.world_size == 2

    s3 = stack.s3()
    manifest = Manifest.model_validate_json(s3.get_object(Bucket=ref.bucket, Key=ref.manifest_key)["Body"].read())
    assert manifest.step == 60 and sorted(s.rank for s in manifest.shards) == [0, 1]
    for shard in manifest.shards:
        head = s3.head_object(Bucket=ref.bucket, Key=shard.key)
        assert head["ContentLength"] == shard.size_bytes
        assert head["Metadata"]["sha256"] == shard.sha256
    # Retention keeps the newest two committed checkpoints (steps 40 and 60) and deletes 20; the namespace's
    # owner record (the run's first restore claimed it) stays, and each node's record of its ranks' fingerprints
    # (the trainer calls run.fingerprint). (Nodes also write their pace records under `pace/` once a straggler
    # window, so a run slower than a window has that folder too.)
    prefix = ref.manifest_key.rsplit("/step-", 1)[0]
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=ref.bucket, Prefix=prefix + "/")["Contents"]]
    assert sorted({k.removeprefix(prefix + "/").split("/")[0] for k in keys} - {"pace"}) == [
        "fingerprints", "owner.json", "step-00000040", "step-00000060"]
    assert sorted(k.rsplit("/", 1)[1] for k in keys if "/fingerprints/" in k) == ["node-0.json", "node-1.json"]
    # Each node's record of its part of a kept step stays beside the shards (the committer's evidence).
    assert sorted(k.rsplit("/", 1)[1] for k in keys if "/step-00000060/nodes/" in k) == ["node-0.json", "node-1.json"]
    assert live_rank_pids(stack) == []


# With the local tier off: `make test-slow`; test_checkpoints.py keeps the verified restore from the store in
# `make test`.
@pytest.mark.parametrize("local_tier, tiers", [
    pytest.param(True, ("local", "local+s3"), id="from-the-local-tier"),
    pytest.param(False, ("s3",), id="from-s3", marks=pytest.mark.slow)])
async def test_crashed_rank_resumes_from_newest_committed_step(
    client: TrainguardClient, baseline: RunResult, prefix: str, stack: DevStack, local_tier: bool,
    tiers: tuple[str, ...]
) -> None:
    spec = make_spec(prefix)
    spec["checkpoint"]["local_tier"] = local_tier
    run_id = await client.start_run(spec, workflow_id=f"it-crash-{uuid.uuid4().hex[:6]}")
    await wait_until(client, run_id, checkpointed)
    committed = (await client.status(run_id)).status.latest_checkpoint
    assert committed is not None
    fault = await client.inject_fault(run_id, "crash", "node-1")
    assert fault.rank == 1

    result = await asyncio.wait_for(client.result(run_id), RUN_TIMEOUT_S)
    assert result.steps_completed == 60
    crashes = [i for i in result.incidents if i.kind is IncidentKind.CRASH]
    assert crashes, result.incidents
    first = crashes[0]
    assert (first.node, first.rank, first.action) == ("node-1", 1, Action.RESTART)
    assert first.resumed_step is not None and first.resumed_step >= committed.step > 0
    # The same nodes restart: each restores its own verified copy where it still has one, not S3 (unless
    # checkpoint.local_tier is off: then every byte comes from the store, verified the same way).
    assert first.restore_tier in tiers, first
    assert first.recovery_path == "relaunch"
    assert first.detection_s is not None and first.detection_s < 5
    assert first.recovery_s is not None and first.recovery_s > 0
    assert result.attempts >= 2
    # Exact resume: bit-identical to the run that never failed.
    assert result.final_state_digest == baseline.final_state_digest
    assert live_rank_pids(stack) == []


async def test_hung_rank_is_detected_from_progress_and_recovered(
    client: TrainguardClient, baseline: RunResult, prefix: str
) -> None:
    spec = make_spec(prefix, health={"hang_floor_s": 1.5})
    run_id = await client.start_run(spec, workflow_id=f"it-hang-{uuid.uuid4().hex[:6]}")
    await wait_until(client, run_id, checkpointed)
    await client.inject_fault(run_id, "hang", "node-0")

    result = await asyncio.wait_for(client.result(run_id), RUN_TIMEOUT_S)
    hangs = [i for i in result.incidents if i.kind is IncidentKind.HANG]
    assert hangs, result.incidents
    assert hangs[0].node == "node-0" and hangs[0].rank == 0
    # Seen from per-rank progress, long before gloo's 30-minute collective timeout.
    assert hangs[0].detection_s is not None and hangs[0].detection_s < 10
    assert result.final_state_digest == baseline.final_state_digest


async def test_user_error_exit_code_stops_the_run_without_restarts(client: TrainguardClient, prefix: str) -> None:
    spec = make_spec(prefix)
    spec["entrypoint"] = ["python", "examples/train.py", "--steps", "0"]
    run_id = await client.start_run(spec, workflow_id=f"it-usererr-{uuid.uuid4().hex[:6]}")
    with pytest.raises(WorkflowFailureError) as failure:
        await asyncio.wait_for(client.result(run_id), RUN_TIMEOUT_S)
    assert "78" in str(failure.value.cause)
    status = (await client.status(run_id)).status
    assert status.attempt == 1
    assert [i.kind for i in status.incidents] == [IncidentKind.USER_ERROR]


@pytest.mark.parametrize(
    ("spec_patch", "field"),
    [
        ({"entrypoint": "python examples/train.py"}, "entrypoint"),
        ({"entrypoint": None}, "entrypoint"),
        ({"nodes": ["node-9"]}, "nodes.0"),
        ({"ranks_per_node": "two"}, "ranks_per_node"),
    ],
)
async def test_bad_spec_fails_within_seconds_naming_the_field(
    client: TrainguardClient, prefix: str, spec_patch: dict, field: str
) -> None:
    spec = make_spec(prefix)
    spec.update(spec_patch)
    spec = {k: v for k, v in spec.items() if v is not None}
    started = time.monotonic()
    # Straight to Temporal, as `temporal workflow start` would: no client-side validation to lean on.
    handle = await client.client.start_workflow(WORKFLOW_TYPE, spec, id=f"it-bad-{uuid.uuid4().hex[:6]}",
                                                task_queue=TASK_QUEUE)
    with pytest.raises(WorkflowFailureError) as failure:
        await asyncio.wait_for(handle.result(), 30)
    assert field in str(failure.value.cause)
    assert time.monotonic() - started < 30


async def test_temporal_cli_starts_a_run_that_completes(client: TrainguardClient, prefix: str, stack: DevStack,
                                                         tmp_path: Path) -> None:
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(make_spec(prefix, steps=20, every=10)))
    run_id = f"it-cli-{uuid.uuid4().hex[:6]}"
    temporal = str(Path(sys.executable).parent / "temporal")
    subprocess.run(
        [temporal, "workflow", "start", "--type", "TrainingRun", "--task-queue", "trainguard",
         "--input-file", str(spec_file), "--workflow-id", run_id, "--address", stack.config.temporal_address],
        check=True, cwd=REPO, capture_output=True, timeout=30,
    )
    result = await asyncio.wait_for(client.result(run_id), RUN_TIMEOUT_S)
    assert result.steps_completed == 20
    assert result.final_checkpoint is not None and result.final_checkpoint.step == 20


# In `make test-slow`: `make test` runs a node lost the Slurm way replaced by the allocation's spare on the real
# stack (tests/integration/test_slurm.py), and the decisions in workflow unit tests.
@pytest.mark.slow
async def test_unresponsive_node_is_replaced_by_a_spare(
    client: TrainguardClient, baseline: RunResult, prefix: str, stack: DevStack
) -> None:
    run_id = await client.start_run(make_spec(prefix, spares=("node-2",)), workflow_id=f"it-node-{uuid.uuid4().hex[:6]}")
    await wait_until(client, run_id, checkpointed)
    agent = json.loads((stack.run_dir / "agent-node-1.json").read_text())["pid"]
    os.kill(agent, signal.SIGKILL)  # the agent is gone; its rank is orphaned and dies with its peers
    try:
        result = await asyncio.wait_for(client.result(run_id), RUN_TIMEOUT_S)
    finally:
        await restart_agent(stack, "node-1")  # back for the tests after this one
    lost = [i for i in result.incidents if i.kind is IncidentKind.NODE_UNRESPONSIVE]
    assert lost and lost[0].node == "node-1" and lost[0].action is Action.REPLACE_NODE
    assert "s3" in (lost[0].restore_tier or "")  # the spare has no copy of its own: S3
    if "did not answer the relaunch" in lost[0].detail:
        # Its peer's crash came first, and the relaunch after it (no stop: agents fence by attempt) found the
        # node lost: the spare joined that relaunch's rendezvous in its place, so the one fault cost one.
        assert result.attempts == 2 and lost[0].recovery_path == "relaunch, a spare joining it", lost[0]
    else:
        assert result.attempts == 2, lost[0]  # found by its stop or its watch's heartbeat: replaced at relaunch
    status = (await client.status(run_id)).status
    assert status.nodes == ["node-0", "node-2"] and status.cordoned == ["node-1"]
    assert result.final_state_digest == baseline.final_state_digest


async def test_no_secret_reaches_the_history(client: TrainguardClient, baseline: RunResult, stack: DevStack) -> None:
    history = "\n".join(history_text(h) for h in await client.histories(baseline.workflow_id))
    secrets = [stack.credentials()["secret_key"], stack.credentials()["access_key"], stack.peer_token()]
    secrets += [v for k, v in os.environ.items() if any(w in k for w in ("SECRET", "TOKEN", "PASSWORD")) and len(v) > 8]
    # The scan covers a whole run: its node groups' launches and watches, and the commits.
    assert "launch_ranks" in history and "watch_ranks" in history and "commit_checkpoints" in history
    assert not [s for s in secrets if s in history]


async def test_a_program_the_node_does_not_allow_is_refused(client: TrainguardClient, prefix: str) -> None:
    spec = make_spec(prefix)
    spec["entrypoint"] = ["/bin/sh", "-c", "echo pwned"]
    rid = await client.start_run(spec, workflow_id=f"it-allow-{uuid.uuid4().hex[:6]}")
    with pytest.raises(WorkflowFailureError) as failure:
        await asyncio.wait_for(client.result(rid), 60)
    assert "entrypoint '/bin/sh' is not allowed on node node-0" in str(failure.value.cause)


async def test_workers_serve_prometheus_metrics(baseline: RunResult, stack: DevStack) -> None:
    import urllib.request

    def scrape(port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return response.read().decode()

    controller = scrape(stack.metrics_port())
    assert "trainguard_goodput" in controller
    assert "temporal_workflow_completed" in controller  # the SDK's own metrics beside ours
    agent = scrape(stack.metrics_port(0))
    assert "trainguard_ranks_alive" in agent and "temporal_activity_execution_latency" in agent
