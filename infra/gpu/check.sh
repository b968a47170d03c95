#!/usr/bin/env bash
# The GPU check of issue 16, for a machine with NVIDIA GPUs and their driver (none was lent to this project's
# tasks so far: this has not run yet). From the repository root:   bash infra/gpu/check.sh
#
# 1. Real NVML: the periodic health read (`read_gpu_health`) and the XID event subscription the agent makes
#    (`XidEvents.start`: True where the driver offers critical-XID events).
# 2. An NCCL job under trainguard on a private stack: one node, one rank per GPU (NCCL wants a GPU of its own
#    per rank), in-process restarts on. It crashes the last rank (with 2+ ranks: an in-process restart, the
#    live ranks keep their state), then hangs it in Python (`chaos hang --mode python`: named from its
#    evidence), and prints each incident's figures. Everything goes to .bench/gpu-check.json.
# About 3 minutes after `make install`. Stops at the first failure.
set -euo pipefail
cd "$(dirname "$0")/../.."
make install >/dev/null
nvidia-smi -L
export TRAINGUARD_PORT_SEARCH_OFFSET="${TRAINGUARD_PORT_SEARCH_OFFSET:-0}"
exec timeout 540 .venv/bin/python - <<'PY'
import asyncio, json, time, uuid

import torch

from activities.health import XidEvents, read_gpu_health
from infra.bench.stack import BENCH_DIR, private_stack
from trainguard.client import TrainguardClient
from trainguard.models import Phase

gpus = torch.cuda.device_count()
assert gpus >= 1 and torch.distributed.is_nccl_available(), "needs CUDA GPUs and NCCL"
health = read_gpu_health()
xid = XidEvents()
out = {"gpus": gpus, "nvml_health": health.model_dump(), "xid_events_subscribed": xid.start()}
print(f"NVML: {health.detail}; XID events subscribed: {out['xid_events_subscribed']}", flush=True)
xid.stop()


async def main() -> None:
    client = await TrainguardClient.connect()
    spec = {"entrypoint": ["python", "examples/train.py", "--steps", "100000", "--step-time", "0.05"],
            "nodes": ["node-0"], "ranks_per_node": gpus,
            "checkpoint": {"prefix": f"gpu-check-{uuid.uuid4().hex[:6]}", "every_steps": 20},
            "restarts": {"in_process": True, "rejoin_timeout_s": 60}}
    rid = await client.start_run(spec, workflow_id=f"gpu-check-{uuid.uuid4().hex[:6]}")
    last = gpus - 1
    try:
        for fault in ("crash", "hang-python"):
            while True:  # this attempt trains
                view = await client.status(rid)
                steps = [s for s in view.rank_steps.values() if s is not None]
                if view.status.phase is Phase.RUNNING and len(steps) == gpus and min(steps) > view.status.resumed_step + 20:
                    break
                await asyncio.sleep(0.5)
            seen = len(view.status.incidents)
            await client.inject_fault(rid, fault, "node-0", rank=last)
            began = time.monotonic()
            while len(view.status.incidents) <= seen or view.status.incidents[seen].recovery_s is None:
                assert time.monotonic() - began < 180, f"{fault}: no recovered incident in 180 s"
                await asyncio.sleep(0.5)
                view = await client.status(rid)
            incident = view.status.incidents[seen]
            out[fault] = incident.model_dump(mode="json", exclude={"log_tail"})
            print(f"{fault}: {incident.kind.value} rank {incident.rank}, detected in {incident.detection_s} s, "
                  f"culprit +{incident.attribution_s} s, recovered in {incident.recovery_s} s "
                  f"({incident.recovery_path}); evidence: {incident.evidence!r}", flush=True)
    finally:
        await client.cancel(rid)


with private_stack("gpu-check", ("node-0",), 21500, echo=lambda line: print(f"  stack: {line}", flush=True)):
    asyncio.run(main())
(BENCH_DIR / "gpu-check.json").write_text(json.dumps(out, indent=2) + "\n")
print(f"wrote {BENCH_DIR / 'gpu-check.json'}")
PY
