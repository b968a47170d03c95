"""A private dev stack for one benchmark: free ports, its own folder under .bench/, gone afterwards
(`infra.harness.PrivateStack`, which the integration tests and the soak use too)."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from infra.harness import PrivateStack

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
    up = (lambda dev: dev.up_temporal(echo=echo, extra_args=temporal_args)) if temporal_only else None
    with PrivateStack(BENCH_DIR / f"{name}-{secrets.token_hex(4)}", nodes, port_start, hosts=hosts, echo=echo,
                      up=up, keep_logs=keep_logs, timings=timings) as stack:
        yield stack
