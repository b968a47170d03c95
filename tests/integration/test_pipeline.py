"""examples/pipeline.py on the real stack: a user's workflow runs TrainingRun as a child and evaluates it."""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from temporalio.client import WorkflowExecutionStatus

from examples.pipeline import PipelineInput, TrainingPipeline, pipeline_worker
from trainguard import WORKFLOW_TYPE
from trainguard.client import TrainguardClient
from trainguard.devstack import DevStack

from .conftest import RUN_TIMEOUT_S, live_rank_pids, make_spec


async def test_pipeline_trains_in_a_child_run_and_evaluates_its_checkpoint(
    client: TrainguardClient, stack: DevStack, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pipeline worker reads S3 the way a node agent does: keys and endpoint from its environment.
    creds = stack.credentials()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", creds["access_key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", creds["secret_key"])
    monkeypatch.setenv("TRAINGUARD_S3_ENDPOINT", stack.config.s3_endpoint)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    pipeline_id = f"it-pipeline-{uuid.uuid4().hex[:8]}"
    train_id = f"{pipeline_id}-train"

    task_queue = f"pipeline-{uuid.uuid4().hex[:8]}"
    with ThreadPoolExecutor(max_workers=2) as executor:
        async with pipeline_worker(client.client, executor, task_queue=task_queue):
            handle = await client.client.start_workflow(
                TrainingPipeline.run,
                PipelineInput(spec=make_spec(prefix), num_eval_batches=4, data_dir=str(tmp_path)),
                id=pipeline_id,
                task_queue=task_queue,
            )
            result = await asyncio.wait_for(handle.result(), RUN_TIMEOUT_S)

    # The child is a TrainingRun like any other, parented by the pipeline, and its result is the pipeline's.
    child = await client.handle(train_id).describe()
    assert child.workflow_type == WORKFLOW_TYPE
    assert child.status == WorkflowExecutionStatus.COMPLETED
    assert child.parent_id == pipeline_id
    assert result.train_workflow_id == train_id
    assert result.run == await client.result(train_id)
    assert result.run.workflow_id == train_id
    assert result.run.steps_completed == 60 and result.run.incidents == []
    ref = result.run.final_checkpoint
    assert ref is not None and ref.step == 60 and ref.manifest_key.startswith(f"{prefix}/{train_id}/")

    children = [e.child_workflow_execution_started_event_attributes.workflow_execution.workflow_id
                async for e in handle.fetch_history_events()
                if e.HasField("child_workflow_execution_started_event_attributes")]
    assert children == [train_id]
    assert (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED

    # prepare_data wrote its description where it was told; evaluate read the trained weights, not fresh ones.
    description = json.loads(Path(result.dataset.description_path).read_text())
    assert Path(result.dataset.description_path).is_relative_to(tmp_path)
    assert description["num_held_out_batches"] == result.dataset.num_held_out_batches == 4
    assert result.dataset.dataset_id.startswith("synthetic-")
    assert math.isfinite(result.eval_loss) and math.isfinite(result.initial_loss)
    assert 0 < result.eval_loss < result.initial_loss
    assert live_rank_pids(stack) == []
