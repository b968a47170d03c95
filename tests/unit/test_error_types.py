"""Error types and fault kinds are enums: every `ApplicationError` raises an `ErrorType` member, every retry
policy's non-retryable list is built from members, and a fault no agent knows (the old undocumented `exit`
among them) is refused, naming the faults there are."""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from activities.models import InjectFaultInput, LaunchRanksInput
from trainguard.error_types import ErrorType, non_retryable
from trainguard.faults import FaultKind, parse_fault
from workflows.node_calls import TRANSFER_RETRY
from workflows.node_pool import SCHEDULER_RETRY
from workflows.rank_log import READ_LOG_RETRY
from workers.node_agent import node_ranks

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("trainguard", "activities", "workflows", "workers", "infra")


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def untyped_errors(path: Path, root: Path = REPO) -> list[str]:
    """`ApplicationError(...)` calls whose `type` is not an `ErrorType` member, and retry policies whose
    non-retryable list is not `non_retryable(...)`."""
    bad = []
    tree = ast.parse(path.read_text(), str(path))
    # A helper's parameter typed `ErrorType` counts as a member: its callers pass one (a type checker holds them).
    typed = {(fn.lineno, arg.arg) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for arg in fn.args.args if arg.annotation is not None and ast.unparse(arg.annotation) == "ErrorType"}
    typed_names = {name for _, name in typed}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        where = f"{path.relative_to(root)}:{node.lineno}"
        if callee == "ApplicationError":
            kind = _keyword(node, "type")
            member = isinstance(kind, ast.Attribute) and isinstance(kind.value, ast.Name) \
                and kind.value.id == "ErrorType" and kind.attr in ErrorType.__members__ \
                or isinstance(kind, ast.Name) and kind.id in typed_names
            if kind is not None and not member:
                bad.append(f"{where}: ApplicationError type {ast.unparse(kind)} is not an ErrorType member")
        if callee == "RetryPolicy":
            listed = _keyword(node, "non_retryable_error_types")
            if listed is not None and not (isinstance(listed, ast.Call) and getattr(listed.func, "id", "")
                                           == "non_retryable"):
                bad.append(f"{where}: non_retryable_error_types={ast.unparse(listed)}: use non_retryable(...)")
    return bad


def test_every_error_type_and_non_retryable_list_comes_from_the_enum() -> None:
    found = [bad for folder in SOURCES for path in sorted((REPO / folder).rglob("*.py"))
             for bad in untyped_errors(path)]
    assert found == [], "\n".join(found)


def test_the_check_sees_a_typed_string(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('raise ApplicationError("x", type="BadSpek")\n'
                     'P = RetryPolicy(non_retryable_error_types=["BadSpec"])\n'
                     'raise ApplicationError("y", type=ErrorType.BAD_SPEC)\n')
    assert [line.split(":")[1] for line in untyped_errors(probe, tmp_path)] == ["1", "2"]


def test_the_policies_refuse_the_same_types_as_before() -> None:
    """The wire strings are unchanged: histories and running workers see the same retry policies."""
    assert TRANSFER_RETRY.non_retryable_error_types == ["CorruptCheckpoint", "NoLocalShards", "BadSpec"]
    assert SCHEDULER_RETRY.non_retryable_error_types == ["SchedulerConfigError"]
    assert READ_LOG_RETRY.non_retryable_error_types == ["NoSuchLog"]
    with pytest.raises(TypeError):
        non_retryable("BadSpec")  # type: ignore[arg-type]


def test_fault_names_parse_and_exit_is_none_of_them() -> None:
    assert parse_fault("node-down") is FaultKind.NODE_DOWN and f"{FaultKind.NODE_DOWN}" == "node-down"
    assert parse_fault("exit") is None and parse_fault("gpu-fault") is None  # the CLI's spelling, not the wire's


async def test_the_agent_refuses_an_unknown_fault_and_leaves_the_rank_running(tmp_path: Path) -> None:
    agent = node_ranks("node-a", tmp_path / "agent", "127.0.0.1", tmp_path,
                           allowed=(str(Path(sys.executable).parent),))
    try:
        await agent.launch.launch_ranks(LaunchRanksInput(
            workflow_id="wf", chain_id="c1", attempt=1, node="node-a", node_rank=0, num_nodes=1, ranks_per_node=1,
            entrypoint=[sys.executable, "-c", "import time; time.sleep(60)"]))
        with pytest.raises(ApplicationError) as refused:
            await agent.chaos.inject_fault(InjectFaultInput(workflow_id="wf", node="node-a", fault="exit"))
        assert refused.value.type == ErrorType.BAD_FAULT and refused.value.non_retryable
        assert "node-down" in refused.value.message and "exit" not in refused.value.message.split(";")[1]
        pid = agent.book.record("wf").ranks[0].pid  # type: ignore[union-attr]
        os.kill(pid, 0)  # still alive: the refused fault did nothing
    finally:
        await agent.book.stop_all(grace_s=0.5)
