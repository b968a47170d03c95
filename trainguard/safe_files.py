"""Files in folders a rank can write to, read and written safely: never through a link, never blocking on a FIFO,
never past a size bound, and written whole or not at all. The node agent (root) and the rank helper (the run-as
user) share these folders (`trainguard.protocol`'s files, the hang-evidence channel, logs).

Standard library only: the rank helper imports it inside the user's training script.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any, BinaryIO


def write_json(path: Path, payload: object) -> None:
    """Whole or not at all, never through a link (`replace_file`): ranks and agents read these files while they
    change, and the agent writes some (a parked process's role) into folders a rank writes too."""
    replace_file(path, json.dumps(payload).encode())


READ_MAX_BYTES = 1 << 20
"""The most `read_json` reads of a file. Files of the contract are small (a progress report is under 4 KiB, a
role under 64 KiB), and most sit in folders a rank writes: a bigger one is none of ours, and this bound keeps a
rank's file that grows without end (a link to `/dev/zero`, were it followed) from taking the agent's memory."""

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
"""No link followed at the last part (a rank's link to a file of root's, to `/proc/<agent>/environ`, to a device),
and no wait at the open: a FIFO opened without a writer would block the reader forever."""


def read_regular(path: Path, max_bytes: int = READ_MAX_BYTES, offset: int = 0, whole: bool = True) -> bytes | None:
    """The bytes of `path` from `offset`, when it is a regular file of one link (never through a link, never a
    FIFO, a device or a folder, never a hard link to a file of someone else's): None when it is missing or no
    such file. At most `max_bytes`: with `whole`, a file with more than that past `offset` reads as None;
    without, only its first `max_bytes` past `offset` are read. Never blocks, so it is safe on a file a rank
    can replace, on any thread."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except (OSError, ValueError):
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            return None
        if whole and info.st_size - offset > max_bytes:
            return None
        chunks: list[bytes] = []
        left = max_bytes + 1 if whole else max_bytes  # one more byte tells a file that grew past the bound
        while left > 0:
            chunk = os.pread(fd, min(left, 1 << 16), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        return None if whole and len(data) > max_bytes else data
    except OSError:
        return None
    finally:
        os.close(fd)


def replace_file(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all, never through a link, in any folder (one a rank writes too): the bytes
    go to a new file of a random name beside it, created exclusively and without following a link (a rank
    cannot have planted one under a name it cannot guess, and `O_EXCL` refuses one it did), then renamed over
    `path` (a rename replaces a link there, never follows it)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def open_append(path: Path) -> BinaryIO:
    """`path` opened to append to (made when missing), never through a link and only when it is a regular file of
    one link: the agent opens logs it hands to processes of the run-as user. Raises OSError otherwise."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
                 | os.O_CLOEXEC, 0o666)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            raise OSError(errno.EINVAL, "not a regular file of one link: refused as a log", str(path))
        os.set_blocking(fd, True)  # the process it is handed to writes as to any file
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise


def read_json(path: Path) -> Any:
    """The file's JSON, or None when it is missing, not (yet) whole JSON, or no regular file of at most
    `READ_MAX_BYTES` (`read_regular`): a rank's FIFO, link or endless file in its place reads as none, at once."""
    data = read_regular(path)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None
