"""The recipes of the docs (`examples/recipes/`, included by docs/guide/recipes.md) resume exactly (issue 44, item 1).

Each recipe runs under trainguard on the dev stack, is crashed once a checkpoint has committed, and resumes from
it: model, optimizer, LR scheduler and data position restored. It must end with the same state digest as the
same recipe under plain torchrun with no fault. The checkpoint falls mid-epoch, so a recipe that restored no
scheduler or no data position would end elsewhere.

DDP (a small model, 2 ranks) runs in `make test`; FSDP2 (2 ranks) and HSDP (2 replicas x 2 shards, 4 ranks)
train a Hugging Face Llama and are slow (`make test-slow`).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from trainguard.client import TrainguardClient
from trainguard.models import IncidentKind

from .conftest import RUN_TIMEOUT_S, checkpointed, wait_until
from .plain_torchrun import REPO, torchrun_digest

pytestmark = pytest.mark.integration
EVERY_STEPS = 20
"""Checkpoint cadence: every recipe's epoch is longer, so the first checkpoint falls mid-epoch."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Recipe:
    script: str
    """The recipe's file under `examples/recipes/`."""
    args: tuple[str, ...]
    """Its arguments, the same under trainguard and torchrun."""
    ranks_per_node: int = 1
    """On two nodes; torchrun starts twice as many ranks on this host."""
    hang_floor_s: float = 5.0
    """Generous: the machine is shared, and importing transformers takes seconds under load."""


RECIPES = {
    "ddp": Recipe(script="ddp.py", args=("--step-time", "0.1")),
    "fsdp2": Recipe(script="fsdp2.py", args=("--step-time", "0.1"), hang_floor_s=10.0),
    "hsdp": Recipe(script="hsdp.py", args=("--step-time", "0.1"), ranks_per_node=2, hang_floor_s=10.0),
}


def recipe_spec(recipe: Recipe, prefix: str) -> dict[str, Any]:
    return {
        "entrypoint": ["python", f"examples/recipes/{recipe.script}", *recipe.args],
        "nodes": ["node-0", "node-1"], "ranks_per_node": recipe.ranks_per_node,
        "checkpoint": {"prefix": prefix, "every_steps": EVERY_STEPS, "keep_last": 2},
        "health": {"hang_floor_s": recipe.hang_floor_s},
    }


@pytest.mark.parametrize("name", [
    "ddp",
    pytest.param("fsdp2", marks=pytest.mark.slow),
    pytest.param("hsdp", marks=pytest.mark.slow),
])
async def test_a_recipe_crashed_after_a_checkpoint_ends_with_plain_torchruns_digest(
        name: str, client: TrainguardClient, prefix: str, tmp_path: Path) -> None:
    recipe = RECIPES[name]
    torchrun = asyncio.create_task(torchrun_digest(
        REPO / "examples" / "recipes" / recipe.script, *recipe.args, tmp=tmp_path, nproc=2 * recipe.ranks_per_node))

    rid = await client.start_run(recipe_spec(recipe, prefix), workflow_id=f"it-recipes-{name}-{uuid.uuid4().hex[:6]}")
    await wait_until(client, rid, lambda v: checkpointed(v, min_step=EVERY_STEPS + 2), timeout_s=150)
    await client.inject_fault(rid, "crash", "node-1")
    result = await asyncio.wait_for(client.result(rid), RUN_TIMEOUT_S)

    [crash] = result.incidents
    assert crash.kind is IncidentKind.CRASH and (crash.resumed_step or 0) >= EVERY_STEPS, crash
    assert (result.final_state_digest or "")[:16] == await torchrun, result.final_state_digest
