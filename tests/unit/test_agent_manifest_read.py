"""The agent's own read of a manifest (`download_shards` given a manifest key, issue 40 finding 7): the shards it
restores must lie where the checkpoint layout puts them, under the manifest's own step folder, or it downloads
nothing. A manifest anyone with the store's key wrote could otherwise point root at another run's objects or
write a restore file outside the restore folder."""

from __future__ import annotations

from typing import Any

import pytest
from temporalio.exceptions import ApplicationError

from activities import checkpoint_transfers
from activities.checkpoint_transfers import NodeCheckpointActivities
from activities.models import DownloadShardsInput, ShardFile, Manifest, ShardInfo
from trainguard.error_types import ErrorType

MANIFEST_KEY = "ckpt/run-a/step-00000100/manifest.json"


def shards_read(monkeypatch: pytest.MonkeyPatch, shards: list[ShardInfo], state_format: str = "torch",
                step: int = 100) -> Any:
    manifest = Manifest(workflow_id="run-a", step=step, world_size=len(shards), attempt=1, shards=shards,
                        state_format=state_format)
    monkeypatch.setattr(checkpoint_transfers, "s3_client", lambda: None)
    monkeypatch.setattr(checkpoint_transfers, "read_manifest", lambda *_args, **_kwargs: manifest)
    request = DownloadShardsInput(workflow_id="run-a", attempt=2, node="node-0", bucket="b",
                                  manifest_key=MANIFEST_KEY, ranks=list(range(len(shards))))
    try:
        return NodeCheckpointActivities._shards_of(request)
    except ApplicationError as error:
        return error


def shard(rank: int, key: str, files: list[ShardFile] | None = None) -> ShardInfo:
    return ShardInfo(rank=rank, key=key, size_bytes=1, sha256="0" * 64, files=files)


def test_a_shard_of_another_runs_folder_is_not_downloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    answer = shards_read(monkeypatch, [shard(0, "ckpt/victim/step-00000100/rank-00000.pt")])
    assert isinstance(answer, ApplicationError) and answer.non_retryable
    assert answer.type == ErrorType.CORRUPT_CHECKPOINT
    assert "puts the shard of rank 0 at ckpt/victim/step-00000100/rank-00000.pt" in str(answer)


def test_a_dcp_file_named_outside_the_layout_is_not_downloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    files = [ShardFile(name="dcp/../../../../etc/cron.d/x", size_bytes=1, sha256="0" * 64)]
    answer = shards_read(monkeypatch, [shard(0, "ckpt/run-a/step-00000100/dcp/", files)], state_format="dcp")
    assert isinstance(answer, ApplicationError) and "outside the DCP layout" in str(answer)


def test_a_manifest_of_another_step_in_this_folder_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    answer = shards_read(monkeypatch, [shard(0, "ckpt/run-a/step-00000100/rank-00000.pt")], step=50)
    assert isinstance(answer, ApplicationError) and "says step 50" in str(answer)


def test_a_manifest_in_the_layout_gives_its_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    answer = shards_read(monkeypatch, [shard(0, "ckpt/run-a/step-00000100/rank-00000.pt")])
    assert [s.key for s in answer] == ["ckpt/run-a/step-00000100/rank-00000.pt"]
