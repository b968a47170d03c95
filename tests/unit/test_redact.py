"""`trainguard.redact`: held secrets and secret-looking values go, what a reader needs of a failure stays."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from activities.models import RankEvidence, WatchEvent, WatchEventKind
from trainguard.redact import REDACTED, redact, redact_model
from trainguard.run_as import RunAs

HELD = "held-0123456789abcdef"


@pytest.mark.parametrize(("text", "expected"), [
    (f"token is {HELD}", f"token is {REDACTED}"),
    (f"x{HELD}y", f"x{REDACTED}y"),  # a held value anywhere, even inside a word
    ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", f"AWS_SECRET_ACCESS_KEY={REDACTED}"),
    ("key wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY!", f"key {REDACTED}!"),
    ("AKIAIOSFODNN7EXAMPLE", REDACTED),
    ("HF_TOKEN=hf_abc PASSWORD=x", f"HF_TOKEN={REDACTED} PASSWORD={REDACTED}"),
    ('{"api_key": "sk-1234"}', f'{{"api_key": "{REDACTED}"}}'),
    ("db_password: hunter2", f"db_password: {REDACTED}"),
    ("Authorization: Bearer eyJ0eXAi.abc.def", f"Authorization: Bearer {REDACTED}"),
    ("https://user:hunter22@example.com/x", f"https://user:{REDACTED}@example.com/x"),
    ("my token 0123456789abcdef0123456789abcdef", f"my token {REDACTED}"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA PRIVATE KEY-----", REDACTED),
    # What a reader needs of a failure is left alone.
    ("KeyError: 'lr'", "KeyError: 'lr'"),
    ("torch.OutOfMemoryError: CUDA out of memory", "torch.OutOfMemoryError: CUDA out of memory"),
    ("commit 3f2a9d8e7c6b5a4938271605f4e3d2c1b0a99887", "commit 3f2a9d8e7c6b5a4938271605f4e3d2c1b0a99887"),
    ('File "/runs/my-token-run/train.py", line 8, in main', 'File "/runs/my-token-run/train.py", line 8, in main'),
    ("sort_key = len", "sort_key = len".replace("len", REDACTED)),  # a name that ends in key: over, not under
])
def test_redact(text: str, expected: str) -> None:
    assert redact(text, [HELD]) == expected
    assert redact(expected, [HELD]) == expected  # idempotent


def test_short_held_values_are_not_searched() -> None:
    assert redact("step 1234 of abc", ["abc", "1234"]) == "step 1234 of abc"


def test_redact_model_redacts_what_ranks_wrote_and_nothing_the_agent_made() -> None:
    event = WatchEvent(kind=WatchEventKind.RANK_EXITED, node="node-a", detected_at=1.0, detail=f"rank 0: {HELD}",
                       log_tail=f"print {HELD}", failure_signature=f"t.py:1 in m: E: {HELD}",
                       log_path=f"/w/runs/{HELD}/rank-00000.log",
                       evidence=[RankEvidence(node="node-a", rank=0, innermost=f"t.py:1 in {HELD}")])

    clean = redact_model(event, [HELD])

    assert HELD not in clean.detail + clean.log_tail + (clean.failure_signature or "") + clean.evidence[0].innermost
    assert clean.log_path == event.log_path and clean.kind is WatchEventKind.RANK_EXITED
    assert HELD in event.detail  # a copy: the original is untouched


def test_run_as_refuses_root_and_unknown_users() -> None:
    with pytest.raises(ValueError, match="is root"):
        RunAs.named("root")
    with pytest.raises(ValueError, match="no such user"):
        RunAs.named("no-such-user-here")


def test_unreachable_names_the_folder_a_user_cannot_pass(open_dir: Path) -> None:
    closed = open_dir / "closed"
    (closed / "inner").mkdir(parents=True)
    closed.chmod(0o700)
    other = RunAs("other", uid=os.getuid() + 12345, gid=os.getgid() + 12345)

    assert other.unreachable(closed / "inner") == closed
    assert other.unreachable(open_dir / "missing") == open_dir / "missing"
    closed.chmod(0o711)
    assert other.unreachable(closed / "inner", os.X_OK) is None
