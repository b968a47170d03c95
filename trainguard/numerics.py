"""What a rank computes to catch training that computes wrong without crashing: the fingerprint of its replicated
state, the judgement of the loss it reports, and the chaos that fakes both faults (`trainguard chaos bitflip|nan`).

Data-parallel replicas hold bit-identical parameters after every optimizer step (DDP, and the replicate dimension of
HSDP), so the fingerprint of one replica's parameters equals every other's: one that differs names the replica a
flipped bit or a bad kernel changed. The fingerprint is exact (the parameters' bits, summed as integers), so a single
flipped bit anywhere changes it, and costs one read of the parameters: on a GPU, a reduction that stays on the
device until its one number is read.

Imports nothing heavy at module level: the rank helper loads it in every rank; torch only inside the functions
that take tensors.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

DEFAULT_FINGERPRINT_EVERY_STEPS = 10
"""`health.fingerprint_every_steps` when a spec does not say. One read of the parameters every 10 steps is well under
1% of a step, which reads them (forward), writes their gradients (backward) and reads and writes them and the
optimizer's state (step) at least once each: `make bench-recovery` measures it against the same run without."""

LOSS_TRAIL_MAX = 64
"""A fingerprint carries at most this many steps' losses (its interval's, at the default of 10 steps)."""

REPLICATED = "replicated"
"""The fingerprint group of plain (not sharded) parameters: every rank of a DDP job holds the same state."""

_MASK = (1 << 64) - 1
_BITS_OF = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}
"""The integer type of each element size: a flipped bit of one element is a flipped bit of its integer."""


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """One rank's fingerprint of its replicated state after `step` steps."""

    step: int
    value: str
    """16 hex digits: the parameters' bits, summed as 64-bit integers (each tensor's sum weighted by its place)."""
    group: str
    """Ranks with the same group hold the same state: `REPLICATED` under DDP, the rank's shard under HSDP
    (`shard 0/2`), its own rank where nothing is replicated (pure FSDP: nothing to compare)."""
    losses: tuple[tuple[int, str], ...] = ()
    """The losses this rank reported since its previous fingerprint, exactly (`float.hex`), by step: what tells
    two replicas apart when they differ with no majority (`activities.fingerprints.settle`). The replica a bit
    flipped in computes its next loss wrong; the other computes that one right and goes wrong a step later, at the
    all-reduce."""

    def to_json(self) -> list[Any]:
        found: list[Any] = [self.step, self.value, self.group]
        return [*found, [list(pair) for pair in self.losses]] if self.losses else found

    @classmethod
    def from_json(cls, data: Any) -> Fingerprint:
        """Raises TypeError, ValueError or IndexError for what is not one."""
        step, value, group = data[0], data[1], data[2]
        trail = data[3] if len(data) > 3 and isinstance(data[3], list) else []
        losses = tuple((int(pair[0]), str(pair[1])[:32]) for pair in trail[-LOSS_TRAIL_MAX:])
        return cls(step=int(step), value=str(value)[:32], group=str(group)[:64], losses=losses)


def local_tensor(param: Any) -> Any:
    """The part of a parameter this rank holds: a DTensor's local shard, else the tensor itself."""
    to_local = getattr(param, "to_local", None)
    return to_local() if callable(to_local) else param


def fingerprint_group(params: Iterable[Any], rank: int) -> str:
    """Which ranks hold the same state as this one: every rank for plain tensors (DDP); for DTensors (FSDP2), the
    ranks at the same coordinate of the mesh's sharded dimensions, which differ only on its replicate dimension
    (HSDP); this rank alone when no dimension replicates (pure FSDP, tensor parallel)."""
    for param in params:
        mesh, placements = getattr(param, "device_mesh", None), getattr(param, "placements", None)
        if mesh is None or placements is None:
            return REPLICATED
        coordinate = mesh.get_coordinate() or []
        replicate = [i for i, p in enumerate(placements) if type(p).__name__ == "Replicate"]
        if not replicate:
            return f"rank {rank}"
        sharded = [f"{coordinate[i]}/{mesh.size(i)}" for i in range(len(placements)) if i not in replicate]
        return f"shard {','.join(sharded)}" if sharded else REPLICATED
    return REPLICATED


def _bits_sum(tensor: Any) -> Any:
    """The tensor's bytes read as 64-bit integers and summed, wrapping (a zero-dimensional tensor on its device): a
    flipped bit changes it by a power of two. Eight bytes at a time where its size and offset allow, which reads
    memory as fast as a float sum does; narrower integers otherwise."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    for width in (torch.int64, torch.int32, torch.int16, torch.uint8):
        try:
            return flat.view(width).sum(dtype=torch.int64)
        except RuntimeError:  # its size or storage offset does not divide by this width
            continue
    raise RuntimeError(f"cannot read the bits of a {tensor.dtype} tensor")


def fingerprint(params: list[Any], step: int, group: str, losses: Iterable[tuple[int, str]] = ()) -> Fingerprint:
    """The exact fingerprint of `params` (this rank's local parts): each tensor's bits summed as integers, the
    sums weighted by place and folded into 64 bits. The reductions stay on the tensors' device and one number comes
    back: one read of the parameters, at memory speed."""
    import torch

    total: Any = None
    with torch.no_grad():
        for place, param in enumerate(params, start=1):
            tensor = local_tensor(param)
            if tensor.numel() == 0:
                continue
            weighted = _bits_sum(tensor) * place
            total = weighted if total is None else total + weighted.to(total.device)
    value = 0 if total is None else int(total.item()) & _MASK
    return Fingerprint(step=step, value=f"{value:016x}", group=group, losses=tuple(losses))


def flip_high_bit(params: list[Any]) -> str:
    """Chaos: flip the highest mantissa bit of one element of the first floating parameter, in place: the element
    changes by up to half its value, as a bit flip in memory or a wrong result of a kernel would, and the loss stays
    plausible (the silent kind, which only a comparison of replicas shows). Returns what was flipped."""
    import torch

    mantissa = {torch.float64: 52, torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
    for index, param in enumerate(params):
        tensor = local_tensor(param)
        if tensor.numel() == 0 or tensor.dtype not in mantissa:
            continue
        with torch.no_grad():
            flat = tensor.data.reshape(-1)
            bits = flat.view(getattr(torch, _BITS_OF[flat.element_size()]))
            before = float(flat[0].item())
            bits[0] ^= 1 << (mantissa[tensor.dtype] - 1)
            return f"parameter {index} element 0: {before!r} -> {float(flat[0].item())!r}"
    raise RuntimeError("no floating parameter to flip a bit of")


def poison_next_forward(model: Any) -> None:
    """Chaos: the model's next forward pass makes NaN from its first module with parameters on (the embedding, the
    first layer), so this rank's loss and gradients are NaN, as an overflow or a bad kernel would make them. Once."""
    first = next((m for m in model.modules() if not list(m.children()) and any(True for _ in m.parameters(False))),
                 model)
    handle: Any = None

    def hook(_module: Any, _inputs: Any, output: Any) -> Any:
        handle.remove()
        if getattr(output, "is_floating_point", lambda: False)():
            return output * float("nan")
        return output

    handle = first.register_forward_hook(hook)


# ------------------------------------------------------------------------------------------------ the loss
LOSS_WINDOW = 50
"""A reported loss is judged against the rank's last this-many losses."""
LOSS_MIN_SAMPLES = 10
"""...once it holds this many: a loss that falls fast in the first steps is not yet a window."""
LOSS_SPIKE_MADS = 20.0
"""A loss above the window's median by more than this many median absolute deviations (and at least
`health.loss_spike_ratio` times the median) is far outside it: a divergence, not the noise of batches."""
DEFAULT_LOSS_SPIKE_RATIO = 100.0
"""`health.loss_spike_ratio` when a spec does not say: a loss a hundred times its recent median. Generous on
purpose: a small model past its fast descent swings to 18 times its median loss now and then (momentum SGD on
examples/train.py at --hidden 16), and a spike that is the data comes back at the same step after the rollback
and stops the run, so a false one costs more than a late one. A model whose loss is steady (a language model)
can set 3 to 5."""


def judge_loss(window: Iterable[float], loss: float, ratio: float = DEFAULT_LOSS_SPIKE_RATIO) -> str | None:
    """Why `loss` is a numerical fault against the recent `window` (a spike: at least `ratio` times its median),
    or None when it is not. Pure."""
    if not math.isfinite(loss):
        return f"loss is {loss}"
    recent = list(window)
    if len(recent) < LOSS_MIN_SAMPLES:
        return None
    median = statistics.median(recent)
    spread = statistics.median(abs(x - median) for x in recent)
    bound = median + max(LOSS_SPIKE_MADS * spread, (ratio - 1) * abs(median))
    if loss > bound:
        return (f"loss {loss:.6g} is far outside its last {len(recent)} steps (median {median:.6g}, "
                f"bound {bound:.6g})")
    return None


class LossWindow:
    """The rank's recent losses; `observe` judges each as it comes. A judged loss stays out of the window."""

    def __init__(self, ratio: float = DEFAULT_LOSS_SPIKE_RATIO) -> None:
        self.recent: deque[float] = deque(maxlen=LOSS_WINDOW)
        self.ratio = ratio

    def observe(self, loss: float) -> str | None:
        why = judge_loss(self.recent, loss, self.ratio)
        if why is None:
            self.recent.append(loss)
        return why
