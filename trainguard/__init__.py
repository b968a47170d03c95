"""trainguard: keeps distributed PyTorch training running, as durable Temporal workflows."""

TASK_QUEUE = "trainguard"
"""Task queue of the controller worker: `TrainingRun` workflows and the store/inventory activities."""

WORKFLOW_TYPE = "TrainingRun"

NODE_CALLS_WORKFLOW = "NodeCalls"
"""Child workflow of a run: one per-node activity on each node of a group (workflows/node_calls.py)."""

NODE_GROUP_WATCH_WORKFLOW = "NodeGroupWatch"
"""Child workflow of a run: the watches of one group of nodes for one attempt (workflows/node_group.py)."""

POOL_WORKFLOW_ID = "trainguard-node-pool"
"""The node pool's workflow id: one pool per namespace (workflows/node_pool.py)."""

POOL_WORKFLOW_TYPE = "NodePool"

READ_LOG_WORKFLOW_TYPE = "ReadRankLog"
"""A short workflow of its own per read of a rank's log (workflows/rank_log.py)."""


def node_task_queue(node: str) -> str:
    """Task queue a node's agent polls; activities that touch the node are pinned to it."""
    return f"trainguard-node-{node}"


__version__ = "0.1.0"
