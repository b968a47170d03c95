"""The FSDP2 recipe trains under trainguard exactly as under plain torchrun (issue 31, item 5).

A Hugging Face Llama (from a config, nothing downloaded) under FSDP2 on gloo, 2 ranks, `examples/train_lm.py`:
run by trainguard with a crash after its first checkpoint (a fresh start, then a DCP restore), under plain
torchrun, and, as the control, a script with no trainguard call at all (no restore template, the training
loop alone). All three end with the same digest. Built on every start, the template initialises AdamW's
state (a step at learning rate 0) and the first two differ from the third.

Slow (`make test-slow`): three launches of 2 ranks importing transformers, about a minute here.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest

from trainguard.client import TrainguardClient
from trainguard.models import IncidentKind

from .conftest import RUN_TIMEOUT_S, checkpointed, wait_until
from .plain_torchrun import torchrun_digest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
STEPS = 40
MODEL_ARGS = ("--hidden", "32")

PLAIN_SCRIPT = f"""
import argparse, sys
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
sys.path.insert(0, {str(REPO / "examples")!r})
from train_lm import build_model, tokens_for
from trainguard.state_digest import state_digest

parser = argparse.ArgumentParser()
for name, default in (("--vocab", 256), ("--hidden", 64), ("--layers", 2), ("--seq-len", 32), ("--batch-size", 4)):
    parser.add_argument(name, type=int, default=default)
args = parser.parse_args()
dist.init_process_group("gloo")
model = build_model(args)
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range({STEPS}):
    tokens = tokens_for(step, dist.get_rank(), args, torch.device("cpu"))
    optimizer.zero_grad(set_to_none=True)
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
digest = state_digest(model)
if dist.get_rank() == 0:
    print(f"digest {{digest[:16]}}", flush=True)
dist.destroy_process_group()
"""


def lm_spec(prefix: str) -> dict[str, Any]:
    return {
        "entrypoint": ["python", "examples/train_lm.py", "--parallel", "fsdp", "--steps", str(STEPS),
                       "--step-time", "0.15", *MODEL_ARGS],
        "nodes": ["node-0", "node-1"], "ranks_per_node": 1,
        "checkpoint": {"prefix": prefix, "every_steps": 10, "keep_last": 2},
        "health": {"hang_floor_s": 10.0},  # transformers' import takes seconds on a loaded machine
    }


async def test_the_fsdp2_recipe_ends_with_plain_torchruns_digest_after_a_fresh_start_and_a_restore(
        client: TrainguardClient, prefix: str, tmp_path: Path) -> None:
    plain = tmp_path / "plain_fsdp.py"
    plain.write_text(PLAIN_SCRIPT)
    control, torchrun = await asyncio.gather(
        torchrun_digest(plain, *MODEL_ARGS, tmp=tmp_path),
        torchrun_digest(REPO / "examples" / "train_lm.py", "--parallel", "fsdp", "--steps", str(STEPS),
                        *MODEL_ARGS, tmp=tmp_path))
    assert torchrun == control  # no restore template built: the training loop alone

    rid = await client.start_run(lm_spec(prefix), workflow_id=f"it-recipe-{uuid.uuid4().hex[:6]}")
    await wait_until(client, rid, lambda v: checkpointed(v, min_step=12), timeout_s=150)
    await client.inject_fault(rid, "crash", "node-1")
    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)
    [crash] = result.incidents
    assert crash.kind is IncidentKind.CRASH and (crash.resumed_step or 0) >= 10, crash  # a DCP restore
    assert (result.final_state_digest or "")[:16] == torchrun, result.final_state_digest
