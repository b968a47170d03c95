"""`make test`: the whole suite (but what is marked slow), with the Slurm module beside the rest.

The Slurm tests (tests/integration/test_slurm.py) spend most of their minutes waiting on Slurm's own clocks: a
node marked down after `SlurmdTimeout`, a requeued job's credential expiring, a job's allocation. They bring their
own stack (Temporal, store, controller, slurmctld and its slurmds), so they run in a second pytest beside the
rest instead of after it, and the suite takes about as long as its longer half. The replica-group tests
(tests/integration/test_replica_groups.py) bring a stack of their own too, and run in that half with the unit
tests (which need no stack) to even the two.

Each half has its own port range (`TRAINGUARD_PORT_SEARCH_OFFSET`) and scratch folder. The rest prints as it
runs; the Slurm half's output goes to `.pytest-tmp/slurm-suite.log` and is printed once both are done. The exit
status is the first failing half's. On a machine without Slurm the Slurm half skips its tests and says why.

    python -m infra.suite [pytest arguments for both halves]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SLURM_TESTS = "tests/integration/test_slurm.py"
BESIDE = (SLURM_TESTS, "tests/integration/test_replica_groups.py", "tests/unit")
"""The second pytest: the modules that bring their own stack (none needs the session's), and the unit tests,
which need none: the two halves then take about as long."""
SLURM_PORT_OFFSET = 3000
"""Added to the Slurm half's port searches, so its stack never races the other half's for a free range."""
SCRATCH = REPO / ".pytest-tmp"
NO_TESTS_COLLECTED = 5
"""pytest's exit status when its arguments select no test."""


def _pytest(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-m", "not slow", *args]


def main(argv: list[str] | None = None) -> int:
    extra = list(sys.argv[1:] if argv is None else argv)
    SCRATCH.mkdir(exist_ok=True)
    log_path = SCRATCH / "slurm-suite.log"
    offset = int(os.environ.get("TRAINGUARD_PORT_SEARCH_OFFSET", "0")) + SLURM_PORT_OFFSET
    began = time.monotonic()
    with log_path.open("w") as log:
        slurm = subprocess.Popen(
            _pytest([*BESIDE, f"--basetemp={SCRATCH / 'pytest-slurm'}", *extra]), cwd=REPO,
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TRAINGUARD_PORT_SEARCH_OFFSET": str(offset)})
        try:
            rest = subprocess.call(_pytest(["tests", *(f"--ignore={path}" for path in BESIDE), *extra]), cwd=REPO)
            slurm_rc = slurm.wait()
        except BaseException:
            slurm.send_signal(signal.SIGINT)  # its fixtures stop its stack and cancel its jobs
            slurm.wait()
            raise
    if slurm_rc == NO_TESTS_COLLECTED:
        slurm_rc = 0  # the arguments (`-k ...`) selected none of the Slurm tests
    print(f"\n{'=' * 30} Slurm half ({', '.join(BESIDE)}, beside the rest) {'=' * 30}", flush=True)
    print(log_path.read_text(), flush=True)
    print(f"suite: the rest exited {rest}, the Slurm half {slurm_rc}; "
          f"{time.monotonic() - began:.0f}s in all", flush=True)
    return rest or slurm_rc


if __name__ == "__main__":
    raise SystemExit(main())
