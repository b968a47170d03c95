"""Whose fault a failed launch is: the spec's, or the node's. One place decides, for launch, rejoin and the
standby alike.

Whatever a spec names (its `working_dir`, its entrypoint, its env) is user input: an error it causes fails the
run as a typed, non-retryable `BadSpec` naming the field, and the workflow cordons no node for it. Only what the
node itself lacks (file descriptors, memory, processes) is raised as it is, retried, and in the end the node's.
What a rank writes into its own folders (a `step-latest` symlink) is not an error at all: listings skip it
(`trainguard.protocol.step_of_dir_name`).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from temporalio.exceptions import ApplicationError

from trainguard.error_types import SPEC_FAULTS, ErrorType
from trainguard.run_as import RunAs

SPEC_ERRNOS = frozenset({errno.E2BIG, errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOEXEC, errno.ENOTDIR,
                         errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG})
"""OS errors a spec's path or value causes (too big, no such file, no permission, not a program, not a folder,
a name too long): the run's fault. Any other (EMFILE, ENOMEM, EAGAIN, EIO) is the node's, and is retried."""


def classify_launch_error(error: BaseException) -> ErrorType | None:
    """The spec's fault type for an error raised while a launch used the spec's values; None when it is the
    node's (the error is raised as it is, so the retry policy retries it, then the run counts it against the
    node). Call it only around what the spec controls: an EACCES on the agent's own workdir is the node's."""
    if isinstance(error, ApplicationError):
        kind = error.type
        return ErrorType(kind) if error.non_retryable and kind in SPEC_FAULTS else None
    if isinstance(error, (ValueError, TypeError)):  # a NUL byte, a lone surrogate: the value itself is bad
        return ErrorType.BAD_SPEC
    if isinstance(error, OSError) and error.errno in SPEC_ERRNOS:
        return ErrorType.BAD_SPEC
    return None


def spec_error(message: str, node: str) -> ApplicationError:
    """The non-retryable `BadSpec` a launch fails with when the spec is at fault; `message` names the field."""
    return ApplicationError(f"{message} (node {node})", type=ErrorType.BAD_SPEC, non_retryable=True)


@contextmanager
def spec_values(field: str, node: str) -> Iterator[None]:
    """Around code that touches a spec's values: an error classified as the spec's is raised as a `BadSpec`
    naming `field`; the node's are raised as they are."""
    try:
        yield
    except ApplicationError:
        raise
    except Exception as error:
        if classify_launch_error(error) is None:
            raise
        raise spec_error(f"{field}: {_reason(error)}", node) from None


def working_dir(path: str | None, default: Path, node: str, run_as: RunAs | None = None) -> Path:
    """The ranks' directory: the spec's `working_dir`, which must be a directory this node has and, with
    `run_as`, one the ranks' user can enter itself (else a `BadSpec`, whatever the OS says of it), or the agent's
    own `default` (`--code-dir`), whose absence is the node's (the agent checks at start that `run_as` reaches
    it). The agent (root) enters the directory for the rank before it drops to the rank's user, so a directory
    under a folder closed to that user would hand the rank what is inside."""
    if not path:
        if not default.is_dir():  # the operator's to mend: retried, then the node's
            raise ApplicationError(f"the agent's --code-dir {str(default)!r} is no directory on node {node}",
                                   type=ErrorType.NODE_UNAVAILABLE)
        return default
    reason = "does not exist"
    try:
        cwd = Path(path)
        if cwd.is_dir():
            if run_as is None or run_as.can_enter(cwd):
                return cwd
            closed = run_as.unreachable(cwd, os.X_OK)
            reason = (f"is closed to the ranks' user {run_as.name}"
                      + (f" ({_shown(str(closed))} is)" if closed is not None else ""))
        elif cwd.exists():
            reason = "is not a directory"
    except Exception as error:
        if classify_launch_error(error) is None:
            raise
        reason = f"is unusable here ({_reason(error)})"
    raise spec_error(f"working_dir {_shown(path)} {reason}: name a directory every node of the run has and "
                     f"its ranks' user can enter", node)


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror  # without the file name: a 300-character path is the spec's own, said once
    return str(error)


def _shown(value: str, limit: int = 120) -> str:
    shown = repr(value)
    return shown if len(shown) <= limit else f"{shown[:limit]}... ({len(value)} characters)"
