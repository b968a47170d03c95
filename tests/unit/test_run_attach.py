"""`trainguard run start` under a running run's id (issue 40 finding 6b): a requeued Slurm job finds its own run
again, and a run someone created ahead under the next job's id, with a spec of their own, is not taken over."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from temporalio.exceptions import WorkflowAlreadyStartedError

from trainguard import cli
from trainguard.client import TrainguardClient, load_spec
from trainguard.run_attach import RunAttachRefused, start_memo


SPEC = {"entrypoint": ["python", "train.py"], "nodes": ["node-0"]}
JOB = {"SLURM_JOB_ID": "4243", "SLURM_JOB_USER": "alice", "SLURM_CLUSTER_NAME": "c1"}


class Starts:
    """Temporal as the client sees it: the runs running (id -> memo), and the starts asked."""

    def __init__(self, running: dict[str, dict[str, Any]]) -> None:
        self.running, self.started = running, []  # type: list[dict[str, Any]]

    async def start_workflow(self, _type: str, spec: dict[str, Any], **kwargs: Any) -> None:
        if kwargs["id"] in self.running:
            raise WorkflowAlreadyStartedError(kwargs["id"], _type)
        self.started.append({"spec": spec, "memo": kwargs.get("memo")})


def fake_temporal(monkeypatch: pytest.MonkeyPatch, running: dict[str, dict[str, Any]]) -> Starts:
    starts = Starts(running)

    class Client(TrainguardClient):
        async def earlier_run(self, workflow_id: str) -> str | None:
            return None

        async def running_memo(self, workflow_id: str) -> dict[str, Any] | None:
            return starts.running.get(workflow_id)

        async def running(self, workflow_id: str) -> bool:
            return workflow_id in starts.running

        async def controller_running(self, max_idle_s: float = 90.0) -> bool:
            return True

    async def fake_connect(*_args: object, **_kwargs: object) -> TrainguardClient:
        return Client(starts)  # type: ignore[arg-type]

    monkeypatch.setattr(TrainguardClient, "connect", fake_connect)
    return starts


def in_job(monkeypatch: pytest.MonkeyPatch, job: dict[str, str]) -> None:
    for name, value in job.items():
        monkeypatch.setenv(name, value)


def start(tmp_path: Path, *extra: str, spec: dict[str, Any] | None = None) -> int:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec or SPEC))
    return cli.main(["run", "start", str(path), "--id", "slurm-4243", *extra])


def test_a_run_created_ahead_with_another_spec_is_not_taken_over(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    ahead = load_spec({"entrypoint": ["python", "steal.py"], "nodes": ["node-0"], "env": {"X": "1"}})
    starts = fake_temporal(monkeypatch, {"slurm-4243": start_memo(ahead, JOB)})  # forged: its job is 4243 too
    in_job(monkeypatch, JOB)

    assert start(tmp_path) == 2
    out = capsys.readouterr()
    assert out.out == "" and starts.started == []
    assert "run slurm-4243 is running and is not this start's: its spec differs in entrypoint, env" in out.err


def test_another_allocation_is_not_attached_to(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    ahead = load_spec({**SPEC, "nodes": ["node-7"]})
    fake_temporal(monkeypatch, {"slurm-4243": start_memo(ahead, JOB)})
    in_job(monkeypatch, JOB)

    assert start(tmp_path, "--nodes", "node-0") == 2
    assert "its spec differs in nodes" in capsys.readouterr().err


def test_a_run_of_another_slurm_job_is_not_attached_to(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    fake_temporal(monkeypatch, {"slurm-4243": start_memo(load_spec(SPEC), {**JOB, "SLURM_JOB_ID": "4242"})})
    in_job(monkeypatch, JOB)

    assert start(tmp_path) == 2
    assert ("it was started in Slurm job 4242 of user alice on cluster c1, this start in Slurm job 4243 of user "
            "alice on cluster c1") in capsys.readouterr().err


def test_a_run_started_outside_trainguard_run_start_is_not_attached_to(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    fake_temporal(monkeypatch, {"slurm-4243": {}})  # `temporal workflow start --workflow-id slurm-4243`
    in_job(monkeypatch, JOB)

    assert start(tmp_path) == 2
    assert "records no spec of its start" in capsys.readouterr().err


def test_a_requeued_job_attaches_to_its_own_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    starts = fake_temporal(monkeypatch, {})
    in_job(monkeypatch, JOB)
    assert start(tmp_path, "--nodes", "node-0,node-1") == 0  # the job's first start records what it started
    [first] = starts.started
    starts.running["slurm-4243"] = first["memo"]
    capsys.readouterr()

    assert start(tmp_path, "--nodes", "node-0,node-1") == 0  # the requeued job: same script, same job
    out = capsys.readouterr()
    assert out.out.strip() == "slurm-4243" and "attached to it" in out.err and len(starts.started) == 1


async def test_the_python_client_refuses_to_attach_to_another_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    ahead = load_spec({**SPEC, "entrypoint": ["python", "steal.py"]})
    starts = Starts({"slurm-4243": start_memo(ahead, JOB)})
    in_job(monkeypatch, JOB)

    class Client(TrainguardClient):
        async def earlier_run(self, workflow_id: str) -> str | None:
            return None

        async def running_memo(self, workflow_id: str) -> dict[str, Any] | None:
            return starts.running.get(workflow_id)

        async def running(self, workflow_id: str) -> bool:
            return workflow_id in starts.running

    with pytest.raises(RunAttachRefused, match="its spec differs in entrypoint"):
        await Client(starts).start_run(SPEC, workflow_id="slurm-4243")  # type: ignore[arg-type]
