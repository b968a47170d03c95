"""A private dev stack for one benchmark: free ports, its own folder under .bench/, gone afterwards."""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainguard.devstack import DevStack

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / ".bench"


def _quiet(_line: str) -> None:
    pass


@contextmanager
def private_stack(name: str, nodes: tuple[str, ...], port_start: int, echo: Callable[[str], None] = _quiet,
                  keep_logs: Path | None = None, timings: dict[str, float] | None = None,
                  temporal_only: bool = False, temporal_args: tuple[str, ...] = (),
                  hosts: bool = False) -> Iterator[DevStack]:
    """Bring up a stack under `.bench/<name>-<random>` on the first free ports from `port_start`, with the
    client's `TRAINGUARD_TEMPORAL_ADDRESS` pointing at it; on the way out (also on errors) stop it, restore the
    variable, copy its logs to `keep_logs` when given, and remove its folder. `timings` gets `stack_up_s` and
    `stack_down_s`. `temporal_only`: just the Temporal dev server, for a benchmark that runs its own workers
(no store, no controller, no node agents). `hosts`: each node in a network namespace of its own
    (`trainguard.hosts`; needs root), removed with the stack."""
    from trainguard.devstack import DevStack, Ports, StackConfig, free_port_base

    home = BENCH_DIR / f"{name}-{secrets.token_hex(4)}"
    config = StackConfig(home=home, ports=Ports.from_base(free_port_base(port_start, len(nodes))), nodes=nodes,
                         code_dir=REPO, hosts=hosts)
    stack = DevStack(config)
    times = timings if timings is not None else {}
    saved = os.environ.get("TRAINGUARD_TEMPORAL_ADDRESS")
    try:
        os.environ["TRAINGUARD_TEMPORAL_ADDRESS"] = config.temporal_address
        began = time.monotonic()
        if temporal_only:
            stack.up_temporal(echo=echo, extra_args=temporal_args)
        else:
            stack.up(echo=echo)
        times["stack_up_s"] = round(time.monotonic() - began, 3)
        yield stack
    finally:
        began = time.monotonic()
        try:
            stack.down(echo=echo)
        finally:
            times["stack_down_s"] = round(time.monotonic() - began, 3)
            if saved is None:
                os.environ.pop("TRAINGUARD_TEMPORAL_ADDRESS", None)
            else:
                os.environ["TRAINGUARD_TEMPORAL_ADDRESS"] = saved
            if keep_logs is not None:
                with suppress(OSError):
                    shutil.copytree(stack.log_dir, keep_logs, dirs_exist_ok=True)
            shutil.rmtree(home, ignore_errors=True)
