"""Recovery benchmark: trainguard against torchrun --max-restarts and NVIDIA's ft_launcher, on the same job
and the same faults.

    python -m infra.bench.recovery [--faults crash,hang,slow,gpu,node-down] [--launchers torchrun,ft_launcher]
                                   [--steps 400] [--json .bench/recovery.json] [--skip-torchrun] [--hosts]

Measured side by side in one run, on this machine, for a 2-rank gloo job of `examples/train.py`
(`--steps 400 --step-time 0.1 --hidden 64`, a checkpoint every 50 steps), each fault hitting rank 1 (node-1)
once training has passed step `--fault-step` (120) and, for trainguard, its node agents have parked the processes
for the next relaunch (the run's steady state; `parked_wait_s` says how long that took, at most 120 s), on the
spare too for the node faults (the spare takes the node's place, from the processes it parked for the run):

- crash: SIGKILL of the rank; hang: SIGSTOP of the rank; slow: the rank stopped 80% of every 0.1 s (a GPU at
  a fifth of its speed); gpu: node-1's GPU check reports an XID; node-down: node-1's agent dies with its ranks.

1. trainguard: a private dev stack (Temporal dev server, SeaweedFS, controller, agents `node-0`, `node-1`,
   and `node-2` as the spare of the node faults slow, gpu and node-down) under `.bench/stack-<random>` on
   free ports from 32000. The fault goes through `TrainguardClient.inject_fault`, carried out by node-1's
   agent. Figures come from the run's result: the incident's `detection_s` (fault to detection) and
   `recovery_s` (detection to the first training step of the next attempt; for a straggler, of the
   replacement that follows the report), and the run's goodput and wall time. Default health settings
   (hang floor 2 s, straggler ratio 1.5 over 2 checkpoint intervals). After a node fault the benchmark
   repairs node-1 (a fresh agent, uncordoned) before the next one.
2. torchrun: `torchrun --nnodes 1 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d` with
   `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (the configuration that restarts reliably here, see PLATFORM.md)
   running the same script with a local checkpoint (`--local-checkpoint-dir`, same cadence) and the
   process-group timeout a user would set (`--pg-timeout-s 60`). The benchmark finds rank 1's worker in
   /proc (by a marker variable it sets, `RANK=1`, the launcher's pid as parent) and sends the signals
   itself. Detection is the launcher's first reaction in its log (`Sending process N closing signal SIGTERM`
   to the survivors, else `Worker group FAILED`; output timestamped on arrival, `LOGLEVEL=INFO`); recovery
   is the first step of the next attempt in the trainer's `--progress-file` (rank 0 appends `step unix-time
   restart-count` per step). Goodput is computed as trainguard computes it: steps x mean step time of the
   final attempt / wall time. gpu and node-down are not measured for the launchers (see TORCHRUN_UNMEASURED).
3. ft_launcher (nvidia-resiliency-ext, the `bench` extra): the same as torchrun, plus its rank monitors with
   a 5 s heartbeat timeout (the trainer's `--ft-heartbeat` sends one per step); a hang is detected at its
   `Did not get subsequent heartbeat` line.
4. `--hosts`: the lost-node rows again on a second private stack in hosts mode (`trainguard.hosts`: every
   agent and its ranks in a network namespace of its own, on a bridge; needs root), as `trainguard/hosts`
   beside the loopback `trainguard` row: node-down (node-1's agent dies with its ranks) and partition (every
   packet node-1 sends or is sent is dropped, `tc` blackhole on both ends of its link; healed, its agent
   restarted and uncordoned afterwards).
5. The floor: the same 2 ranks started cold by plain torchrun with a local checkpoint present, time from
   launch to the first training step. No recovery can beat a cold start of the job it restarts.
6. Numerical faults (`infra/bench/recovery_numerics.py`, unless `--skip-numerics`), on the same stack: a flipped
   bit (`chaos bitflip`) and a NaN loss (`chaos nan`) in a 2 x 2-rank run of the same trainer, detection in steps
   and seconds and the rollback's cost; and the fingerprint's overhead, fault-free runs with and without
   fingerprints side by side and its cost against a training step measured directly. The launchers have no such
   check: a flipped bit or a NaN trains on under them.

This is a benchmark, not a test: it prints figures and writes them to JSON; it never asserts a time.
Every process it starts is killed (process groups, and workers found by the marker) and every file it
writes but `.bench/recovery.json` is removed, also on errors (`--keep-logs` keeps the launchers' output and
the stack's logs under `.bench/recovery-logs/`). torch's temporary files go to a TMPDIR under `.bench/`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict
from pathlib import Path
from typing import Any

from infra.bench.recovery_baselines import (
    TORCHRUN_MAX_RESTARTS,
    TORCHRUN_PG_TIMEOUT_S,
    torchrun_fault,
    torchrun_floor,
)
from infra.bench.recovery_report import (
    BENCH_DIR,
    FAULT_NODE,
    FAULT_RANK,
    LAUNCHERS,
    NODES,
    SLOW_DUTY,
    Floor,
    Measurement,
    fmt,
    machine,
    report,
    say,
    summary,
    write_results,
)

DEFAULT_JSON = BENCH_DIR / "recovery.json"
PORT_SEARCH_START = 32000
FAULTS = ("crash", "hang", "slow", "gpu", "node-down")
INCIDENT_KINDS = {"crash": "crash", "hang": "hang", "slow": "straggler", "gpu": "gpu_unhealthy",
                  "node-down": "node_unresponsive", "partition": "node_unresponsive"}
"""The incident each fault should produce."""
NODE_FAULTS = frozenset({"slow", "gpu", "node-down", "partition"})
"""Faults trainguard answers by replacing the node: its runs get a spare (`node-2`)."""
SPARE = "node-2"
HOSTS_FAULTS = ("node-down", "partition")
"""The lost-node rows `--hosts` measures in hosts mode; `partition` exists only there (packets dropped)."""
HOSTS_SYSTEM = "trainguard/hosts"


# ------------------------------------------------------------------------------------- trainguard


def trainguard_spec(opts: argparse.Namespace, prefix: str, fault: str) -> dict[str, Any]:
    return {
        "entrypoint": ["python", "examples/train.py", "--steps", str(opts.steps), "--step-time",
                       f"{opts.step_time:g}", "--hidden", str(opts.hidden)],
        "nodes": list(NODES),
        "spare_nodes": [SPARE] if fault in NODE_FAULTS else [],
        "ranks_per_node": 1,
        "checkpoint": {"prefix": prefix, "every_steps": opts.every},
    }


async def trainguard_faults(opts: argparse.Namespace, faults: list[str], dev: Any,
                            system: str = "trainguard", numerics: dict[str, Any] | None = None) -> list[Measurement]:
    """Each fault's run in turn; then, given `numerics`, the numerical rows (`recovery_numerics`) into it."""
    from trainguard.client import TrainguardClient
    from trainguard.settings import Settings

    client = await TrainguardClient.connect(Settings.from_env({**os.environ, **dev.client_env()}))
    results = []
    for fault in faults:
        # A partition drops node-1's packets at its link (hosts mode); every other fault goes through its agent.
        cut = (lambda: dev.config.network.partition(FAULT_NODE)) if fault == "partition" else None
        try:
            measured = await trainguard_fault(client, opts, fault, dev.config.home, system, cut=cut)
        except Exception as error:  # noqa: BLE001 - one failed measurement must not lose the others
            measured = Measurement(fault=fault, system=system, note=f"error: {error!r}"[:300])
        if fault == "partition":
            dev.config.network.heal(FAULT_NODE)
        if fault in NODE_FAULTS:
            await repair(client, dev, FAULT_NODE)
        say(f"  -> {summary(measured)}")
        results.append(measured)
    if numerics is not None:
        from infra.bench.recovery_numerics import measure

        try:
            numerics.update(await measure(client, opts, say))
        except Exception as error:  # noqa: BLE001 - the other rows stand without these
            numerics["error"] = f"{error!r}"[:300]
    return results


async def repair(client: Any, dev: Any, node: str) -> None:
    """What an operator does after a node fault: a fresh agent (the injected XID is gone), then uncordon."""
    await asyncio.to_thread(dev.restart, f"agent-{node}", lambda _line: None)
    await client.uncordon(node)


PARKED_WAIT_MAX_S = 120.0
"""The longest a trainguard fault waits for the run's parked processes: a run in its steady state has them (its
agents park them after the attempt's first step; a quiet machine takes 2-4 s to, a machine at load 20 half a
minute), and real faults come minutes to days into a run, not seconds."""


def parked_ready(home: Path, run_id: str, nodes: tuple[str, ...] = NODES) -> bool:
    """Every node of the run (and its spare, for a node fault: the spare takes the node's place) has its processes
    for the next relaunch parked, waiting in `tg.standby()`."""
    from trainguard.protocol import RunLayout, StandbyMark, read_attempt_file

    for node in nodes:
        layout = RunLayout.of(home / "nodes" / node, run_id)
        record = read_attempt_file(layout.ranks_file)
        if record is None or not record.parked:
            return False
        pids = {p.pid for p in record.parked}
        marks = [StandbyMark.read(f) for f in layout.parked_dir.glob("park-*.mark.json")]
        if len({m.pid for m in marks if m is not None and m.parked and m.pid in pids}) < len(pids):
            return False
    return True


def rank_step(home: Path, node: str, run_id: str, attempt: int, rank: int) -> int | None:
    """The step a rank last reported, read straight from its progress file on the node agent's disk.

    The run's status (watch heartbeats) lags by seconds; this is how the fault is sent at the same step
    as torchrun's, which the benchmark watches the same way (its trainer's progress file).
    """
    from trainguard.protocol import RunLayout, read_progress

    progress = read_progress(RunLayout.of(home / "nodes" / node, run_id).progress_file(attempt, rank))
    return progress.step if progress is not None else None


async def trainguard_fault(client: Any, opts: argparse.Namespace, fault: str, home: Path,
                           system: str = "trainguard", spec_changes: dict[str, Any] | None = None,
                           cut: Any = None) -> Measurement:
    """One run of the job with `fault` sent once it passes `opts.fault_step`. `spec_changes` are merged into
    the spec's sections (e.g. `{"restarts": {"in_process": True}}`). `cut`: what makes the fault instead of
    the agent (a partition: the agent cannot be asked to cut itself off)."""
    from temporalio.service import RPCError

    result = Measurement(fault=fault, system=system)
    tag = secrets.token_hex(4)
    spec = trainguard_spec(opts, f"bench-recovery-{fault}-{tag}", fault)
    for section, changes in (spec_changes or {}).items():
        spec[section] = {**spec.get(section, {}), **changes}
    run_id = await client.start_run(spec, workflow_id=f"bench-recovery-{fault}-{tag}")
    result.workflow_id = run_id
    timeout_s = 180 + 3 * opts.steps * opts.step_time
    warm_on = (*NODES, SPARE) if fault in NODE_FAULTS else NODES
    deadline = time.monotonic() + timeout_s
    finished = False
    passed_at: float | None = None
    try:
        attempt: int | None = None
        last_status = 0.0
        failed_queries = 0
        while time.monotonic() < deadline:
            if attempt is None or time.monotonic() - last_status > 2.0:
                last_status = time.monotonic()
                try:
                    view = await client.status(run_id)
                except RPCError as error:  # a query waits on a workflow task: a busy controller times it out
                    failed_queries += 1
                    say(f"  trainguard {fault}: status query failed ({error.message}); retrying")
                    await asyncio.sleep(0.5)
                    continue
                if view.execution_status != "RUNNING":
                    result.note = f"the run ended before the fault: {view.status.reason}"
                    return result
                if view.status.phase.value == "running":
                    attempt = view.status.attempt
            step = rank_step(home, "node-0", run_id, attempt, 0) if attempt else None
            if step is not None and step >= opts.fault_step and passed_at is None:
                passed_at = time.monotonic()
            if passed_at is not None and time.monotonic() - passed_at < PARKED_WAIT_MAX_S \
                    and not parked_ready(home, run_id, warm_on):
                await asyncio.sleep(0.1)  # the steady state: the relaunch it measures is served warm
                continue
            if step is not None and step >= opts.fault_step:
                if parked_ready(home, run_id, warm_on):
                    assert passed_at is not None
                    result.parked_wait_s = round(time.monotonic() - passed_at, 2)
                if cut is not None:
                    await asyncio.to_thread(cut)
                    what = f"every packet to and from {FAULT_NODE} dropped"
                else:
                    injected = await client.inject_fault(run_id, fault, FAULT_NODE, slow_duty=SLOW_DUTY)
                    what = f"{fault} of rank {injected.rank} (pid {injected.pid}) on {FAULT_NODE}"
                landed = rank_step(home, "node-0", run_id, attempt, 0) if attempt else None
                result.fault_step = landed if landed is not None else step
                say(f"  {system} {fault}: {what}; rank 0 at step {step} when asked, {result.fault_step} when done")
                break
            await asyncio.sleep(0.02)
        else:
            result.note = f"step {opts.fault_step} not reached within {timeout_s:.0f}s"
            return result
        if failed_queries:
            result.note = f"{failed_queries} status queries timed out before the fault"
        outcome = await asyncio.wait_for(client.result(run_id), max(1.0, deadline - time.monotonic()))
        finished = True
        incidents = list(outcome.incidents)
        wanted = INCIDENT_KINDS[fault]
        # A straggler is reported first, then replaced when it persists: the figure is the replacement's.
        incident = next((i for i in reversed(incidents) if i.kind.value == wanted),
                        incidents[0] if incidents else None)
        others = [i.kind.value for i in incidents if i is not incident]
        if incident is None:
            result.note = "no incident recorded"
        else:
            if incident.kind.value != wanted:
                kind = f"incident kind {incident.kind.value}"
                result.note = f"{result.note}; {kind}" if result.note else kind
            result.detection_s = incident.detection_s
            result.restart_s = incident.recovery_s
            if incident.detection_s is not None and incident.recovery_s is not None:
                result.time_to_recover_s = round(incident.detection_s + incident.recovery_s, 3)
            first = next((i for i in incidents if i.kind.value == wanted), incident)
            if first is not incident and first.detection_s is not None and result.time_to_recover_s is not None:
                # A straggler: detected when first reported, recovered once the spare replaced it.
                result.detection_s = first.detection_s
                result.restart_s = round(result.time_to_recover_s - first.detection_s, 3)
            if (incident.detection_s is None and incident.recovery_s is not None and incidents[0] is not incident
                    and incidents[0].detection_s is not None):
                # A lost node found at the stop after its peers' hang (a partition): the run noticed at the
                # first incident; the node's recovery_s runs from its own, later, detection.
                first = incidents[0]
                fault_at = first.detected_at - first.detection_s
                result.detection_s = first.detection_s
                result.time_to_recover_s = round(incident.detected_at + incident.recovery_s - fault_at, 3)
                result.restart_s = round(result.time_to_recover_s - first.detection_s, 3)
            result.resumed_step = incident.resumed_step
            result.restore_tier, result.recovery_path = incident.restore_tier, incident.recovery_path
        if others:
            extra = f"other incidents: {', '.join(others)}"
            result.note = f"{result.note}; {extra}" if result.note else extra
        result.goodput = outcome.goodput
        result.wall_s = outcome.wall_s
        result.steps_completed = outcome.steps_completed
        result.completed = outcome.steps_completed == opts.steps
        result.attempts = outcome.attempts
        result.mean_step_s = outcome.mean_step_s
        result.digest = outcome.final_state_digest
        return result
    except TimeoutError:
        result.note = f"the run did not finish within {timeout_s:.0f}s"
        return result
    finally:
        if not finished:
            with suppress(Exception):
                await client.cancel(run_id)


NVML_STANDIN = Path(__file__).resolve().parent / "nvml_standin"
"""A stand-in `pynvml` (`infra/bench/nvml_standin/pynvml.py`) for the gpu fault: the agents subscribe to its XID
events as to a real NVML's, and chaos raises its XID there, so detection is measured on the path a real
XID takes (the event wait, then the watch's next poll). No GPU here."""


@contextmanager
def _nvml_standin(on: bool) -> Iterator[None]:
    """With `on`, the stack's processes import the stand-in NVML (first on PYTHONPATH) while it starts."""
    saved = os.environ.get("PYTHONPATH")
    if on:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(NVML_STANDIN), saved) if p)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def run_trainguard(opts: argparse.Namespace, faults: list[str], work: Path,
                   hosts: bool = False) -> tuple[list[Measurement], dict[str, Any]]:
    from infra.bench.stack import private_stack

    numerics = not hosts and not opts.skip_numerics
    nodes = (*NODES, SPARE) if NODE_FAULTS & set(faults) or numerics else NODES
    info: dict[str, Any] = {"nvml": "stand-in event set (infra/bench/nvml_standin)" if "gpu" in faults else "none"}
    name = "hosts-stack" if hosts else "stack"
    with _nvml_standin("gpu" in faults), private_stack(name, nodes, PORT_SEARCH_START, echo=lambda line: say(f"  {name}: {line}"),
                       keep_logs=work / f"{name}-logs" if opts.keep_logs else None, timings=info, hosts=hosts) as dev:
        info.update(home=str(dev.home), port_base=dev.config.ports.temporal,
                    weed_grpc_ports=dev.config.ports.weed_grpc_ports(), hosts=hosts)
        if hosts:
            info["addresses"] = {node: dev.node_address(node) for node in nodes}
        say(f"  {name} up in {info['stack_up_s']:.1f}s on port base {dev.config.ports.temporal}")
        system = HOSTS_SYSTEM if hosts else "trainguard"
        found = info.setdefault("numerics", {}) if numerics else None
        return asyncio.run(trainguard_faults(opts, faults, dev, system, found)), info


def _tmp_entries() -> set[str]:
    try:
        return set(os.listdir("/tmp"))
    except OSError:
        return set()


# ------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"comma-separated, of {', '.join(FAULTS)} (default all)")
    parser.add_argument("--steps", type=int, default=400, help="training steps per run (default 400)")
    parser.add_argument("--step-time", type=float, default=0.1, help="trainer --step-time (default 0.1)")
    parser.add_argument("--hidden", type=int, default=64, help="trainer --hidden (default 64)")
    parser.add_argument("--every", type=int, default=50, help="checkpoint every N steps (default 50)")
    parser.add_argument("--fault-step", type=int, default=120, help="inject once training passes this step")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON,
                        help=f"results file (default {DEFAULT_JSON})")
    parser.add_argument("--skip-torchrun", action="store_true",
                        help="trainguard only (still measures the floor)")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS),
                        help="the baselines, of torchrun, ft_launcher (default both; ft_launcher needs "
                             "nvidia-resiliency-ext, in the bench extra)")
    parser.add_argument("--skip-trainguard", action="store_true", help="torchrun and the floor only")
    parser.add_argument("--hosts", action="store_true",
                        help=f"also measure the lost-node rows ({', '.join(HOSTS_FAULTS)}) in hosts mode: each node "
                             "in a network namespace of its own (needs root)")
    parser.add_argument("--skip-numerics", action="store_true",
                        help="leave out the numerical rows (a flipped bit, a NaN loss, the fingerprint's overhead)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep torchrun output and the stack's logs under .bench/recovery-logs")
    opts = parser.parse_args(argv)
    faults = [f.strip() for f in opts.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if opts.hosts:
        from trainguard.hosts import unavailable_reason

        if reason := unavailable_reason():
            parser.error(f"--hosts: {reason}")
    if unknown:
        parser.error(f"unknown fault(s): {', '.join(unknown)} (known: {', '.join(FAULTS)})")
    if not 0 < opts.fault_step < opts.steps:
        parser.error("--fault-step must be between 0 and --steps")
    launchers = [name.strip() for name in opts.launchers.split(",") if name.strip()]
    if unknown_launchers := [name for name in launchers if name not in LAUNCHERS]:
        parser.error(f"unknown launcher(s): {', '.join(unknown_launchers)} (known: {', '.join(LAUNCHERS)})")
    if "ft_launcher" in launchers and not (Path(sys.executable).parent / "ft_launcher").exists():
        say("ft_launcher not installed (pip install -e '.[bench]'): measuring torchrun only")
        launchers.remove("ft_launcher")

    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    work = BENCH_DIR / f"recovery-{secrets.token_hex(4)}"
    work.mkdir(parents=True)
    log = work / "torchrun.log"
    tmp_before = _tmp_entries()
    load_before = os.getloadavg()
    started = time.monotonic()
    results: list[Measurement] = []
    floor: Floor | None = None
    stack_info: dict[str, Any] = {}
    say(f"recovery benchmark: {len(faults)} fault(s) {faults}, 2 ranks gloo, {opts.steps} steps x "
        f"{opts.step_time:g}s, checkpoint every {opts.every}, fault after step {opts.fault_step}; "
        f"{os.cpu_count()} CPUs, load {load_before[0]:.2f}")
    try:
        if not opts.skip_trainguard:
            say("trainguard: private dev stack")
            tg_results, stack_info = run_trainguard(opts, faults, work)
            results.extend(tg_results)
        if opts.hosts and not opts.skip_trainguard:
            say("trainguard: private dev stack in hosts mode")
            hosts_results, stack_info["hosts_stack"] = run_trainguard(opts, list(HOSTS_FAULTS), work, hosts=True)
            results.extend(hosts_results)
        say("floor: cold start from a local checkpoint under plain torchrun")
        floor = torchrun_floor(opts, work, log)
        say(f"  floor {fmt(floor.cold_start_s)} s {floor.note}")
        for system in ([] if opts.skip_torchrun else launchers):
            for fault in faults:
                say(f"{system}: {fault}")
                try:
                    measured = torchrun_fault(opts, fault, work, log, system)
                except Exception as error:  # noqa: BLE001 - one failed measurement must not lose the others
                    measured = Measurement(fault=fault, system=system, note=f"error: {error!r}"[:300])
                say(f"  -> {summary(measured)}")
                results.append(measured)
    finally:
        if opts.keep_logs:
            keep = BENCH_DIR / "recovery-logs"
            keep.mkdir(exist_ok=True)
            for item in (log, work / "stack-logs", work / "hosts-stack-logs"):
                if item.exists():
                    target = keep / item.name
                    if item.is_dir():
                        shutil.copytree(item, target, dirs_exist_ok=True)
                    else:
                        shutil.copy2(item, target)
        shutil.rmtree(work, ignore_errors=True)

    order = {f: i for i, f in enumerate(dict.fromkeys([*faults, *(HOSTS_FAULTS if opts.hosts else ())]))}
    systems = ["trainguard", HOSTS_SYSTEM, *LAUNCHERS]
    results.sort(key=lambda m: (order[m.fault], systems.index(m.system)))
    lines, ratios = report(results, floor)
    numerics = stack_info.pop("numerics", None)
    if numerics and "faults" in numerics:
        from infra.bench.recovery_numerics import table

        lines += table(numerics)
    elif numerics:
        lines.append(f"numerical rows not measured: {numerics.get('error')}")
    new_tmp = sorted(_tmp_entries() - tmp_before)
    stack_socks = tuple(f"-{port}.sock" for port in [*stack_info.get("weed_grpc_ports", []),
                                                     *stack_info.get("hosts_stack", {}).get("weed_grpc_ports", [])])
    ours = [n for n in new_tmp if n.startswith(("torchelastic_", "torchinductor_"))
            or (n.startswith("seaweedfs-") and n.endswith(stack_socks))]
    load_after = os.getloadavg()
    say("")
    for line in lines:
        say(line)
    say(f"total {time.monotonic() - started:.0f}s; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} "
        f"after (other jobs may share the CPUs)")
    if ours:
        say(f"warning: new entries in /tmp that look like ours: {ours}")
    payload = {
        "benchmark": "recovery",
        "config": {"faults": faults, "steps": opts.steps, "step_time": opts.step_time, "hidden": opts.hidden,
                   "checkpoint_every": opts.every, "fault_step": opts.fault_step, "nodes": list(NODES),
                   "fault_node": FAULT_NODE, "fault_rank": FAULT_RANK, "hosts": opts.hosts,
                   "torchrun": {"max_restarts": TORCHRUN_MAX_RESTARTS, "pg_timeout_s": TORCHRUN_PG_TIMEOUT_S,
                                "rdzv_backend": "c10d", "share_rdzv_store": False}},
        "machine": machine(load_before, load_after),
        "stack": stack_info,
        "results": [asdict(m) for m in results],
        "floor": asdict(floor) if floor else None,
        "ratios": ratios,
        "numerics": numerics,
        "table": lines,
        "new_tmp_entries": new_tmp,
        "total_s": round(time.monotonic() - started, 3),
    }
    write_results(opts.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
