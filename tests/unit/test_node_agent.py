"""The node agent's command line, read by its own `main` (issue 27 finding 9: `TRAINGUARD_CHAOS=OFF` left chaos on,
because only lowercase `off` turned it off).

`main` runs up to the worker it would build; the test stops it there and reads what it was given. Starting a real
agent on the integration stack would register a fifth node in the session's shared pool for one boolean.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from workers import node_agent


class _Built(Exception):
    """Raised in place of building the worker: `main` has parsed everything by then."""


@pytest.fixture
def agent_main(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """`node_agent.main` with no Temporal, no secrets moved, no logging set up: `build_worker` records its kwargs."""
    built: dict[str, Any] = {}

    async def connect() -> object:
        return object()

    def build_worker(*args: Any, **kwargs: Any) -> Any:
        built.update(kwargs)
        raise _Built

    monkeypatch.setattr(node_agent, "connect", connect)
    monkeypatch.setattr(node_agent, "build_worker", build_worker)
    monkeypatch.setattr(node_agent, "hold_agent_secrets", lambda: None)  # would drop the test's own environment
    monkeypatch.setattr(node_agent, "setup_logging", lambda component: None)
    for name in (node_agent.PEER_TOKEN_ENV, node_agent.RUN_AS_ENV, "TRAINGUARD_ALLOWED_ENTRYPOINTS",
                 "TRAINGUARD_ALLOWED_ENV", node_agent.NODE_LABELS_ENV, "TRAINGUARD_PEER_PORT", "TRAINGUARD_CHAOS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["node_agent", "--node", "node-0", "--workdir", str(tmp_path / "work"),
                                      "--allow", "*", "--peer-port", "-1"])
    return built


@pytest.mark.parametrize("value, chaos", [
    ("OFF", False), ("Off", False), ("off", False), ("FALSE", False), ("0", False), ("No", False),
    ("ON", True), ("on", True), ("1", True), ("", True),
])
async def test_the_agent_reads_trainguard_chaos_in_any_case(
        agent_main: dict[str, Any], monkeypatch: pytest.MonkeyPatch, value: str, chaos: bool) -> None:
    monkeypatch.setenv("TRAINGUARD_CHAOS", value)
    with pytest.raises(_Built):
        await node_agent.main()
    assert agent_main["chaos"] is chaos


async def test_the_agent_refuses_to_start_on_any_other_word_naming_the_variable(
        agent_main: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TRAINGUARD_CHAOS", "offf")
    with pytest.raises(SystemExit) as refused:
        await node_agent.main()
    assert refused.value.code == 2 and not agent_main
    assert "TRAINGUARD_CHAOS=" in capsys.readouterr().err


async def test_no_chaos_turns_chaos_off_whatever_the_variable_says(
        agent_main: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_CHAOS", "on")
    monkeypatch.setattr(sys, "argv", [*sys.argv, "--no-chaos"])
    with pytest.raises(_Built):
        await node_agent.main()
    assert agent_main["chaos"] is False
