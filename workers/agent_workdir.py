"""The node agent's workdir: made private to the agent, and refused when someone else could have made it.

A job script's default (`/tmp/trainguard-$SLURM_JOB_ID/<node>`, examples/slurm/train.sbatch) is a name anyone
on the node can predict and create first in `/tmp`. The agent writes rank records, shards and restore folders
there as root and launches ranks from it: a folder another user made (or can write) lets that user swap what
the agent reads and where it writes. So the agent creates what is missing with mode 0700 (0711 when ranks run
as another user, who must pass through it to their own folders, never list or write it), and refuses a workdir
owned by another user, one that group or others can write, or one inside a folder another user made in a shared
folder such as `/tmp`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_MODE = 0o700
"""What the agent creates: only its own user reads, writes or enters it."""
TRAVERSE_MODE = 0o711
"""What the agent creates when ranks run as another user (`--run-as`): they may pass through to the folders
handed to them, not list or change the agent's."""
GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UnsafeWorkdir(ValueError):
    """The workdir (or a folder above it) could have been made or changed by another user: the agent does not
    start on it. Say which, and what to do instead."""


def prepare_workdir(path: Path, ranks_as_other_user: bool = False, uid: int | None = None) -> Path:
    """Create `path` (and its missing parents) private to the agent's user `uid` (default: the effective one),
    or check the one there; return it resolved. Raise `UnsafeWorkdir` naming the folder that fails."""
    uid = os.geteuid() if uid is None else uid
    mode = TRAVERSE_MODE if ranks_as_other_user else PRIVATE_MODE
    target = Path(os.path.abspath(path))
    in_shared = False
    for folder in [*reversed(target.parents), target]:
        try:
            os.mkdir(folder, mode)
            os.chmod(folder, mode)  # the umask may have taken bits away; never more than `mode`
        except FileExistsError:
            pass
        in_shared = _check(folder, uid, mine=folder == target, in_shared=in_shared)
    return target.resolve()


def _check(folder: Path, uid: int, mine: bool, in_shared: bool) -> bool:
    """Raise `UnsafeWorkdir` when `folder` (the workdir itself when `mine`; `in_shared`: its parent is a
    shared folder such as /tmp) is not safe; return whether `folder` is a shared folder itself."""
    info = os.lstat(folder)
    if stat.S_ISLNK(info.st_mode):
        # A link in a shared folder points wherever its maker chose: only a root-owned one (a system layout
        # such as /var/run -> /run) is followed.
        if info.st_uid != 0:
            raise UnsafeWorkdir(f"--workdir: {folder} is a link made by uid {info.st_uid}, not by root: choose a "
                                f"workdir whose path has no link another user made")
        info = os.stat(folder)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeWorkdir(f"--workdir: {folder} is not a folder: choose another workdir")
    shared = info.st_mode & GROUP_OTHER_WRITE and not info.st_mode & stat.S_ISVTX
    if shared or (mine and info.st_mode & GROUP_OTHER_WRITE):
        raise UnsafeWorkdir(f"--workdir: {folder} (mode {stat.S_IMODE(info.st_mode):o}) is writable by group or "
                            f"others, who could swap what the agent reads and writes there: remove those bits "
                            f"(chmod go-w) or choose a workdir of the agent's own")
    # A folder above the workdir may be another user's (an operator's home) unless it sits in a shared folder,
    # where anyone could have made it first.
    if (mine and info.st_uid != uid) or (in_shared and info.st_uid not in (uid, 0)):
        raise UnsafeWorkdir(f"--workdir: {folder} belongs to uid {info.st_uid}, not to the agent's user (uid "
                            f"{uid}): another user made it first (a predictable name in a shared folder such as "
                            f"/tmp); choose a workdir of the agent's own (TRAINGUARD_WORKDIR, or a folder under "
                            f"the job's private tmp)")
    return bool(info.st_mode & stat.S_IWOTH)
