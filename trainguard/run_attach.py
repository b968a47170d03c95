"""When a start may attach to the run already running under its id: only the same spec, from the same Slurm job.

A requeued Slurm job starts its run again under the same id (`slurm-<job id>`) and must find the one it was
doing. But a run id says nothing by itself: anyone who may start a workflow can create `slurm-<next job id>`
ahead, with a spec of their own (entrypoint, env, nodes), and the next job's `trainguard run start` would
attach to it and hand it the job's nodes. So a start records what it started in the run's memo (`start_memo`:
a digest of each top-level field of the spec, beside the Slurm job of `trainguard.slurm_job`), and a later start
under the same id attaches only when `why_not_attach` finds nothing that differs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from trainguard.slurm_job import SLURM_JOB_MEMO, job_memo, recorded_job
from trainguard.spec import RunSpec

SPEC_DIGEST_MEMO = "spec_digest"
"""The run's memo key holding `spec_digests` of the spec its start was asked for."""
DIGEST_HEX_CHARS = 32
"""128 bits of SHA-256 per field: collisions out of reach, the memo small (a few hundred bytes)."""


class RunAttachRefused(ValueError):
    """A run runs under the id a start names, and it is not this start's: another spec or another Slurm job
    (or no record of either). Start under another id, or cancel that run first."""


def spec_digests(spec: RunSpec) -> dict[str, str]:
    """A digest of each top-level field of `spec` (its JSON, keys sorted): equal digests, equal field."""
    fields = spec.model_dump(mode="json")
    return {name: hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode())
            .hexdigest()[:DIGEST_HEX_CHARS] for name, value in sorted(fields.items())}


def start_memo(spec: RunSpec, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The memo a start of `spec` records: its digests, and inside a Slurm job the job (`job_memo`)."""
    return {SPEC_DIGEST_MEMO: spec_digests(spec), **(job_memo(environ) or {})}


def why_not_attach(memo: Mapping[str, Any], spec: RunSpec, environ: Mapping[str, str] | None = None) -> str | None:
    """What differs between the running run (its `memo`) and a start of `spec` in this environment; None when
    nothing does and the start may attach."""
    recorded = memo.get(SPEC_DIGEST_MEMO)
    if not isinstance(recorded, Mapping):
        return ("it records no spec of its start (it was not started by `trainguard run start`, e.g. "
                "`temporal workflow start`, or by a trainguard before runs recorded one)")
    ours = spec_digests(spec)
    differ = sorted(name for name in set(ours) | set(recorded) if ours.get(name) != recorded.get(name))
    problems = [f"its spec differs in {', '.join(differ)}"] if differ else []
    theirs_job, our_job = recorded_job(memo), recorded_job(job_memo(environ) or {})
    if theirs_job != our_job:
        problems.append(f"it was started {_job_words(theirs_job, SLURM_JOB_MEMO in memo)}, this start "
                        f"{_job_words(our_job, our_job is not None)}")
    return "; ".join(problems) or None


def _job_words(job: Any, recorded: bool) -> str:
    if job is None:
        return "in a Slurm job it does not name" if recorded else "outside any Slurm job"
    where = f" on cluster {job.cluster}" if job.cluster else ""
    who = f" of user {job.user}" if job.user else ""
    return f"in Slurm job {job.job_id}{who}{where}"
