"""The unprivileged user a node agent starts its ranks as (`--run-as USER`, `TRAINGUARD_RUN_AS`).

Ranks run user code. Run as the agent's own user they could read everything the agent can: its environment
(`/proc/<agent>/environ`, where the kernel keeps the block the agent started with, whatever the agent later
removes from `os.environ`), its memory, its files. The kernel lets only the same uid (or root) read a
process's environ and memory, so a uid of their own is what keeps the agent's secrets from ranks. The agent
must be root (or hold CAP_SETUID, CAP_SETGID and CAP_CHOWN) to start them as another user; it hands them only
the folders they write (`RunAs.own`).
"""

from __future__ import annotations

import os
import pwd
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict



class PopenUser(TypedDict, total=False):
    """`subprocess.Popen` keywords that start a process as another user (`RunAs.popen_args`); empty: as
    the caller."""

    user: int
    group: int
    extra_groups: list[int]


RUN_AS_ENV = "TRAINGUARD_RUN_AS"
"""The user ranks run as, when `--run-as` is not given."""

ENTER_CHECK_SHELL = "/bin/sh"
"""Runs `RunAs.can_enter`'s check as the user: every Linux node has it, and any user may run it (the agent's
own interpreter may sit under a home the user cannot enter)."""

ENTER_CHECK_TIMEOUT_S = 10.0
"""A `cd` answers in milliseconds; one that takes longer waits on a stuck mount, which a retry may outlast."""


@dataclass(frozen=True, slots=True)
class RunAs:
    """A user ranks run as: its name, uid and primary gid (no supplementary groups)."""

    name: str
    uid: int
    gid: int
    home: str = "/nonexistent"
    """Its home directory in the passwd database (unused: a rank's HOME is its run's tmp folder)."""

    @classmethod
    def named(cls, user: str) -> RunAs:
        """The user `user` (a name or a numeric uid) from the passwd database. Raises ValueError for an
        unknown user, and for root: ranks as root read every secret of the node."""
        try:
            entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
        except KeyError:
            raise ValueError(f"--run-as {user!r}: no such user on this node (create one, e.g. "
                             f"`useradd --system --no-create-home trainguard-rank`, or use nobody)") from None
        if entry.pw_uid == 0:
            raise ValueError(f"--run-as {user!r} is root: ranks as root read every secret of the node; "
                             f"name an unprivileged user")
        return cls(name=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid, home=entry.pw_dir)

    def popen_args(self) -> PopenUser:
        """`subprocess.Popen` keywords that start a process as this user, with its group and no other."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def own(self, *paths: Path) -> None:
        """Give `paths` (folders the agent made for a rank to write into) to this user. Only the folders
        themselves: what is inside is the rank's own already, or the agent's to read."""
        for path in paths:
            os.chown(path, self.uid, self.gid)

    def can_enter(self, path: Path) -> bool:
        """Whether a process of this user (its uid and primary group, no other) can make `path` its working
        directory: the kernel's own judgement, ACLs and all, from a shell started as the user that changes
        into it. `subprocess` enters a `cwd` before it drops to the user, so without this a rank would be
        handed a directory it could never reach itself. Raises `subprocess.TimeoutExpired` when the check hangs
        (a stuck mount: the node's trouble, not the spec's)."""
        done = subprocess.run(  # a fixed argv; the path is an argument, never shell text
            [ENTER_CHECK_SHELL, "-c", 'cd -- "$1"', "sh", str(path)], cwd="/", env={}, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=ENTER_CHECK_TIMEOUT_S,
            **self.popen_args())
        return done.returncode == 0

    def unreachable(self, path: Path, need: int = os.R_OK) -> Path | None:
        """The first of `path` and the folders above it this user cannot pass (search) or, for `path` itself,
        use as `need` says (`os.R_OK`, `os.X_OK`, `os.W_OK`, or-ed); None when it can. Judged from the mode
        bits and owners (not ACLs), as the kernel would for this uid and gid."""
        target = Path(os.path.abspath(path))
        for folder in [*reversed(target.parents), target]:
            try:
                info = folder.stat()
            except OSError:
                return folder
            wanted = need if folder == target else os.X_OK
            if not self._allows(info, wanted):
                return folder
        return None

    def _allows(self, info: os.stat_result, need: int) -> bool:
        if info.st_uid == self.uid:
            shift = 6
        elif info.st_gid == self.gid:
            shift = 3
        else:
            shift = 0
        bits = (info.st_mode >> shift) & 0o7
        wanted = (4 if need & os.R_OK else 0) | (2 if need & os.W_OK else 0) | (1 if need & os.X_OK else 0)
        return bits & wanted == wanted


def run_as_from(value: str | None) -> RunAs | None:
    """The `RunAs` of `--run-as` / `TRAINGUARD_RUN_AS`; None when unset or empty (ranks run as the agent)."""
    value = (value or "").strip()
    return RunAs.named(value) if value else None
