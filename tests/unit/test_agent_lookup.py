"""Looking up which agents poll their queues rides out a namespace's rate limit instead of failing."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.service import RPCError, RPCStatusCode

from trainguard import pool


class Service:
    """A workflow service that refuses the first `refusals` lookups as a namespace past its rate limit does."""

    def __init__(self, refusals: int, status: RPCStatusCode = RPCStatusCode.RESOURCE_EXHAUSTED) -> None:
        self.refusals, self.status, self.calls = refusals, status, 0

    async def describe_task_queue(self, request: Any) -> Any:
        self.calls += 1
        if self.calls <= self.refusals:
            raise RPCError("namespace rate limit exceeded", self.status, b"")
        poller = SimpleNamespace(last_access_time=SimpleNamespace(ToSeconds=lambda: int(time.time())))
        return SimpleNamespace(pollers=[poller])


async def test_a_lookup_refused_by_the_rate_limit_is_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool, "LOOKUP_BUSY_FIRST_RETRY_S", 0.001)
    service = Service(refusals=3)
    client = SimpleNamespace(namespace="default", workflow_service=service)
    assert await pool.has_pollers(client, "q", TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY, 60.0)  # type: ignore[arg-type]
    assert service.calls == 4


async def test_any_other_refusal_still_fails_the_lookup() -> None:
    client = SimpleNamespace(namespace="default", workflow_service=Service(1, RPCStatusCode.PERMISSION_DENIED))
    with pytest.raises(RPCError):
        await pool.has_pollers(client, "q", TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY, 60.0)  # type: ignore[arg-type]
