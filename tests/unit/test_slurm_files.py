"""The Slurm pieces that need no cluster: the job script's shape, the dev cluster's slurm.conf and ports, how
`sinfo --json` is read, which drains are an operator's, which jobs are ended once their runs are, and when a job's
agents count as up."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, UTC
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from trainguard.dev_slurm import SlurmCluster, node_states, unavailable_reason
from trainguard.models import PoolNode
from trainguard.pool import agents_not_ready
from trainguard.ports import Ports, free_port_base, slurm_ports
from trainguard.slurm_job import JOB_COMMENT, job_memo, not_the_runs_job
from workers.slurm_drains import SlurmDrainWatch, expand_hostlist, headless_jobs, operator_drains

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "slurm" / "train.sbatch"
CLUSTER_SCRIPT = REPO / "examples" / "slurm" / "cluster.sbatch"


def code_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_job_script_is_short_and_keeps_the_job_through_a_node_loss() -> None:
    text = SCRIPT.read_text()
    assert len(code_lines(text)) <= 30
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0
    directives = re.findall(r"^#SBATCH (\S+)", text, re.MULTILINE)
    assert {"--requeue", "--no-kill", "--nodes=3"} <= set(directives)
    # The step too: without its own --no-kill, slurmctld kills the agents' whole step when one node fails.
    assert re.search(r"^srun .*--no-kill", text, re.MULTILINE)
    assert 'RUN="slurm-$SLURM_JOB_ID"' in text and '--node "$SLURMD_NODENAME"' in text


def sbatch_options(text: str) -> dict[str, str]:
    """A job script's `#SBATCH` options: name -> value ('' for a flag)."""
    return dict(option.partition("=")[::2] for option in re.findall(r"^#SBATCH (\S+)", text, re.MULTILINE))


def seconds(limit: str) -> int:
    """A Slurm time limit written `[D-]HH:MM:SS` in seconds."""
    days, _, clock = limit.rpartition("-")
    hours, minutes, secs = map(int, clock.split(":"))
    return int(days or 0) * 86_400 + hours * 3600 + minutes * 60 + secs


def test_the_cluster_script_asks_for_whole_gpu_nodes_and_is_signalled_before_its_time_limit() -> None:
    text = CLUSTER_SCRIPT.read_text()
    assert subprocess.run(["bash", "-n", str(CLUSTER_SCRIPT)], check=False).returncode == 0
    options = sbatch_options(text)
    assert options["--gpus-per-node"] == "8" and options["--exclusive"] == "" and options["--mem"] == "0"
    assert options["--ntasks-per-node"] == "1"  # one agent a node: it starts the node's ranks
    found = re.fullmatch(r"B:(\w+)@(\d+)", options["--signal"])
    assert found, "the signal must go to the batch shell (B:), which stops the run and requeues the job"
    # Slurm sends it up to 60 s early; the stop (a checkpoint, the run's end) needs the rest of the lead.
    assert 120 <= int(found[2]) < seconds(options["--time"]) / 4
    assert f"trap at_time_limit {found[1]}" in text
    # Another job of the same name (a resubmission) waits for this one: two jobs never drive one run.
    assert options["--dependency"] == "singleton" and {"--requeue", "--no-kill"} <= set(options)
    assert options["--comment"] == JOB_COMMENT
    assert options["--output"].startswith("logs/") and options["--open-mode"] == "append"
    assert '/$SLURMD_NODENAME-$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}"' in text  # each run of the job: fresh folders
    assert len(code_lines(text)) <= 45


def test_the_logs_folder_is_in_the_checkout_and_its_logs_are_not() -> None:
    # sbatch does not make the --output folder: without it the job fails at launch (exit 0:53).
    assert (REPO / "logs").is_dir()
    ignored = subprocess.run(["git", "check-ignore", "-q", "logs/trainguard-run-7.out"], cwd=REPO, check=False)
    kept = subprocess.run(["git", "check-ignore", "-q", "logs/.gitignore"], cwd=REPO, check=False)
    assert (ignored.returncode, kept.returncode) == (0, 1)


def _fake_cluster(root: Path) -> Path:
    """A submit directory whose `.venv/bin` (first on the script's PATH) holds stand-ins for `srun`, `scontrol` and
    `trainguard` that log each call to `calls`. The agents' step runs until the job is requeued; the run commits
    checkpoint 131 once asked; `run result` waits until the run is cancelled; `run list` shows it completed once
    `completed` exists."""
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    stand_ins = {
        "srun": 'while [ ! -e "$ROOT/requeued" ]; do sleep 0.05; done',
        # A requeue ends the job's steps, the agents' among them, as Slurm does: srun is gone by the script's end.
        "scontrol": 'case "$1" in show) printf "gpu-01\\ngpu-02\\ngpu-03\\n" ;; requeue) touch "$ROOT/requeued"; '
                    'sleep 0.3 ;; esac',
        "trainguard": """case "$1 $2" in
  "run list") if [ -e "$ROOT/completed" ]; then echo "COMPLETED    $RUN_ID"; fi ;;
  "run status") echo "{\\"latest_checkpoint\\": $(cat "$ROOT/checkpoint" 2>/dev/null || echo null)}" ;;
  "run checkpoint") echo '{"step": 131}' > "$ROOT/checkpoint" ;;
  "run cancel") touch "$ROOT/cancelled" ;;
  "run result") while [ ! -e "$ROOT/cancelled" ]; do sleep 0.05; done ;;
esac""",
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f'#!/bin/bash\necho "{name} $*" >> "$ROOT/calls"\n{body}\n')
        (bin_dir / name).chmod(0o755)
    return root


def _job_env(root: Path, **extra: str) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "ROOT": str(root), "RUN_ID": "llama-sft", "SLURM_SUBMIT_DIR": str(root),
            "SLURM_JOB_NAME": "llama-sft", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-[01-03]",
            "SLURM_CPUS_ON_NODE": "96", **extra}


def _calls(root: Path) -> list[str]:
    return (root / "calls").read_text().splitlines() if (root / "calls").exists() else []


@pytest.mark.parametrize(("gpus", "srun_gpus"), [("8", ["--gpus-per-node=8"]), (None, [])],
                         ids=["gpus", "no-gres"])
def test_at_its_time_limit_the_job_checkpoints_ends_its_run_and_requeues_itself(
        tmp_path: Path, gpus: str | None, srun_gpus: list[str]) -> None:
    root = _fake_cluster(tmp_path)
    env = _job_env(root, **({"SLURM_GPUS_PER_NODE": gpus} if gpus else {}))
    job = subprocess.Popen(["bash", str(CLUSTER_SCRIPT)], env=env, cwd=root, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while "trainguard run result llama-sft" not in _calls(root):  # the job waits on its run
            assert time.monotonic() < deadline and job.poll() is None, (_calls(root), job.poll())
            time.sleep(0.05)
        job.send_signal(signal.SIGUSR1)  # what `--signal=B:USR1@300` sends
        output, _ = job.communicate(timeout=30)
    finally:
        job.kill()
    assert job.returncode == 0, output
    calls = _calls(root)
    srun = next(c.split()[1:] for c in calls if c.startswith("srun "))
    # The step gets the node's CPUs, memory and GPUs: since Slurm 22.05 srun inherits no --cpus-per-task.
    assert srun[:3] == ["--ntasks-per-node=1", "--cpus-per-task=96", "--mem=0"] and "--no-kill" in srun
    assert [a for a in srun if a.startswith("--gpus")] == srun_gpus
    # The run is named after the job, never its id: a requeued or resubmitted job resumes the same run.
    assert "trainguard run start examples/quickstart.json --id llama-sft --resume --nodes gpu-01,gpu-02 " \
           "--spare-nodes gpu-03" in calls
    stopping = ("trainguard run checkpoint", "trainguard run cancel", "scontrol requeue")
    stop = [c for c in calls if c.startswith(stopping)]
    assert stop == ["trainguard run checkpoint llama-sft", "trainguard run cancel llama-sft", "scontrol requeue 4242"]
    # The cancel waited for the checkpoint asked for to commit.
    assert calls.index("trainguard run cancel llama-sft") > max(
        i for i, c in enumerate(calls) if c == "trainguard run status llama-sft")


def test_a_job_whose_run_completed_in_an_earlier_job_starts_nothing(tmp_path: Path) -> None:
    root = _fake_cluster(tmp_path)
    (root / "completed").touch()
    done = subprocess.run(["bash", str(CLUSTER_SCRIPT)], env=_job_env(root), cwd=root, capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    assert "run llama-sft completed in an earlier job" in done.stdout
    assert not [c for c in _calls(root) if c.startswith(("srun", "trainguard run start"))]


def test_the_dev_cluster_conf_is_under_its_home_on_the_stacks_ports(tmp_path: Path) -> None:
    ports = Ports.from_base(30_000)
    cluster = SlurmCluster(tmp_path / "slurm", ("node-0", "node-1"), ports, slurmd_timeout_s=10)
    conf = cluster.conf_text()
    ctld, slurmds = slurm_ports(ports, 2)
    assert (ctld, slurmds) == (30_030, [30_031, 30_032])
    assert f"SlurmctldPort={ctld}" in conf and "Port=30031" in conf and "Port=30032" in conf
    assert f"AuthInfo=socket={tmp_path}/slurm/munge/munge.socket.2,cred_expire=10" in conf
    assert "SlurmdTimeout=10" in conf and "ReturnToService=1" in conf
    for key in ("StateSaveLocation", "SlurmdSpoolDir", "SlurmctldPidFile", "SlurmdLogFile"):
        assert re.search(rf"^{key}={re.escape(str(tmp_path))}/slurm/", conf, re.MULTILINE), key
    assert cluster.env() == {"SLURM_CONF": f"{tmp_path}/slurm/slurm.conf"}


def test_slurm_ports_stay_inside_the_stacks_range() -> None:
    base = free_port_base(41_000, 4)
    ctld, slurmds = slurm_ports(Ports.from_base(base), 16)
    assert base < ctld and slurmds[-1] < base + 50  # the next base's stack starts 50 ports on
    with pytest.raises(ValueError, match="at most 16"):
        slurm_ports(Ports.from_base(base), 17)


SINFO = {"nodes": [
    {"name": "node-0", "state": "idle", "state_flags": [], "reason": ""},
    {"name": "node-1", "state": "idle", "state_flags": ["DRAIN"], "reason": "operator: memory test"},
    {"name": "node-2", "state": "down", "state_flags": ["DRAIN", "NOT_RESPONDING"],
     "reason": "trainguard: node_unresponsive: node agent stopped heartbeating"},
    {"name": "node-3", "state": ["ALLOCATED", "DRAIN"], "reason": "kernel upgrade"},
]}


def test_sinfo_json_is_read_in_both_shapes() -> None:
    states = node_states(SINFO)
    assert states["node-2"]["state"] == ["DOWN", "DRAIN", "NOT_RESPONDING"]
    assert states["node-3"]["state"] == ["ALLOCATED", "DRAIN"]


def test_only_an_operators_drains_move_runs() -> None:
    # trainguard's own drain (its cordon) was already acted on; an undrained node is no one's business.
    assert operator_drains(SINFO) == {"node-1": "operator: memory test", "node-3": "kernel upgrade"}


@pytest.mark.parametrize(("hostlist", "names"), [
    ("node-0", ["node-0"]),
    ("node-[1-2]", ["node-1", "node-2"]),
    ("node-[0-2,5],gpu07", ["node-0", "node-1", "node-2", "node-5", "gpu07"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("", []),
])
def test_slurm_hostlists_expand_to_node_names(hostlist: str, names: list[str]) -> None:
    assert expand_hostlist(hostlist) == names


def test_only_running_jobs_that_lost_their_batch_host_are_headless() -> None:
    squeue = {"jobs": [
        {"job_id": 7, "job_state": "RUNNING", "batch_host": "node-0", "nodes": "node-[1-2]"},  # node 0 lost
        {"job_id": 8, "job_state": "RUNNING", "batch_host": "node-0", "nodes": "node-[0-2]"},  # whole
        {"job_id": 9, "job_state": "PENDING", "batch_host": "", "nodes": ""},
        {"job_id": 10, "job_state": "COMPLETING", "batch_host": "node-3", "nodes": "node-1"},
    ]}
    assert headless_jobs(squeue) == [7]


@pytest.mark.parametrize(("missing", "registered_at", "ready"), [
    ([], 1_000.0, True),
    (["node-0"], 1_000.0, False),   # registered, but its poller is gone: an agent of an earlier job
    ([], 900.0, False),             # polling, but registered before this job's agents started
    ([], 996.0, True),              # within the clock slack
])
def test_a_jobs_agents_count_as_up_only_when_polling_and_registered_since_it_began(
        missing: list[str], registered_at: float, ready: bool) -> None:
    pool = [PoolNode(node="node-0", registered_at=registered_at)]
    assert (agents_not_ready(["node-0"], pool, missing, since=1_000.0) == []) is ready


def test_without_slurm_the_error_names_the_packages_and_the_make_target(tmp_path: Path) -> None:
    reason = unavailable_reason(which=lambda _name: None, sbin=tmp_path)
    assert reason is not None
    assert "slurm-wlm slurmctld slurmd munge slurm-client" in reason and "make slurm-install" in reason


JOB_START = 1_000_000.0
"""When the fake squeue's jobs started (Unix time); their runs started after."""


class _Handle:
    def __init__(self, status: WorkflowExecutionStatus | None, memo: dict[str, Any] | None = None,
                 started: float = JOB_START + 60) -> None:
        self.status, self._memo = status, memo or {}
        self.start_time = datetime.fromtimestamp(started, UTC)

    async def describe(self) -> _Handle:
        if self.status is None:
            raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")
        return self

    async def memo(self) -> dict[str, Any]:
        return self._memo


class _Client:
    """Runs by id: a status (None: absent), with the memo its start recorded and when it started."""

    def __init__(self, runs: dict[str, WorkflowExecutionStatus | None],
                 memos: dict[str, dict[str, Any]] | None = None, started: dict[str, float] | None = None) -> None:
        self.runs, self.memos, self.started = runs, memos or {}, started or {}

    def get_workflow_handle(self, run_id: str) -> _Handle:
        return _Handle(self.runs.get(run_id), self.memos.get(run_id), self.started.get(run_id, JOB_START + 60))


def _headless(job: int, **fields: Any) -> dict[str, Any]:
    """A running job of `alice` whose batch host node-0 was lost, marked trainguard's by the job script."""
    return {"job_id": job, "job_state": "RUNNING", "batch_host": "node-0", "nodes": "node-[1-2]",
            "user_name": "alice", "cluster": "lab", "comment": JOB_COMMENT, "start_time": int(JOB_START), **fields}


def _memo(job: int, user: str = "alice", cluster: str = "lab") -> dict[str, Any]:
    """What `trainguard run start` inside job `job` records (`trainguard.slurm_job.job_memo`)."""
    return job_memo({"SLURM_JOB_ID": str(job), "SLURM_JOB_USER": user, "SLURM_CLUSTER_NAME": cluster}) or {}


def _fake_slurm(tmp_path: Path, jobs: list[dict[str, Any]]) -> tuple[Path, Path, Path]:
    squeue, scancel, cancelled = tmp_path / "squeue", tmp_path / "scancel", tmp_path / "cancelled"
    squeue.write_text(f"#!/bin/sh\necho '{json.dumps({'jobs': jobs})}'\n")
    scancel.write_text(f"#!/bin/sh\necho \"$1\" >> {cancelled}\n")
    for script in (squeue, scancel):
        script.chmod(0o755)
    return squeue, scancel, cancelled


async def test_a_headless_job_is_cancelled_only_once_its_own_run_is_over(tmp_path: Path) -> None:
    squeue, scancel, cancelled = _fake_slurm(tmp_path, [_headless(job) for job in (7, 8, 9)])
    runs = {"slurm-7": WorkflowExecutionStatus.COMPLETED, "slurm-8": WorkflowExecutionStatus.RUNNING}  # 9: none
    client = _Client(runs, memos={"slurm-7": _memo(7), "slurm-8": _memo(8)})
    watch = SlurmDrainWatch(client, squeue=str(squeue), scancel=str(scancel))  # type: ignore[arg-type]
    assert await watch.end_headless_jobs() == [7]
    runs["slurm-8"] = WorkflowExecutionStatus.FAILED  # its run ended since
    assert await watch.end_headless_jobs() == [8]
    assert cancelled.read_text().split() == ["7", "8"]  # each once; job 9, no trainguard run, never


@pytest.mark.parametrize(("job", "memo", "run_started"), [
    # Issue 40 finding 6(a): `temporal workflow start --workflow-id slurm-4242` (no job recorded), failed: the
    # controller cancelled job 4242, another user's job that was not trainguard's.
    (_headless(4242, user_name="bob", comment="", name="bobs-sim"), {}, JOB_START + 60),
    (_headless(4242), {}, JOB_START + 60),                                 # a run that recorded no job
    (_headless(4242), _memo(4241), JOB_START + 60),                        # recorded another job
    (_headless(4242, comment=""), _memo(4242), JOB_START + 60),           # the job does not mark itself ours
    (_headless(4242, user_name="bob"), _memo(4242), JOB_START + 60),      # another user's job
    (_headless(4242, cluster="other"), _memo(4242), JOB_START + 60),      # the same id on another cluster
    (_headless(4242), _memo(4242), JOB_START - 3600),                     # a run older than the job: ids restart
])
async def test_a_headless_job_its_run_did_not_record_as_its_own_is_never_cancelled(
        tmp_path: Path, job: dict[str, Any], memo: dict[str, Any], run_started: float) -> None:
    squeue, scancel, cancelled = _fake_slurm(tmp_path, [job])
    client = _Client({"slurm-4242": WorkflowExecutionStatus.FAILED}, memos={"slurm-4242": memo},
                     started={"slurm-4242": run_started})
    watch = SlurmDrainWatch(client, squeue=str(squeue), scancel=str(scancel))  # type: ignore[arg-type]

    assert await watch.end_headless_jobs() == []
    assert not cancelled.exists()


def test_the_job_script_marks_its_job_as_trainguards() -> None:
    assert f"#SBATCH --comment={JOB_COMMENT}\n" in SCRIPT.read_text()


# ------------------------------------------------------------------- issue 40 finding 11: the watch keeps going
def _script(path: Path, lines: list[str]) -> Path:
    """An executable that prints `lines[i]` on its i-th call, then the last one for ever."""
    count = path.with_suffix(".count")
    answers = path.with_suffix(".answers")
    answers.write_text(json.dumps(lines))
    path.write_text(f"#!/bin/sh\nn=$(cat {count} 2>/dev/null || echo 0); echo $((n + 1)) > {count}\n"
                    f"exec python3 -c 'import json,sys; a=json.load(open(\"{answers}\")); "
                    f"print(a[min(int(sys.argv[1]), len(a) - 1)])' \"$n\"\n")
    path.chmod(0o755)
    return path


async def test_the_watch_logs_and_keeps_going_through_a_malformed_answer_and_an_update_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 40 finding 11: a `KeyError` (a node without a name in `sinfo --json`) or an update that timed out
    ended the watch quietly: drains and cancels stopped until the controller restarted."""
    import asyncio
    import logging

    from temporalio.client import WorkflowUpdateRPCTimeoutOrCancelledError

    from trainguard.client import TrainguardClient
    from workers import slurm_drains

    drained = {"nodes": [{"name": "node-1", "state": "idle", "state_flags": ["DRAIN"], "reason": "memtest"}]}
    sinfo = _script(tmp_path / "sinfo", [json.dumps({"nodes": [{"state": "idle"}]}), json.dumps(drained)])
    squeue = _script(tmp_path / "squeue", [json.dumps({"jobs": []})])

    async def pool_nodes(_client: object) -> list[PoolNode]:
        return [PoolNode(node="node-1", leased_to="run-a")]

    asked: list[tuple[str, str]] = []

    async def drain_node(_self: object, run: str, node: str, reason: str = "") -> None:
        asked.append((run, node))
        if len(asked) == 1:
            raise WorkflowUpdateRPCTimeoutOrCancelledError()

    monkeypatch.setattr(slurm_drains, "pool_nodes", pool_nodes)
    monkeypatch.setattr(TrainguardClient, "drain_node", drain_node)
    watch = SlurmDrainWatch(object(), executable=str(sinfo), squeue=str(squeue),  # type: ignore[arg-type]
                            poll_s=0.01, max_backoff_s=0.05)
    stop = asyncio.Event()
    caplog.set_level(logging.WARNING, logger=slurm_drains.__name__)
    watching = asyncio.create_task(watch.run(stop))
    for _ in range(500):
        if len(asked) >= 2 or watching.done():
            break
        await asyncio.sleep(0.01)

    assert not watching.done(), watching.exception()  # before the fix: ended by the KeyError
    assert asked == [("run-a", "node-1"), ("run-a", "node-1")]  # the timed-out request asked again
    stop.set()
    await asyncio.wait_for(watching, 5)
    logged = caplog.text
    assert "KeyError" in logged and "WorkflowUpdateRPCTimeoutOrCancelledError" in logged


async def test_the_controller_restarts_a_watch_that_ends_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    import asyncio
    import logging

    from workers import slurm_drains

    class _Dies(SlurmDrainWatch):
        runs = 0

        async def run(self, stop: asyncio.Event) -> None:
            type(self).runs += 1
            if type(self).runs == 1:
                raise RuntimeError("a bug in the loop")
            await stop.wait()

    stop = asyncio.Event()
    watch = _Dies(object(), poll_s=0.01, max_backoff_s=0.01)  # type: ignore[arg-type]
    caplog.set_level(logging.ERROR, logger=slurm_drains.__name__)
    task = asyncio.create_task(slurm_drains.keep_watching(watch, stop))
    for _ in range(200):
        if _Dies.runs >= 2:
            break
        await asyncio.sleep(0.01)
    assert _Dies.runs == 2 and not task.done()
    assert "a bug in the loop" in caplog.text and "restart" in caplog.text
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_a_run_started_inside_a_slurm_job_records_the_job_the_controller_checks(
        env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other half of finding 6(a): `trainguard run start` inside job J records J, which is what makes the
    controller's check pass for the job script's own run, and fail for a run anyone started under `slurm-J`."""
    import uuid

    from trainguard.client import TrainguardClient

    for name, value in {"SLURM_JOB_ID": "4242", "SLURM_JOB_USER": "alice", "SLURM_CLUSTER_NAME": "lab"}.items():
        monkeypatch.setenv(name, value)
    run_id = f"slurm-4242-{uuid.uuid4().hex[:6]}"
    await TrainguardClient(env.client).start_run({"entrypoint": ["python", "train.py"], "nodes": ["node-0"]},
                                                 workflow_id=run_id)
    handle = env.client.get_workflow_handle(run_id)
    try:
        description = await handle.describe()
        memo = await description.memo()
    finally:
        await handle.terminate("test: no worker runs it")

    assert not_the_runs_job(_headless(4242), memo, description.start_time) is None
    assert "started from job 4242" in (not_the_runs_job(_headless(4243), memo, description.start_time) or "")
