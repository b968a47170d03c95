"""`trainguard dev up` waits for its agents and controller to poll: a Temporal server it has just started may
cancel or refuse a call for a moment, and that is "not ready yet", never a failed `up`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from temporalio.service import RPCError, RPCStatusCode

from trainguard import connect, pool
from trainguard.devstack import DevStack, StackConfig
from trainguard.models import PoolNode


@pytest.fixture
def stack(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> DevStack:
    dev = DevStack(StackConfig.from_env({"TRAINGUARD_HOME": str(tmp_path)}))
    monkeypatch.setattr(dev, "components", lambda: [])
    monkeypatch.setattr(dev, "_spawned_at", lambda _name: 0.0)

    async def fake_connect(_settings: Any) -> object:
        return object()

    async def registered(_client: object) -> list[PoolNode]:
        return [PoolNode(node=n, registered_at=1.0) for n in dev.config.nodes]

    monkeypatch.setattr(connect, "connect", fake_connect)
    monkeypatch.setattr(pool, "pool_nodes", registered)
    return dev


def _answers(monkeypatch: pytest.MonkeyPatch, errors: list[RPCError]) -> list[str]:
    """Every agent and the controller poll; the server's first answers are `errors`. Returns the calls made."""
    calls: list[str] = []

    async def missing_agents(_client: object, _nodes: list[str], max_idle_s: float = 90.0) -> list[str]:
        calls.append("agents")
        if errors:
            raise errors.pop(0)
        return []

    async def has_pollers(*_args: Any) -> bool:
        return True

    monkeypatch.setattr(pool, "missing_agents", missing_agents)
    monkeypatch.setattr(pool, "has_pollers", has_pollers)
    return calls


def test_a_server_that_cancels_a_call_as_it_starts_is_asked_again(stack: DevStack,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _answers(monkeypatch, [RPCError("context canceled", RPCStatusCode.CANCELLED, b""),
                                   RPCError("connection refused", RPCStatusCode.UNAVAILABLE, b"")])
    stack._wait_workers()
    assert calls == ["agents"] * 3


def test_a_server_that_refuses_for_another_reason_fails_the_start(stack: DevStack,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _answers(monkeypatch, [RPCError("request unauthorized", RPCStatusCode.PERMISSION_DENIED, b"")])
    with pytest.raises(RPCError, match="unauthorized"):
        stack._wait_workers()
