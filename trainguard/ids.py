"""Run ids a user may choose: checked once, where a run starts, with a message that says what to change.

A run's workflow id names its folder on every node and, by default, its checkpoint namespace in the store. An
id with `..` wedged a finished run (the store refused every upload, so the run stayed Running with its nodes
leased), and an id `/X` wrote into another run's folder. The CLI, the client and the workflow refuse such ids
before anything acts on them. Pure and stdlib-only, so the workflow sandbox can import it.
"""

from __future__ import annotations

import unicodedata

MAX_WORKFLOW_ID_BYTES = 255
"""Longest run id, in UTF-8 bytes: a folder name's limit on Linux file systems (NAME_MAX), well under
Temporal's 1,000-byte default limit on workflow ids."""

_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
"""Unicode categories refused in an id: control characters (newline, tab, NUL, ESC), invisible format
characters (zero-width spaces, bidirectional overrides that make an id read as another), lone surrogates, and
line and paragraph separators. A log line or a folder name holds none of them safely."""


def workflow_id_problem(workflow_id: str) -> str | None:
    """Why `workflow_id` cannot name a run (None when it can)."""
    if not workflow_id:
        return "is empty"
    if "/" in workflow_id:
        return "contains '/': a run id names the run's folder, and '/' would reach into another run's"
    if ".." in workflow_id or workflow_id == ".":
        return "contains '..' (or is '.'): a run id names the run's folder, and the store refuses such keys"
    bad = next((c for c in workflow_id if unicodedata.category(c) in _REFUSED_CATEGORIES), None)
    if bad is not None:
        return f"contains the control character U+{ord(bad):04X}"
    if (size := len(workflow_id.encode("utf-8"))) > MAX_WORKFLOW_ID_BYTES:
        return f"is {size} bytes as UTF-8, more than {MAX_WORKFLOW_ID_BYTES} (MAX_WORKFLOW_ID_BYTES)"
    return None


def validate_workflow_id(workflow_id: str) -> str:
    """`workflow_id` when it can name a run; else a ValueError that names the id and what to change."""
    if (problem := workflow_id_problem(workflow_id)) is not None:
        shown = workflow_id if len(workflow_id) <= 80 else f"{workflow_id[:77]}..."
        raise ValueError(f"run id {shown!r} {problem}: choose an id of letters, digits and '-', '_' or '.' "
                         f"(no '..', no '/', no control characters, at most {MAX_WORKFLOW_ID_BYTES} bytes)")
    return workflow_id
