"""The rank helper: a few lines in any torchrun-style script make it a trainguard rank.

```python
from trainguard import rank as tg

run = tg.init()                          # reads the environment the node agent set
state = run.restore()                    # the checkpoint the run restored, verified, or None
if state: model.load_state_dict(state["model"]); opt.load_state_dict(state["optim"])
run.fingerprint(model)                   # optional: replicas compared, so a flipped bit is found
for step in range(run.start_step, total_steps):
    loss = train_one_step(step)          # derive data from `step` so a resume sees the same batches
    run.step_done(step + 1, loss=loss)   # progress heartbeat: steps completed (a NaN loss is a fault)
    if run.should_save(step + 1):
        run.save(step + 1, {"model": model.state_dict(), "optim": opt.state_dict()})
run.finish(digest=tg.state_digest(model))
```

`save` holds training up only for an in-memory copy of the state; the file is written and checksummed by a
background thread, then the node agent uploads it. Sharded state (DTensor: FSDP2, tensor parallel) is saved
with `torch.distributed.checkpoint` and restored into the caller's state dict, resharded:
`run.restore(template)`, where `template()` returns `{"model": model_sd, "optim": optim_sd}` from
`get_state_dict(model, optim)`: it is called only when there is a checkpoint to load (building it initialises
the optimizer's state, which a fresh start must not do). Torch, Python and NumPy RNG states are saved and
restored with every checkpoint, so a script whose data depends only on the step resumes bit-exactly.

Outside trainguard (no `TRAINGUARD_*` environment) every call is a no-op apart from `restore`, which returns
None, so the same script still runs under plain torchrun.
"""

# Over 500 lines on purpose: this is the whole API a training script sees (`init`, `RankRun`, `state_digest`),
# and it reads top to bottom as the contract a rank keeps; its file names and environment come from
# `trainguard.protocol`, its evidence channel from `trainguard.evidence`.

from __future__ import annotations

import collections
import contextlib
import inspect
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from trainguard import evidence as _evidence
from trainguard import numerics as _numerics
from trainguard import protocol as _protocol
from trainguard import safe_files as _safe_files
from trainguard.safe_load import (DCP_DIR, ENV_ALLOW_PICKLE, TEMPLATE_FIX, Template, caller_outside, files_digest,
                                  helper_bytes, helper_from_bytes, load_weights_only, safe_dcp, sha256_file)
from trainguard.state_digest import holds_dtensor, holds_tensor, is_sharded, state_digest  # noqa: F401 - tg.state_digest: the API
from trainguard.settings import env_flag

EXIT_NO_RETRY = _protocol.EXIT_NO_RETRY
"""Exit with this code (EX_CONFIG) for an error a restart cannot fix: the run stops with your message
instead of spending its restart budget."""

_PROGRESS_MIN_INTERVAL_S = 0.05
COMPUTE_STEPS = 15
"""`compute_s` is the median of the rank's last this-many compute times: a persistent slowdown shows within eight
steps, while one long step (a first step that compiles, a rank-0-only evaluation the script counted as compute)
never does. A moving average carried such a step for dozens of steps and made a healthy rank a straggler."""
DCP_GROUP_TIMEOUT_S = 120.0
"""Bound of one DCP save's collectives (planning, metadata): a peer that died mid-save fails the writer
thread within it, never the training thread, which is stopped and relaunched by the agent much sooner."""
_HELPER_KEY = "_trainguard"

DCP_METADATA = f"{DCP_DIR}/.metadata"
FORMAT_TORCH = "torch"
"""One `torch.save` per rank (`rank-NNNNN.pt`): rank r restores shard r mod the checkpoint's world size."""
FORMAT_DCP = "dcp"
"""`torch.distributed.checkpoint`: every rank writes its part, the load reshards to any world size."""
FORMATS = ("auto", FORMAT_TORCH, FORMAT_DCP)


def _helper_key(rank: int) -> str:
    """This rank's own entry in a DCP checkpoint (its step and RNG): per rank, since DCP saves one copy of
    what every rank holds under the same key."""
    return f"{_HELPER_KEY}.rank-{rank:05d}"


def _atomic_write_json(path: Path, payload: dict[str, Any]) -> None:
    _safe_files.write_json(path, payload)


def _snapshot(value: Any) -> Any:
    """A deep copy of tensors into CPU memory, so training can mutate the originals at once."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _snapshot(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_snapshot(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_snapshot(item) for item in value)
    return value


def _rng_state() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RankRun:
    """This rank's view of the run. Create it with `init()`."""

    def __init__(self, environ: dict[str, str] | os._Environ[str] = os.environ, *, replicated: bool = False,
                 checkpoint_format: str = "auto") -> None:
        if checkpoint_format not in FORMATS:
            raise ValueError(f"checkpoint_format {checkpoint_format!r}: choose one of {', '.join(FORMATS)}")
        self.replicated = replicated
        """Every rank holds the same state (DDP): rank 0 alone writes the shard, every rank restores it."""
        self.checkpoint_format = checkpoint_format
        self.managed = _protocol.ENV_PROGRESS_FILE in environ
        self.rank = int(environ.get("RANK", "0"))
        self.world_size = int(environ.get("WORLD_SIZE", "1"))
        self.attempt = int(environ.get(_protocol.ENV_ATTEMPT, "1"))
        self.checkpoint_every = int(environ.get(_protocol.ENV_CHECKPOINT_EVERY, "0"))
        self.start_step = int(environ.get(_protocol.ENV_RESTORE_STEP, "0"))
        self.allow_pickle = env_flag(ENV_ALLOW_PICKLE, False, environ)
        """The node's operator trusts every checkpoint it restores (`ENV_ALLOW_PICKLE`): restores unpickle."""
        self._progress_path = Path(environ[_protocol.ENV_PROGRESS_FILE]) if self.managed else None
        self._checkpoint_dir = Path(environ.get(_protocol.ENV_CHECKPOINT_DIR, ".")) if self.managed else None
        request = environ.get(_protocol.ENV_CHECKPOINT_REQUEST_FILE)
        self._request_path = Path(request) if request else None
        self._request_mtime = 0.0
        self._requested_step: int | None = None
        restore = environ.get(_protocol.ENV_RESTORE_DIR)
        self._restore_dir = Path(restore) if restore else None
        rejoin = environ.get(_protocol.ENV_REJOIN_TIMEOUT_S)
        self.rejoin_timeout_s = float(rejoin) if rejoin and self.managed else None
        """Set when the run has in-process restarts on (`restarts.in_process`); None: `rejoin` re-raises."""
        self.joining = environ.get(_protocol.ENV_JOIN) == _protocol.JOIN_YES
        """This process replaces a rank that died: `restore` takes its state from a live peer."""
        rejoin_file = environ.get(_protocol.ENV_REJOIN_FILE)
        self._rejoin_path = Path(rejoin_file) if rejoin_file else None
        self._writer: threading.Thread | None = None
        self._writer_error: BaseException | None = None
        self._last_write = 0.0
        self._last_step_at: float | None = None
        self._step_time_ema: float | None = None
        self._compute_ema: float | None = None
        """The median of the rank's last `COMPUTE_STEPS` compute times (what it reports as `compute_s`)."""
        self._compute_recent: collections.deque[float] = collections.deque(maxlen=COMPUTE_STEPS)
        self._num_timed_steps = 0
        self._sum_step_s = 0.0
        self._phase: tuple[str, float, float | None] | None = None
        """The named phase the rank is in: (name, unix time it began, expected length)."""
        self._phase_s: dict[str, float] = {}
        self._phase_since_step_s = 0.0
        """Named-phase time since the last step: a step's time leaves it out."""
        self._step = self.start_step
        self._saved: set[int] = set()
        self._dcp_group: Any = None
        self._dcp_stager: Any = None
        self._untemplated_restore: str | None = None
        """Where the script called `restore()` with nothing to load a DCP checkpoint into (file:line)."""
        base = environ.get(_protocol.ENV_EVIDENCE_BASE)
        self._evidence = _evidence.RankChannel(Path(base)).start() if base and self.managed else None
        """Answers the agent's requests for stacks and collective position (see `trainguard.evidence`)."""
        self.fingerprint_every = int(environ.get(_protocol.ENV_FINGERPRINT_EVERY, "0") or 0)
        """Steps between fingerprints of the state `fingerprint` was given (`health.fingerprint_every_steps`)."""
        self._model: Any = None
        self._params: list[Any] = []
        self._fingerprint_group = ""
        self._fingerprints: collections.deque[_numerics.Fingerprint] = collections.deque(
            maxlen=_protocol.FINGERPRINTS_KEPT)
        self._losses = _numerics.LossWindow(float(environ.get(_protocol.ENV_LOSS_SPIKE_RATIO, "0") or 0)
                                            or _numerics.DEFAULT_LOSS_SPIKE_RATIO)
        self._numerical: dict[str, Any] | None = None
        """The first numerical fault of the loss the script reported, as the progress file says it."""
        self._loss_trail: collections.deque[tuple[int, str]] = collections.deque(maxlen=_numerics.LOSS_TRAIL_MAX)
        """Each step's reported loss since the newest fingerprint, exactly: the next fingerprint carries them."""
        if not self.joining:  # a joiner learns its step from its peers, and reports from its first step on
            self._write_progress(force=True)

    # -------------------------------------------------------------------------------------- progress
    def report_uncaught_exceptions(self) -> None:
        """An exception nobody catches ends the script: say so in the progress file at once. The process may
        take seconds more to exit (torch's own teardown, longer on a loaded machine), and a rank silent past
        its hang bound meanwhile would be judged hung, not crashed with its traceback."""
        previous = sys.excepthook

        def hook(kind: type[BaseException], error: BaseException, trace: Any) -> None:
            with contextlib.suppress(Exception):
                self._write_progress(force=True, error=f"{kind.__name__}: {error}"[:500])
            previous(kind, error, trace)

        sys.excepthook = hook

    def _write_progress(self, force: bool = False, **extra: Any) -> None:
        if self._progress_path is None:
            return
        now = time.time()
        if not force and now - self._last_write < _PROGRESS_MIN_INTERVAL_S:
            return
        _protocol.Progress(
            rank=self.rank, pid=os.getpid(), attempt=self.attempt, step=self._step, time=now,
            step_time_s=self._step_time_ema, compute_s=self._compute_ema, timed_steps=self._num_timed_steps,
            evidence=str(self._evidence.paths.base) if self._evidence is not None else None,
            phase=self._phase[0] if self._phase else None, phase_since=self._phase[1] if self._phase else None,
            phase_expected_s=self._phase[2] if self._phase else None, phase_s=dict(self._phase_s) or None,
            fingerprints=[f.to_json() for f in self._fingerprints] or None, numerical=self._numerical,
            **extra,
        ).write(self._progress_path)
        self._last_write = now

    def fingerprint(self, model: Any) -> Any:
        """Take part in the run's check of replicas: every `health.fingerprint_every_steps` steps (and at every
        save) this rank reports an exact fingerprint of `model`'s parameters (its shards, under FSDP2), and the
        run compares replicas' fingerprints, so a replica that computes wrong without crashing (a flipped bit)
        is named and replaced. One line, after wrapping the model (DDP, `fully_shard`); returns `model`. Under
        DDP every rank is a replica; under HSDP the ranks holding the same shard are; pure FSDP has no replicas
        to compare. Also what `trainguard chaos bitflip|nan` acts on. A no-op outside trainguard."""
        if not self.managed:
            return model
        self._model = model
        self._params = [p for p in model.parameters()]
        self._fingerprint_group = _numerics.fingerprint_group(self._params, self.rank)
        if self._evidence is not None:
            self._evidence.fingerprinted = True
        return model

    def _take_fingerprint(self, step: int) -> _numerics.Fingerprint | None:
        if not self._params or (self._fingerprints and self._fingerprints[-1].step == step):
            return self._fingerprints[-1] if self._fingerprints else None
        taken = _numerics.fingerprint(self._params, step, self._fingerprint_group,
                                      losses=[pair for pair in self._loss_trail if pair[0] <= step])
        self._loss_trail.clear()
        self._fingerprints.append(taken)
        return taken

    def _numeric_chaos(self) -> None:
        """`trainguard chaos bitflip|nan`, asked through the evidence channel, on the model `fingerprint` got."""
        channel = self._evidence
        if channel is None or not channel.numeric_chaos or self._model is None:
            return
        mode, channel.numeric_chaos = channel.numeric_chaos, ""
        if mode == "bitflip":
            flipped = _numerics.flip_high_bit(self._params)
            print(f"trainguard chaos: rank {self.rank} flipped a bit at step {self._step}: {flipped}", flush=True)
        else:
            _numerics.poison_next_forward(self._model)
            print(f"trainguard chaos: rank {self.rank}'s next loss and gradients are NaN", flush=True)

    def _managed_loss(self, step: int, loss: Any) -> bool:
        return self.managed and self._judge_loss(step, loss)

    def _judge_loss(self, step: int, loss: Any) -> bool:
        """Judge the loss the script reported; True for the first numerical fault (written at once)."""
        value = float(loss.item() if hasattr(loss, "item") else loss)
        if self._params:
            self._loss_trail.append((step, value.hex()))
        why = self._losses.observe(value)
        if why is None or self._numerical is not None:
            return False
        self._numerical = {"step": step, "loss": value, "detail": why, "at": time.time()}
        return True

    def step_done(self, step: int, compute_s: float | None = None, loss: Any = None) -> None:
        """Report that `step` steps are complete. Call once per training step: it is the heartbeat.

        `compute_s` is this rank's own work in the step, outside collectives (forward pass, data, local
        compute). Step wall times are equal on every rank of a data-parallel job, so this is what shows a
        straggler; without it stragglers are not detected.

        `loss` (a float or a one-element tensor) is the step's loss: one that is NaN or infinite, or far above
        its recent steps, is a numerical fault, and the run rolls back to the checkpoint before it. With
        `fingerprint`, each step's loss also tells two replicas that differ apart (the one a bit flipped in
        computes its next loss wrong first). Reading a GPU tensor's value waits for the step: pass what the
        script reads anyway (its logged loss), every step where it can.
        """
        now = time.monotonic()
        if compute_s is not None:
            self._compute_recent.append(compute_s)
            self._compute_ema = statistics.median(self._compute_recent)
        if self._last_step_at is not None:
            elapsed = max(0.0, now - self._last_step_at - self._phase_since_step_s)
            self._sum_step_s += elapsed
            self._num_timed_steps += 1
            ema = self._step_time_ema
            self._step_time_ema = elapsed if ema is None else 0.8 * ema + 0.2 * elapsed
        self._last_step_at = now
        self._phase_since_step_s = 0.0
        previous, self._step = self._step, step
        fault = loss is not None and self._managed_loss(step, loss)
        if self._params and self.fingerprint_every > 0 and step % self.fingerprint_every == 0:
            self._take_fingerprint(step)
        self._check_saves(step, previous)
        self._write_progress(force=fault)
        if self._evidence is not None:
            self._evidence.on_step(step)  # where a chaos hang asked for takes hold
            self._numeric_chaos()  # after the optimizer step: the next fingerprint sees a flipped bit

    @contextlib.contextmanager
    def phase(self, name: str, expected_s: float | None = None) -> Iterator[None]:
        """Name a phase between steps: an evaluation, a save, an epoch's data loading.

            with run.phase("eval", expected_s=60):
                evaluate(model)

        No script needs this to be safe: a rank busy between steps (CPU, I/O) or waiting in a collective is
        never taken for hung before `health.hang_max_s`. Naming a phase says where the rank is in `run status`,
        the Web UI and the run report (its time counts as the phase's, not as lost), and covers an idle wait the
        agent cannot see through (polling a file, a sleep): a rank idle in a named phase is hung only after twice
        `expected_s`, or `hang_max_s` without it. A phase longer than `hang_max_s` needs `expected_s`. The time in
        a phase does not count as step time. Phases nest: the innermost is shown. A no-op outside trainguard.
        """
        if not name:
            raise ValueError("run.phase(name): give the phase a name, e.g. 'eval', 'save' or 'data'")
        if expected_s is not None and not expected_s > 0:
            raise ValueError(f"run.phase({name!r}, expected_s={expected_s!r}): expected_s must be a positive "
                             "number of seconds, or None")
        outer = self._phase
        began = time.time()
        self._phase = (name[:_protocol.PHASE_NAME_MAX], began, expected_s)
        self._write_progress(force=True)
        try:
            yield
        finally:
            spent = time.time() - began
            key = self._phase[0]
            if key in self._phase_s or len(self._phase_s) < _protocol.PHASES_MAX:
                self._phase_s[key] = self._phase_s.get(key, 0.0) + spent
            if outer is None:
                self._phase_since_step_s += spent
            self._phase = outer
            self._write_progress(force=True)

    def hook_ddp(self, ddp: Any) -> Any:
        """Route a DDP model's gradient all-reduce through trainguard's comm hook: torch's own all-reduce,
        bit for bit, which `trainguard chaos hang --mode skip-collective` can make this rank skip. Call it once,
        right after wrapping the model, before the first backward. Returns `ddp`. A no-op outside trainguard."""
        if self._evidence is not None:
            ddp.register_comm_hook(None, self._evidence.allreduce_hook)
            self._evidence.ddp_hooked = True
        return ddp

    def _check_saves(self, step: int, previous: int) -> None:
        """At a checkpoint step: a replica (`replicated`, rank > 0) records that rank 0's shard is its own.
        Just after one it reported itself (`previous`): a rank that did not save it stops the run with a reason,
        the first time, instead of leaving a checkpoint that can never commit (a script that saves on rank 0
        only). A rank that never reported the step did not pass it: a replica group TorchFT healed from a live
        group's state jumps past it (step 90 to 101), and its peers never wrote that step either."""
        if not self.managed or self.checkpoint_every <= 0 or self._checkpoint_dir is None:
            return
        if self.replicated and self.rank != 0:
            if step % self.checkpoint_every == 0 or step == self._checkpoint_requested():
                self._write_replica(step)
            return
        due = (step - 1) // self.checkpoint_every * self.checkpoint_every
        if due <= self.start_step or due in self._saved or step - 1 != due or previous != due:
            return
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized() or self.world_size < 2:
            return  # a script with no peers (a stand-in, a single process) may simply not checkpoint
        message = (f"trainguard: rank {self.rank} passed checkpoint step {due} (checkpoint.every_steps "
                   f"{self.checkpoint_every}) without run.save({due}, ...): the step can never commit without "
                   f"its shard. Call run.save on every rank, or tg.init(replicated=True) when every rank holds "
                   f"rank 0's state (DDP) and only rank 0 saves.")
        self._stop(message)

    def _write_replica(self, step: int) -> None:
        step_dir = self._checkpoint_dir / _protocol.step_dir_name(step)  # type: ignore[operator]  # callers check it is set
        step_dir.mkdir(parents=True, exist_ok=True)
        self._saved.add(step)
        _atomic_write_json(step_dir / _protocol.shard_meta_name(self.rank),
                           {"rank": self.rank, "step": step, "size_bytes": 0, "sha256": "", "replica_of": 0,
                            **self._fingerprint_meta(step)})

    def _fingerprint_meta(self, step: int) -> dict[str, Any]:
        """The fingerprint of the state saved at `step`, for its shard's meta file: the manifest carries it, and
        a checkpoint whose replicas disagree is never restored."""
        taken = self._take_fingerprint(step) if self._params else None
        return {} if taken is None else {"fingerprint": taken.to_json()}

    # ------------------------------------------------------------------------------------ checkpoints
    def should_save(self, step: int) -> bool:
        """True at every `checkpoint.every_steps` step, and at the step an operator's `checkpoint_now` named."""
        if not self.managed or step <= 0:
            return False
        if self.checkpoint_every > 0 and step % self.checkpoint_every == 0:
            return True
        return step == self._checkpoint_requested()

    def _checkpoint_requested(self) -> int | None:
        """The step of the latest `checkpoint_now`, re-read only when its file changes (a stat per step)."""
        if self._request_path is None:
            return None
        try:
            mtime = self._request_path.stat().st_mtime
        except OSError:
            return self._requested_step
        if mtime != self._request_mtime:
            self._request_mtime = mtime
            request = _protocol.CheckpointRequest.read(self._request_path)
            if request is not None:
                self._requested_step = request.step
        return self._requested_step

    def save(self, step: int, state: dict[str, Any]) -> float:
        """Snapshot `state` into memory and write it in the background. Returns the stall in seconds.

        State holding DTensors (FSDP2 `fully_shard`, tensor parallel; `get_state_dict(model, optim)`) is
        written with `torch.distributed.checkpoint` (DCP): a collective, so every rank calls `save` at the
        same step. Other state is one `torch.save` per rank, unless `init(checkpoint_format="dcp")`. At most
        one staged copy is held in host memory: a save waits for the previous one to be written."""
        if not self.managed or self._checkpoint_dir is None:
            return 0.0
        if self._untemplated_restore is not None and self._format_of(state) == FORMAT_DCP:
            self._stop(f"trainguard: {caller_outside(__file__)}: run.save({step}, ...) writes a "
                       f"torch.distributed.checkpoint (DCP), which only a restore given its template can load, but "
                       f"{self._untemplated_restore} calls run.restore() with none: the run could never "
                       f"resume. {TEMPLATE_FIX}")
        started = time.monotonic()
        # Before the saving flag: a write stuck on a peer that died mid-plan is then judged by the plain hang
        # bound, not the bound plus the checkpoint grace, so the agent stops this rank as hung in time.
        self._wait_for_writer()
        self._saved.add(step)
        if self.replicated and self.rank != 0:
            self._write_replica(step)  # rank 0's shard is this rank's too
            return time.monotonic() - started
        self._write_progress(force=True, saving=True)
        fingerprint = self._fingerprint_meta(step)
        if self._format_of(state) == FORMAT_DCP:
            self._start_dcp_save(step, state, fingerprint)
        else:
            payload = {**_snapshot(state), _HELPER_KEY: {"step": step, "rank": self.rank, "rng": _rng_state()}}
            self._writer = threading.Thread(
                target=self._write_shard, args=(step, payload, holds_tensor(state, is_sharded), fingerprint),
                name=f"trainguard-save-{step}", daemon=True,
            )
            self._writer.start()
        stall = time.monotonic() - started
        self._write_progress(force=True)
        # A save is not a training step: do not let it inflate the next step time.
        self._last_step_at = time.monotonic()
        return stall

    def _format_of(self, state: dict[str, Any]) -> str:
        if self.checkpoint_format != "auto":
            return self.checkpoint_format
        return FORMAT_DCP if holds_dtensor(state) else FORMAT_TORCH

    def _group(self) -> Any:
        """A gloo group of every rank for DCP's planning collectives, which run in the writer thread beside
        training's own (a group of their own, so the two never interleave; CPU, as DCP's async save needs).
        Its timeout bounds a save whose peer died while it was being planned: the writer fails within it, the
        training thread waits on it only at its next save, and the agent has relaunched the attempt long before."""
        import torch.distributed as dist

        if self._dcp_group is None:
            self._dcp_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=DCP_GROUP_TIMEOUT_S))
        return self._dcp_group

    def _start_dcp_save(self, step: int, state: dict[str, Any], fingerprint: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        assert self._checkpoint_dir is not None
        step_dir = self._checkpoint_dir / _protocol.step_dir_name(step)
        (step_dir / DCP_DIR).mkdir(parents=True, exist_ok=True)
        helper = helper_bytes({"step": step, "rank": self.rank, "rng": _rng_state()})
        writer = dcp.FileSystemWriter(str(step_dir / DCP_DIR), single_file_per_rank=True, sync_files=True,
                                      thread_count=1)
        # async_save stages the CPU copy here (the stall), then plans and writes in a thread of its own.
        future = dcp.async_save({**state, _helper_key(self.rank): helper}, storage_writer=writer,
                                process_group=self._group(), **self._stager_argument(dcp.async_save))
        self._writer = threading.Thread(target=self._finish_dcp_save, args=(step, step_dir, future, fingerprint),
                                        name=f"trainguard-save-{step}", daemon=True)
        self._writer.start()

    def _stager_argument(self, async_save: Callable[..., Any]) -> dict[str, Any]:
        """One stager for the rank's life, where this torch has DCP's `DefaultStager` and `async_save` takes
        it: it keeps its CPU copy of each tensor and copies into it again at the next save, so the host holds
        one staged copy (the bound) and later saves allocate nothing. An older torch (the package asks only
        for a floor) stages a fresh CPU copy at each save itself: the same bound, allocated anew."""
        if self._dcp_stager is None:
            if "async_stager" not in inspect.signature(async_save).parameters:
                return {}
            try:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            except ImportError:
                return {}
            self._dcp_stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                            use_async_staging=False, use_non_blocking_copy=False))
        return {"async_stager": self._dcp_stager}

    def _finish_dcp_save(self, step: int, step_dir: Path, future: Any, fingerprint: dict[str, Any]) -> None:
        """Wait for DCP's write, then checksum this rank's files (rank 0's include `.metadata`) and write
        the meta file the agent uploads from."""
        try:
            future.result()
            names = sorted(p.name for p in (step_dir / DCP_DIR).glob(f"__{self.rank}_*.distcp"))
            if self.rank == 0:
                names.append(Path(DCP_METADATA).name)
            files: list[dict[str, Any]] = []
            for name in names:
                path = step_dir / DCP_DIR / name
                files.append({"name": f"{DCP_DIR}/{name}", "size_bytes": path.stat().st_size,
                              "sha256": sha256_file(path)})
            meta = {"rank": self.rank, "step": step, "format": FORMAT_DCP, "files": files,
                    "size_bytes": sum(f["size_bytes"] for f in files), "sha256": files_digest(files), **fingerprint}
            _atomic_write_json(step_dir / _protocol.shard_meta_name(self.rank), meta)
        except BaseException as error:  # noqa: BLE001 - surfaced on the next save or at finish
            self._writer_error = error

    def _write_shard(self, step: int, payload: dict[str, Any], sharded: bool = False,
                     fingerprint: dict[str, Any] | None = None) -> None:
        import torch

        try:
            assert self._checkpoint_dir is not None
            step_dir = self._checkpoint_dir / _protocol.step_dir_name(step)
            step_dir.mkdir(parents=True, exist_ok=True)
            final = step_dir / _protocol.shard_name(self.rank)
            tmp = step_dir / f".rank-{self.rank:05d}.pt.tmp"
            with tmp.open("wb") as handle:
                torch.save(payload, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, final)
            meta: dict[str, Any] = {"rank": self.rank, "step": step, "size_bytes": final.stat().st_size}
            if sharded:
                meta["sharded"] = True  # loads only onto this world size: the run must not shrink onto it
            meta["sha256"] = sha256_file(final)
            meta.update(fingerprint or {})
            # The meta file appears last: the agent treats a shard without it as not written yet.
            _atomic_write_json(step_dir / _protocol.shard_meta_name(self.rank), meta)
        except BaseException as error:  # noqa: BLE001 - surfaced on the next save or at finish
            self._writer_error = error

    def _wait_for_writer(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._writer_error is not None:
            error, self._writer_error = self._writer_error, None
            raise RuntimeError(f"trainguard: writing a checkpoint shard failed: {error}") from error

    def restore(self, state: Template | None = None) -> dict[str, Any] | None:
        """The restored checkpoint's state for this rank (checksum verified), or None for a fresh start.

        A DCP checkpoint loads into the state dict `state()` builds (`get_state_dict(model, optim)` for FSDP2;
        called only then: on a fresh optimizer it is an AdamW step at lr 0, which plain torchrun never takes),
        in place and resharded to this run's world size, and returns it: a collective, so call it on every
        rank. A dict works too. Given neither, a script's first DCP `save` stops the run saying so.
        A `torch.save` checkpoint returns the rank's dict (rank r: shard r mod its world size).

        A rank restarted in process (`joining`) gets the state a live peer holds instead, and `start_step`
        becomes that peer's step. Call it after `init_process_group`, before wrapping the model in DDP: the
        live ranks meet it there from `rejoin`."""
        if self.joining:
            joined, self.start_step = self._agree(None, -1)
            self._step = self.start_step
            return joined
        if state is None:
            self._untemplated_restore = caller_outside(__file__)
        if self._restore_dir is None:
            return None
        if (self._restore_dir / DCP_METADATA).exists():
            if state is None:
                self._stop(f"trainguard: {self._untemplated_restore}: the restored checkpoint is a "
                           f"torch.distributed.checkpoint (DCP), which loads into a template: run.restore() "
                           f"was given none. {TEMPLATE_FIX}")
            return self._restore_dcp(state() if callable(state) else state)
        import pickle

        shard = self._restore_dir / _protocol.shard_name(self.rank)
        meta = json.loads((self._restore_dir / _protocol.shard_meta_name(self.rank)).read_text())
        if sha256_file(shard) != meta["sha256"]:
            raise RuntimeError(f"trainguard: restored shard {shard} does not match its checksum")
        try:
            loaded = load_weights_only(shard, allow_pickle=self.allow_pickle)
        except pickle.UnpicklingError as error:
            self._refuse_restore(shard, error)
        helper = loaded.pop(_HELPER_KEY, None)
        if helper is not None:
            _set_rng_state(helper["rng"])
        return loaded

    def _stop(self, message: str) -> NoReturn:
        """An error no restart can fix: say so on stderr and in the progress file, exit `EXIT_NO_RETRY`."""
        print(message, file=sys.stderr, flush=True)
        self._write_progress(force=True, error=message)
        raise SystemExit(EXIT_NO_RETRY)

    def _refuse_restore(self, path: Path, error: Exception) -> NoReturn:
        """A restore that would unpickle more than weights: the rank stops with `EXIT_NO_RETRY` (a restart
        loads the same checkpoint), saying what was refused and what to change."""
        lines = str(error).splitlines() or [type(error).__name__]
        refused = next((line.strip() for line in lines if "GLOBAL" in line or "names " in line), lines[0])
        refused = refused.removeprefix("WeightsUnpickler error: ").split(" was not an allowed global")[0]
        message = (f"trainguard: rank {self.rank} refused to restore {path}: it holds objects beyond tensors, "
                   f"containers, numbers and strings ({refused[:300]}), and unpickling them could run any code. "
                   f"Save plain state (model.state_dict(), optimizer.state_dict(), ints), or, where every "
                   f"checkpoint a node restores is trusted, its operator sets {ENV_ALLOW_PICKLE}=1 for its agent.")
        self._stop(message)

    def _restore_dcp(self, state: dict[str, Any]) -> dict[str, Any]:
        """Load a DCP checkpoint into `state`. The node agent verified every file against the manifest's
        sha256 before the rank started; its metadata and non-tensor values load weights-only all the same."""
        import pickle

        import torch.distributed.checkpoint as dcp

        assert self._restore_dir is not None
        reader, planner = safe_dcp(self._restore_dir, self.allow_pickle)
        key = _helper_key(self.rank)
        try:
            # A rank the checkpoint's world did not have (the run grew) has no RNG of its own there.
            has_helper = key in reader.read_metadata().state_dict_metadata
            target = {**state, key: b""} if has_helper else dict(state)
            dcp.load(target, storage_reader=reader, planner=planner)
            helper = helper_from_bytes(target.pop(key), self.allow_pickle) if has_helper else None
        except pickle.UnpicklingError as error:
            self._refuse_restore(self._restore_dir / DCP_DIR, error)
        if helper is not None:
            _set_rng_state(helper["rng"])
        state.update({k: v for k, v in target.items() if k in state})
        return state

    # ------------------------------------------------------------------------------ in-process restart
    @property
    def can_rejoin(self) -> bool:
        return self.rejoin_timeout_s is not None and self._rejoin_path is not None

    def rejoin(self, error: BaseException, state: dict[str, Any], step: int) -> int:
        """After a collective failed (a peer died): leave the broken process group, wait for the node agent
        to name the new one, join it with the ranks restarted in the dead ones' places, and hand them
        `state` (this rank's model and optimizer state after `step` steps). Returns the step to go on from;
        the caller keeps its in-memory state, and wraps the model in DDP again.

        Raises `error` again when the run has no in-process restarts, when no new group is named within
        the run's `restarts.rejoin_timeout_s`, or when the live ranks do not agree on the step (one had
        finished a step the others had not): the rank then exits and the run relaunches from a checkpoint."""
        import torch.distributed as dist

        if not self.can_rejoin:
            raise error
        assert self._rejoin_path is not None and self.rejoin_timeout_s is not None
        backend = dist.get_backend() if dist.is_initialized() else "gloo"
        if dist.is_initialized():
            dist.destroy_process_group()
        deadline = time.monotonic() + self.rejoin_timeout_s
        target: _protocol.Rejoin | None = None
        while target is None:
            found = _protocol.Rejoin.read(self._rejoin_path)
            target = found if found is not None and found.attempt > self.attempt else None
            if target is None:
                if time.monotonic() > deadline:
                    raise error
                time.sleep(0.05)
        self._wait_for_writer()  # a save in flight belongs to the attempt it was made in
        self.attempt = target.attempt
        self._progress_path = Path(target.progress_file)
        self._request_path = Path(target.checkpoint_request_file)
        self._request_mtime, self._requested_step = 0.0, None
        os.environ.update({"MASTER_ADDR": target.master_addr, "MASTER_PORT": str(target.master_port),
                           "WORLD_SIZE": str(target.world_size), _protocol.ENV_ATTEMPT: str(self.attempt)})
        # Bounded: if the restarted peers never come, exit and let the run relaunch from a checkpoint.
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=self.rejoin_timeout_s))
        _, agreed = self._agree(state, step)
        self._step, self._last_step_at = agreed, None  # the gap was no training step
        self._write_progress(force=True)
        return agreed

    def _agree(self, state: dict[str, Any] | None, step: int) -> tuple[dict[str, Any] | None, int]:
        """All ranks of a new group: find the live ranks (step >= 0), check they stand at the same step, and
        send the lowest one's state to every rank. Returns (that state, the step)."""
        import torch.distributed as dist

        steps: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(steps, step)
        live = [rank for rank, at in enumerate(steps) if at >= 0]
        if not live:
            raise RuntimeError("trainguard: in-process restart found no live rank to take the state from")
        if len({steps[rank] for rank in live}) != 1:
            raise RuntimeError(f"trainguard: live ranks stand at different steps {steps}: cannot rejoin")
        box = [_snapshot(state) if dist.get_rank() == live[0] else None]
        dist.broadcast_object_list(box, src=live[0])
        return box[0], int(steps[live[0]])

    # ---------------------------------------------------------------------------------------- finish
    def finish(self, digest: str | None = None) -> None:
        """Wait for pending checkpoint writes and report the rank finished (with the model digest)."""
        self._wait_for_writer()
        if self._dcp_stager is not None:
            self._dcp_stager.close()  # frees the staged copy
            self._dcp_stager = None
        mean = self._sum_step_s / self._num_timed_steps if self._num_timed_steps else None
        self._write_progress(force=True, finished=True, digest=digest, mean_step_s=mean)


def standby(poll_s: float = 0.02) -> None:
    """Call first thing in a script, after its imports and before `init_process_group` or any GPU use.

    Returns at once for a rank started as itself (saying so to its node agent: the script parks, so the agent
    may start the run's next ranks ahead of need). A process the agent started ahead of need (parked for a
    relaunch, or a standby of an in-process restart) waits here instead, interpreter and imports loaded, until
    the agent gives it a rank's role: then it returns as that rank, its environment set as for any rank and
    its output sent to that rank's log. Exits if the agent that started it goes away."""
    path = os.environ.get(_protocol.ENV_STANDBY_FILE)
    if path:
        _warm_up()
    _mark(parked=bool(path))
    if not path:
        return
    agent = os.getppid()
    while True:
        role = _protocol.StandbyRole.read(Path(path))
        if role is not None:
            break
        if os.getppid() != agent:
            raise SystemExit(0) from None
        time.sleep(poll_s)
    del os.environ[_protocol.ENV_STANDBY_FILE]
    os.environ.update(role.env)
    if role.log_file:
        _log_to(role.log_file)
    _mark(parked=False)  # the new attempt's mark: its ranks park, as they would started as themselves


def _warm_up() -> None:
    """Pay, while parked, for what torch imports on first use rather than at `import torch`: the first
    optimizer imports `torch._dynamo` (1-4 s here, more than the rest of a relaunch). CPU only, no RNG drawn,
    and nothing for a script that has not imported torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    with contextlib.suppress(Exception):  # a warm-up that fails costs the rank that time later, nothing more
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _mark(parked: bool) -> None:
    """The `StandbyMark` handshake, where the agent asked for it (an older agent asks for none)."""
    path = os.environ.get(_protocol.ENV_STANDBY_MARK)
    if path:
        with contextlib.suppress(OSError):
            _protocol.StandbyMark(os.getpid(), parked=parked).write(Path(path))


def _log_to(path: str) -> None:
    """stdout and stderr (the file descriptors, so child processes and C libraries follow) to `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def init(*, replicated: bool = False, checkpoint_format: str = "auto") -> RankRun:
    """This rank's handle on the run, from the environment the node agent set.

    `replicated=True`: every rank holds the same state (DDP), so rank 0 alone writes the checkpoint's one
    shard and every rank restores from it; a script that saves on rank 0 only needs it. `checkpoint_format`:
    `auto` (DCP for state holding DTensors, else `torch.save` per rank), `torch` or `dcp`."""
    run = RankRun(replicated=replicated, checkpoint_format=checkpoint_format)
    run.report_uncaught_exceptions()
    return run
