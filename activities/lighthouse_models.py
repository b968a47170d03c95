"""What a run asks of the node agent that hosts its TorchFT lighthouse (`activities.lighthouse`): plain models, so
the run's workflows can import them."""

from __future__ import annotations

from pydantic import BaseModel, Field


class LighthouseInput(BaseModel):
    """The lighthouse of run `workflow_id`, as its `replica_groups` configure it."""

    workflow_id: str
    min_replicas: int = Field(1, ge=1)
    heartbeat_timeout_ms: int = Field(5000, ge=1)
    join_timeout_ms: int = Field(60000, ge=1)


class LighthouseAddress(BaseModel):
    """Where the run's lighthouse serves: every rank's `TORCHFT_LIGHTHOUSE`."""

    node: str
    address: str
    """`http://<host>:<port>`; the same for the run's whole life (a restarted lighthouse takes the same port)."""
    pid: int
