"""Sharded training state on the real stack: a Hugging Face Llama trained with FSDP2 (DCP checkpoints that
reshard) and with DDP (replicated state saved once), through faults.

The first: node-1 is lost, the run shrinks to one node, the one rank restores the two-rank checkpoint
resharded (its full state equal to the state at the checkpoint), completes, and its final checkpoint loads
from the store with plain `dcp_to_torch_save`. Every one takes over a minute here (each launch imports
transformers), more than `make test` allows a new test: all are marked slow (`make test-slow`). `make test`
keeps a real DCP save and restore through the rank helper in tests/unit/test_rank_helper.py.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError

from activities.checkpoint_layout import shard_objects
from activities.store_reads import read_manifest
from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack
from trainguard.models import Action, IncidentKind, Phase, RunResult

from .conftest import RUN_TIMEOUT_S, checkpointed, live_rank_pids, restart_agent, wait_until

pytestmark = pytest.mark.integration
BUCKET = "trainguard"


def run_id(kind: str) -> str:
    return f"it-{kind}-{uuid.uuid4().hex[:6]}"


def lm_spec(prefix: str, parallel: str, digest_log: Path | None = None, steps: int = 40, every: int = 10,
            step_time: float = 0.15, extra_args: tuple[str, ...] = (), **extra: Any) -> dict[str, Any]:
    """examples/train_lm.py on 2 nodes x 1 rank (what examples/lm.json runs, smaller and shorter)."""
    entrypoint = ["python", "examples/train_lm.py", "--parallel", parallel, "--steps", str(steps),
                  "--step-time", str(step_time), "--hidden", "32", *extra_args]
    if digest_log is not None:
        entrypoint += ["--digest-log", str(digest_log)]
    spec: dict[str, Any] = {
        "entrypoint": entrypoint, "nodes": ["node-0", "node-1"], "ranks_per_node": 1,
        "checkpoint": {"prefix": prefix, "every_steps": every, "keep_last": 2},
        "health": {"hang_floor_s": 10.0},  # transformers' import takes seconds on a loaded machine
    }
    spec.update(extra)
    return spec


def digests(path: Path) -> dict[tuple[str, int, int], str]:
    """(save|restore, step, world size) -> the full model's digest at that point, as the trainer logged it."""
    found = {}
    for line in path.read_text().splitlines():
        kind, step, world, digest = line.split(maxsplit=3)  # a digest cut off by the fault: "unavailable: ..."
        found[(kind, int(step), int(world))] = digest
    return found


def download_dcp(stack: DevStack, manifest_key: str, into: Path) -> Any:
    """The committed checkpoint's DCP files, from the store with a plain S3 client, into `into`."""
    s3 = stack.s3()
    manifest = read_manifest(s3, BUCKET, manifest_key)
    assert manifest is not None and manifest.state_format == "dcp", manifest
    for shard in manifest.shards:
        for name, obj in shard_objects(shard):
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(BUCKET, obj.key, str(target))
    return manifest


@pytest.mark.slow  # 70-120 s here under load (two launches importing transformers, a 10 s loss detection)
async def test_fsdp_run_loses_a_node_shrinks_resharded_and_its_checkpoint_loads_with_plain_torch(
        client: TrainguardClient, prefix: str, stack: DevStack, tmp_path: Path) -> None:
    log = tmp_path / "digests.txt"
    rid = await client.start_run(lm_spec(prefix, "fsdp", log, steps=30, step_time=0.1, min_nodes=1),
                                 workflow_id=run_id("lm-shrink"))
    try:
        await wait_until(client, rid, lambda v: checkpointed(v, min_step=11), timeout_s=150)
        await client.inject_fault(rid, "node-down", "node-1")
        result: RunResult = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    finally:
        await restart_agent(stack, "node-1")  # it took itself down; later tests need it
        await client.uncordon("node-1")
    lost = [i for i in result.incidents if i.kind is IncidentKind.NODE_UNRESPONSIVE]
    assert [(i.node, i.action) for i in lost] == [("node-1", Action.SHRINK)], result.incidents
    assert result.steps_completed == 30 and result.final_checkpoint is not None
    assert not (result.final_state_digest or "").startswith("unavailable"), result.final_state_digest
    # The one rank restored the two-rank checkpoint resharded: the full model equal to the one saved.
    logged = digests(log)
    restores = [(step, world) for kind, step, world in logged if kind == "restore"]
    assert restores and all(world == 1 for _, world in restores), logged
    for step, _ in restores:
        assert logged[("restore", step, 1)] == logged[("save", step, 2)], f"step {step} restored otherwise"
    assert result.final_checkpoint.world_size == 1

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    import torch

    manifest = download_dcp(stack, result.final_checkpoint.manifest_key, tmp_path / "final")
    dcp_to_torch_save(tmp_path / "final" / "dcp", tmp_path / "final.pt")
    state = torch.load(tmp_path / "final.pt", weights_only=False)
    assert state["model"]["model.embed_tokens.weight"].shape == (256, 32)
    assert manifest.step == result.final_checkpoint.step
    assert live_rank_pids(stack) == []


@pytest.mark.slow  # over a minute here (a launch importing transformers, a 10 s loss detection)
async def test_fsdp_run_saving_per_rank_torch_files_pauses_for_an_operator_instead_of_shrinking(
        client: TrainguardClient, prefix: str, stack: DevStack) -> None:
    spec = lm_spec(prefix, "fsdp", steps=200, step_time=0.1, min_nodes=1,
                   extra_args=("--checkpoint-format", "torch"))
    rid = await client.start_run(spec, workflow_id=run_id("lm-torch"))
    try:
        await wait_until(client, rid, lambda v: checkpointed(v, min_step=10), timeout_s=150)
        view = await client.status(rid)
        assert view.status.latest_checkpoint is not None and not view.status.latest_checkpoint.reshardable
        manifest = read_manifest(stack.s3(), BUCKET, view.status.latest_checkpoint.manifest_key)
        assert manifest is not None and manifest.reshardable is False and manifest.state_format == "torch"
        await client.inject_fault(rid, "node-down", "node-1")
        paused = await wait_until(client, rid, lambda v: v.status.phase is Phase.PAUSED, timeout_s=90)
        assert "not shrinking" in (paused.status.reason or "") and "cannot be resharded onto 1" in (
            paused.status.reason or ""), paused.status.reason
        assert paused.status.world_size == 2 and paused.status.cordoned == []
        await client.abort(rid, reason="test over")
    finally:
        await restart_agent(stack, "node-1")
    with pytest.raises(WorkflowFailureError):  # aborted by its operator
        await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    assert live_rank_pids(stack) == []


@pytest.mark.slow
async def test_fsdp_crash_and_hang_end_with_the_fault_free_digest_and_the_run_grows_back(
        client: TrainguardClient, prefix: str, stack: DevStack, tmp_path: Path) -> None:
    baseline = await asyncio.wait_for(client.result(await client.start_run(
        lm_spec(f"{prefix}-base", "fsdp"), workflow_id=run_id("lm-base"))), RUN_TIMEOUT_S)
    assert baseline.incidents == [] and baseline.final_state_digest
    rid = await client.start_run(lm_spec(prefix, "fsdp"), workflow_id=run_id("lm-crash"))
    await wait_until(client, rid, lambda v: checkpointed(v, min_step=12), timeout_s=150)
    await client.inject_fault(rid, "crash", "node-1")
    await wait_until(client, rid, lambda v: v.status.attempt == 2 and checkpointed(v, min_step=25), timeout_s=150)
    await client.inject_fault(rid, "hang", "node-0")
    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    assert [i.kind for i in result.incidents] == [IncidentKind.CRASH, IncidentKind.HANG], result.incidents
    assert result.final_state_digest == baseline.final_state_digest

    # Lose a node, shrink onto the other, grow back once it returns: resharded both ways.
    log = tmp_path / "grow.txt"
    rid = await client.start_run(lm_spec(f"{prefix}-grow", "fsdp", log, steps=60, min_nodes=1),
                                 workflow_id=run_id("lm-grow"))
    try:
        await wait_until(client, rid, lambda v: checkpointed(v, min_step=12), timeout_s=150)
        await client.inject_fault(rid, "node-down", "node-1")
        await wait_until(client, rid, lambda v: v.status.world_size == 1 and v.live_step > 0, timeout_s=120)
        await restart_agent(stack, "node-1")
        grown = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    finally:
        await client.uncordon("node-1")
    # One incident, the lost node, then the shrink and the grow-back. Where its peer's crash in the collective
    # came first, the relaunch that followed it (no stop first: agents fence by attempt) is how node-1 was
    # found lost, in an attempt of its own that never trained.
    [lost] = grown.incidents
    assert lost.kind is IncidentKind.NODE_UNRESPONSIVE and lost.node == "node-1", lost
    found_by_relaunch = "did not answer the relaunch" in lost.detail
    assert grown.attempts == 3 + found_by_relaunch and grown.final_checkpoint is not None, lost.detail
    assert grown.final_checkpoint.world_size == 2
    logged = digests(log)
    for kind, step, world in logged:
        if kind == "restore":
            saved = [d for (k, s, _), d in logged.items() if k == "save" and s == step]
            assert saved and logged[(kind, step, world)] in saved, (step, world)
    assert {world for kind, _, world in logged if kind == "restore"} == {1, 2}


@pytest.mark.slow
async def test_ddp_with_replicated_state_uploads_one_shard_per_step_and_recovers(
        client: TrainguardClient, prefix: str, stack: DevStack) -> None:
    baseline = await asyncio.wait_for(client.result(await client.start_run(
        lm_spec(f"{prefix}-base", "ddp"), workflow_id=run_id("lm-ddp-base"))), RUN_TIMEOUT_S)
    rid = await client.start_run(lm_spec(prefix, "ddp", extra_args=("--replicated",)),
                                 workflow_id=run_id("lm-ddp-rep"))
    await wait_until(client, rid, lambda v: checkpointed(v, min_step=12), timeout_s=150)
    await client.inject_fault(rid, "crash", "node-1")  # node-1 restores rank 0's shard
    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    assert [i.kind for i in result.incidents] == [IncidentKind.CRASH], result.incidents
    assert result.final_state_digest == baseline.final_state_digest
    assert result.final_checkpoint is not None
    manifest = read_manifest(stack.s3(), BUCKET, result.final_checkpoint.manifest_key)
    assert manifest is not None
    assert [(s.rank, s.replica_of, len(shard_objects(s))) for s in manifest.shards] == [(0, None, 1), (1, 0, 0)]
    assert manifest.total_bytes == manifest.shards[0].size_bytes
