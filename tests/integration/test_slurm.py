"""trainguard on a real Slurm cluster (`trainguard dev up --slurm`): slurmctld, four `slurmd -N` emulated nodes
and a munged of the stack's own, beside its Temporal, store and controller (the scheduler hook on). Every run is
`examples/slurm/train.sbatch` submitted with `sbatch`: its agents are started by `srun`, its faults are dealt
the Slurm way (signals by PID, a killed slurmd, `scontrol update`, `scontrol requeue`).

`examples/slurm/cluster.sbatch`, the script for GPU clusters with time limits, runs here too, its GPU request
off (`SBATCH_GPUS_PER_NODE=0`: the emulated nodes have no gres).

Skipped, saying why, without Slurm (Debian's slurm-wlm slurmctld slurmd munge slurm-client: `make slurm-install`)
or without root. The stack is checked at the end like the session stack: nothing it or its jobs started runs on.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from infra import harness
from infra.harness import Irregular
from trainguard.client import TrainguardClient
from trainguard.dev_slurm import SlurmCluster, unavailable_reason
from trainguard.devstack import SLURM_NODES, DevStack
from trainguard.models import IncidentKind, RunResult, RunStatus
from trainguard.pool import wait_for_agents
from trainguard.protocol import RunLayout
from trainguard.settings import Settings

from .conftest import REPO, RUN_TIMEOUT_S, activity_failures, checkpointed, wait_until
from .ft_logs import check_groups, group_ready

pytestmark = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=f"no Slurm cluster can run here: {unavailable_reason()}")

SCRIPT = REPO / "examples" / "slurm" / "train.sbatch"
CLUSTER_SCRIPT = REPO / "examples" / "slurm" / "cluster.sbatch"
NO_GPUS = {"SBATCH_GPUS_PER_NODE": "0"}
"""The emulated nodes have no GPUs (no gres): the cluster script's `--gpus-per-node` request, turned off."""
QUICKSTART = REPO / "examples" / "quickstart.json"
SLURMD_TIMEOUT_S = 10
"""Short, so a killed slurmd's node is down in ~15 s, not PLATFORM.md's ~35 s (SlurmdTimeout=30)."""
Reference = asyncio.Task[str]
"""The quickstart's digest on the dev stack, computed beside the first job (`quickstart_digest`): awaited."""
JOB_END_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


@pytest.fixture(scope="module")
def slurm_stack() -> Iterator[DevStack]:
    home = REPO / ".pytest-stack" / f"slurm-{uuid.uuid4().hex[:8]}"
    lines: list[str] = []
    main_address = os.environ.get(harness.ADDRESS_ENV)
    private = harness.PrivateStack(
        home, SLURM_NODES, 27600, keep_logs=harness.kept_logs_dir(home), echo=lines.append,
        # The session stack's address stays the environment's: this module's client is pointed here explicitly.
        env={harness.ADDRESS_ENV: main_address},
        up=lambda dev: dev.up(echo=lines.append))
    private.config = private.stack.config = _slurm_config(private.config)
    private.stack = DevStack(private.config)
    with private as dev:
        yield dev
    strays = [line for line in lines if "its jobs left" in line or "still live" in line]
    assert not private.leftovers, f"processes survived dev down: {private.leftovers}"
    assert not strays, f"Slurm jobs left processes behind: {strays}"


def _slurm_config(config):  # type: ignore[no-untyped-def]
    import dataclasses

    return dataclasses.replace(config, slurm=True, slurmd_timeout_s=SLURMD_TIMEOUT_S)


@pytest.fixture(scope="module")
async def slurm_client(slurm_stack: DevStack) -> AsyncIterator[TrainguardClient]:
    yield await TrainguardClient.connect(Settings.from_env({**os.environ, **slurm_stack.client_env()}))


@pytest.fixture
def cluster(slurm_stack: DevStack) -> Iterator[SlurmCluster]:
    """The stack's Slurm cluster; after each test: its jobs cancelled, its slurmds up, every node resumed."""
    cluster: SlurmCluster = slurm_stack.slurm
    yield cluster
    cluster.cancel_jobs(lambda _line: None)
    assert not cluster.live_jobs(), "a job outlived scancel"
    for node in cluster.nodes:
        if not slurm_stack._alive(f"slurmd-{node}"):
            slurm_stack._spawn(f"slurmd-{node}", cluster.slurmd_argv(node), env={**os.environ, **cluster.env()})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = cluster.node_states()
        for node, info in states.items():
            if {"DRAIN", "DOWN"} & set(info["state"]) and "NOT_RESPONDING" not in info["state"]:
                cluster.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
        if all(info["state"] == ["IDLE"] for info in cluster.node_states().values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"nodes not idle after the test: {cluster.node_states()}")


def submit(stack: DevStack, spec: dict[str, object] | None = None, script: Path = SCRIPT,
           options: tuple[str, ...] = (), **env: str) -> int:
    """sbatch an example script (with sbatch `options`) from the checkout, as a platform team would, with the
    stack's settings in the environment; its agents' folders under the stack's home (so the stack's rank scans
    find their ranks)."""
    extra = {"TRAINGUARD_WORKDIR": str(stack.home / "nodes"), "TRAINGUARD_LOGS": str(stack.slurm.log_dir), **env}
    if spec is not None:
        path = stack.home / f"spec-{uuid.uuid4().hex[:6]}.json"
        path.write_text(json.dumps(spec))
        extra["TRAINGUARD_SPEC"] = str(path)
    done = subprocess.run(["sbatch", "--parsable", f"--output={stack.slurm.log_dir}/job-%j.out", *options,
                           str(script)], capture_output=True, text=True, timeout=30, check=False, cwd=REPO,
                          env={**stack.worker_env(), **extra})
    if done.returncode:
        raise AssertionError(f"sbatch failed: {done.stderr}")
    return int(done.stdout.strip().split(";")[0])


def quick_spec(step_time: float = 0.05) -> dict[str, object]:
    """The quickstart's spec, with tighter hang bounds (a stopped rank is named in seconds) and shorter steps (the
    step time is a sleep standing in for compute): same training, same digest."""
    spec = json.loads(QUICKSTART.read_text())
    entrypoint = spec["entrypoint"]
    entrypoint[entrypoint.index("--step-time") + 1] = str(step_time)
    spec["health"] = {"hang_floor_s": 5.0}
    return spec


def job_state(cluster: SlurmCluster, job: int) -> str:
    for entry in cluster.jobs():
        if int(entry["job_id"]) == job:
            return str(entry.get("job_state", "")).upper()
    return "GONE"


async def job_ends(cluster: SlurmCluster, job: int, timeout_s: float = RUN_TIMEOUT_S) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = await asyncio.to_thread(job_state, cluster, job)
        if state in JOB_END_STATES or state == "GONE":
            return state
        await asyncio.sleep(0.5)
    raise AssertionError(f"job {job} still {state} after {timeout_s:.0f}s")


async def run_started(client: TrainguardClient, run_id: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            await client.handle(run_id).describe()
            return
        except Exception:  # noqa: BLE001 - not started yet (NOT_FOUND)
            await asyncio.sleep(0.5)
    raise AssertionError(f"{run_id} not started within {timeout_s:.0f}s")


def job_log(cluster: SlurmCluster, job: int) -> str:
    try:
        return (cluster.log_dir / f"job-{job}.out").read_text()[-3000:]
    except OSError:
        return "(no job log)"


async def finished(client: TrainguardClient, cluster: SlurmCluster, job: int, job_ends_too: bool = True) -> RunResult:
    run_id = f"slurm-{job}"
    await run_started(client, run_id)
    try:
        result = await asyncio.wait_for(client.result(run_id), RUN_TIMEOUT_S)
    except Exception as error:
        raise AssertionError(f"{run_id}: {error}; activity failures {await activity_failures(client, run_id)}; "
                             f"job log:\n{job_log(cluster, job)}") from error
    if job_ends_too:
        assert await job_ends(cluster, job) == "COMPLETED", job_log(cluster, job)
    return result


def agent_pid(cluster: SlurmCluster, node: str) -> int:
    """The node agent `srun` started on `node`, found in /proc by the environment Slurm gave its task."""
    marker = f"SLURMD_NODENAME={node}".encode()
    for pid in cluster.stray_processes():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"workers.node_agent" in cmdline and marker in environ:
            return pid
    raise AssertionError(f"no node agent found on {node}")


def node_processes(cluster: SlurmCluster, node: str) -> list[int]:
    """Every process the cluster's jobs run on `node` (its tasks carry `SLURMD_NODENAME`), and the slurmstepds
    above them."""
    marker = f"SLURMD_NODENAME={node}".encode()
    found: set[int] = set()
    for pid in cluster.stray_processes():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[1])
        except OSError:
            continue
        if marker in environ:
            found.add(pid)
            if parent in cluster.stray_processes() and marker not in Path(f"/proc/{parent}/environ").read_bytes():
                found.add(parent)  # the slurmstepd of this task's step on the node
    return sorted(found)


def lose_node(stack: DevStack, node: str) -> None:
    """The node dies the way a Slurm node does: everything of the job on it (its agent, its ranks, the step
    daemons above them; on the batch host the batch script) and its slurmd, SIGKILLed by PID."""
    cluster: SlurmCluster = stack.slurm
    pids = [agent_pid(cluster, node), *node_processes(cluster, node),
            *(r.pid for r in harness.scan_ranks(stack.home) if r.node == node)]
    slurmd = stack._alive(f"slurmd-{node}")
    assert slurmd, f"slurmd of {node} not running"
    # All at once, as a power loss would: frozen first, so no process of the node (the batch step's daemon above
    # the batch script, say) sees another die and tells slurmctld the job is over before it is killed itself.
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in [slurmd, *reversed(pids)]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


async def node_state(cluster: SlurmCluster, node: str, want: set[str], timeout_s: float = 90) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = (await asyncio.to_thread(cluster.node_states))[node]
        if want <= set(info["state"]):
            return info
        await asyncio.sleep(0.5)
    raise AssertionError(f"{node} not {want} within {timeout_s:.0f}s: {info}")


def training_on(nodes: set[str], past_step: int, min_attempt: int = 2):  # type: ignore[no-untyped-def]
    """A view predicate: a later attempt trains on exactly `nodes`, past `past_step`."""
    return lambda v: (v.status.attempt >= min_attempt and v.status.phase.value == "running"
                      and set(v.status.nodes) == nodes and v.live_step > past_step)


def recovered(kind: IncidentKind, nodes: set[str] | None = None):  # type: ignore[no-untyped-def]
    """A view predicate: the run's latest `kind` incident is over (its next attempt took its first step),
    on exactly `nodes` when given. Steps alone can be the previous attempt's, still in the watch's heartbeats."""
    def check(view) -> bool:  # type: ignore[no-untyped-def]
        found = [i for i in view.status.incidents if i.kind is kind]
        return bool(found) and found[-1].recovery_s is not None and view.status.phase.value == "running" \
            and (nodes is None or set(view.status.nodes) == nodes)
    return check


def job_entry(cluster: SlurmCluster, job: int) -> dict[str, object]:
    return next(j for j in cluster.jobs() if int(j["job_id"]) == job)


async def count_runs(client: TrainguardClient, run_id: str) -> int:
    return len([e async for e in client.client.list_workflows(f"WorkflowId = '{run_id}'")])


@pytest.fixture(scope="module")
async def quickstart_digest(slurm_stack: DevStack, slurm_client: TrainguardClient) -> AsyncIterator[Reference]:
    """The quickstart's final state digest on the dev stack, without Slurm, run beside the first test's job: three
    node agents of the stack's own (named apart from Slurm's nodes) run it, and stop once it is done. Tests
    `await` it."""
    async def reference() -> str:
        names, since = [f"ref-{index}" for index in range(3)], time.time()
        for node in names:
            workdir = slurm_stack.home / "nodes" / node
            workdir.mkdir(parents=True, exist_ok=True)
            slurm_stack._spawn(f"agent-{node}", [
                sys.executable, "-m", "workers.node_agent", "--node", node, "--workdir", str(workdir), "--host",
                "127.0.0.1", "--allow", str(Path(sys.executable).parent)], env=slurm_stack.worker_env(), cwd=REPO)
        try:
            assert not await wait_for_agents(slurm_client.client, names, since, timeout_s=120), "agents not up"
            spec = {**json.loads(QUICKSTART.read_text()), "nodes": names[:2], "spare_nodes": names[2:]}
            run_id = await slurm_client.start_run(spec, workflow_id=f"quickstart-{uuid.uuid4().hex[:8]}")
            digest = (await asyncio.wait_for(slurm_client.result(run_id), RUN_TIMEOUT_S)).final_state_digest
        finally:
            await asyncio.to_thread(slurm_stack.stop, [f"agent-{node}" for node in names], lambda _line: None)
        assert digest
        return digest

    task = asyncio.ensure_future(reference())
    yield task
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# --------------------------------------------------------------------------------------------------- tests
async def test_the_job_runs_the_quickstart_to_its_digest(slurm_stack: DevStack, slurm_client: TrainguardClient,
                                                          cluster: SlurmCluster, quickstart_digest: Reference) -> None:
    began = time.monotonic()
    job = submit(slurm_stack)
    result = await finished(slurm_client, cluster, job)
    assert result.final_state_digest == await quickstart_digest
    assert result.steps_completed == 300 and result.attempts == 1 and not result.incidents
    print(f"slurm job {job}: submitted to completed in {time.monotonic() - began:.1f}s")


async def test_a_crash_and_a_hang_are_recovered_inside_the_job(
        slurm_stack: DevStack, slurm_client: TrainguardClient, cluster: SlurmCluster,
        quickstart_digest: Reference) -> None:
    job = submit(slurm_stack, quick_spec(), TRAINGUARD_CHAOS="on")  # the agents take `trainguard chaos`
    run_id = f"slurm-{job}"
    await run_started(slurm_client, run_id)
    view = await wait_until(slurm_client, run_id, checkpointed, timeout_s=120)
    await slurm_client.inject_fault(run_id, "crash", "node-1")
    await wait_until(slurm_client, run_id, recovered(IncidentKind.CRASH), 120)
    await slurm_client.inject_fault(run_id, "hang", "node-0")
    result = await finished(slurm_client, cluster, job)
    kinds = [i.kind for i in result.incidents]
    assert IncidentKind.CRASH in kinds and IncidentKind.HANG in kinds, result.incidents
    assert result.final_state_digest == await quickstart_digest
    assert job_entry(cluster, job).get("restart_cnt", 0) == 0, "recovered by a requeue, not inside the job"
    print("crash, hang: detection->first step "
          + ", ".join(f"{i.kind.value} {i.recovery_s}s" for i in result.incidents))


# A lost node that is not the rendezvous host takes the same path with less to move: `make test-slow`.
@pytest.mark.parametrize("lost", [pytest.param("node-1", id="a-node", marks=pytest.mark.slow),
                                  pytest.param("node-0", id="the-rendezvous-host")])
async def test_a_node_lost_the_slurm_way_is_replaced_by_the_allocations_spare(
        slurm_stack: DevStack, slurm_client: TrainguardClient, cluster: SlurmCluster, quickstart_digest: Reference,
        lost: str) -> None:
    """Its agent, ranks and slurmd killed: trainguard moves the run onto the spare and cordons the node, which
    drains it in Slurm naming trainguard and the incident; Slurm marks it down too. Back, and uncordoned by
    `trainguard nodes uncordon`, it is resumed in Slurm."""
    job = submit(slurm_stack, quick_spec())
    run_id = f"slurm-{job}"
    await run_started(slurm_client, run_id)
    view = await wait_until(slurm_client, run_id, checkpointed, timeout_s=120)
    lost_at = time.monotonic()
    lose_node(slurm_stack, lost)
    stays = ({"node-0", "node-1"} - {lost}) | {"node-2"}
    view = await wait_until(slurm_client, run_id, recovered(IncidentKind.NODE_UNRESPONSIVE, stays), 180)
    training_again_s = time.monotonic() - lost_at
    assert lost in view.status.cordoned
    info = await node_state(cluster, lost, {"DRAIN"}, timeout_s=30)
    assert str(info["reason"]).startswith("trainguard: ") and "node_unresponsive" in str(info["reason"]), info
    await node_state(cluster, lost, {"DOWN"}, timeout_s=60)  # Slurm's own view, after SlurmdTimeout
    slurm_down_s = time.monotonic() - lost_at
    # The batch script ran on node 0 and was lost with it: the controller ends the job once its run is done.
    result = await finished(slurm_client, cluster, job, job_ends_too=lost != "node-0")
    if lost == "node-0":
        assert await job_ends(cluster, job, timeout_s=60) == "CANCELLED", job_log(cluster, job)
    assert result.final_state_digest == await quickstart_digest
    assert [i.kind for i in result.incidents] == [IncidentKind.NODE_UNRESPONSIVE], result.incidents
    entry = job_entry(cluster, job)
    assert entry.get("restart_cnt", 0) == 0, "recovered by a requeue, not inside the job"
    assert lost not in str(entry.get("nodes")), f"Slurm still counts {lost} in the job: {entry.get('nodes')}"
    # The node is repaired (its slurmd back), then handed back by the operator: Slurm resumes it.
    slurm_stack._spawn(f"slurmd-{lost}", cluster.slurmd_argv(lost), env={**os.environ, **cluster.env()})
    deadline = time.monotonic() + 60
    while "NOT_RESPONDING" in (await asyncio.to_thread(cluster.node_states))[lost]["state"]:
        assert time.monotonic() < deadline, "slurmd did not register again"
        await asyncio.sleep(0.5)
    done = subprocess.run([str(REPO / ".venv" / "bin" / "trainguard"), "nodes", "uncordon", lost], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env={**os.environ, **slurm_stack.client_env()})
    assert done.returncode == 0, done.stderr
    deadline = time.monotonic() + 60
    while {"DRAIN", "DOWN"} & set((await asyncio.to_thread(cluster.node_states))[lost]["state"]):
        assert time.monotonic() < deadline, f"{lost} not resumed in Slurm: {cluster.node_states()[lost]}"
        await asyncio.sleep(0.5)
    print(f"lost {lost}: training again on the spare after {training_again_s:.1f}s (recovery "
          f"{result.incidents[0].recovery_s}s after detection); Slurm marked it down after {slurm_down_s:.1f}s")


async def test_an_operators_slurm_drain_moves_the_run_off_the_node(
        slurm_stack: DevStack, slurm_client: TrainguardClient, cluster: SlurmCluster,
        quickstart_digest: Reference) -> None:
    # The run must outlast the drain's poll and its next checkpoint.
    job = submit(slurm_stack, quick_spec(step_time=0.1))
    run_id = f"slurm-{job}"
    await run_started(slurm_client, run_id)
    view = await wait_until(slurm_client, run_id, checkpointed, timeout_s=120)
    drained_at = time.monotonic()
    cluster.run("scontrol", "update", "nodename=node-1", "state=drain", "reason=operator: memory test")
    view = await wait_until(slurm_client, run_id, training_on({"node-0", "node-2"}, view.live_step), 120)
    moved_s = time.monotonic() - drained_at
    result = await finished(slurm_client, cluster, job)
    assert result.final_state_digest == await quickstart_digest
    assert cluster.node_states()["node-1"]["reason"] == "operator: memory test"  # the operator's, untouched
    print(f"operator drain: run training off node-1 after {moved_s:.1f}s")


async def test_a_requeued_job_resumes_its_run(
        slurm_stack: DevStack, slurm_client: TrainguardClient, cluster: SlurmCluster,
        quickstart_digest: Reference) -> None:
    job = submit(slurm_stack, quick_spec(step_time=0.1))  # the run must outlast the requeue itself
    run_id = f"slurm-{job}"
    await run_started(slurm_client, run_id)
    view = await wait_until(slurm_client, run_id, lambda v: checkpointed(v, 110), timeout_s=120)
    assert view.status.latest_checkpoint is not None
    committed = view.status.latest_checkpoint.step
    requeued_at = time.monotonic()
    cluster.run("scontrol", "requeue", str(job))
    await wait_until(slurm_client, run_id, recovered(IncidentKind.AGENT_RESTART, {"node-0", "node-1"}), 180)
    training_again_s = time.monotonic() - requeued_at
    result = await finished(slurm_client, cluster, job)
    assert job_entry(cluster, job).get("restart_cnt") == 1, "the job was not requeued"
    assert await count_runs(slurm_client, run_id) == 1, "the requeued job started a second run"
    assert result.final_state_digest == await quickstart_digest
    restarts = [i for i in result.incidents if i.kind is IncidentKind.AGENT_RESTART]
    # From the newest checkpoint committed before the requeue, or one committed while it was under way.
    assert restarts and (restarts[0].resumed_step or 0) >= committed, (committed, result.incidents)
    print(f"requeue: training again after {training_again_s:.1f}s, from step {restarts[0].resumed_step}")


async def executions(client: TrainguardClient, run_id: str) -> list[tuple[str, str]]:
    """(Temporal run id, status) of every execution under the workflow id `run_id`, oldest first."""
    found = [e async for e in client.client.list_workflows(f"WorkflowId = '{run_id}'")]
    return [(e.run_id, (e.status.name if e.status else "RUNNING")) for e in sorted(found, key=lambda e: e.start_time)]


# ~2 min waiting on Slurm's time limit: `make test-slow`. test_a_requeued_job_resumes_its_run keeps a requeue
# resuming the same run in `make test`.
@pytest.mark.slow
async def test_the_cluster_script_requeued_at_its_time_limit_resumes_the_same_run(
        slurm_stack: DevStack, slurm_client: TrainguardClient, cluster: SlurmCluster,
        quickstart_digest: Reference) -> None:
    """examples/slurm/cluster.sbatch: the job is named after the run. At the time-limit signal (`--signal=B:USR1`,
    sent here at once instead of up to a minute off, as Slurm's resolution has it) the job commits a checkpoint,
    ends the run and requeues itself; run again, it resumes the same run id from that checkpoint and ends with
    the uninterrupted run's digest. A job submitted later under the name finds the run done and starts none."""
    run_id = f"chain-{uuid.uuid4().hex[:8]}"
    began = time.monotonic()
    job = submit(slurm_stack, None, CLUSTER_SCRIPT, (f"--job-name={run_id}",), **NO_GPUS)  # the quickstart
    await run_started(slurm_client, run_id)
    view = await wait_until(slurm_client, run_id, checkpointed, timeout_s=120)
    assert view.status.latest_checkpoint is not None
    committed_before = view.status.latest_checkpoint.step
    cluster.run("scancel", "--batch", "--signal=USR1", str(job))
    signalled = time.monotonic()
    deadline = signalled + 180
    while len(found := await executions(slurm_client, run_id)) < 2 or found[-1][1] != "RUNNING":
        assert time.monotonic() < deadline, f"no second execution of {run_id}: {found}; {job_log(cluster, job)}"
        await asyncio.sleep(0.5)
    resumed_s = time.monotonic() - signalled
    result = await finished_execution(slurm_client, cluster, job, run_id)
    first, second = await executions(slurm_client, run_id)
    assert (first[1], second[1]) == ("CANCELED", "COMPLETED")  # one at a time, under one id
    cut = await slurm_client.client.get_workflow_handle(run_id, run_id=first[0]).query("status", result_type=RunStatus)
    assert cut.latest_checkpoint is not None and cut.latest_checkpoint.step > committed_before, \
        "the job did not commit a checkpoint at its time limit"
    # From that checkpoint or a newer one: the ranks train on until the run's end stops them, and a regular
    # checkpoint they reach meanwhile may still commit (the ended run's committer is abandoned, not cancelled, and
    # finishes its pass). Either is a complete checkpoint of this run, and the digest below is the same.
    resumed = (await slurm_client.status(run_id)).status.resumed_step
    assert resumed is not None and resumed >= cut.latest_checkpoint.step, (resumed, cut.latest_checkpoint.step)
    assert result.final_state_digest == await quickstart_digest
    assert result.steps_completed == 300 and not result.incidents, [(i.kind, i.detail) for i in result.incidents]
    assert job_entry(cluster, job).get("restart_cnt") == 1, "the job did not requeue itself"
    assert "near its time limit" in (cluster.log_dir / f"job-{job}.out").read_text()

    again = submit(slurm_stack, None, CLUSTER_SCRIPT, (f"--job-name={run_id}",), **NO_GPUS)
    assert await job_ends(cluster, again, timeout_s=60) == "COMPLETED", job_log(cluster, again)
    assert f"run {run_id} completed in an earlier job" in job_log(cluster, again)
    assert len(await executions(slurm_client, run_id)) == 2, "a job submitted after the run was done started it again"
    print(f"cluster script: checkpointed, ended and requeued at the signal, training again in the requeued job "
          f"{resumed_s:.1f}s later from step {cut.latest_checkpoint.step}; whole test {time.monotonic() - began:.0f}s")


async def finished_execution(client: TrainguardClient, cluster: SlurmCluster, job: int, run_id: str) -> RunResult:
    """The result of the execution running under `run_id` now, and its job completed."""
    try:
        result = await asyncio.wait_for(client.result(run_id), RUN_TIMEOUT_S)
    except Exception as error:
        raise AssertionError(f"{run_id}: {error}; activity failures {await activity_failures(client, run_id)}; "
                             f"job log:\n{job_log(cluster, job)}") from error
    assert await job_ends(cluster, job) == "COMPLETED", job_log(cluster, job)
    return result


# `make test-slow`: the dev stack's test_healthy_irregular.py keeps the irregular script's judgement in
# `make test`, and the other Slurm tests keep launching through the job script.
@pytest.mark.slow
async def test_a_healthy_irregular_job_runs_in_one_attempt_with_no_incident(
        slurm_stack: DevStack, slurm_client: TrainguardClient, cluster: SlurmCluster) -> None:
    """examples/irregular.py through the sbatch path, with the quickstart's settings (the spec's default health):
    10-s evaluations on every rank, a rank-0 save its peers wait for, DataLoader workers started again at an
    epoch boundary, +-50% step jitter. Nothing in it is a hang or a straggler (issue 39)."""
    phases = Irregular()
    spec = {**json.loads(QUICKSTART.read_text()), "entrypoint": phases.argv()}
    assert "health" not in spec  # the defaults a user gets
    job = submit(slurm_stack, spec)
    result = await finished(slurm_client, cluster, job)
    described = "\n".join(f"{i.kind.value} node {i.node} rank {i.rank}: {i.detail}; evidence: "
                          f"{(i.evidence or '-').splitlines()[0]}" for i in result.incidents)
    assert result.attempts == 1 and not result.incidents, described
    assert result.steps_completed == phases.steps
    # The job has ended and its agents with it, so no agent answers a log read: the log is read where rank 0's
    # agent left it, on the node's disk.
    logs = list((slurm_stack.home / "nodes").glob(f"**/{RunLayout.of(Path(), f'slurm-{job}').log_file(1, 0)}"))
    assert len(logs) == 1, logs
    log = logs[0].read_text(errors="replace")
    assert "eval at step 25" in log and "eval at step 50" in log and "save at step 40" in log, log[-3000:]
    assert "epoch from step 30: workers ready" in log, log[-3000:]


async def test_replica_groups_in_the_job_recover_one_group_at_a_time(
        slurm_stack: DevStack, slurm_client: TrainguardClient, cluster: SlurmCluster) -> None:
    """examples/ft.json (3 replica groups of 1 node x 2 ranks, TorchFT) through the project's job script on four
    nodes, the last its spare: a crash in group 1, then group 0's node lost the Slurm way (the batch host). Each
    group recovers alone while the others step on, and the run completes on one digest."""
    spec = {**json.loads((REPO / "examples" / "ft.json").read_text()),
            "entrypoint": ["python", "examples/train_ft.py", "--steps", "600", "--step-time", "0.05", "--log-steps"]}
    job = submit(slurm_stack, spec, options=("--nodes=4",), TRAINGUARD_CHAOS="on")
    run_id = f"slurm-{job}"
    await run_started(slurm_client, run_id)
    try:
        await wait_until(slurm_client, run_id, lambda v: all(group_ready(v, g, 1, 60) for g in range(3)), 180)
        await slurm_client.inject_fault(run_id, "crash", "node-1")
        await wait_until(slurm_client, run_id, lambda v: group_ready(v, 1, 2, 1), 120)
        lose_node(slurm_stack, "node-0")
        result = await finished(slurm_client, cluster, job, job_ends_too=False)
        # The batch script was lost with node-0: the controller ends the job once its run is done.
        assert await job_ends(cluster, job, timeout_s=60) == "CANCELLED", job_log(cluster, job)
    finally:
        await slurm_client.uncordon("node-0")
    found = {(i.group, i.kind, i.node) for i in result.incidents}
    assert found == {(1, IncidentKind.CRASH, "node-1"), (0, IncidentKind.NODE_UNRESPONSIVE, "node-0")}, found
    assert result.steps_completed == 600 and result.final_checkpoint is not None
    digest = check_groups(slurm_stack.home, run_id, result, 600)
    assert result.final_state_digest == digest
