"""The node-scale benchmark end to end at its smallest: 16 simulated nodes on a private dev server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_bench_nodes_runs_a_crash_a_hang_and_a_lost_node_to_the_end(tmp_path: Path) -> None:
    results = tmp_path / "nodes.json"
    done = subprocess.run(  # argv list
        [sys.executable, "-m", "infra.bench.nodes", "--nodes", "16", "--checkpoints", "3", "--every-steps", "30",
         "--timeout-s", "90", "--json", str(results)],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "shared queues" in done.stdout

    [size] = json.loads(results.read_text())

    assert size["completed"], size["notes"]
    assert size["nodes"] == 16 and size["commits"] >= 3
    assert [i.split(" on ")[0] for i in size["incidents"]] == ["crash", "hang", "node_unresponsive"]
    assert size["hang"]["culprit_right"], size["hang"]
    assert size["events_total"] >= size["events_root"] > 0
    assert 16 <= size["max_pending"] < 2000
    assert size["largest_payload_bytes"] > 0
    assert size["relaunch_p95_s"] is not None and size["relaunch_p95_s"] >= 0
    assert size["controller_cpu_s"] > 0 and size["controller_peak_rss_mb"] > 0
    assert set(size["events_per_checkpoint"]) >= {"all", "root"}
