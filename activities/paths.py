"""Where a node agent keeps a run's files. Nodes share no disk: shards travel between nodes through S3.

The layout is part of the agent-to-rank contract and lives in `trainguard.protocol`; these names stay
importable from here for the agent's own modules."""

from __future__ import annotations

from trainguard.protocol import RunLayout, safe_name, shard_meta_name, shard_name, step_dir_name

__all__ = ["RunLayout", "safe_name", "shard_meta_name", "shard_name", "step_dir_name"]
