"""A spec's `working_dir` is judged as the ranks' user would see it, not as the agent (root) does (issue 40
finding 9): a rank run as another user once read a file under a 0700 folder through the working directory root
had entered for it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from activities.models import LaunchRanksInput
from trainguard.error_types import ErrorType
from trainguard.run_as import RunAs

SYSTEM_PYTHON = "/usr/bin/python3"
"""An interpreter any user can run (the venv's may live under a home only its owner can enter)."""
READS = "print(open('secret.txt').read(), flush=True)"

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                                reason="starting a rank as another user needs root and a system python")


async def _launch(open_dir: Path, working_dir: Path) -> tuple[str, int | None]:
    """Launch one rank as `nobody` in `working_dir` reading `secret.txt` there; (its log, its exit code)."""
    import asyncio

    from trainguard.protocol import RunLayout
    from workers.node_agent import node_ranks

    agent = node_ranks("node-a", open_dir / "agent", "127.0.0.1", open_dir, allowed=(SYSTEM_PYTHON,),
                       run_as=RunAs.named("nobody"))
    try:
        await agent.launch.launch_ranks(LaunchRanksInput(
            workflow_id="wf", chain_id="c1", attempt=1, node="node-a", node_rank=0, num_nodes=1, ranks_per_node=1,
            entrypoint=[SYSTEM_PYTHON, "-c", READS], working_dir=str(working_dir)))
        rank = agent.book.record("wf").ranks[0]  # type: ignore[union-attr]
        for _ in range(600):
            if rank.poll():
                break
            await asyncio.sleep(0.05)
        return RunLayout.of(open_dir / "agent", "wf").log_file(1, 0).read_text(), rank.exit_code
    finally:
        await agent.book.stop_all(grace_s=0.5)


@needs_root
async def test_a_working_dir_under_a_folder_the_ranks_user_cannot_enter_is_the_specs_error(open_dir: Path) -> None:
    closed = open_dir / "closed"
    work = closed / "work"
    work.mkdir(parents=True)
    (work / "secret.txt").write_text("ROOT'S SECRET")
    (work / "secret.txt").chmod(0o644)
    work.chmod(0o755)
    closed.chmod(0o700)  # root's: nobody cannot pass it

    with pytest.raises(ApplicationError) as refused:
        log, _ = await _launch(open_dir, work)
        pytest.fail(f"the rank ran in {work} as nobody and printed: {log!r}")

    assert refused.value.type == ErrorType.BAD_SPEC and refused.value.non_retryable
    assert "working_dir" in str(refused.value) and "nobody" in str(refused.value) and str(closed) in str(refused.value)


@needs_root
async def test_control_a_working_dir_the_ranks_user_can_enter_runs(open_dir: Path) -> None:
    work = open_dir / "work"
    work.mkdir()
    (work / "secret.txt").write_text("AN OPEN FILE")

    log, code = await _launch(open_dir, work)

    assert code == 0 and "AN OPEN FILE" in log
