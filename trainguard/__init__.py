"""trainguard: keeps distributed PyTorch training running, as durable Temporal workflows."""

TASK_QUEUE = "trainguard"
"""Task queue of the controller worker: `TrainingRun` workflows and the store/inventory activities."""

WORKFLOW_TYPE = "TrainingRun"


def node_task_queue(node: str) -> str:
    """Task queue a node's agent polls; activities that touch the node are pinned to it."""
    return f"trainguard-node-{node}"


__version__ = "0.1.0"
