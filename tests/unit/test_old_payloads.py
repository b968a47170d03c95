"""Fields removed as dead code still decode where old histories carry them: pydantic ignores what a model no
longer declares, so a replay (or a worker of the next version) reads an older payload."""

from __future__ import annotations

from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import pydantic_data_converter

from activities.models import WatchRanksInput
from workflows.node_group_models import NodeGroupWatchInput


def test_a_watch_input_with_the_removed_first_step_reported_still_decodes() -> None:
    old = {"workflow_id": "r", "attempt": 2, "node": "node-1", "reported_step": 10, "first_step_reported": True}
    watch = WatchRanksInput.model_validate(old)
    assert (watch.attempt, watch.reported_step) == (2, 10)
    assert "first_step_reported" not in watch.model_dump()


def test_a_node_group_watch_input_recorded_with_it_decodes_through_the_data_converter() -> None:
    watch = WatchRanksInput(workflow_id="r", attempt=2, node="node-1").model_dump(mode="json")
    [payload] = pydantic_data_converter.payload_converter.to_payloads([{"run_workflow_id": "r", "group": 0, "watch": watch, "nodes": ["node-1"]}])
    raw = payload.data.replace(b'"node":"node-1"', b'"node":"node-1","first_step_reported":false')
    assert raw != payload.data
    [decoded] = pydantic_data_converter.payload_converter.from_payloads(
        [Payload(metadata=payload.metadata, data=raw)], [NodeGroupWatchInput])
    assert decoded.watch.node == "node-1"
