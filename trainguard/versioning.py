"""Worker versioning of the controller: which build it is, the first build made current, promoting a new one.

The controller is versioned by default (`workers.controller.deployment_config`): every run, with its node
groups, is pinned to the build that started it, so an upgrade never replays a history on code that did not
write it. Without `TRAINGUARD_BUILD_ID` the build id is derived from the workflow code (`derived_build_id`);
`TRAINGUARD_BUILD_ID=unversioned` turns versioning off, for a Temporal server without worker deployments.

What the derived id covers: every module of the `workflows` package and every module of this project
(`CODE_PACKAGES`) they import, transitively, wherever in the file the import is (a workflow imports some inside
functions and `imports_passed_through` blocks), but for imports under `if TYPE_CHECKING:`, which never run.
That is the code a workflow's commands and payloads can depend on: the workflows, the pydantic models they
decode (`activities/models.py`, `trainguard/spec.py`, ...), and the helpers they call. It is read as source
text (any edit counts, a comment too: a build id that changes when nothing did costs a drain, one that does not
change when the workflow did costs a non-deterministic replay), by path under the code root, with line endings
made `\\n`: the same checkout, wheel or image gives the same id in every process and on every machine. The
Python, Temporal SDK and pydantic versions are not in it; set `TRAINGUARD_BUILD_ID` to version by image instead.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from collections.abc import Awaitable, Callable

from trainguard import POOL_WORKFLOW_ID, TASK_QUEUE

if TYPE_CHECKING:
    from temporalio.client import Client

    from trainguard.settings import Settings

T = TypeVar("T")

UNVERSIONED = "unversioned"
"""`TRAINGUARD_BUILD_ID=unversioned`: no worker versioning (a server without worker deployments). Every run
then replays on whatever controller build takes its next workflow task."""
CODE_PACKAGES = ("trainguard", "workflows", "activities", "workers")
"""This project's top-level packages (pyproject.toml): imports of anything else are not followed."""
WORKFLOW_PACKAGE = "workflows"
DERIVED_PREFIX = "wf-"
"""Derived build ids read `wf-<digest>`: told apart from a release's own ids at a glance."""
DIGEST_CHARS = 12
"""48 bits of sha256: a collision between two builds of one deployment is not a concern."""
CODE_ROOT = Path(__file__).resolve().parents[1]
"""Where this process's code lives (a checkout, or site-packages for a wheel): the folder of `CODE_PACKAGES`."""

CLAIM_TIMEOUT_S = 30.0
"""How long a starting controller waits for its deployment to appear (at its workers' first poll) to make its
build current when none is. The server answers in well under a second; past this the controller goes on
serving and logs what to run."""
CLAIM_RETRY_S = 0.2
BUSY_RETRY_S = (0.2, 2.0)
"""First and longest wait before asking a busy deployment again. The server takes a few requests at a time per
worker deployment and refuses more (RESOURCE_EXHAUSTED, "too many requests issued to Worker Deployment"): seen
here when a starting controller and `dev up` both asked at once."""
BUSY_TIMEOUT_S = 30.0


async def _call(rpc: Callable[[Any], Awaitable[T]], request: Any) -> T:
    """`rpc(request)`, asked again while the deployment is busy (`BUSY_RETRY_S`), for `BUSY_TIMEOUT_S` at most."""
    from temporalio.service import RPCError, RPCStatusCode

    delay, deadline = BUSY_RETRY_S[0], time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            return await rpc(request)
        except RPCError as error:
            if error.status is not RPCStatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(BUSY_RETRY_S[1], delay * 2)


# --------------------------------------------------------------------------------------------- build id
def _module_file(root: Path, module: str) -> Path | None:
    path = root.joinpath(*module.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(source: bytes, module: str, is_package: bool) -> list[str]:
    """The modules (and `from X import name` candidates `X.name`) the source imports, but under TYPE_CHECKING."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for branch in node.orelse:
                visit(branch)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            found.append(base)
            found.extend(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def workflow_code_files(root: Path = CODE_ROOT) -> dict[str, Path]:
    """Module name -> file of the workflow code under `root`: the `workflows` package and every project module
    it imports, transitively (the module docstring says why these)."""
    package = root / WORKFLOW_PACKAGE
    if not (package / "__init__.py").is_file():
        raise FileNotFoundError(f"no {WORKFLOW_PACKAGE} package under {root}: not a trainguard code root")
    todo = [WORKFLOW_PACKAGE, *(f"{WORKFLOW_PACKAGE}.{p.stem}" for p in package.glob("*.py") if p.stem != "__init__")]
    files: dict[str, Path] = {}
    while todo:
        module = todo.pop()
        if module in files or module.split(".")[0] not in CODE_PACKAGES:
            continue
        path = _module_file(root, module)
        if path is None:  # `from package import name` where name is not a module
            continue
        files[module] = path
        parts = module.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # a module's packages run first
        todo.extend(_imported(path.read_bytes(), module, path.name == "__init__.py"))
    return dict(sorted(files.items()))


@lru_cache(maxsize=8)
def derived_build_id(root: Path = CODE_ROOT) -> str:
    """`wf-<digest>` of the workflow code under `root` (`workflow_code_files`)."""
    digest = hashlib.sha256()
    for path in workflow_code_files(root).values():
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes().replace(b"\r\n", b"\n") + b"\0")
    return DERIVED_PREFIX + digest.hexdigest()[:DIGEST_CHARS]


def controller_build_id(settings: Settings, root: Path = CODE_ROOT) -> str | None:
    """The controller's build: `TRAINGUARD_BUILD_ID` when set, else derived from the code; None for
    `unversioned` (no worker versioning)."""
    if settings.build_id is not None:
        return None if settings.build_id.strip().lower() == UNVERSIONED else settings.build_id.strip()
    return derived_build_id(root)


# ---------------------------------------------------------------------------------------------- server
def version_name(deployment: str, build_id: str) -> str:
    """How visibility writes a version (`TemporalWorkerDeploymentVersion`): `deployment:build`."""
    return f"{deployment}:{build_id}"


async def current_build(client: Client, deployment: str) -> tuple[str | None, bool, bytes]:
    """(the deployment's current build, None for unversioned workers; whether a current version was ever set;
    the conflict token to set it with). Raises RPCError NOT_FOUND before any worker of it polled."""
    from temporalio.api.workflowservice.v1 import DescribeWorkerDeploymentRequest

    described = await _call(client.workflow_service.describe_worker_deployment,
                            DescribeWorkerDeploymentRequest(namespace=client.namespace, deployment_name=deployment))
    routing = described.worker_deployment_info.routing_config
    return (routing.current_deployment_version.build_id or None, routing.HasField("current_version_changed_time"),
            described.conflict_token)


async def claim_first_version(client: Client, deployment: str, build_id: str,
                              timeout_s: float = CLAIM_TIMEOUT_S) -> str | None:
    """Make `build_id` current if its deployment never had a current version (a first deploy: otherwise new runs
    would wait for unversioned workers that do not exist). A deployment with a current build keeps it: a later
    build takes over only when promoted (`promote`). Returns the current build afterwards (None: unversioned,
    set so by an operator). Call it once the build's worker polls: the deployment appears at its first poll."""
    from temporalio.api.workflowservice.v1 import SetWorkerDeploymentCurrentVersionRequest
    from temporalio.service import RPCError, RPCStatusCode

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            current, ever_set, token = await current_build(client, deployment)
            if current is not None or ever_set:
                return current
            # The token makes this a compare-and-set: of two first builds starting at once, one wins.
            await _call(client.workflow_service.set_worker_deployment_current_version,
                        SetWorkerDeploymentCurrentVersionRequest(
                            namespace=client.namespace, deployment_name=deployment, build_id=build_id,
                            conflict_token=token, allow_no_pollers=True,
                            identity=f"trainguard controller {build_id}"))
            return build_id
        except RPCError as error:
            # NOT_FOUND: no poll reached the deployment yet; FAILED_PRECONDITION: another build set it first.
            if error.status not in (RPCStatusCode.NOT_FOUND, RPCStatusCode.FAILED_PRECONDITION) \
                    or time.monotonic() > deadline:
                raise
        await asyncio.sleep(CLAIM_RETRY_S)


@dataclass(frozen=True, slots=True)
class Promotion:
    deployment: str
    build_id: str
    """The build now current."""
    previous: str | None
    """The build current before (None: unversioned workers)."""
    pool_moved: bool
    """The node pool got the auto_upgrade override (False: no pool workflow runs)."""
    older: dict[str, list[str]] = field(default_factory=dict)
    """Other build -> the workflow ids still running on it (runs, and their node groups' children), the node pool
    left out: their builds' controllers must keep running until these end."""

    def lines(self) -> list[str]:
        """What `trainguard controller promote` prints."""
        was = "already" if self.previous == self.build_id else f"was {self.previous or 'unversioned workers'}"
        out = [f"{self.deployment}: {self.build_id} is current ({was}): new runs start on it"]
        out.append(f"node pool: moves to {self.build_id} at its next workflow task (auto_upgrade)" if self.pool_moved
                   else "node pool: not running; the first controller starts it on the current build")
        if not self.older:
            out.append("nothing runs on another build: their controllers may stop")
        for build, ids in sorted(self.older.items()):
            runs = [i for i in ids if "/" not in i]
            children = len(ids) - len(runs)
            out.append(f"still running on {build} (keep its controller until they end): "
                       f"{', '.join(runs) or '-'}" + (f" (+{children} node-group workflows)" if children else ""))
        return out


async def running_on(client: Client, deployment: str, build_id: str) -> list[str]:
    """Workflow ids running on the build (as visibility has it: a moved workflow shows its new build from its
    next workflow task on)."""
    query = (f"TemporalWorkerDeploymentVersion = '{version_name(deployment, build_id)}' "
             f"AND ExecutionStatus = 'Running'")
    return sorted([execution.id async for execution in client.list_workflows(query)])


async def deployment_builds(client: Client, deployment: str) -> list[str]:
    """Every build the deployment knows (each that polled and was not deleted)."""
    from temporalio.api.workflowservice.v1 import DescribeWorkerDeploymentRequest

    described = await _call(client.workflow_service.describe_worker_deployment,
                            DescribeWorkerDeploymentRequest(namespace=client.namespace, deployment_name=deployment))
    return [summary.deployment_version.build_id for summary in described.worker_deployment_info.version_summaries]


async def promote(client: Client, deployment: str, build_id: str) -> Promotion:
    """Make `build_id` current (new runs start on it), move the node pool to it (the one workflow that never ends:
    an auto_upgrade override, so its next workflow task runs on the current build), and list what still runs on
    other builds. Refused (RPCError NOT_FOUND) until a worker of the build has polled. Idempotent."""
    from temporalio.api.common.v1 import WorkflowExecution
    from temporalio.api.workflow.v1 import VersioningOverride, WorkflowExecutionOptions
    from temporalio.api.workflowservice.v1 import (SetWorkerDeploymentCurrentVersionRequest,
                                                   UpdateWorkflowExecutionOptionsRequest)
    from temporalio.api.enums.v1 import VersioningBehavior
    from temporalio.service import RPCError, RPCStatusCode
    from google.protobuf.field_mask_pb2 import FieldMask

    answer = await _call(client.workflow_service.set_worker_deployment_current_version,
                         SetWorkerDeploymentCurrentVersionRequest(
                             namespace=client.namespace, deployment_name=deployment, build_id=build_id,
                             identity="trainguard controller promote"))
    previous = answer.previous_deployment_version.build_id or None
    try:
        await _call(client.workflow_service.update_workflow_execution_options, UpdateWorkflowExecutionOptionsRequest(
            namespace=client.namespace, workflow_execution=WorkflowExecution(workflow_id=POOL_WORKFLOW_ID),
            workflow_execution_options=WorkflowExecutionOptions(versioning_override=VersioningOverride(
                behavior=VersioningBehavior.VERSIONING_BEHAVIOR_AUTO_UPGRADE)),
            update_mask=FieldMask(paths=["versioning_override"])))
        pool_moved = True
    except RPCError as error:
        if error.status is not RPCStatusCode.NOT_FOUND:
            raise
        pool_moved = False
    older: dict[str, list[str]] = {}
    for build in await deployment_builds(client, deployment):
        if build != build_id:
            ids = [i for i in await running_on(client, deployment, build) if i != POOL_WORKFLOW_ID]
            if ids:
                older[build] = ids
    return Promotion(deployment, build_id, previous, pool_moved, older)


async def poller_build(client: Client, identity_prefix: str) -> tuple[bool, str | None]:
    """(whether a workflow poller of the controller's task queue has an identity starting with `identity_prefix`,
    the build it polls as: None when unversioned). The SDK's identity is `<pid>@<host>`: a dev stack finds the
    build of the controller it started by its pid."""
    from temporalio.api.enums.v1 import TaskQueueType
    from temporalio.api.taskqueue.v1 import TaskQueue
    from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

    described = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
        namespace=client.namespace, task_queue=TaskQueue(name=TASK_QUEUE),
        task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW))
    for poller in described.pollers:
        if poller.identity.startswith(identity_prefix):
            return True, poller.deployment_options.build_id or None
    return False, None

