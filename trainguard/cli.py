"""The `trainguard` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from trainguard.models import SLOW_DUTY_MAX, SLOW_DUTY_MIN, Incident, RunResult
from trainguard.faults import FaultKind
from trainguard.ids import validate_workflow_id
from trainguard.spec import RunSpec, SpecError, close_names


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


# ------------------------------------------------------------------------------------------------ dev
MODE_ENV = {"--hosts": "TRAINGUARD_DEV_HOSTS", "--slurm": "TRAINGUARD_DEV_SLURM", "--tls": "TRAINGUARD_DEV_TLS"}
"""Each of `dev up`'s mode flags and the variable that asks for it too."""


def dev_stack(args: argparse.Namespace) -> Any:
    """The dev stack from the environment and the flags. `up` is the mode asked for (`--hosts`, `--slurm`,
    `--tls` or their variables) whatever mode the home was in before, and refuses when a stack runs there in
    another (`DevStack.check_mode`). Every other command (`status`, `down`, `env`, `promote`, `demo`) finds the
    stack in the mode it runs in; with none running, `status` and `down` also look for what a stack left in
    Slurm or hosts mode (its slurm.conf, its network's state file), whose leftovers `down` removes."""
    from trainguard.devstack import DevStack, StackConfig

    env = dict(os.environ)
    env.update({name: "1" for flag, name in MODE_ENV.items() if getattr(args, flag[2:], False)})
    stack = DevStack(StackConfig.from_env(env))
    action = getattr(args, "action", None)
    if action == "up":
        return stack
    mode = stack.running_mode()
    if mode is None and action in ("status", "down"):
        left = (("--hosts", stack.config.network.state_file.exists()), ("--slurm", stack.slurm.conf.exists()))
        mode = tuple(flag for flag, found in left if found) + (("--tls",) if stack.config.tls else ())
    if mode is None or mode == stack.config.mode:
        return stack
    return DevStack(StackConfig.from_env({**env, **{name: "1" if flag in mode else "0"
                                                    for flag, name in MODE_ENV.items()}}))


def cmd_dev(args: argparse.Namespace) -> int:
    from trainguard.dev_slurm import SlurmUnavailable
    from trainguard.devstack import StackModeConflict
    from trainguard.hosts import HostsUnavailable

    stack = dev_stack(args)
    if args.action == "up":
        try:
            stack.up()
        except StackModeConflict as error:
            print(f"trainguard dev up: {error}", file=sys.stderr)
            return 2
        except HostsUnavailable as error:
            print(f"trainguard dev up --hosts: {error}", file=sys.stderr)
            return 2
        except SlurmUnavailable as error:
            print(f"trainguard dev up --slurm: {error}", file=sys.stderr)
            return 2
    elif args.action == "down":
        stack.down()
    elif args.action == "promote":
        return asyncio.run(_promote(args.build_id, {**os.environ, **stack.client_env()}))
    elif args.action == "env":
        import shlex

        env = stack.worker_env()  # what an agent started outside the stack (a Slurm job's) needs to join it
        for key in sorted(k for k in env if k.startswith(("TRAINGUARD_", "AWS_", "SLURM_CONF"))
                          and env[k] != os.environ.get(k)):
            print(f"export {key}={shlex.quote(env[key])}")
    else:
        for name, pid in stack.status().items():
            where = f" at {stack.node_address(name[6:])}" if stack.config.hosts and name.startswith("agent-") else ""
            print(f"{name:<16} {f'running (pid {pid})' if pid else 'stopped'}{where}")
        print(f"Temporal Web UI: {stack.config.ui_url}")
    return 0


# ----------------------------------------------------------------------------------------- controller
async def _promote(build_id: str | None, environ: dict[str, str] | None = None) -> int:
    """`controller promote` (and `dev promote`): make a controller build current, move the node pool to it,
    print what still runs on other builds. The build: `--build-id`, else the one this code is
    (`TRAINGUARD_BUILD_ID`, else derived from the workflow code, as the controller does)."""
    from temporalio.service import RPCError, RPCStatusCode

    from trainguard.connect import connect
    from trainguard.settings import Settings
    from trainguard.versioning import UNVERSIONED, controller_build_id, promote

    settings = Settings.from_env(environ)
    build = build_id or controller_build_id(settings)
    if build is None:
        print(f"trainguard controller promote: TRAINGUARD_BUILD_ID={UNVERSIONED}: versioning is off, there is no "
              f"build to promote (give --build-id)", file=sys.stderr)
        return 2
    client = await connect(settings)
    try:
        promotion = await promote(client, settings.deployment, build)
    except RPCError as error:
        if error.status is not RPCStatusCode.NOT_FOUND:
            raise
        print(f"trainguard controller promote: build {build} is not in worker deployment {settings.deployment} "
              f"({error.message}): start its controller first; a build is promoted once it polls", file=sys.stderr)
        return 1
    for line in promotion.lines():
        print(line)
    return 0


# ----------------------------------------------------------------------------------------------- spec
def cmd_spec(args: argparse.Namespace) -> int:
    if args.action == "schema":
        _print_json(RunSpec.model_json_schema())
        return 0
    from trainguard.client import load_spec

    try:
        spec = load_spec(args.file)
    except SpecError as error:
        print(error, file=sys.stderr)
        return 2
    _warn_exec_env(args.file, spec)
    print(f"{args.file}: valid ({spec.node_count} nodes x {spec.ranks_per_node} ranks, world size {spec.world_size})")
    return 0


def _warn_exec_env(source: str, spec: RunSpec) -> None:
    """Names node agents refuse unless their operator allows them: the spec is valid, but say so before it runs."""
    for name in spec.exec_env():
        print(f"{source}: warning: env.{name} can change what the ranks run or load or where they write; node "
              f"agents refuse it unless their operator allows it (--allow-env {name})", file=sys.stderr)


# ------------------------------------------------------------------------------------------------ run
def format_incident(incident: Incident) -> str:
    where = incident.node or "-"
    if incident.rank is not None:
        where += f" rank {incident.rank}"
    timing = []
    if incident.detection_s is not None:
        timing.append(f"detected in {incident.detection_s:.2f}s")
    if incident.recovery_s is not None:
        timing.append(f"recovered in {incident.recovery_s:.2f}s")
    if incident.resumed_step is not None:
        timing.append(f"resumed from step {incident.resumed_step}")
    line = f"{incident.kind.value} on {where}: {incident.action.value}; {', '.join(timing)}"
    if incident.evidence:
        line += "".join(f"\n    {part}" for part in incident.evidence.splitlines())
    return line


def summary_line(result: RunResult) -> str:
    recovered = sum(1 for i in result.incidents if i.recovery_s is not None)
    return (f"demo: {result.workflow_id} completed {result.steps_completed} steps, {recovered} incidents "
            f"recovered, goodput {result.goodput * 100:.1f}%")


async def _run_cmd(args: argparse.Namespace) -> int:
    if args.action == "report":
        from trainguard.report import main_report

        return await main_report(args.id, args.png)
    from trainguard.client import TrainguardClient, load_spec
    from trainguard.run_attach import RunAttachRefused

    if args.action == "start":
        try:  # the id names the run's folders: `..` or `/` would wedge it or reach into another run's
            if args.id is not None:
                validate_workflow_id(args.id)
        except ValueError as error:
            print(f"trainguard run start --id: {error}", file=sys.stderr)
            return 2
        try:
            if args.resume_from is not None:
                validate_workflow_id(args.resume_from)
        except ValueError as error:
            print(f"trainguard run start --resume-from: {error}", file=sys.stderr)
            return 2
        try:  # before connecting: a bad file is the user's to fix, whether or not Temporal answers
            spec = load_spec(Path(args.spec))
        except SpecError as error:
            print(error, file=sys.stderr)
            return 2
        if args.nodes or args.spare_nodes:  # e.g. a Slurm job's allocation
            spec = spec.model_copy(update={k: v.split(",") for k, v in
                                           (("nodes", args.nodes), ("spare_nodes", args.spare_nodes)) if v})
            spec = load_spec(spec.model_dump(mode="json", exclude_defaults=True))
        _warn_exec_env(args.spec, spec)
        if args.resume_from is not None and spec.checkpoint.resume_from not in (None, args.resume_from):
            print(f"trainguard run start --resume-from {args.resume_from}: {args.spec} names another run in "
                  f"checkpoint.resume_from ({spec.checkpoint.resume_from}): name one", file=sys.stderr)
            return 2
    client = await TrainguardClient.connect()
    attached = False
    if args.action == "start" and args.id:
        try:  # a requeued Slurm job starts its run again under the same id: it finds the one it was doing
            attached = await client.attach(args.id, spec, resume=args.resume, resume_from=args.resume_from)
        except RunAttachRefused as error:  # someone else's run under this id (made ahead of this job, say)
            print(f"trainguard run start --id: {error}", file=sys.stderr)
            return 2
    if attached:
        print(f"trainguard: run {args.id} is running, started with this spec from this Slurm job: attached to "
              f"it", file=sys.stderr)
        print(args.id)
        if args.wait:
            _print_json((await client.result(args.id)).model_dump(mode="json"))
        return 0
    if args.action == "start":
        earlier = await client.earlier_run(args.id) if args.id else None
        if earlier and not args.resume and spec.checkpoint.namespace is None:
            print(f"trainguard: run id {args.id} was used by an earlier run ({earlier.lower()}): this run starts "
                  f"fresh in a checkpoint namespace of its own (`--resume` restores the earlier run's newest "
                  f"checkpoint instead)", file=sys.stderr)
        elif earlier:
            print(f"trainguard: run id {args.id} was used by an earlier run ({earlier.lower()}): resuming from "
                  f"its newest committed checkpoint", file=sys.stderr)
        if args.resume_from is not None:
            print(f"trainguard: until it commits a checkpoint of its own, this run restores run {args.resume_from}'s "
                  f"newest committed checkpoint, and never prunes that run's checkpoints", file=sys.stderr)
        run_id = await client.start_run(spec, workflow_id=args.id, resume=args.resume, resume_from=args.resume_from)
        print(run_id)
        if not await client.controller_running():
            from trainguard.errors import no_controller_hint

            print(f"trainguard: warning: {no_controller_hint(client.client.service_client.config.target_host)}",
                  file=sys.stderr)
        if args.wait:
            result = await client.result(run_id)
            _print_json(result.model_dump(mode="json"))
        return 0
    if args.action == "logs":
        return await _logs(client, args)
    if args.action == "status":
        view = await client.status(args.id)
        groups = [{"workflow_id": g.workflow_id, "execution": g.execution_status, "phase": g.status.phase.value,
                   "attempt": g.status.attempt, "step": g.status.step, "nodes": g.status.nodes,
                   "spares": g.status.spares, "incidents": len(g.status.incidents), "reason": g.status.reason}
                  for g in view.groups]
        _print_json({"execution": view.execution_status, "rank_steps": view.rank_steps,
                     "long_phases": view.long_phases, **view.status.model_dump(mode="json"),
                     **({"groups": groups} if groups else {})})
    elif args.action == "result":
        _print_json((await client.result(args.id)).model_dump(mode="json"))
    elif args.action == "cancel":
        await client.cancel(args.id)
    elif args.action == "drain":
        answer = await client.drain_node(args.id, args.node, args.reason or "")
        print(f"draining {args.node} at the next checkpoint (run was {answer.phase.value})")
    elif args.action == "checkpoint":
        print(f"every rank checkpoints at step {(await client.checkpoint_now(args.id)).step}")
    elif args.action in ("pause", "resume", "abort"):
        answer = await getattr(client, args.action)(args.id, args.reason or "")
        print(f"{args.action} accepted (run was {answer.phase.value})")
    elif args.action == "list":
        for run_id, status in await client.list_runs(args.query):
            print(f"{status:<12} {run_id}")
    return 0


LOG_TAIL_BYTES = 16 * 1024
"""What `run logs` shows by default: the end of the log, where a traceback is."""
FOLLOW_INTERVAL_S = 1.0


async def _logs(client: Any, args: argparse.Namespace) -> int:
    """`run logs`: the end of a rank's log from its node's agent; `--follow` keeps printing what is added."""
    chunk = await client.rank_log(args.id, args.node, args.rank, args.attempt, tail_bytes=LOG_TAIL_BYTES)
    print(f"==> rank {chunk.rank} on {chunk.node}, attempt {chunk.attempt}: {chunk.path} <==", file=sys.stderr)
    sys.stdout.write(chunk.text)
    sys.stdout.flush()
    while args.follow:
        await asyncio.sleep(FOLLOW_INTERVAL_S)
        chunk = await client.rank_log(args.id, chunk.node, chunk.rank, chunk.attempt, offset=chunk.next_offset)
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    return 0


async def _chaos_cmd(args: argparse.Namespace) -> int:
    from trainguard.client import TrainguardClient

    args.fault = {"gpu-fault": FaultKind.GPU, "corrupt-checkpoint": FaultKind.CORRUPT}.get(args.fault, args.fault)
    if args.node is None and args.rank is None:
        print("trainguard chaos: name the node (--node) or the rank (--rank), whose node is then looked up",
              file=sys.stderr)
        return 2
    if args.fault == FaultKind.HANG:
        from trainguard.evidence import fault_name

        args.fault = fault_name(args.mode)
    elif args.mode != "stop":
        print(f"--mode is for hang only, not {args.fault}", file=sys.stderr)
        return 2
    if args.recurring and args.fault != FaultKind.BITFLIP:
        print(f"--recurring is for bitflip only, not {args.fault}", file=sys.stderr)
        return 2
    client = await TrainguardClient.connect()
    result = await client.inject_fault(args.run, args.fault, args.node, args.rank, args.duty, args.recurring)
    if args.fault == FaultKind.CORRUPT:
        target = f"rank {result.rank}'s shard of checkpoint step {result.step}"
    else:
        target = f"rank {result.rank} (pid {result.pid})" if result.rank >= 0 else "the node"
    print(f"{args.fault}: {target} on {result.node}")
    return 0


async def _nodes_cmd(args: argparse.Namespace) -> int:
    from trainguard.client import TrainguardClient

    client = await TrainguardClient.connect()
    if args.action == "wait":
        from trainguard.pool import wait_for_agents

        wanted = list(args.node)
        missing = await wait_for_agents(client.client, wanted, args.since, args.timeout_s)
        if missing:
            print(f"node agents not up after {args.timeout_s:.0f}s: {', '.join(missing)}", file=sys.stderr)
            return 1
        print(f"node agents up: {', '.join(wanted)}", file=sys.stderr)
        return 0
    if args.action != "list" and len(args.node) != 1:
        print(f"trainguard nodes {args.action}: name one node", file=sys.stderr)
        return 2
    args.node = args.node[0] if args.node else None
    if args.action == "cordon":
        await client.cordon(args.node, args.reason or "")
    elif args.action == "uncordon":
        await client.uncordon(args.node)
    elif args.action == "drain":
        await client.drain_pool_node(args.node)
    for node in await client.nodes():
        by = f" (by run {node.cordoned_by})" if node.cordoned_by else ""
        state = f"cordoned{by}: {node.cordoned}" if node.cordoned else ("draining" if node.draining else "schedulable")
        lease = f"leased to {node.leased_to}" if node.leased_to else "free"
        labels = ",".join(f"{k}={v}" for k, v in sorted(node.labels.items()))
        print(f"{node.node:<16} {state:<40} {lease}" + (f"  {labels}" if labels else ""))
    return 0


# ----------------------------------------------------------------------------------------------- demo
async def run_demo(spec_path: Path, crash_after_step: int, ui_url: str, timeout_s: float,
                   client_env: dict[str, str] | None = None) -> RunResult:
    from trainguard.client import TrainguardClient, load_spec
    from trainguard.settings import Settings

    client = await TrainguardClient.connect(Settings.from_env({**os.environ, **(client_env or {})}))
    spec = load_spec(spec_path)
    run_id = await client.start_run(spec, workflow_id=f"quickstart-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"started {run_id}: {ui_url}/namespaces/default/workflows/{run_id}", flush=True)
    crashed = False
    deadline = time.monotonic() + timeout_s
    last_line = ""
    while True:
        view = await client.status(run_id)
        status = view.status
        steps = " ".join(f"r{r}:{s if s is not None else '-'}" for r, s in view.rank_steps.items())
        ckpt = status.latest_checkpoint.step if status.latest_checkpoint else "-"
        line = (f"  {status.phase.value:<10} attempt {status.attempt}  step {view.live_step:>4}  "
                f"ranks [{steps}]  checkpoint {ckpt}  incidents {len(status.incidents)}")
        if line != last_line:
            print(line, flush=True)
            last_line = line
        if view.execution_status != "RUNNING":
            break
        if not crashed and status.phase.value == "running" and view.live_step >= crash_after_step:
            node = status.nodes[-1]
            fault = await client.inject_fault(run_id, "crash", node)
            print(f"  chaos: killed rank {fault.rank} (pid {fault.pid}) on {node} at step {view.live_step}",
                  flush=True)
            crashed = True
        if time.monotonic() > deadline:
            await client.cancel(run_id)
            raise RuntimeError(f"demo run {run_id} did not finish within {timeout_s:.0f}s; cancelled it")
        await asyncio.sleep(0.5)
    result = await client.result(run_id)
    for incident in result.incidents:
        print(f"  incident: {format_incident(incident)}")
    print(f"  final checkpoint: {result.final_checkpoint.manifest_key if result.final_checkpoint else '-'}")
    print(f"  final state digest: {result.final_state_digest}")
    print(f"  run in the Web UI: {ui_url}/namespaces/default/workflows/{run_id}")
    return result


def cmd_demo(args: argparse.Namespace) -> int:
    """`make demo`: the quickstart on the dev stack, brought up for it and stopped after it unless `--keep`; a
    stack that was up before the demo is left up. Never on a stack in Slurm mode, which has no agents of its
    own until a Slurm job starts them."""
    from trainguard.devstack import StackModeConflict, mode_text
    from trainguard.hosts import HostsUnavailable

    stack = dev_stack(args)  # TRAINGUARD_DEV_HOSTS=1, or a stack up in hosts mode: on three hosts
    was_up = stack.running_mode() is not None
    if stack.config.slurm:
        state = "is up in" if was_up else "would come up in (TRAINGUARD_DEV_SLURM)"
        print(f"trainguard demo: the stack at {stack.home} {state} {mode_text(stack.config.mode)}, where node "
              f"agents come from Slurm jobs only and the demo needs the stack's own: run `trainguard dev down` "
              f"first{'' if was_up else ' and unset TRAINGUARD_DEV_SLURM'}, then `trainguard demo`", file=sys.stderr)
        return 2
    try:
        stack.up()
    except (HostsUnavailable, StackModeConflict) as error:
        print(f"trainguard demo: {error}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run_demo(Path(args.spec), args.crash_after_step, stack.config.ui_url, args.timeout,
                                      stack.client_env()))
        print(summary_line(result), flush=True)
    finally:
        if was_up:
            print(f"the dev stack was up before the demo and is left running (Web UI: {stack.config.ui_url}); "
                  f"stop it with: trainguard dev down")
        elif args.keep:
            print(f"dev stack left running (--keep), Web UI at {stack.config.ui_url}; stop it with: "
                  f"trainguard dev down")
        else:
            stack.down(echo=lambda _line: None)
            print("stopped the dev stack the demo started: the Web UI links above no longer answer. To keep it "
                  "running: make demo DEMO_ARGS=--keep (or trainguard demo --keep)")
    return 0


# ----------------------------------------------------------------------------------------------- main
def _duty(text: str) -> float:
    """`--duty`: refused out of range, never clamped (5 would silently mean 0.95)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not SLOW_DUTY_MIN <= value <= SLOW_DUTY_MAX:
        raise argparse.ArgumentTypeError(f"{value:g} is out of range: give {SLOW_DUTY_MIN} to {SLOW_DUTY_MAX}")
    return value


_INVALID_CHOICE = re.compile(r"invalid choice: (?P<given>.*?) \(choose from (?P<choices>.*)\)$")


class _Parser(argparse.ArgumentParser):
    """argparse, saying "did you mean" for a misspelt command or choice (Python 3.14's `suggest_on_error`; this
    runs on 3.11). Misspelt flags are `main`'s: argparse reports them at the top, not where they were given."""

    def error(self, message: str) -> NoReturn:
        found = _INVALID_CHOICE.search(message)
        if found:
            choices = [c.strip().strip("'\"") for c in found["choices"].split(",")]
            close = close_names(found["given"].strip("'\""), choices)
            if close:
                message += f"; did you mean {' or '.join(close)}?"
        super().error(message)


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command `args` are for: `trainguard run logs` for `run logs ...`."""
    while (sub := _subparsers(parser)) is not None and getattr(args, sub.dest, None) in sub.choices:
        parser = sub.choices[getattr(args, sub.dest)]
    return parser


def _all_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    if (sub := _subparsers(parser)) is not None:
        for child in dict.fromkeys(sub.choices.values()):
            yield from _all_parsers(child)


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]


def unrecognized(extras: list[str], root: argparse.ArgumentParser, chosen: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments" with, for each flag, the flags of that command it may have meant, or
    the commands that take it (`--follow` given to `run status` is `run logs`')."""
    hints = []
    others = [p for p in _all_parsers(root) if p is not chosen]
    for flag in (e.split("=", 1)[0] for e in extras if e.startswith("-")):
        close = close_names(flag, _flags(chosen))
        taking = [p.prog for p in others if flag in _flags(p)]
        elsewhere = [f"{f} ({p.prog})" for p in others for f in close_names(flag, _flags(p)) if f != "--help"]
        if close:
            hints.append(f"{flag}: did you mean {' or '.join(close)}?")
        elif taking:
            hints.append(f"{flag} is a flag of {' and '.join(taking)}")
        elif elsewhere:
            hints.append(f"{flag}: did you mean {' or '.join(elsewhere[:3])}?")
    return f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else "")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="trainguard", description="Keep distributed training running.")
    sub = parser.add_subparsers(dest="command", required=True)

    dev = sub.add_parser("dev", help="the embedded stack: Temporal dev server, SeaweedFS, workers")
    dev.add_argument("action", choices=["up", "down", "status", "env", "promote"],
                     help="env: print the exports an agent outside the stack needs (eval \"$(trainguard dev env)\"); "
                          "promote: `trainguard controller promote` on the stack")
    dev.add_argument("--build-id", help="promote: the controller build (default: the one this code derives)")
    dev.add_argument("--tls", action="store_true",
                     help="reach Temporal over mutual TLS through a front with the stack's own CA "
                          "(also TRAINGUARD_DEV_TLS=1); prints the client settings to export")
    dev.add_argument("--hosts", action="store_true",
                     help="each node agent and its ranks in a network namespace of its own, on a bridge the "
                          "stack makes (also TRAINGUARD_DEV_HOSTS=1; needs root); `down` removes them")
    dev.add_argument("--slurm", action="store_true",
                     help="a single-host Slurm cluster (slurmctld, 4 emulated slurmd nodes, munged) beside the "
                          "stack, and no node agents: Slurm jobs start them (also TRAINGUARD_DEV_SLURM=1; needs "
                          "root and Slurm: make slurm-install); prints the SLURM_CONF clients need")
    dev.set_defaults(func=cmd_dev)

    controller = sub.add_parser("controller", help="the controller's builds (worker versioning)")
    controller_sub = controller.add_subparsers(dest="action", required=True)
    promoting = controller_sub.add_parser(
        "promote", help="make a build current (new runs start on it), move the node pool to it, and list what "
                        "still runs on other builds")
    promoting.add_argument("--build-id", help="default: the build this code is (TRAINGUARD_BUILD_ID, else derived "
                                              "from the workflow code)")
    promoting.set_defaults(func=lambda a: asyncio.run(_promote(a.build_id)))

    spec = sub.add_parser("spec", help="the run spec: print its JSON schema or check a file")
    spec.add_argument("action", choices=["schema", "check"],
                      help="schema: print the run spec's JSON schema; check: validate FILE, naming every field to fix")
    spec.add_argument("file", nargs="?", help="spec file for `check`")
    spec.set_defaults(func=cmd_spec)

    run = sub.add_parser("run", help="start, inspect and stop runs")
    run_sub = run.add_subparsers(dest="action", required=True)
    start = run_sub.add_parser("start", help="start a run from a spec file")
    start.add_argument("spec", help="the run spec, a JSON file (`trainguard spec check` validates one)")
    start.add_argument("--id", help="workflow id (default: run-<random>)")
    start.add_argument("--wait", action="store_true", help="wait for the result and print it")
    start.add_argument("--resume", action="store_true",
                       help="under an id an earlier run used: restore its newest checkpoint (default: start fresh)")
    start.add_argument("--resume-from", metavar="RUN",
                       help="start from run RUN's newest committed checkpoint (its workflow id; recorded in the "
                            "spec as checkpoint.resume_from); this run never prunes RUN's checkpoints")
    start.add_argument("--nodes", metavar="A,B", help="train on these nodes instead of the spec's (e.g. a Slurm "
                                                      "job's allocation)")
    start.add_argument("--spare-nodes", metavar="C,D", help="these spares instead of the spec's")
    run_id = "the run's workflow id"
    for name, text in (("status", "phase, attempt, live step of every rank, incidents, checkpoint (JSON)"),
                       ("result", "wait for the run to end and print its result (JSON)"),
                       ("cancel", "cancel the run: every rank is stopped before it ends")):
        run_sub.add_parser(name, help=text).add_argument("id", help=run_id)
    for name, text in (("pause", "stop the ranks and hold the run until `resume` or `abort`"),
                       ("resume", "relaunch a paused run from its newest checkpoint"),
                       ("abort", "end a paused run; it fails with the reason")):
        operator = run_sub.add_parser(name, help=text)
        operator.add_argument("id", help=run_id)
        operator.add_argument("--reason", help="recorded in the run's history and status")
    drain = run_sub.add_parser("drain", help="move the run off a node at its next checkpoint")
    drain.add_argument("id", help=run_id)
    drain.add_argument("--node", required=True, help="the node to move off (a spare takes its place)")
    drain.add_argument("--reason", help="recorded in the run's history and status")
    run_sub.add_parser("checkpoint", help="checkpoint every rank now").add_argument("id", help=run_id)
    logs = run_sub.add_parser("logs", help="a rank's stdout and stderr, read by its node's agent (like kubectl logs)")
    logs.add_argument("id", help=run_id)
    logs.add_argument("--node", help="default: the node that runs --rank")
    logs.add_argument("--rank", type=int, help="global rank (default: the node's first, or rank 0)")
    logs.add_argument("--attempt", type=int, help="launch attempt (default: the newest on that node)")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing what the rank writes")
    report = run_sub.add_parser("report", help="where the run's wall time went: phases, time lost per incident, "
                                               "goodput (from its history)")
    report.add_argument("id", help=run_id)
    report.add_argument("--png", help="also draw it into this PNG file (needs matplotlib: pip install '.[bench]')")
    listing = run_sub.add_parser("list", help="runs and their execution status")
    listing.add_argument("--query", help="extra visibility query, e.g. \"ExecutionStatus='Running'\"")
    run.set_defaults(func=lambda a: asyncio.run(_run_cmd(a)))

    nodes = sub.add_parser("nodes", help="the node pool: list, cordon, uncordon, drain; wait for agents")
    nodes.add_argument("action", choices=["list", "cordon", "uncordon", "drain", "wait"],
                       help="list: every node, its cordon and lease; cordon: keep the node out of future leases; "
                            "uncordon: lift that; drain: take the node out of the pool once its run releases it; "
                            "wait: until the nodes' agents have registered")
    nodes.add_argument("node", nargs="*", help="the node (wait: the nodes)")
    nodes.add_argument("--reason", help="cordon: recorded with the cordon")
    nodes.add_argument("--since", type=float, default=0.0,
                       help="wait: unix time the agents were started (an older registration does not count)")
    nodes.add_argument("--timeout-s", type=float, default=120.0, help="wait: give up (exit 1) after this long")
    nodes.set_defaults(func=lambda a: asyncio.run(_nodes_cmd(a)))

    chaos = sub.add_parser("chaos", help="inject a fault into a live run through its node agent")
    chaos.add_argument("fault", choices=["crash", "hang", "slow", "gpu-fault", "node-down", "corrupt-checkpoint",
                                         "bitflip", "nan"],
                       help="the fault (see the failure model)")
    chaos.add_argument("--run", required=True, help="workflow id")
    chaos.add_argument("--node", help="the node (default: the one that runs --rank)")
    chaos.add_argument("--rank", type=int, help="global rank (default: the node's first)")
    chaos.add_argument("--duty", type=_duty, default=0.5,
                       help=f"slow: fraction of time the rank is stopped, {SLOW_DUTY_MIN} to {SLOW_DUTY_MAX}")
    chaos.add_argument("--mode", choices=["stop", "python", "skip-collective", "io"], default="stop",
                       help="hang: stop (SIGSTOP, the default), python (blocks forever in Python, process alive), "
                            "skip-collective (skips the all-reduce its peers wait in), io (a read that never "
                            "returns); all but stop are carried out by the rank helper")
    chaos.add_argument("--recurring", action="store_true",
                       help="bitflip: the node's GPU is sick: it flips a bit in every attempt it runs, until its "
                            "agent restarts (two replicas that differ are told apart only by a fault that recurs)")
    chaos.set_defaults(func=lambda a: asyncio.run(_chaos_cmd(a)))

    demo = sub.add_parser("demo", help="bring the stack up, run the quickstart, crash a rank, recover")
    demo.add_argument("--spec", default="examples/quickstart.json", help="the run spec the demo runs")
    demo.add_argument("--crash-after-step", type=int, default=120,
                      help="crash a rank once the run has passed this step")
    demo.add_argument("--timeout", type=float, default=600,
                      help="seconds before the demo gives up and cancels its run")
    demo.add_argument("--keep", action="store_true", help="leave the stack running afterwards")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        chosen = _chosen(parser, args)
        chosen.error(unrecognized(extras, parser, chosen))
    if args.command == "spec" and args.action == "check" and not args.file:
        print("trainguard spec check: give the spec file to check", file=sys.stderr)
        return 2
    if args.command == "nodes" and args.action != "list" and not args.node:
        print(f"trainguard nodes {args.action}: name the node", file=sys.stderr)
        return 2
    return int(args.func(args) or 0)


def entrypoint() -> None:
    """Console-script entry. Exits with os._exit after flushing: the Temporal SDK's native runtime threads
    can abort the interpreter during finalization ("PyGILState_Release"), turning success into a crash."""
    try:
        code = main()
    except KeyboardInterrupt:
        code = 130
    except Exception as error:  # noqa: BLE001 - the CLI's last word: one readable line, not a traceback
        from trainguard.errors import describe_error

        print(f"trainguard: {describe_error(error)}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entrypoint()
