"""`trainguard.redact`: held secrets and secret-looking values go, what a reader needs of a failure stays."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from uuid import uuid4

import pytest
from temporalio import activity, workflow
from temporalio.client import WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.models import DownloadShardsResult, RankEvidence, WatchEvent, WatchEventKind
from trainguard.redact import REDACTED, redact, redact_model
from trainguard.run_as import RunAs
from trainguard.settings import forget_agent_secrets, hold_agent_secrets
from workers.redaction import RedactNodeResults

HELD = "held-0123456789abcdef"


@pytest.mark.parametrize(("text", "expected"), [
    (f"token is {HELD}", f"token is {REDACTED}"),
    (f"x{HELD}y", f"x{REDACTED}y"),  # a held value anywhere, even inside a word
    ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", f"AWS_SECRET_ACCESS_KEY={REDACTED}"),
    ("key wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY!", f"key {REDACTED}!"),
    ("AKIAIOSFODNN7EXAMPLE", REDACTED),
    ("HF_TOKEN=hf_abc PASSWORD=x", f"HF_TOKEN={REDACTED} PASSWORD={REDACTED}"),
    ('{"api_key": "sk-1234"}', f'{{"api_key": "{REDACTED}"}}'),
    ("db_password: hunter2", f"db_password: {REDACTED}"),
    ("Authorization: Bearer eyJ0eXAi.abc.def", f"Authorization: Bearer {REDACTED}"),
    ("https://user:hunter22@example.com/x", f"https://user:{REDACTED}@example.com/x"),
    ("my token 0123456789abcdef0123456789abcdef", f"my token {REDACTED}"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA PRIVATE KEY-----", REDACTED),
    # What a reader needs of a failure is left alone.
    ("KeyError: 'lr'", "KeyError: 'lr'"),
    ("torch.OutOfMemoryError: CUDA out of memory", "torch.OutOfMemoryError: CUDA out of memory"),
    ("commit 3f2a9d8e7c6b5a4938271605f4e3d2c1b0a99887", "commit 3f2a9d8e7c6b5a4938271605f4e3d2c1b0a99887"),
    ('File "/runs/my-token-run/train.py", line 8, in main', 'File "/runs/my-token-run/train.py", line 8, in main'),
    ("sort_key = len", "sort_key = len".replace("len", REDACTED)),  # a name that ends in key: over, not under
])
def test_redact(text: str, expected: str) -> None:
    assert redact(text, [HELD]) == expected
    assert redact(expected, [HELD]) == expected  # idempotent


def test_short_held_values_are_not_searched() -> None:
    assert redact("step 1234 of abc", ["abc", "1234"]) == "step 1234 of abc"


def test_redact_model_redacts_what_ranks_wrote_and_nothing_the_agent_made() -> None:
    event = WatchEvent(kind=WatchEventKind.RANK_EXITED, node="node-a", detected_at=1.0, detail=f"rank 0: {HELD}",
                       log_tail=f"print {HELD}", failure_signature=f"t.py:1 in m: E: {HELD}",
                       log_path=f"/w/runs/{HELD}/rank-00000.log",
                       evidence=[RankEvidence(node="node-a", rank=0, innermost=f"t.py:1 in {HELD}")])

    clean = redact_model(event, [HELD])

    assert HELD not in clean.detail + clean.log_tail + (clean.failure_signature or "") + clean.evidence[0].innermost
    assert clean.log_path == event.log_path and clean.kind is WatchEventKind.RANK_EXITED
    assert HELD in event.detail  # a copy: the original is untouched


def test_redact_model_redacts_every_text_but_the_identifiers_the_workflow_acts_on() -> None:
    """Issue 40 finding 4: a token in a KEEPALIVE's `upload_error` or a FINISHED's `state_digest` (the script
    hands the digest in) reached the run's status, the Web UI and its result unredacted."""
    event = WatchEvent(kind=WatchEventKind.KEEPALIVE, node="node-a", upload_error=f"ClientError: token {HELD}",
                       state_digest=f"sha256:{HELD}", restore_tiers=["s3"],
                       evidence=[RankEvidence(node="node-a", rank=0, state=f"S {HELD}",
                                              stacks_key="runs/r/incidents/1/rank-0.txt")])
    download = DownloadShardsResult(restore_dir="/w/runs/r/restore/step-5", tiers={0: f"s3 {HELD}"})

    clean, clean_download = redact_model(event, [HELD]), redact_model(download, [HELD])

    assert HELD not in f"{clean.upload_error} {clean.state_digest} {clean.evidence[0].state}"
    assert clean.upload_error == f"ClientError: token {REDACTED}"
    assert HELD not in clean_download.tiers[0]
    # What the workflow acts on arrives as the agent made it.
    assert clean.node == "node-a" and clean.evidence[0].stacks_key == event.evidence[0].stacks_key
    assert clean_download.restore_dir == download.restore_dir and clean.restore_tiers == ["s3"]


@pytest.fixture
def held_secret() -> Iterator[str]:
    hold_agent_secrets({"TRAINGUARD_PEER_TOKEN": HELD})
    yield HELD
    forget_agent_secrets()


@activity.defn(name="report_upload_trouble")
async def report_upload_trouble(node: str) -> WatchEvent:
    # An activity that forgot to redact: the node's worker must redact for it.
    return WatchEvent(kind=WatchEventKind.KEEPALIVE, node=node, upload_error=f"store said: peer token {HELD}")


@activity.defn(name="fail_with_rank_text")
async def fail_with_rank_text(node: str) -> None:
    try:
        raise OSError(f"the rank wrote {HELD}")
    except OSError as error:
        raise ApplicationError(f"launch failed on {node}: {HELD}", type="LaunchFailed",
                               non_retryable=True) from error


@workflow.defn(sandboxed=False)
class CallNodeActivity:
    @workflow.run
    async def run(self, name: str) -> WatchEvent | None:
        return await workflow.execute_activity(  # type: ignore[no-any-return]
            name, "node-a", start_to_close_timeout=timedelta(seconds=10),
            retry_policy=RetryPolicy(maximum_attempts=1), result_type=WatchEvent)


async def test_a_node_workers_results_and_failures_leave_it_redacted(env: WorkflowEnvironment,
                                                                      held_secret: str) -> None:
    """Every node activity's result and failure passes `RedactNodeResults`, whatever the activity redacted."""
    queue = f"redact-{uuid4()}"
    async with Worker(env.client, task_queue=queue, workflows=[CallNodeActivity],
                      activities=[report_upload_trouble, fail_with_rank_text], interceptors=[RedactNodeResults()]):
        event = await env.client.execute_workflow(CallNodeActivity.run, "report_upload_trouble", id=f"r-{uuid4()}",
                                                  task_queue=queue, result_type=WatchEvent)
        with pytest.raises(WorkflowFailureError) as failed:
            await env.client.execute_workflow(CallNodeActivity.run, "fail_with_rank_text", id=f"r-{uuid4()}",
                                              task_queue=queue)

    assert event is not None and event.upload_error == f"store said: peer token {REDACTED}"
    assert event.node == "node-a"
    activity_error = failed.value.cause
    assert isinstance(activity_error, ActivityError)
    error = activity_error.cause
    assert isinstance(error, ApplicationError)
    assert error.message == f"launch failed on node-a: {REDACTED}"
    assert error.type == "LaunchFailed" and error.non_retryable
    assert isinstance(error.cause, ApplicationError) and error.cause.message == f"the rank wrote {REDACTED}"
    assert error.cause.type == "OSError"


def test_the_node_agent_worker_redacts(tmp_path: Path, env: WorkflowEnvironment) -> None:
    from workers.node_agent import build_worker

    worker, _ = build_worker(env.client, "node-a", tmp_path, "127.0.0.1", tmp_path, peer_tier=False)
    assert any(isinstance(i, RedactNodeResults) for i in worker.config()["interceptors"])


def test_run_as_refuses_root_and_unknown_users() -> None:
    with pytest.raises(ValueError, match="is root"):
        RunAs.named("root")
    with pytest.raises(ValueError, match="no such user"):
        RunAs.named("no-such-user-here")


def test_unreachable_names_the_folder_a_user_cannot_pass(open_dir: Path) -> None:
    closed = open_dir / "closed"
    (closed / "inner").mkdir(parents=True)
    closed.chmod(0o700)
    other = RunAs("other", uid=os.getuid() + 12345, gid=os.getgid() + 12345)

    assert other.unreachable(closed / "inner") == closed
    assert other.unreachable(open_dir / "missing") == open_dir / "missing"
    closed.chmod(0o711)
    assert other.unreachable(closed / "inner", os.X_OK) is None
