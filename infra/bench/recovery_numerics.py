"""The numerical rows of `make bench-recovery`: a flipped bit (silent data corruption) and a NaN loss, each
injected into a live run on the benchmark's private stack, and the cost of the fingerprints that find the first.

The job is the quickstart's shape: `examples/train.py` on two nodes of two DDP ranks (four replicas, so a majority
names the one that differs) with a spare, a checkpoint every `--every` steps. Measured, side by side in one stack:

- fault-free runs with fingerprints (`health.fingerprint_every_steps`, default 10) and without (0): their final
  digests and mean step times (`fingerprints_on` / `fingerprints_off`). On two shared CPU cores with a step that
  is mostly a sleep, this wall-clock difference is noise around zero, so the fingerprint's cost is also measured
  directly (`cost`): the time of one fingerprint of the trainer's model, and of a 64M-parameter one, against the
  time of one training step of the same model (forward, backward, optimizer step, no sleep), in this process.
  The overhead at the default interval is fingerprint / (interval x step);
- `bitflip`: `chaos bitflip` on node-1's first rank once training passes `--fault-step`. Detection in steps is the
  step whose fingerprints differed less the step the rank's helper flipped the bit at (from its log); in seconds,
  the incident's `detection_s` (from the injection). Rollback cost: the steps redone (detection step less the
  step resumed from) and the incident's `recovery_s`;
- `nan`: `chaos nan` on the same rank: the numerical fault's step less the step the fault was asked at, the
  same rollback figures.

Each recovered run's digest is compared with the fault-free run's. Prints a table; its figures go to the
recovery JSON under `numerics`. A benchmark, not a test: it never asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any

from trainguard.numerics import DEFAULT_FINGERPRINT_EVERY_STEPS

FAULT_NODE = "node-1"
FAULT_RANK = 2
"""node-1's first rank with two ranks per node."""
NUMERIC_FAULTS = ("bitflip", "nan")
INCIDENT_KINDS = {"bitflip": "silent_data_corruption", "nan": "numerical_fault"}


@dataclass(slots=True)
class NumericRow:
    fault: str
    detection_steps: int | None = None
    detection_s: float | None = None
    redone_steps: int | None = None
    recovery_s: float | None = None
    resumed_step: int | None = None
    node: str | None = None
    action: str | None = None
    same_digest: bool | None = None
    wall_s: float | None = None
    note: str = ""


def spec(opts: argparse.Namespace, prefix: str, fingerprint_every: int = DEFAULT_FINGERPRINT_EVERY_STEPS
         ) -> dict[str, Any]:
    return {
        "entrypoint": ["python", "examples/train.py", "--steps", str(opts.steps), "--step-time",
                       f"{opts.step_time:g}", "--hidden", str(opts.hidden)],
        "nodes": ["node-0", "node-1"], "spare_nodes": ["node-2"], "ranks_per_node": 2,
        "checkpoint": {"prefix": prefix, "every_steps": opts.every},
        "health": {"fingerprint_every_steps": fingerprint_every},
    }


async def _progress_step(client: Any, run_id: str) -> int:
    view = await client.status(run_id)
    return view.live_step if view.status.phase.value == "running" else -1


async def fault_run(client: Any, opts: argparse.Namespace, fault: str, digest: str | None) -> NumericRow:
    row = NumericRow(fault=fault)
    tag = secrets.token_hex(4)
    run_id = await client.start_run(spec(opts, f"bench-numerics-{fault}-{tag}"),
                                    workflow_id=f"bench-numerics-{fault}-{tag}")
    deadline = time.monotonic() + 180 + 3 * opts.steps * opts.step_time
    while await _progress_step(client, run_id) < opts.fault_step:
        if time.monotonic() > deadline:
            row.note = f"step {opts.fault_step} not reached"
            return row
        await asyncio.sleep(0.1)
    asked_at_step = await _progress_step(client, run_id)
    await client.inject_fault(run_id, fault, FAULT_NODE, rank=FAULT_RANK)
    outcome = await asyncio.wait_for(client.result(run_id), max(1.0, deadline - time.monotonic()))
    incident = next((i for i in outcome.incidents if i.kind.value == INCIDENT_KINDS[fault]), None)
    row.wall_s = outcome.wall_s
    row.same_digest = digest is not None and outcome.final_state_digest == digest
    if incident is None:
        row.note = f"no {INCIDENT_KINDS[fault]} incident: {[i.kind.value for i in outcome.incidents]}"
        return row
    row.node, row.action = incident.node, incident.action.value
    row.detection_s, row.recovery_s, row.resumed_step = incident.detection_s, incident.recovery_s, incident.resumed_step
    if fault == "bitflip":
        found = re.search(r"at step (\d+)", incident.cause)
        log = (await client.rank_log(run_id, node=FAULT_NODE, rank=FAULT_RANK, attempt=incident.attempt)).text
        flipped = re.search(r"flipped a bit at step (\d+)", log)
        detected = int(found.group(1)) if found else None
        if detected is not None and flipped is not None:
            row.detection_steps = detected - int(flipped.group(1))
    else:
        detected = incident.bad_step
        if detected is not None:
            row.detection_steps = detected - asked_at_step
    if detected is not None and incident.resumed_step is not None:
        row.redone_steps = detected - incident.resumed_step
    return row


async def clean_run(client: Any, opts: argparse.Namespace, fingerprint_every: int) -> dict[str, Any]:
    tag = secrets.token_hex(4)
    run_id = await client.start_run(spec(opts, f"bench-numerics-clean-{tag}", fingerprint_every),
                                    workflow_id=f"bench-numerics-clean-{fingerprint_every}-{tag}")
    outcome = await asyncio.wait_for(client.result(run_id), 180 + 3 * opts.steps * opts.step_time)
    return {"fingerprint_every_steps": fingerprint_every, "mean_step_s": outcome.mean_step_s,
            "wall_s": outcome.wall_s, "digest": outcome.final_state_digest, "incidents": len(outcome.incidents)}


def _train_step(model: Any, optimizer: Any, inputs: Any, targets: Any) -> None:
    from torch import nn

    optimizer.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()


def fingerprint_cost(hidden: int, repeats: int = 20) -> dict[str, Any]:
    """One fingerprint against one training step of the same model (no sleep), in this process, on the CPU: the
    trainer's MLP at `hidden`, and a 64M-parameter MLP (both are passes over memory, so the ratio is what a
    larger model keeps)."""
    import torch
    from torch import nn

    from trainguard.numerics import fingerprint

    def model_of(width: int, depth: int) -> nn.Module:
        layers: list[nn.Module] = [nn.Linear(32, width), nn.Tanh()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.Tanh()]
        return nn.Sequential(*layers, nn.Linear(width, 1))

    figures: dict[str, Any] = {}
    for name, model in (("trainer", model_of(hidden, 1)), ("64M", model_of(4096, 4))):
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        inputs, targets = torch.randn(64, 32), torch.randn(64, 1)
        params = list(model.parameters())
        _train_step(model, optimizer, inputs, targets)
        fingerprint(params, 0, "")
        began = time.perf_counter()
        for _ in range(repeats):
            _train_step(model, optimizer, inputs, targets)
        step_s = (time.perf_counter() - began) / repeats
        began = time.perf_counter()
        for _ in range(repeats):
            fingerprint(params, 0, "")
        fingerprint_s = (time.perf_counter() - began) / repeats
        figures[name] = {"parameters": sum(p.numel() for p in params), "step_s": round(step_s, 6),
                         "fingerprint_s": round(fingerprint_s, 6),
                         "overhead": round(fingerprint_s / (DEFAULT_FINGERPRINT_EVERY_STEPS * step_s), 5)}
    return figures


async def measure(client: Any, opts: argparse.Namespace, say: Any) -> dict[str, Any]:
    """Every numerical row on the stack `client` talks to (it must have node-2 as a spare)."""
    say("  numerics: fault-free runs with and without fingerprints")
    on = await clean_run(client, opts, DEFAULT_FINGERPRINT_EVERY_STEPS)
    off = await clean_run(client, opts, 0)
    rows = []
    for fault in NUMERIC_FAULTS:
        say(f"  numerics: {fault}")
        try:
            rows.append(await fault_run(client, opts, fault, on["digest"]))
        except Exception as error:  # noqa: BLE001 - one failed measurement must not lose the others
            rows.append(NumericRow(fault=fault, note=f"error: {error!r}"[:300]))
        if fault == "bitflip":
            await client.uncordon(FAULT_NODE)
    cost = fingerprint_cost(opts.hidden)
    return {"fingerprints_on": on, "fingerprints_off": off, "faults": [asdict(r) for r in rows], "cost": cost,
            "fingerprint_every_steps": DEFAULT_FINGERPRINT_EVERY_STEPS, "nodes": 2, "ranks_per_node": 2}


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def table(figures: dict[str, Any]) -> list[str]:
    """The numerical rows as the benchmark prints them."""
    lines = ["", f"numerical faults (examples/train.py, 2 nodes x 2 DDP ranks, fingerprint every "
                 f"{figures['fingerprint_every_steps']} steps):",
             "| fault | incident | node | action | detection (steps) | detection (s) | redone steps | recovery (s) "
             "| fault-free digest |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in figures["faults"]:
        lines.append(f"| {row['fault']} | {INCIDENT_KINDS[row['fault']]} | {row['node'] or '-'} | "
                     f"{row['action'] or '-'} | {_fmt(row['detection_steps'])} | {_fmt(row['detection_s'])} | "
                     f"{_fmt(row['redone_steps'])} | {_fmt(row['recovery_s'])} | "
                     f"{'same' if row['same_digest'] else 'DIFFERENT' if row['same_digest'] is False else '-'}"
                     f"{' (' + row['note'] + ')' if row['note'] else ''} |")
    on, off = figures["fingerprints_on"], figures["fingerprints_off"]
    lines += ["", "fingerprint overhead:",
              f"- side by side, fault-free: mean step {_fmt(on['mean_step_s'], 4)} s with fingerprints, "
              f"{_fmt(off['mean_step_s'], 4)} s without; digests "
              f"{'equal' if on['digest'] == off['digest'] else 'differ'} (a wall-clock difference on shared CPUs "
              f"with a mostly sleeping step is noise)"]
    every, took = figures["fingerprint_every_steps"], figures["cost"]["trainer"]["fingerprint_s"]
    if on["mean_step_s"]:
        lines.append(f"- in the benchmark's job: one fingerprint of its model ({took * 1e3:.3f} ms) every {every} "
                     f"steps of {on['mean_step_s']:.4f} s: {took / (every * on['mean_step_s']) * 100:.3f}% "
                     f"of step time")
    for name, cost in figures["cost"].items():
        lines.append(f"- {name} model ({cost['parameters']:,} parameters): one fingerprint "
                     f"{cost['fingerprint_s'] * 1e3:.3f} ms, one training step {cost['step_s'] * 1e3:.3f} ms: "
                     f"{cost['overhead'] * 100:.2f}% of step time at one fingerprint every "
                     f"{figures['fingerprint_every_steps']} steps")
    return lines
