"""`ReadRankLog`: one read of a rank's log from its node's agent, for `trainguard run logs`.

A short workflow of its own rather than an update on the run, so `--follow` polling never adds to the run's
history (Temporal allows 2,000 updates in one). Its id is the client's; it holds no state.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from activities import names
    from trainguard import READ_LOG_WORKFLOW_TYPE, node_task_queue
    from trainguard.error_types import ErrorType, non_retryable
    from trainguard.models import ReadRankLogInput, ReadRankLogResult

READ_LOG_TIMEOUT = timedelta(seconds=30)
"""Reading at most 256 KB of a local file."""
READ_LOG_SCHEDULE_TO_START = timedelta(seconds=10)
"""A node whose agent does not pick the read up is down: say so instead of waiting."""
READ_LOG_RETRY = RetryPolicy(maximum_attempts=2, non_retryable_error_types=non_retryable(ErrorType.NO_SUCH_LOG))
"""A read is cheap and the user is waiting: one retry for a worker restart, no more."""


@workflow.defn(name=READ_LOG_WORKFLOW_TYPE)
class ReadRankLog:
    @workflow.run
    async def run(self, request: ReadRankLogInput) -> ReadRankLogResult:
        return await workflow.execute_activity(
            names.READ_RANK_LOG, request, task_queue=node_task_queue(request.node),
            start_to_close_timeout=READ_LOG_TIMEOUT, schedule_to_start_timeout=READ_LOG_SCHEDULE_TO_START,
            retry_policy=READ_LOG_RETRY, result_type=ReadRankLogResult,
            summary=f"read rank {request.rank}'s log on {request.node}")
