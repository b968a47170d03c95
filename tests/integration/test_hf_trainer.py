"""A Hugging Face `Trainer` script with the trainguard callback resumes exactly (issue 44, item 2).

`examples/hf_trainer.py`, a Llama from a config fine-tuned by a plain `transformers.Trainer` (DDP over gloo,
2 ranks on 2 nodes, each writing the Trainer's folders under its node's own TMPDIR), run by trainguard with a
crash after its first committed checkpoint, ends with the digest of the same script under plain torchrun: the
Trainer's own resume restored the model, AdamW, the cosine schedule and the data position (mid-epoch) from
the checkpoint trainguard committed.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest

from trainguard.client import TrainguardClient
from trainguard.models import IncidentKind

from .conftest import RUN_TIMEOUT_S, activity_failures, checkpointed, wait_until
from .plain_torchrun import torchrun_digest

pytestmark = [pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]
STEPS = 30
EVERY = 8
SCRIPT_ARGS = ("--steps", str(STEPS), "--samples", "40")
"""40 samples, 2 ranks of 4: 5 steps an epoch, so the checkpoint at step 8 resumes mid-epoch."""


def hf_spec(prefix: str) -> dict[str, Any]:
    return {
        "entrypoint": ["python", "examples/hf_trainer.py", *SCRIPT_ARGS, "--step-time", "0.2"],
        "nodes": ["node-0", "node-1"], "ranks_per_node": 1,
        "checkpoint": {"prefix": prefix, "every_steps": EVERY, "keep_last": 2},
        "health": {"hang_floor_s": 10.0},  # transformers' import takes seconds on a loaded machine
    }


async def test_a_trainer_script_crashed_after_a_checkpoint_ends_with_plain_torchruns_digest(
        client: TrainguardClient, prefix: str, tmp_path: Path) -> None:
    rid = await client.start_run(hf_spec(prefix), workflow_id=f"it-hf-{uuid.uuid4().hex[:6]}")
    torchrun = asyncio.create_task(torchrun_digest(REPO / "examples" / "hf_trainer.py", *SCRIPT_ARGS, tmp=tmp_path))
    await wait_until(client, rid, lambda v: checkpointed(v, min_step=EVERY + 2), timeout_s=150)
    await client.inject_fault(rid, "crash", "node-1")
    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)

    [crash] = result.incidents
    assert crash.kind is IncidentKind.CRASH and (crash.resumed_step or 0) >= EVERY, \
        (crash, await activity_failures(client, rid))
    assert (result.final_state_digest or "")[:16] == await torchrun, result.final_state_digest
