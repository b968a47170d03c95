"""A node's restore folder holds only what the checkpoint's manifest names, each file verified (issue 40).

A requeued Slurm job failed its run: its node's `<workdir>/.../restore/step-100` still held a DCP checkpoint of
an earlier job under the same run id, so the rank helper, finding `dcp/.metadata` beside the new `torch.save`
shard, took the checkpoint for DCP and stopped (`run.restore() was given none`, exit 78). No store is needed
here: the shard comes from the node's own copy (the local tier), as it does after a relaunch on the same node.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from temporalio.testing import ActivityEnvironment

from activities.checkpoint_transfers import NodeCheckpointActivities
from activities.models import DownloadShardsInput, ShardInfo
from trainguard.protocol import RunLayout, shard_meta_name, shard_name
from trainguard.rank import DCP_METADATA

RUN = "slurm-42"
STEP = 100
GENUINE = b"".join(i.to_bytes(4, "little") for i in range(4096))


async def test_a_restore_folder_holds_only_the_manifests_files_each_verified(tmp_path: Path) -> None:
    layout = RunLayout.of(tmp_path, RUN)
    local = layout.local_step_dir(STEP)
    local.mkdir(parents=True)
    (local / shard_name(0)).write_bytes(GENUINE)
    sha = hashlib.sha256(GENUINE).hexdigest()
    shard = ShardInfo(rank=0, key=f"runs/{RUN}/step-{STEP:08d}/{shard_name(0)}", size_bytes=len(GENUINE), sha256=sha,
                      node="node-x")
    # An earlier job's step 100 under the same run id: a DCP checkpoint, a shard of a larger world, and a rank 0
    # shard whose record claims the manifest's checksum over other bytes.
    restore = layout.restore_dir(STEP)
    (restore / "dcp").mkdir(parents=True)
    (restore / DCP_METADATA).write_bytes(b"earlier job's DCP metadata")
    (restore / "dcp" / "__0_0.distcp").write_bytes(b"earlier job's DCP shard")
    (restore / shard_name(1)).write_bytes(b"earlier job's rank 1")
    (restore / shard_meta_name(1)).write_text("{}")
    (restore / shard_name(0)).write_bytes(b"x" * len(GENUINE))
    (restore / shard_meta_name(0)).write_text(json.dumps({"rank": 0, "size_bytes": len(GENUINE), "sha256": sha}))
    agent = NodeCheckpointActivities("node-x", tmp_path)

    result = await ActivityEnvironment().run(agent.download_shards, DownloadShardsInput(
        workflow_id=RUN, attempt=1, node="node-x", bucket="unused", shards=[shard]))

    assert Path(result.restore_dir) == restore
    # Before the fix: `dcp/` (which the rank helper takes for a DCP checkpoint), rank 1's shard and the
    # earlier bytes of rank 0's were all still there.
    assert sorted(p.relative_to(restore).as_posix() for p in restore.rglob("*")) == sorted(
        [shard_name(0), shard_meta_name(0)])
    assert not (restore / DCP_METADATA).exists()
    assert (restore / shard_name(0)).read_bytes() == GENUINE
    assert result.tiers == {0: "local"}


def test_clearing_removes_a_link_without_following_it(tmp_path: Path) -> None:
    from activities.checkpoint_transfers import clear_unnamed, restored_names

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the restore's")
    restore = tmp_path / "restore"
    restore.mkdir()
    (restore / "dcp").symlink_to(outside, target_is_directory=True)
    (restore / shard_name(0)).symlink_to(outside / "keep.txt")
    shard = ShardInfo(rank=0, key="k", size_bytes=1, sha256="0" * 64)

    removed = clear_unnamed(restore, restored_names([shard]))

    assert sorted(removed) == ["dcp", shard_name(0)] and list(restore.iterdir()) == []
    assert (outside / "keep.txt").read_text() == "not the restore's"
