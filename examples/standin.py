"""A lightweight stand-in rank: the rank helper's progress heartbeat and nothing else (no torch, no collective).

Used by the controller scale benchmark (infra/bench/scale.py) to run many concurrent runs on one machine:
it makes a trainguard run's control traffic (launch, watch, hang detection, relaunch, finish) without the
cost of real ranks. It does not checkpoint.

    python examples/standin.py --steps 300 --step-time 0.1
"""

from __future__ import annotations

import argparse
import time

from trainguard import rank as tg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--step-time", type=float, default=0.1)
    args = parser.parse_args()
    if args.steps < 1:
        print("--steps must be at least 1", flush=True)
        raise SystemExit(tg.EXIT_NO_RETRY)
    run = tg.init()
    for step in range(run.start_step, args.steps):
        time.sleep(args.step_time)
        run.step_done(step + 1, compute_s=args.step_time)
    run.finish(digest="standin")


if __name__ == "__main__":
    main()
