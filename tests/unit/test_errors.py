"""The CLI's last line says what happened: the cause of a failed run or a refused update, where it looked for
Temporal and how to start a stack, never a bare SDK message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from temporalio.client import WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.exceptions import ActivityError, ApplicationError, RetryState
from temporalio.service import RPCError, RPCStatusCode

from trainguard.errors import describe_error
from trainguard.settings import Settings

SETTINGS = Settings.from_env({"TRAINGUARD_TEMPORAL_ADDRESS": "127.0.0.1:7999"})


def _caused(error: BaseException, cause: BaseException) -> BaseException:
    error.__cause__ = cause
    return error


def test_a_failed_run_says_its_cause() -> None:
    cause = ApplicationError("invalid run spec: nodes: at least 1 item", type="InvalidSpec", non_retryable=True)
    text = describe_error(WorkflowFailureError(cause=cause), SETTINGS)
    assert text == "the run failed: invalid run spec: nodes: at least 1 item"


def test_the_cause_chain_skips_the_sdks_wrappers() -> None:
    activity = _caused(ActivityError("Activity task failed", scheduled_event_id=1, started_event_id=2,
                                     identity="w", activity_type="launch_ranks", activity_id="1",
                                     retry_state=RetryState.NON_RETRYABLE_FAILURE),
                       ApplicationError("entrypoint.0: cannot start 'nope' on node node-0", type="BadSpec"))
    outer = _caused(ApplicationError("launch failed on node-0"), activity)
    text = describe_error(WorkflowFailureError(cause=outer), SETTINGS)
    assert text == "the run failed: launch failed on node-0: entrypoint.0: cannot start 'nope' on node node-0"
    assert "Activity task failed" not in text


def test_a_refused_update_says_why() -> None:
    refused = WorkflowUpdateFailedError(ApplicationError("run is running, not paused: nothing to resume",
                                                         type="ValueError"))
    assert describe_error(refused, SETTINGS) == "refused: run is running, not paused: nothing to resume"


def test_rpc_errors_name_the_address_and_what_to_do() -> None:
    down = describe_error(RPCError("connection refused", RPCStatusCode.UNAVAILABLE, b""), SETTINGS)
    assert "127.0.0.1:7999 (from TRAINGUARD_TEMPORAL_ADDRESS)" in down and "trainguard dev up" in down
    for message in ("Timeout expired", "no poller seen for task queue recently, worker may be down"):
        slow = describe_error(RPCError(message, RPCStatusCode.UNKNOWN, b""), SETTINGS)
        assert "no controller polls task queue 'trainguard'" in slow
    gone = describe_error(RPCError("workflow not found for ID: run-x", RPCStatusCode.NOT_FOUND, b""), SETTINGS)
    assert gone.startswith("not found at 127.0.0.1:7999") and "run-x" in gone


def test_the_cli_without_a_stack_says_where_it_looked_and_exits_1(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(TRAINGUARD_TEMPORAL_ADDRESS="127.0.0.1:1", TRAINGUARD_HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "trainguard.cli", "run", "status", "run-x"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "trainguard: cannot reach Temporal at 127.0.0.1:1 (from TRAINGUARD_TEMPORAL_ADDRESS)" in done.stderr
    assert "trainguard dev up" in done.stderr and "Traceback" not in done.stderr
