"""Activities that move checkpoints between nodes and S3, and commit them.

Node agents upload their own shards from inside their watch and write their node record last; the
controller's committer sees a step whose records cover every rank and writes its manifest. No shard list
passes through a workflow's history.

The parts live by what they touch: the bucket's layout and the manifest's rules, pure
(`activities.checkpoint_layout`); the store and the controller's activities (`activities.checkpoint_store`);
the node's uploads and downloads (`activities.checkpoint_transfers`). Chaos corruption of a shard is with the
other faults, in `activities.chaos`. The names the workers, tests and benchmarks import from here stay here.
"""

from __future__ import annotations

from activities.checkpoint_layout import (
    MANIFEST_FORMAT, MANIFEST_NAME, MANIFEST_PAGE_RANKS, NODE_RECORDS, SHA256_METADATA, doomed_steps,
    manifest_body, manifest_header, manifest_key, manifest_problem, node_record_key, object_name,
    reshardable_of, restore_sources, shard_from_meta, shard_objects, state_format_of, step_of, step_prefix
)
from activities.checkpoint_store import (
    ORPHANED_UPLOAD_AGE_S, STORE_CHECK_THREADS, STORE_HEARTBEAT_EVERY_S, StoreActivities,
    abort_orphaned_uploads, check_shard_in_store, committed_shard, list_steps, read_manifest
)
from activities.checkpoint_transfers import (
    PART_SIZE_BYTES, TRANSFER_CONCURRENCY, NodeCheckpointActivities, local_digests, stored_intact
)

__all__ = [
    "MANIFEST_FORMAT", "MANIFEST_NAME", "MANIFEST_PAGE_RANKS", "NODE_RECORDS", "ORPHANED_UPLOAD_AGE_S",
    "PART_SIZE_BYTES", "SHA256_METADATA", "STORE_CHECK_THREADS", "STORE_HEARTBEAT_EVERY_S", "TRANSFER_CONCURRENCY",
    "NodeCheckpointActivities", "StoreActivities", "abort_orphaned_uploads", "check_shard_in_store",
    "committed_shard", "doomed_steps", "list_steps", "local_digests", "manifest_body", "manifest_header",
    "manifest_key", "manifest_problem", "node_record_key", "object_name", "read_manifest", "reshardable_of",
    "restore_sources", "shard_from_meta", "shard_objects", "state_format_of", "step_of", "step_prefix",
    "stored_intact",
]
