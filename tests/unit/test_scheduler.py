"""The scheduler hook: what Slurm and Kubernetes are told, run against a stand-in executable that records
its argv, and the environment switch that keeps the hook off by default."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.scheduler import (
    HOOK_OFF,
    KubernetesScheduler,
    NoScheduler,
    NotifySchedulerInput,
    NotifySchedulerResult,
    SchedulerAction,
    SchedulerActivities,
    SchedulerCommandFailed,
    SchedulerConfigError,
    SlurmScheduler,
    scheduler_from_env,
    slurm_reason,
    taint_value,
)

STAND_IN = """\
#!{python}
# Records its argv; fails when STAND_IN_FAIL names a substring of the call (stderr STAND_IN_STDERR).
import json, os, sys, time
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
fail = os.environ.get("STAND_IN_FAIL")
if fail and fail in " ".join(sys.argv[1:]):
    sys.stderr.write(os.environ.get("STAND_IN_STDERR", "boom") + "\\n")
    sys.exit(1)
time.sleep(float(os.environ.get("STAND_IN_SLEEP_S", "0")))
"""


@pytest.fixture
def stand_in(tmp_path: Path) -> tuple[Path, Path]:
    """A scheduler CLI stand-in and the file it appends each call's argv (as JSON) to."""
    calls = tmp_path / "calls.jsonl"
    exe = tmp_path / "stand-in"
    exe.write_text(STAND_IN.format(python=sys.executable, log=str(calls)))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe, calls


def recorded(calls: Path) -> list[list[str]]:
    if not calls.exists():
        return []
    return [json.loads(line) for line in calls.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------- slurm


def test_slurm_cordon_drains_the_node(stand_in: tuple[Path, Path]) -> None:
    exe, calls = stand_in

    ran = SlurmScheduler(executable=str(exe)).cordon("gpu-17", "node_unresponsive: no heartbeat for 10s")

    assert recorded(calls) == [
        ["update", "nodename=gpu-17", "state=drain", "reason=trainguard: node_unresponsive: no heartbeat for 10s"]
    ]
    assert ran == [[str(exe), *recorded(calls)[0]]]


def test_slurm_uncordon_resumes_the_node(stand_in: tuple[Path, Path]) -> None:
    exe, calls = stand_in

    SlurmScheduler(executable=str(exe)).uncordon("gpu-17")

    assert recorded(calls) == [["update", "nodename=gpu-17", "state=resume"]]


def test_slurm_cordon_twice_tells_slurm_twice_and_succeeds(stand_in: tuple[Path, Path]) -> None:
    exe, calls = stand_in
    slurm = SlurmScheduler(executable=str(exe))

    slurm.cordon("gpu-17", "gpu_unhealthy")
    slurm.cordon("gpu-17", "gpu_unhealthy")

    assert recorded(calls)[0] == recorded(calls)[1]


def test_slurm_uncordon_of_a_node_not_drained_is_done(stand_in: tuple[Path, Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    exe, _ = stand_in
    monkeypatch.setenv("STAND_IN_FAIL", "state=resume")
    monkeypatch.setenv("STAND_IN_STDERR", "slurm_update error: Invalid node state specified")

    assert SlurmScheduler(executable=str(exe)).uncordon("gpu-17") == [
        [str(exe), "update", "nodename=gpu-17", "state=resume"]
    ]


def test_slurm_unknown_node_is_a_config_error(stand_in: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    exe, _ = stand_in
    monkeypatch.setenv("STAND_IN_FAIL", "state=drain")
    monkeypatch.setenv("STAND_IN_STDERR", "slurm_update error: Invalid node name specified")

    with pytest.raises(SchedulerConfigError, match="Slurm has no such node"):
        SlurmScheduler(executable=str(exe)).cordon("gpu-99", "x")


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        pytest.param("", "trainguard: cordoned", id="empty"),
        pytest.param("line one\nline two\t tabbed", "trainguard: line one line two tabbed", id="one-line"),
        pytest.param("x" * 500, "trainguard: " + "x" * 188, id="bounded"),
    ],
)
def test_slurm_reason(reason: str, expected: str) -> None:
    assert slurm_reason(reason) == expected


# ----------------------------------------------------------------------------------------- kubernetes


def test_kubernetes_cordon_cordons_and_taints(stand_in: tuple[Path, Path]) -> None:
    exe, calls = stand_in

    ran = KubernetesScheduler(executable=str(exe)).cordon("gpu-17", "gpu_unhealthy: GPU 0: 3 uncorrectable ECC")

    assert recorded(calls) == [
        ["cordon", "gpu-17"],
        ["taint", "nodes", "gpu-17", "trainguard.io/unhealthy=gpu_unhealthy:NoSchedule", "--overwrite"],
    ]
    assert [argv[0] for argv in ran] == [str(exe), str(exe)]


def test_kubernetes_uncordon_uncordons_and_removes_the_taint(stand_in: tuple[Path, Path]) -> None:
    exe, calls = stand_in

    KubernetesScheduler(executable=str(exe)).uncordon("gpu-17")

    assert recorded(calls) == [["uncordon", "gpu-17"], ["taint", "nodes", "gpu-17", "trainguard.io/unhealthy-"]]


def test_kubernetes_uncordon_without_the_taint_is_done(stand_in: tuple[Path, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    exe, calls = stand_in
    monkeypatch.setenv("STAND_IN_FAIL", "taint")
    monkeypatch.setenv("STAND_IN_STDERR", 'error: taint "trainguard.io/unhealthy" not found')

    KubernetesScheduler(executable=str(exe)).uncordon("gpu-17")

    assert len(recorded(calls)) == 2


def test_kubernetes_unknown_node_is_a_config_error(stand_in: tuple[Path, Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    exe, calls = stand_in
    monkeypatch.setenv("STAND_IN_FAIL", "cordon")
    monkeypatch.setenv("STAND_IN_STDERR", 'Error from server (NotFound): nodes "gpu-99" not found')

    with pytest.raises(SchedulerConfigError, match="Kubernetes has no such node"):
        KubernetesScheduler(executable=str(exe)).cordon("gpu-99", "x")
    assert recorded(calls) == [["cordon", "gpu-99"]]  # no taint after a failed cordon


def test_kubernetes_api_error_fails_the_command(stand_in: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    exe, _ = stand_in
    monkeypatch.setenv("STAND_IN_FAIL", "taint")
    monkeypatch.setenv("STAND_IN_STDERR", "Unable to connect to the server: dial tcp: i/o timeout")

    with pytest.raises(SchedulerCommandFailed, match="exited 1: Unable to connect"):
        KubernetesScheduler(executable=str(exe)).cordon("gpu-17", "x")


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        pytest.param("node_unresponsive: watch heartbeat timed out", "node_unresponsive", id="kind"),
        pytest.param("GPU checks failed: GPU 0: hot", "GPU-checks-failed", id="spaces"),
        pytest.param("", "cordoned", id="empty"),
        pytest.param("!!!", "cordoned", id="nothing-left"),
        pytest.param("-drained by ops-", "drained-by-ops", id="alnum-ends"),
        pytest.param("a" * 100, "a" * 63, id="bounded"),
    ],
)
def test_taint_value_is_a_valid_label_value(reason: str, expected: str) -> None:
    assert taint_value(reason) == expected


# ------------------------------------------------------------------------------------- command failures


def test_missing_executable_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(SchedulerConfigError, match="TRAINGUARD_SCHEDULER_COMMAND"):
        SlurmScheduler(executable=str(tmp_path / "no-scontrol")).cordon("gpu-17", "x")


def test_a_command_that_hangs_times_out(stand_in: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    exe, _ = stand_in
    monkeypatch.setenv("STAND_IN_SLEEP_S", "5")

    with pytest.raises(SchedulerCommandFailed, match="no answer within"):
        SlurmScheduler(executable=str(exe), timeout_s=0.5).cordon("gpu-17", "x")


# ------------------------------------------------------------------------------------------ from env


def test_hook_is_off_by_default() -> None:
    assert isinstance(scheduler_from_env({}), NoScheduler)
    assert isinstance(scheduler_from_env({"TRAINGUARD_SCHEDULER": "none"}), NoScheduler)
    assert isinstance(scheduler_from_env({"TRAINGUARD_SCHEDULER": ""}), NoScheduler)


@pytest.mark.parametrize(
    ("value", "kind", "executable"),
    [
        pytest.param("slurm", SlurmScheduler, "scontrol", id="slurm"),
        pytest.param("kubernetes", KubernetesScheduler, "kubectl", id="kubernetes"),
        pytest.param(" Kubernetes ", KubernetesScheduler, "kubectl", id="case-and-space"),
    ],
)
def test_scheduler_from_env(value: str, kind: type, executable: str) -> None:
    scheduler = scheduler_from_env({"TRAINGUARD_SCHEDULER": value})

    assert isinstance(scheduler, kind)
    assert scheduler.executable == executable  # type: ignore[attr-defined]


def test_scheduler_command_overrides_the_executable() -> None:
    scheduler = scheduler_from_env({"TRAINGUARD_SCHEDULER": "slurm",
                                    "TRAINGUARD_SCHEDULER_COMMAND": "/opt/slurm/bin/scontrol"})

    assert scheduler.executable == "/opt/slurm/bin/scontrol"  # type: ignore[attr-defined]


def test_unknown_scheduler_is_refused() -> None:
    with pytest.raises(SchedulerConfigError, match="TRAINGUARD_SCHEDULER='pbs'"):
        scheduler_from_env({"TRAINGUARD_SCHEDULER": "pbs"})


def test_activities_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAINGUARD_SCHEDULER", raising=False)
    assert isinstance(SchedulerActivities().scheduler, NoScheduler)

    monkeypatch.setenv("TRAINGUARD_SCHEDULER", "slurm")
    assert isinstance(SchedulerActivities().scheduler, SlurmScheduler)


# ------------------------------------------------------------------------------------------ activity


async def test_activity_with_the_hook_off_runs_nothing() -> None:
    result = await ActivityEnvironment().run(
        SchedulerActivities(NoScheduler()).notify_scheduler,
        NotifySchedulerInput(node="gpu-17", action=SchedulerAction.CORDON, reason="x"),
    )

    assert result == NotifySchedulerResult(scheduler="none", commands=[], detail=HOOK_OFF)


async def test_activity_cordons_through_the_scheduler(stand_in: tuple[Path, Path]) -> None:
    exe, calls = stand_in
    activities = SchedulerActivities(KubernetesScheduler(executable=str(exe)))

    result = await ActivityEnvironment().run(
        activities.notify_scheduler,
        NotifySchedulerInput(node="gpu-17", action=SchedulerAction.CORDON, reason="node_unresponsive: x",
                             run_id="my-run"),
    )

    assert result.scheduler == "kubernetes"
    assert result.detail == "kubernetes: cordon gpu-17"
    assert [argv[1:] for argv in result.commands] == recorded(calls)


async def test_activity_uncordons_through_the_scheduler(stand_in: tuple[Path, Path]) -> None:
    exe, calls = stand_in
    activities = SchedulerActivities(SlurmScheduler(executable=str(exe)))

    result = await ActivityEnvironment().run(
        activities.notify_scheduler, NotifySchedulerInput(node="gpu-17", action=SchedulerAction.UNCORDON)
    )

    assert recorded(calls) == [["update", "nodename=gpu-17", "state=resume"]]
    assert result.detail == "slurm: uncordon gpu-17"


async def test_activity_failure_is_retryable(stand_in: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    exe, _ = stand_in
    monkeypatch.setenv("STAND_IN_FAIL", "drain")
    monkeypatch.setenv("STAND_IN_STDERR", "slurm_load_node error: Unable to contact slurm controller")

    with pytest.raises(ApplicationError) as raised:
        await ActivityEnvironment().run(
            SchedulerActivities(SlurmScheduler(executable=str(exe))).notify_scheduler,
            NotifySchedulerInput(node="gpu-17", action=SchedulerAction.CORDON, reason="x"),
        )

    assert raised.value.type == "SchedulerCommandFailed"
    assert raised.value.non_retryable is False


async def test_activity_config_error_is_not_retried(tmp_path: Path) -> None:
    with pytest.raises(ApplicationError) as raised:
        await ActivityEnvironment().run(
            SchedulerActivities(SlurmScheduler(executable=str(tmp_path / "missing"))).notify_scheduler,
            NotifySchedulerInput(node="gpu-17", action=SchedulerAction.CORDON, reason="x"),
        )

    assert raised.value.type == "SchedulerConfigError"
    assert raised.value.non_retryable is True


@pytest.mark.parametrize("node", ["gpu-[01-04]", "a,b", "--all", "GPU-17", "gpu.example.com", ""])
def test_input_refuses_node_names_a_scheduler_would_expand(node: str) -> None:
    # `scontrol update nodename=a,b` or `gpu-[01-04]` would drain several nodes at once.
    with pytest.raises(ValidationError):
        NotifySchedulerInput(node=node, action=SchedulerAction.CORDON)


def test_input_round_trips_as_json() -> None:
    request = NotifySchedulerInput(node="gpu-17", action=SchedulerAction.CORDON, reason="r", run_id="my-run")

    assert request.model_dump(mode="json")["action"] == "cordon"
    assert NotifySchedulerInput.model_validate_json(request.model_dump_json()) == request
