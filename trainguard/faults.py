"""The faults `inject_fault` (and `trainguard chaos`) can inject: the names the run's update, the workflow
and the node agent agree on.

Standard library only: workflows import it.
"""

from __future__ import annotations

from enum import StrEnum


class FaultKind(StrEnum):
    """An `inject_fault` fault, as `ChaosRequest.fault` and `InjectFaultInput.fault` carry it (a string on the
    wire: the member is its value)."""

    CRASH = "crash"
    """SIGKILL one rank."""
    HANG = "hang"
    """SIGSTOP one rank (`trainguard chaos hang --mode stop`)."""
    HANG_PYTHON = "hang-python"
    """The rank blocks forever in Python while its process keeps running (`--mode python`)."""
    HANG_SKIP_COLLECTIVE = "hang-skip-collective"
    """The rank skips the gradient all-reduce its peers enter (`--mode skip-collective`)."""
    HANG_IO = "hang-io"
    """The rank blocks in a read that never returns (`--mode io`)."""
    SLOW = "slow"
    """Stop and continue one rank with a duty cycle (`slow_duty`): a straggler."""
    GPU = "gpu"
    """The node's GPU check reports an XID error (`trainguard chaos gpu-fault`)."""
    NODE_DOWN = "node-down"
    """The agent kills its ranks and itself: the machine is gone as far as the run can tell."""
    CORRUPT = "corrupt"
    """A byte of the node's shard of the newest committed checkpoint flips (`trainguard chaos corrupt-checkpoint`)."""
    BITFLIP = "bitflip"
    """One bit of one parameter element of one rank flips after an optimizer step (`trainguard chaos bitflip`)."""
    NAN = "nan"
    """One rank's next loss and gradients are NaN (`trainguard chaos nan`)."""


SIGNALLED = frozenset({FaultKind.CRASH, FaultKind.HANG})
"""Faults the agent carries out with a signal to the rank's own process."""
NUMERIC = frozenset({FaultKind.BITFLIP, FaultKind.NAN})
"""Faults the rank's helper carries out on the model its script handed to `RankRun.fingerprint`."""


def parse_fault(name: str) -> FaultKind | None:
    """The fault called `name`, None for a name no agent knows (the caller refuses it, naming `choices()`)."""
    try:
        return FaultKind(name)
    except ValueError:
        return None


def choices() -> str:
    return ", ".join(kind.value for kind in FaultKind)
