"""The scheduler hook: tell the cluster's own scheduler (Slurm, Kubernetes) when trainguard cordons a node.

trainguard's node pool already keeps its own runs off a cordoned node. The hook also keeps everyone else's
jobs off it: Slurm drains the node, Kubernetes cordons and taints it. It is off unless the controller's
environment turns it on:

    TRAINGUARD_SCHEDULER=none|slurm|kubernetes   (default none: nothing is run)
    TRAINGUARD_SCHEDULER_COMMAND=/path/to/exe    (default `scontrol` or `kubectl` from PATH)

Commands are argv lists run without a shell, each under a timeout. Both verbs are idempotent: cordoning a
cordoned node, or uncordoning one that never was, succeeds. A command that fails raises, so Temporal retries.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Protocol

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import names
from trainguard.error_types import ErrorType
from activities.models import HOOK_OFF, NotifySchedulerInput, NotifySchedulerResult, SchedulerAction  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

SCHEDULER_ENV = "TRAINGUARD_SCHEDULER"
SCHEDULER_COMMAND_ENV = "TRAINGUARD_SCHEDULER_COMMAND"

COMMAND_TIMEOUT_S = 20.0
"""One `scontrol`/`kubectl` call: an RPC to slurmctld or the API server answers in well under a second;
20 s means it is down or overloaded, and the activity's retry policy, not this call, decides what next."""

TAINT_KEY = "trainguard.io/unhealthy"
"""Kubernetes taint set on a cordoned node (effect NoSchedule); its value is a short form of the reason."""

SLURM_REASON_PREFIX = "trainguard: "
"""Slurm shows the drain reason in `sinfo -R`: the prefix tells an admin who drained the node."""

_MAX_SLURM_REASON = 200
_MAX_LABEL_VALUE = 63


class SchedulerConfigError(ValueError):
    """The hook is misconfigured (unknown scheduler, missing executable, unknown node): retries cannot help."""


class SchedulerCommandFailed(RuntimeError):
    """A scheduler command exited non-zero or timed out: the scheduler may be briefly down, so retry."""


# ------------------------------------------------------------------------------------------ schedulers


class Scheduler(Protocol):
    """What trainguard tells a cluster scheduler. Both calls return the argv of every command they ran."""

    name: str

    def cordon(self, node: str, reason: str) -> list[list[str]]: ...

    def uncordon(self, node: str) -> list[list[str]]: ...


class NoScheduler:
    """The hook is off (the default): nothing is run."""

    name = "none"

    def cordon(self, node: str, reason: str) -> list[list[str]]:
        return []

    def uncordon(self, node: str) -> list[list[str]]:
        return []


class _CommandScheduler(ABC):
    """Runs a scheduler's command line tool; `executable` replaces argv[0] (a full path, or a stand-in)."""

    name = ""
    default_executable = ""

    def __init__(self, executable: str | None = None, timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        self.executable = executable or self.default_executable
        self.timeout_s = timeout_s

    @abstractmethod
    def cordon(self, node: str, reason: str) -> list[list[str]]: ...

    @abstractmethod
    def uncordon(self, node: str) -> list[list[str]]: ...

    def _run(self, args: list[str], tolerate: tuple[str, ...] = ()) -> list[str]:
        """Run `executable args...`; a failure whose stderr contains one of `tolerate` counts as done."""
        argv = [self.executable, *args]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s, check=False)
        except FileNotFoundError as error:
            raise SchedulerConfigError(
                f"{self.executable!r} not found: install it or set {SCHEDULER_COMMAND_ENV} to its path"
            ) from error
        except subprocess.TimeoutExpired as error:
            raise SchedulerCommandFailed(f"{' '.join(argv)}: no answer within {self.timeout_s:.0f}s") from error
        if done.returncode != 0:
            output = (done.stderr or done.stdout).strip()
            if any(marker in output for marker in tolerate):
                log.info("%s: already done (%s)", " ".join(argv), output)
                return argv
            self._raise_if_unknown_node(output, argv)
            raise SchedulerCommandFailed(f"{' '.join(argv)} exited {done.returncode}: {output[-500:]}")
        return argv

    def _raise_if_unknown_node(self, output: str, argv: list[str]) -> None:  # noqa: B027 - a default that knows no message
        """Subclasses recognize 'no such node': the node id differs from the scheduler's node name."""


class SlurmScheduler(_CommandScheduler):
    """Drains the node (`state=drain`: running jobs finish, no new ones start) and resumes it."""

    name = "slurm"
    default_executable = "scontrol"

    def cordon(self, node: str, reason: str) -> list[list[str]]:
        # Draining a drained node succeeds and only updates its reason.
        return [self._run(["update", f"nodename={node}", "state=drain", f"reason={slurm_reason(reason)}"])]

    def uncordon(self, node: str) -> list[list[str]]:
        # Resuming a node that is not drained or down is refused with "Invalid node state specified".
        return [self._run(["update", f"nodename={node}", "state=resume"], tolerate=("Invalid node state",))]

    def _raise_if_unknown_node(self, output: str, argv: list[str]) -> None:
        if "Invalid node name" in output:
            raise SchedulerConfigError(f"{' '.join(argv)}: Slurm has no such node (node ids must be Slurm node "
                                       f"names): {output[-300:]}")


class KubernetesScheduler(_CommandScheduler):
    """Cordons the node (no new pods) and taints it `trainguard.io/unhealthy=<reason>:NoSchedule`."""

    name = "kubernetes"
    default_executable = "kubectl"

    def cordon(self, node: str, reason: str) -> list[list[str]]:
        # `kubectl cordon` of a cordoned node succeeds; `--overwrite` lets a second taint replace the first.
        return [
            self._run(["cordon", node]),
            self._run(["taint", "nodes", node, f"{TAINT_KEY}={taint_value(reason)}:NoSchedule", "--overwrite"]),
        ]

    def uncordon(self, node: str) -> list[list[str]]:
        # Removing a taint the node does not carry fails with `taint "trainguard.io/unhealthy" not found`.
        return [
            self._run(["uncordon", node]),
            self._run(["taint", "nodes", node, f"{TAINT_KEY}-"], tolerate=(f'taint "{TAINT_KEY}" not found',)),
        ]

    def _raise_if_unknown_node(self, output: str, argv: list[str]) -> None:
        if "(NotFound)" in output:
            raise SchedulerConfigError(f"{' '.join(argv)}: Kubernetes has no such node (node ids must be node "
                                       f"names): {output[-300:]}")


def slurm_reason(reason: str) -> str:
    """One line for `scontrol ... reason=`: Slurm refuses an empty reason when draining."""
    text = " ".join(reason.split()) or "cordoned"
    return (SLURM_REASON_PREFIX + text)[:_MAX_SLURM_REASON]


def taint_value(reason: str) -> str:
    """A taint value (a label value: at most 63 of [A-Za-z0-9-_.], alphanumeric at both ends) from the
    reason's head, e.g. 'node_unresponsive: no heartbeat for 10s' -> 'node_unresponsive'."""
    head = reason.split(":", 1)[0]
    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", head.strip())[:_MAX_LABEL_VALUE]
    value = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)
    return value or "cordoned"


_SCHEDULERS: dict[str, type[_CommandScheduler]] = {
    SlurmScheduler.name: SlurmScheduler,
    KubernetesScheduler.name: KubernetesScheduler,
}


def scheduler_from_env(environ: Mapping[str, str] | None = None) -> Scheduler:
    """The scheduler `TRAINGUARD_SCHEDULER` names (none|slurm|kubernetes, default none), run through
    `TRAINGUARD_SCHEDULER_COMMAND` when set. An unknown name raises: a typo must not silently turn it off."""
    env = os.environ if environ is None else environ
    name = env.get(SCHEDULER_ENV, "").strip().lower() or NoScheduler.name
    if name == NoScheduler.name:
        return NoScheduler()
    if name not in _SCHEDULERS:
        raise SchedulerConfigError(
            f"{SCHEDULER_ENV}={name!r}: expected one of none, {', '.join(sorted(_SCHEDULERS))}"
        )
    return _SCHEDULERS[name](executable=env.get(SCHEDULER_COMMAND_ENV) or None)


# ------------------------------------------------------------------------------------------- activity


class SchedulerActivities:
    """Controller-side: the scheduler is chosen once, from the worker's environment, at start-up."""

    def __init__(self, scheduler: Scheduler | None = None) -> None:
        self.scheduler = scheduler if scheduler is not None else scheduler_from_env()

    @activity.defn(name=names.NOTIFY_SCHEDULER)
    async def notify_scheduler(self, request: NotifySchedulerInput) -> NotifySchedulerResult:
        """Cordon or uncordon a node in the cluster's scheduler too. Idempotent; a no-op when the hook is off."""
        if isinstance(self.scheduler, NoScheduler):
            return NotifySchedulerResult()
        try:
            if request.action is SchedulerAction.CORDON:
                commands = await asyncio.to_thread(self.scheduler.cordon, request.node, request.reason)
            else:
                commands = await asyncio.to_thread(self.scheduler.uncordon, request.node)
        except SchedulerConfigError as error:
            raise ApplicationError(str(error), type=ErrorType.SCHEDULER_CONFIG_ERROR, non_retryable=True) from error
        except SchedulerCommandFailed as error:
            raise ApplicationError(str(error), type=ErrorType.SCHEDULER_COMMAND_FAILED) from error
        detail = f"{self.scheduler.name}: {request.action.value} {request.node}"
        log.info("%s (run %s): %s", detail, request.run_id or "-", "; ".join(" ".join(c) for c in commands))
        return NotifySchedulerResult(scheduler=self.scheduler.name, commands=commands, detail=detail)
