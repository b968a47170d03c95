"""TorchFT's lighthouse for one run with replica groups, as a process a node agent starts and watches.

    python -m trainguard.lighthouse --port 29510 --min-replicas 1 --ready-file F [--heartbeat-timeout-ms 5000]

The lighthouse forms each step's quorum of replica groups. It serves on `--port` (0: any free port) and, once
it serves, writes its address (`http://<host>:<port>`) to `--ready-file` atomically; it runs until SIGTERM.
It holds no state worth keeping: started again on the same port, the groups' managers reconnect to it.

Needs TorchFT (the `ft` extra) where it runs; without it the process exits 3 with a message that says so.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from trainguard.safe_files import replace_file

EXIT_NO_TORCHFT = 3
"""The exit status when TorchFT is missing: the node agent reports it as the spec's problem, not the node's."""

NO_TORCHFT = "TorchFT is not installed where the lighthouse runs: pip install 'trainguard[ft]'"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0, help="port to serve on (default: any free one)")
    parser.add_argument("--host", default="127.0.0.1", help="the address groups reach this node at")
    parser.add_argument("--min-replicas", type=int, default=1, help="fewest groups in a quorum")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    parser.add_argument("--join-timeout-ms", type=int, default=60000)
    parser.add_argument("--ready-file", type=Path, required=True, help="where the address goes once it serves")
    args = parser.parse_args(argv)
    try:
        from torchft._torchft import LighthouseServer
    except ImportError:
        print(NO_TORCHFT, file=sys.stderr, flush=True)
        return EXIT_NO_TORCHFT
    server = LighthouseServer(bind=f"[::]:{args.port}", min_replicas=args.min_replicas,
                              join_timeout_ms=args.join_timeout_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    port = int(server.address().rsplit(":", 1)[1])
    replace_file(args.ready_file, f"http://{args.host}:{port}\n".encode())
    print(f"lighthouse serving at http://{args.host}:{port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
