"""Redaction of what a node agent sends to Temporal: every text a rank could have written into it.

A rank's log tail, an incident's detail, a failure signature, hang evidence: all of it ends in the run's
history, which anyone who may read the namespace reads. `redact` blanks out of a text the secret values the
agent holds (`trainguard.settings.hold_agent_secrets`) and values that look secret wherever they come from:
an AWS key id or secret key, the value of an assignment to a name that ends in KEY, TOKEN, SECRET,
PASSWORD (`HF_TOKEN=...`, `"api_key": "..."`), a bearer token, a password in a URL, a PEM private key.
It is a net, not a guarantee: a rank that encodes a secret (base64, reversed, split) gets it past any filter;
what keeps a rank from reading the agent's secrets in the first place is a uid of its own (`--run-as`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from enum import Enum
from typing import Any, TypeVar

from pydantic import BaseModel

REDACTED = "[redacted]"

MIN_KNOWN_SECRET_CHARS = 8
"""Held values shorter than this are not searched for: a short value would blank innocent words."""

_NAME = r"[A-Za-z0-9_.-]*(?:key|token|secret|password|passwd|pwd|credentials?)"
_ASSIGNMENT = re.compile(
    rf"""(?ix)
    (?P<name>\b{_NAME})(?![A-Za-z0-9])   # AWS_SECRET_ACCESS_KEY, hf_token, "api_key" (not KeyError)
    (?P<sep>["']?\s*[:=]\s*["']?)        # =, :, "...": "
    (?P<value>(?!\[redacted\])[^\s"',;}})\]]+)
    """)
"""`NAME=value`, `NAME: value`, `"name": "value"`: the value goes, the name stays (it says what went)."""
_AFTER_NAME = re.compile(rf"(?i)(?P<head>\b{_NAME}\b[\s:'\"]{{1,3}})(?P<value>[A-Za-z0-9+/=_-]{{16,}})")
"""A long hex or base64 run just after such a name, without `=` (`token 3f9a...`, `secret is ...`)."""
_BEARER = re.compile(r"(?i)\b(?P<head>bearer|basic|token)\s+(?P<value>(?!\[redacted\])[A-Za-z0-9._~+/=-]{8,})")
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^\s:/@]+:)(?P<value>[^\s@/]+)(?=@)", re.IGNORECASE)
_AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA|AROA|AIDA)[A-Z0-9]{16}\b")
_AWS_SECRET = re.compile(r"(?<![A-Za-z0-9/+=])(?=[A-Za-z0-9/+]*[A-Z])(?=[A-Za-z0-9/+]*[a-z])(?=[A-Za-z0-9/+]*\d)"
                         r"[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])")
"""40 characters of base64 with upper case, lower case and a digit: an AWS secret key (a git sha is hex)."""
_PRIVATE_KEY = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)", re.DOTALL)


def redact(text: str, known: Iterable[str] | None = None) -> str:
    """`text` with every secret value in `known` (default: what this process holds) and every secret-looking
    value replaced by `[redacted]`. Idempotent: redacting twice changes nothing more."""
    if not text:
        return text
    if known is None:
        from trainguard.settings import held_secret_values

        known = held_secret_values()
    # The longest first: a held value that contains another is blanked whole.
    for value in sorted({v for v in known if len(v) >= MIN_KNOWN_SECRET_CHARS}, key=len, reverse=True):
        text = text.replace(value, REDACTED)
    text = _PRIVATE_KEY.sub(REDACTED, text)
    text = _URL_PASSWORD.sub(lambda m: m["head"] + REDACTED, text)
    text = _BEARER.sub(lambda m: f"{m['head']} {REDACTED}", text)
    text = _ASSIGNMENT.sub(lambda m: m["name"] + m["sep"] + REDACTED, text)
    text = _AFTER_NAME.sub(lambda m: m["head"] + REDACTED, text)
    text = _AWS_KEY_ID.sub(REDACTED, text)
    return _AWS_SECRET.sub(REDACTED, text)


IDENTIFIER_FIELDS = frozenset({
    "node", "host", "master_addr", "workflow_id", "chain_id", "bucket", "run_prefix", "key", "manifest_key",
    "stacks_key", "sha256", "path", "log_path", "restore_dir",
})
"""The only text fields `redact_model` leaves alone: ids, addresses, store keys, checksums and paths the agent or
the controller made, which the workflow acts on and which must reach it byte for byte (a redacted restore folder
or store key would break the next launch). Every other text, in any model, list or dict, is redacted: a field
added tomorrow that carries what a rank wrote (an upload error, a state digest, a process state) is covered
without anyone remembering to list it. Add a name here only for a value no rank can write."""

Model = TypeVar("Model", bound=BaseModel)


def redact_value(value: Any, known: Iterable[str] | None = None, name: str = "") -> Any:
    """`value` with `redact` applied to every text in it (models, lists, tuples and dict values, however deep)
    except the fields named in `IDENTIFIER_FIELDS` and enum members; a model comes back as a copy."""
    if known is None:
        from trainguard.settings import held_secret_values

        known = held_secret_values()
    values = list(known)

    def clean(item: Any, field: str) -> Any:
        if isinstance(item, Enum) or field in IDENTIFIER_FIELDS:
            return item
        if isinstance(item, str):
            return redact(item, values)
        if isinstance(item, BaseModel):
            changes = {f: clean(getattr(item, f), f) for f in type(item).model_fields}
            return item.model_copy(update={k: v for k, v in changes.items() if v is not getattr(item, k)})
        if isinstance(item, list):
            return [clean(element, field) for element in item]
        if isinstance(item, tuple):
            return tuple(clean(element, field) for element in item)
        if isinstance(item, dict):
            return {key: clean(element, field) for key, element in item.items()}
        return item

    return clean(value, name)


def redact_model(model: Model, known: Iterable[str] | None = None) -> Model:
    """A copy of `model` with `redact` applied to every text field but `IDENTIFIER_FIELDS`, in nested models,
    lists and dicts too: whatever a node agent returns to Temporal passes through here (`workers.redaction`
    applies it to every node activity's result and failure)."""
    return redact_value(model, known)
