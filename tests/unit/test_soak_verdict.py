"""The soak's report of nodes taken as lost: the soak only restarts components, so each such incident is a restart
read as a lost node unless its agent stayed away past the node timeout, and the kills before it say which."""

from __future__ import annotations

from types import SimpleNamespace

from infra.soak_model import Kill, RunRecord
from infra.soak_verdict import SoakVerdict


def test_each_node_taken_as_lost_is_listed_with_the_kills_of_the_minute_before_it() -> None:
    verdict = SoakVerdict()
    verdict.t0_wall = 1_000.0
    verdict.chaos = SimpleNamespace(kills=[  # type: ignore[assignment]
        Kill("temporal", "temporal", at_s=30.0, signal="SIGKILL", down_s=2.2),  # over a minute before
        Kill("agent", "agent-node-2", at_s=90.0, signal="SIGKILL", down_s=6.3),
        Kill("seaweedfs", "s3", at_s=105.0, signal="SIGTERM", down_s=5.0),  # after it
    ])
    run = RunRecord(workflow_id="soak-run-040", job="s60e10", nodes=["node-1", "node-2"], spares=["node-0"],
                    prefix="p", incidents=[
                        {"kind": "agent_restart", "node": "node-1", "detected_at": 1_050.0, "action": "restart"},
                        {"kind": "node_unresponsive", "node": "node-2", "detected_at": 1_100.4,
                         "action": "replace_node"}])
    verdict.runs = {run.workflow_id: run}

    assert verdict.nodes_taken_as_lost() == [{
        "workflow_id": "soak-run-040", "node": "node-2", "at_s": 100.4, "action": "replace_node",
        "kills_before": ["agent-node-2 SIGKILL at 90.0s (back after 6.3s)"]}]
