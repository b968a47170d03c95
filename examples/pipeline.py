"""Example: your own Temporal pipeline runs `TrainingRun` as a child workflow.

`TrainingPipeline` prepares a dataset, trains on it with trainguard, and evaluates the final checkpoint:

    prepare_data (activity) -> TrainingRun (child workflow, task queue "trainguard") -> evaluate (activity)

The pipeline has its own worker on its own task queue; trainguard's controller and node agents run the child
exactly as they run any other training run, so incidents, recovery and checkpoints work the same way.

    python examples/pipeline.py worker                                   # polls "trainguard-pipeline"
    python examples/pipeline.py start --spec examples/quickstart.json    # runs one, prints its result

Both read `TRAINGUARD_TEMPORAL_ADDRESS`; the worker also needs S3 access for `evaluate` (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `TRAINGUARD_S3_ENDPOINT`, as a node agent has). The data set is the synthetic one
`examples/train.py` generates from the step number; `prepare_data` only records what it is, where a real
pipeline would export or tokenize data.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import uuid
from concurrent.futures import Executor, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import BaseModel
from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():
    from trainguard import TASK_QUEUE, WORKFLOW_TYPE
    from trainguard.connect import connect
    from trainguard.models import CheckpointRef, RunResult

PIPELINE_TASK_QUEUE = "trainguard-pipeline"
"""Task queue of this pipeline's worker; the child `TrainingRun` runs on trainguard's own queue."""

HELD_OUT_FIRST_STEP = 1_000_000
"""`examples/train.py` seeds the batch of step s from s; steps this far out are never trained on."""

# ------------------------------------------------------------------------------------------------- models


class PipelineInput(BaseModel):
    spec: dict[str, Any]
    """The `TrainingRun` spec, as its JSON (`examples/quickstart.json`); the child validates it."""
    num_eval_batches: int = 8
    """Held-out batches `evaluate` averages the loss over; default 8."""
    eval_batch_size: int = 256
    """Examples per held-out batch; default 256."""
    data_dir: str = ".trainguard/pipeline-data"
    """Where `prepare_data` writes the dataset description, on the pipeline worker's disk."""


class DatasetInfo(BaseModel):
    dataset_id: str
    """`synthetic-<hash of the description>`: the same description always gets the same id."""
    description_path: str
    """The `dataset.json` written on the worker that ran `prepare_data`."""
    held_out_first_step: int = HELD_OUT_FIRST_STEP
    num_held_out_batches: int = 8
    held_out_batch_size: int = 256


class PrepareDataInput(BaseModel):
    data_dir: str
    num_held_out_batches: int
    held_out_batch_size: int


class EvaluateInput(BaseModel):
    checkpoint: CheckpointRef
    """The run's final committed checkpoint; only its rank-0 shard is read (DDP replicas are identical)."""
    dataset: DatasetInfo


class EvaluateResult(BaseModel):
    loss: float
    """Mean MSE of the trained model on the held-out batches."""
    initial_loss: float
    """The same for the untrained model (`build_model`'s fixed seed), for comparison."""
    checkpoint_step: int


class PipelineResult(BaseModel):
    dataset: DatasetInfo
    run: RunResult
    """What the child `TrainingRun` returned: steps, attempts, incidents, final checkpoint."""
    eval_loss: float
    """Held-out loss of the final checkpoint."""
    initial_loss: float = 0.0
    """Held-out loss before training."""
    train_workflow_id: str = ""
    """The child's workflow id, `<pipeline workflow id>-train`; its checkpoints are under that name in S3."""


# --------------------------------------------------------------------------------------------- activities

PREPARE_DATA_TIMEOUT = timedelta(minutes=1)
# Writing a small local file fails only on a full or unmounted disk: worth a few tries, not forever.
PREPARE_DATA_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3)

# Importing torch, downloading one shard and a few forward passes: seconds here, minutes for a big model.
EVALUATE_TIMEOUT = timedelta(minutes=5)
# S3 errors (a restarting store, throttling) pass; a bounded backoff rides them out. A checkpoint that is
# missing after that was pruned or never existed, and more retries would not bring it back.
EVALUATE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=2), backoff_coefficient=2.0,
                             maximum_interval=timedelta(seconds=30), maximum_attempts=5)


@activity.defn(name="prepare_data")
def prepare_data(request: PrepareDataInput) -> DatasetInfo:
    """Record the synthetic data set `examples/train.py` trains on, and which batches are held out."""
    description = {
        "generator": "examples/train.py batch_for(step, rank)",
        "features": 32,
        "target": "sin(sum(x[:4]))",
        "held_out_first_step": HELD_OUT_FIRST_STEP,
        "num_held_out_batches": request.num_held_out_batches,
        "held_out_batch_size": request.held_out_batch_size,
    }
    body = json.dumps(description, indent=1, sort_keys=True)
    dataset_id = "synthetic-" + hashlib.sha256(body.encode()).hexdigest()[:12]
    path = Path(request.data_dir) / dataset_id / "dataset.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(body)
    os.replace(tmp, path)  # a retry after a crash mid-write never leaves half a file
    activity.logger.info("dataset %s described at %s", dataset_id, path)
    return DatasetInfo(dataset_id=dataset_id, description_path=str(path.resolve()),
                       num_held_out_batches=request.num_held_out_batches,
                       held_out_batch_size=request.held_out_batch_size)


@activity.defn(name="evaluate")
def evaluate(request: EvaluateInput) -> EvaluateResult:
    """Load the final checkpoint's rank-0 shard from S3 and measure the model's held-out loss."""
    import io

    import torch

    from trainguard.settings import s3_client

    ref, dataset = request.checkpoint, request.dataset
    s3 = s3_client()  # keys from the worker's environment, never from the workflow's input
    manifest = json.loads(s3.get_object(Bucket=ref.bucket, Key=ref.manifest_key)["Body"].read())
    shard = next(s for s in manifest["shards"] if s["rank"] == 0)
    body = s3.get_object(Bucket=ref.bucket, Key=shard["key"])["Body"].read()
    if hashlib.sha256(body).hexdigest() != shard["sha256"]:
        raise ApplicationError(f"{shard['key']}: sha256 differs from the manifest's", type="ShardCorrupt")
    state = torch.load(io.BytesIO(body), map_location="cpu", weights_only=False)

    trainer = _example_trainer()
    hidden = state["model"]["0.weight"].shape[0]  # the width the run was started with (`--hidden`)
    model = trainer.build_model(hidden)
    initial_loss = _held_out_loss(trainer, model, dataset)
    model.load_state_dict(state["model"])
    loss = _held_out_loss(trainer, model, dataset)
    activity.logger.info("checkpoint step %d: held-out loss %.6f (untrained %.6f)",
                         ref.step, loss, initial_loss)
    return EvaluateResult(loss=loss, initial_loss=initial_loss, checkpoint_step=ref.step)


def _example_trainer() -> ModuleType:
    """`examples/train.py` as a module, for its `build_model` and `batch_for` (examples is no package)."""
    import importlib.util

    path = Path(__file__).resolve().with_name("train.py")
    spec = importlib.util.spec_from_file_location("trainguard_example_train", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _held_out_loss(trainer: ModuleType, model: Any, dataset: DatasetInfo) -> float:
    import torch

    losses = []
    with torch.no_grad():
        for i in range(dataset.num_held_out_batches):
            step = dataset.held_out_first_step + i
            inputs, targets = trainer.batch_for(step, 0, dataset.held_out_batch_size, torch.device("cpu"))
            losses.append(torch.nn.functional.mse_loss(model(inputs), targets).item())
    return sum(losses) / len(losses)


# ----------------------------------------------------------------------------------------------- workflow


@workflow.defn(name="TrainingPipeline")
class TrainingPipeline:
    @workflow.run
    async def run(self, request: PipelineInput) -> PipelineResult:
        dataset = await workflow.execute_activity(
            prepare_data,
            PrepareDataInput(data_dir=request.data_dir, num_held_out_batches=request.num_eval_batches,
                             held_out_batch_size=request.eval_batch_size),
            start_to_close_timeout=PREPARE_DATA_TIMEOUT,
            retry_policy=PREPARE_DATA_RETRY,
            summary="describe the synthetic data set",
        )
        # Hand the data set to the ranks through the spec's environment (never secrets: it is in the history).
        env = {**(request.spec.get("env") or {}), "PIPELINE_DATASET_ID": dataset.dataset_id}
        spec = {**request.spec, "env": env}
        train_id = f"{workflow.info().workflow_id}-train"
        run = await workflow.execute_child_workflow(
            WORKFLOW_TYPE,
            spec,
            id=train_id,
            task_queue=TASK_QUEUE,
            result_type=RunResult,
            # No retry policy: TrainingRun recovers from crashes, hangs and lost nodes itself, and a run that
            # fails anyway failed for a reason (a bad spec, a spent restart budget) a rerun would meet again.
            # Cancel rather than terminate the run if this pipeline ends early: a cancelled run stops its
            # ranks on the way out, a terminated one would leave them running on the nodes.
            parent_close_policy=workflow.ParentClosePolicy.REQUEST_CANCEL,
            static_summary=f"train on {dataset.dataset_id}",
        )
        if run.final_checkpoint is None:
            raise ApplicationError(f"{train_id} committed no checkpoint: nothing to evaluate",
                                   type="NoCheckpoint", non_retryable=True)
        evaluation = await workflow.execute_activity(
            evaluate,
            EvaluateInput(checkpoint=run.final_checkpoint, dataset=dataset),
            start_to_close_timeout=EVALUATE_TIMEOUT,
            retry_policy=EVALUATE_RETRY,
            summary=f"evaluate checkpoint step {run.final_checkpoint.step}",
        )
        return PipelineResult(dataset=dataset, run=run, eval_loss=evaluation.loss,
                              initial_loss=evaluation.initial_loss, train_workflow_id=train_id)


# ----------------------------------------------------------------------------------------- worker, starter


def pipeline_worker(client: Client, activity_executor: Executor,
                    task_queue: str = PIPELINE_TASK_QUEUE) -> Worker:
    """The pipeline's worker: its workflow and both activities (sync ones, so they run in the executor)."""
    return Worker(client, task_queue=task_queue, workflows=[TrainingPipeline],
                  activities=[prepare_data, evaluate], activity_executor=activity_executor)


async def run_worker() -> None:
    client = await connect()  # the pydantic data converter, as trainguard's own workers use
    with ThreadPoolExecutor(max_workers=4) as executor:
        logging.info("pipeline worker polling %s", PIPELINE_TASK_QUEUE)
        await pipeline_worker(client, executor).run()


async def start(spec_path: Path, workflow_id: str | None) -> PipelineResult:
    from trainguard.client import load_spec

    # Validate here so a wrong field is reported before anything starts (the child checks again).
    spec = load_spec(spec_path).model_dump(mode="json")
    client = await connect()
    return await client.execute_workflow(
        TrainingPipeline.run,
        PipelineInput(spec=spec),
        id=workflow_id or f"pipeline-{uuid.uuid4().hex[:12]}",
        task_queue=PIPELINE_TASK_QUEUE,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Example pipeline: prepare data, TrainingRun, evaluate.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("worker", help=f"run the pipeline's worker on task queue {PIPELINE_TASK_QUEUE!r}")
    starter = commands.add_parser("start", help="run one pipeline and print its result")
    starter.add_argument("--spec", type=Path, required=True, help="TrainingRun spec JSON")
    starter.add_argument("--id", default=None, help="pipeline workflow id (default pipeline-<random>)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "worker":
        asyncio.run(run_worker())
        return
    result = asyncio.run(start(args.spec, args.id))
    run = result.run
    print(f"{result.train_workflow_id}: {run.steps_completed} steps, {run.attempts} attempt(s), "
          f"{len(run.incidents)} incident(s); held-out loss {result.eval_loss:.6f} "
          f"(untrained {result.initial_loss:.6f}) on {result.dataset.dataset_id}")


if __name__ == "__main__":
    main()
