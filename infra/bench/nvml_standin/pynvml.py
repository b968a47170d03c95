"""A stand-in `pynvml` for machines without a GPU: NVML's event-set API over an in-process queue.

Put this folder first on `PYTHONPATH` (`infra.bench.recovery` does, for its gpu fault) and a node agent's
`XidEvents` subscribes to it as it would to the real NVML: `nvmlEventSetCreate`,
`nvmlDeviceRegisterEvents(..., nvmlEventTypeXidCriticalError, ...)`, then its thread blocks in
`nvmlEventSetWait_v2`. `inject_xid(gpu, xid)` raises an XID event on every event set registered for that
GPU, as the driver would; `chaos gpu-fault` calls it when the loaded NVML has it (the real one does not), so
the fault reaches the agent through the same wait a real XID does. The periodic counters read healthy.

Only what trainguard calls is here; the rest of NVML is absent (trainguard skips a query a binding lacks).
`TRAINGUARD_NVML_STANDIN_GPUS` sets the GPU count (default 1).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field

STANDIN = True
"""Marks this module as the stand-in (the real pynvml has no such name)."""

NVML_TEMPERATURE_GPU = 0
nvmlEventTypeXidCriticalError = 0x0000000000000008


class NVMLError(Exception):
    pass


class NVMLError_Timeout(NVMLError):  # pynvml's own name
    pass


class NVMLError_Uninitialized(NVMLError):  # pynvml's own name
    pass


@dataclass(frozen=True)
class _Handle:
    value: int


@dataclass
class _EventSet:
    events: queue.Queue[_EventData] = field(default_factory=queue.Queue)
    devices: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class _EventData:
    device: _Handle
    eventType: int  # pynvml's field names
    eventData: int
    gpuInstanceId: int = 0
    computeInstanceId: int = 0


_lock = threading.Lock()
_sets: list[_EventSet] = []
_initialized = 0
raised: list[tuple[int, int, float]] = []
"""(gpu, xid, unix time) of every event `inject_xid` raised."""
delivered: list[tuple[int, int, float]] = []
"""...and of every event a waiter received from `nvmlEventSetWait_v2`."""


def _count() -> int:
    return int(os.environ.get("TRAINGUARD_NVML_STANDIN_GPUS", "1"))


def _check() -> None:
    if not _initialized:
        raise NVMLError_Uninitialized("NVML not initialized (stand-in)")


def nvmlInit() -> None:  # pynvml's names from here on
    global _initialized
    with _lock:
        _initialized += 1


def nvmlShutdown() -> None:
    global _initialized
    with _lock:
        _initialized = max(0, _initialized - 1)


def nvmlDeviceGetCount() -> int:
    _check()
    return _count()


def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
    _check()
    if not 0 <= index < _count():
        raise NVMLError(f"no GPU {index} (stand-in has {_count()})")
    return _Handle(index)


def nvmlDeviceGetTemperature(handle: _Handle, sensor: int) -> int:
    _check()
    return 40


def nvmlDeviceGetTotalEccErrors(handle: _Handle, error_type: int, counter: int) -> int:
    _check()
    return 0


def nvmlEventSetCreate() -> _EventSet:
    _check()
    created = _EventSet()
    with _lock:
        _sets.append(created)
    return created


def nvmlDeviceRegisterEvents(handle: _Handle, event_types: int, event_set: _EventSet) -> None:
    _check()
    if event_types & nvmlEventTypeXidCriticalError:
        event_set.devices.add(handle.value)


def nvmlEventSetWait_v2(event_set: _EventSet, timeout_ms: int) -> _EventData:
    try:
        data = event_set.events.get(timeout=timeout_ms / 1000)
    except queue.Empty:
        raise NVMLError_Timeout("timeout (stand-in)") from None
    delivered.append((data.device.value, data.eventData, time.time()))
    return data


nvmlEventSetWait = nvmlEventSetWait_v2


def nvmlEventSetFree(event_set: _EventSet) -> None:
    with _lock:
        if event_set in _sets:
            _sets.remove(event_set)


def inject_xid(gpu: int, xid: int) -> int:
    """Raise XID `xid` on GPU `gpu`, as the driver would: an event on every set registered for it. Returns how
    many sets it reached (0: nothing is subscribed)."""
    with _lock:
        targets = [s for s in _sets if gpu in s.devices]
    raised.append((gpu, xid, time.time()))
    for target in targets:
        target.events.put(_EventData(device=_Handle(gpu), eventType=nvmlEventTypeXidCriticalError, eventData=xid))
    return len(targets)
