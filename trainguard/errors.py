"""What went wrong, in words an operator can act on: the cause of a failed run, a refused update or a
query nobody answered, never the SDK's bare "Workflow execution failed"."""

from __future__ import annotations

from temporalio.client import WorkflowFailureError, WorkflowQueryFailedError, WorkflowUpdateFailedError
from temporalio.exceptions import ActivityError, ChildWorkflowError, FailureError
from temporalio.service import RPCError, RPCStatusCode

from trainguard import TASK_QUEUE
from trainguard.settings import Settings

START_A_STACK = ("start one with `trainguard dev up`, or point TRAINGUARD_TEMPORAL_ADDRESS (or TRAINGUARD_PORT_BASE, "
                 "TRAINGUARD_HOME) at the one you mean")


NO_POLLER = "no poller seen for task queue"
"""What the Temporal server answers a query that no worker picked up (after about 30 s)."""


class NoController(RuntimeError):
    """Nothing polls the `trainguard` task queue: no controller runs the workflows or answers their queries."""


def no_controller_hint(address: str) -> str:
    return (f"no controller polls task queue {TASK_QUEUE!r} at {address}: runs wait in `reserving` and queries "
            f"go unanswered until one does (`trainguard dev up` starts one; elsewhere run `python -m "
            f"workers.controller`)")


def cause_chain(error: BaseException | None) -> str:
    """The messages down a Temporal failure's causes, outermost first, without the SDK's generic wrappers
    ("Activity task failed", "Child Workflow execution failed"), which say only where it happened."""
    messages: list[str] = []
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        wrapper = isinstance(error, (ActivityError, ChildWorkflowError))
        message = error.message if isinstance(error, FailureError) else str(error)
        if message and not wrapper and message not in messages:
            messages.append(message)
        error = getattr(error, "cause", None) or error.__cause__
    return ": ".join(messages) or "no cause given"


def describe_error(error: BaseException, settings: Settings | None = None) -> str:
    """One readable account of `error` for the CLI's last line."""
    if isinstance(error, WorkflowFailureError):
        return f"the run failed: {cause_chain(error.cause)}"
    if isinstance(error, WorkflowUpdateFailedError):
        return f"refused: {cause_chain(error.cause)}"
    if isinstance(error, WorkflowQueryFailedError):
        return f"the query failed: {error.message}"
    settings = settings or Settings.from_env()
    address = f"{settings.temporal_address} (from {settings.address_source})"
    if isinstance(error, RPCError):
        if error.status is RPCStatusCode.NOT_FOUND:
            return f"not found at {address}: {error.message}"
        if error.status in (RPCStatusCode.UNAVAILABLE,):
            return f"cannot reach Temporal at {address} ({error.message}): {START_A_STACK}"
        if (error.status is RPCStatusCode.DEADLINE_EXCEEDED or "Timeout expired" in error.message
                or NO_POLLER in error.message):
            return f"no answer from {address} in time ({error.message}): is a controller running? " \
                   f"{no_controller_hint(address)}"
        return f"Temporal at {address} refused: {error.message}"
    if isinstance(error, RuntimeError) and str(error).startswith("Failed client connect"):
        return f"cannot reach Temporal at {address}: {START_A_STACK} ({error})"
    return str(error) or type(error).__name__
