"""A script's final digest under plain torchrun: the baseline that a run under trainguard must end with."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


async def torchrun_digest(script: Path, *args: str, tmp: Path, nproc: int = 2) -> str:
    """The digest (16 hex digits) that rank 0 of `script` prints last (`... digest HEX`), under plain torchrun:
    `nproc` ranks on this host, no trainguard environment, so every rank-helper call is a no-op."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(OMP_NUM_THREADS="1", TMPDIR=str(tmp), PYTHONPATH=str(REPO))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(script),
        *args, cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output, _ = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
    text = output.decode(errors="replace")
    assert process.returncode == 0, text[-3000:]
    assert "digest " in text, f"{script.name} printed no digest:\n{text[-3000:]}"
    return text.split("digest ")[-1].split()[0][:16]
