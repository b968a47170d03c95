"""What leaves a node agent for Temporal is redacted: every activity's result and every failure's message.

A node agent's activities return what its ranks wrote in many places (a log tail, an exception, an upload
error raised by a store the rank's script configured, a state digest the script handed in, a process state),
and their failures carry texts the same way. All of it ends in the run's history, its status and its result,
which anyone who may read the namespace reads. Rather than each activity remembering to redact each field, the
agent's worker runs every activity through `RedactNodeResults`: a result is redacted field by field
(`trainguard.redact.redact_value`, every text but the identifiers the workflow acts on), a failure's message
and its causes' messages are redacted, so an activity or a field added later is covered too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from temporalio.exceptions import ApplicationError, FailureError
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from trainguard.redact import redact, redact_value


def redacted_error(error: BaseException, known: Iterable[str] | None = None) -> BaseException:
    """`error` itself when no message in it or its causes holds a secret; else an `ApplicationError` of the same
    type name, retry behaviour and details, its message and its causes' redacted. Temporal's own errors other
    than `ApplicationError` (a cancellation, a heartbeat timeout) pass unchanged: the SDK acts on their class."""
    if known is None:
        from trainguard.settings import held_secret_values

        known = held_secret_values()
    values = list(known)
    if not isinstance(error, Exception) or (isinstance(error, FailureError)
                                            and not isinstance(error, ApplicationError)):
        return error
    cause = error.__cause__
    clean_cause = redacted_error(cause, values) if cause is not None else None
    message = error.message if isinstance(error, ApplicationError) else str(error)
    clean_message = redact(message, values)
    if isinstance(error, ApplicationError):
        details = list(error.details)
        clean_details = redact_value(details, values)
        if clean_message == message and clean_details == details and clean_cause is cause:
            return error
        # The failure's own type, passed through: not one chosen here, so not an `ErrorType` member by name.
        same: dict[str, Any] = {"type": error.type, "non_retryable": error.non_retryable,
                                "next_retry_delay": error.next_retry_delay, "category": error.category}
        clean: ApplicationError = ApplicationError(clean_message, *clean_details, **same)
    else:
        if clean_message == message and clean_cause is cause:
            return error
        # Temporal names a plain exception's failure by its class and retries it: the same, minus the secret.
        plain: dict[str, Any] = {"type": type(error).__name__}
        clean = ApplicationError(clean_message, **plain)
    clean.__cause__ = clean_cause
    return clean.with_traceback(error.__traceback__)


class _RedactActivity(ActivityInboundInterceptor):
    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        try:
            result = await self.next.execute_activity(input)
        except Exception as error:
            clean = redacted_error(error)
            if clean is error:
                raise
            raise clean from clean.__cause__
        return redact_value(result)


class RedactNodeResults(Interceptor):
    """A node agent worker's interceptor: every activity's result and failure leaves the node redacted."""

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _RedactActivity(next)
