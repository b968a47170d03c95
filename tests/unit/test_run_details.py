"""The Web UI's glance at a run: its current details say phase, attempt, step, nodes and the last incident."""

from __future__ import annotations

from trainguard.models import Action, CheckpointRef, Incident, IncidentKind, Phase, RunStatus
from workflows.run_details import run_details


def test_a_fresh_run_says_its_phase_and_that_nothing_is_committed_yet() -> None:
    text = run_details(RunStatus(phase=Phase.RESERVING), [])
    assert text == "**reserving**, attempt 0, step 0 (no checkpoint yet)"


def test_a_recovered_run_names_its_nodes_checkpoint_and_last_incident() -> None:
    status = RunStatus(
        phase=Phase.RUNNING, attempt=2, step=120, nodes=["node-0", "node-2"], world_size=2, cordoned=["node-1"],
        latest_checkpoint=CheckpointRef(step=100, manifest_key="runs/r/step-00000100/manifest.json", bucket="b"),
        incidents=[Incident(kind=IncidentKind.CRASH, node="node-1", rank=1, attempt=1, action=Action.RESTART,
                            detail="rank 1 exited with code 1: ValueError: x" + "!" * 1000,
                            log_path="/n/runs/r/attempt-0001/logs/rank-00001.log")])
    text = run_details(status, ["node-3"])
    assert text.startswith("**running**, attempt 2, step 120 (checkpoint 100)")
    assert "nodes: node-0, node-2 (2 ranks); spares: node-3" in text and "taken out: node-1" in text
    assert "last: crash on node-1 rank 1 (attempt 1, restart): rank 1 exited with code 1: ValueError: x" in text
    assert "rank log: `/n/runs/r/attempt-0001/logs/rank-00001.log` on node-1" in text
    assert len(text) < 1000  # a glance: the detail is cut


def test_checkpoints_that_stop_committing_say_why_at_a_glance() -> None:
    store = RunStatus(phase=Phase.RUNNING, store_error="EndpointConnectionError: Could not connect")
    assert "checkpoints not committing: EndpointConnectionError: Could not connect" in run_details(store, [])
    nodes = RunStatus(phase=Phase.RUNNING, upload_errors={"node-1": "ClientError: InternalError", "node-0": "x"})
    assert "checkpoints not committing: node-0: x; node-1: ClientError: InternalError" in run_details(nodes, [])
    assert "not committing" not in run_details(RunStatus(phase=Phase.RUNNING), [])
