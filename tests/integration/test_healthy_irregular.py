"""Healthy irregular scripts run to the end in one attempt, with no incident (issue 39).

Real scripts pause between steps far longer than the default `health.hang_floor_s` (2 s): an evaluation on every
rank, a synchronous save on rank 0 while its peers wait in the next all-reduce, an epoch boundary that starts
DataLoader workers again, steps of +-50% jitter, a slow first step. Each case runs with the spec's default
health settings, as a user would, and checks the rank's own log that the long phases did happen (a run without
them would pass by construction). The irregular DDP run must also end with `examples/train.py`'s digest: its
phases change nothing it trains. Its Slurm twin is in `test_slurm.py`.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import uuid
from pathlib import Path

import pytest

from infra.harness import Irregular, make_irregular_spec
from trainguard.client import TrainguardClient
from trainguard.models import RunResult
from trainguard.spec import HealthSpec

from .conftest import REPO, RUN_TIMEOUT_S, activity_failures

PHASES = Irregular()
"""Evaluations of 10 s at steps 25 and 50, a 5-s rank-0 save at step 40, an epoch boundary at step 30."""
LM_STEPS = 30
LM_EVAL_EVERY = 15
LM_EVAL_BATCHES = 1500
"""About 7 s of forward passes here unloaded (0.5 s per 100), more on a loaded machine: past the hang floor."""
LOG_TAIL_BYTES = 65_536
EVAL_LINE = re.compile(r"eval at step (\d+): .* in ([\d.]+)s")


def short_id(kind: str) -> str:
    """A short run id. Ranks get TMPDIR = <node workdir>/runs/<run id>/tmp, and DataLoader workers hand tensors
    over through a Unix socket under TMPDIR, whose path may not exceed 107 bytes: a long id fails the workers."""
    return f"it-{kind}-{uuid.uuid4().hex[:6]}"


async def torchrun_digest(tmp: Path, nproc: int, *args: str) -> str:
    """Rank 0's digest (16 hex digits) of `examples/train.py` under plain torchrun, no trainguard environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(OMP_NUM_THREADS="1", TMPDIR=str(tmp))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        "examples/train.py", *args, cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    output, _ = await asyncio.wait_for(process.communicate(), 240)
    text = output.decode(errors="replace")
    assert process.returncode == 0, text[-3000:]
    return text.split("digest ")[-1].split()[0]


async def one_clean_attempt(client: TrainguardClient, run_id: str, steps: int) -> RunResult:
    """The run's result, asserted to be one attempt with no incident and every step done."""
    try:
        result = await asyncio.wait_for(client.result(run_id), RUN_TIMEOUT_S)
    except Exception as error:
        raise AssertionError(f"{run_id}: {error}; activity failures {await activity_failures(client, run_id)}; "
                             f"incidents {(await client.status(run_id)).status.incidents}") from error
    described = "\n".join(f"{i.kind.value} at {i.detected_at:.1f}, node {i.node} rank {i.rank}: {i.detail}; "
                          f"evidence: {(i.evidence or '-').splitlines()[0]}" for i in result.incidents)
    assert result.incidents == [], described
    assert result.attempts == 1, described
    assert result.steps_completed == steps
    return result


async def rank0_log(client: TrainguardClient, run_id: str) -> str:
    return (await client.rank_log(run_id, rank=0, tail_bytes=LOG_TAIL_BYTES)).text


async def test_an_irregular_ddp_script_runs_in_one_attempt_with_no_incident(
        client: TrainguardClient, prefix: str, tmp_path: Path) -> None:
    spec = make_irregular_spec(prefix, PHASES)
    run_id = await client.start_run(spec, workflow_id=short_id("irr"))
    result = await one_clean_attempt(client, run_id, PHASES.steps)

    log = await rank0_log(client, run_id)
    evals = {int(step): float(seconds) for step, seconds in EVAL_LINE.findall(log)}
    assert set(evals) == {25, 50}, log[-3000:]
    assert min(evals.values()) >= PHASES.eval_s > HealthSpec().hang_floor_s
    assert re.search(r"save at step 40: \d+ bytes to .*, ([\d.]+)s", log), log[-3000:]
    assert "epoch from step 30: workers ready" in log, log[-3000:]
    # Same training as the uniform example at the same world size: the phases changed nothing it learned.
    reference = await torchrun_digest(tmp_path, 4, "--steps", str(PHASES.steps), "--step-time", "0",
                                      "--hidden", "64")
    assert (result.final_state_digest or "")[:16] == reference, (result.final_state_digest, reference)


# Slow (make test-slow), to keep `make test` under 15 minutes on 2 cores: the irregular DDP script (above) and the Slurm half's irregular job stay in it.
@pytest.mark.slow
async def test_a_hugging_face_llama_with_an_evaluation_pass_runs_in_one_attempt_with_no_incident(
        client: TrainguardClient, prefix: str) -> None:
    spec = {
        "entrypoint": ["python", "examples/train_lm.py", "--parallel", "fsdp", "--steps", str(LM_STEPS),
                       "--hidden", "32", "--eval-every", str(LM_EVAL_EVERY), "--eval-batches", str(LM_EVAL_BATCHES)],
        "nodes": ["node-0", "node-1"], "ranks_per_node": 1,
        "checkpoint": {"prefix": prefix, "every_steps": 10, "keep_last": 2},
    }
    run_id = await client.start_run(spec, workflow_id=short_id("irrlm"))
    await one_clean_attempt(client, run_id, LM_STEPS)

    evals = {int(step): float(seconds) for step, seconds in EVAL_LINE.findall(await rank0_log(client, run_id))}
    assert set(evals) == {15, 30}, evals
    assert max(evals.values()) > HealthSpec().hang_floor_s, evals  # a real gap, not one inside the floor
