"""Node health: GPU checks through NVML (`pynvml`), pure rules over what NVML reports.

Without NVML (no driver, no GPU) the checks report "unavailable" and never fail a run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from temporalio import activity

from activities import names
from activities.models import CheckNodeInput, CheckNodeResult, GpuHealth

log = logging.getLogger(__name__)

# Above this a GPU throttles hard and errors become likely; NVML's own slowdown threshold is close to it.
MAX_GPU_TEMPERATURE_C = 90


@dataclass(frozen=True, slots=True)
class GpuReading:
    index: int
    temperature_c: int | None = None
    ecc_uncorrectable: int = 0
    retired_pages_pending: bool = False
    row_remap_pending: bool = False
    row_remap_failed: bool = False
    hw_slowdown: bool = False
    recovery_action: int = 0
    """NVML's GPU recovery action field where the driver offers it: 0 means none needed."""


def judge_gpus(readings: list[GpuReading]) -> GpuHealth:
    """Unhealthy on anything a restart on the same GPU would not fix."""
    problems: list[str] = []
    for gpu in readings:
        if gpu.ecc_uncorrectable:
            problems.append(f"GPU {gpu.index}: {gpu.ecc_uncorrectable} uncorrectable ECC errors")
        if gpu.retired_pages_pending:
            problems.append(f"GPU {gpu.index}: retired pages pending (reset needed)")
        if gpu.row_remap_pending or gpu.row_remap_failed:
            problems.append(f"GPU {gpu.index}: row remap {'failed' if gpu.row_remap_failed else 'pending'}")
        if gpu.recovery_action:
            problems.append(f"GPU {gpu.index}: NVML recovery action {gpu.recovery_action} requested")
        if gpu.temperature_c is not None and gpu.temperature_c >= MAX_GPU_TEMPERATURE_C:
            problems.append(f"GPU {gpu.index}: {gpu.temperature_c} C")
        if gpu.hw_slowdown:
            problems.append(f"GPU {gpu.index}: hardware slowdown (thermal or power brake)")
    return GpuHealth(
        available=True,
        healthy=not problems,
        detail="; ".join(problems) or f"{len(readings)} GPUs healthy",
        num_gpus=len(readings),
    )


class NvmlBackend:
    """Reads the real GPUs through pynvml. Each query a driver lacks is skipped, not fatal."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml

    def _try(self, query: str, *args: Any, default: Any = None) -> Any:
        """Call `nvml.<query>(*args)`; a query this binding or driver lacks gives `default`."""
        fn = getattr(self.nvml, query, None)
        if fn is None:
            return default
        try:
            return fn(*args)
        except self.nvml.NVMLError:
            return default

    def _recovery_action(self, handle: Any) -> int:
        """NVML's GPU recovery action field (0 = none) where the driver reports it."""
        field_id = getattr(self.nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field_id is None:
            return 0
        values = self._try("nvmlDeviceGetFieldValues", handle, [field_id], default=None)
        if not values or getattr(values[0], "nvmlReturn", 1) != 0:
            return 0
        return int(getattr(values[0].value, "uiVal", 0) or 0)

    def read(self) -> list[GpuReading]:
        nvml = self.nvml
        readings = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            remap = self._try("nvmlDeviceGetRemappedRows", handle, default=(0, 0, 0, 0))
            reasons = self._try("nvmlDeviceGetCurrentClocksThrottleReasons", handle, default=0) or 0
            slowdown_mask = getattr(nvml, "nvmlClocksThrottleReasonHwSlowdown", 0x8)
            readings.append(
                GpuReading(
                    index=index,
                    temperature_c=self._try("nvmlDeviceGetTemperature", handle,
                                            getattr(nvml, "NVML_TEMPERATURE_GPU", 0)),
                    ecc_uncorrectable=self._try(
                        "nvmlDeviceGetTotalEccErrors", handle, getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                        getattr(nvml, "NVML_VOLATILE_ECC", 0), default=0,
                    ) or 0,
                    retired_pages_pending=bool(self._try("nvmlDeviceGetRetiredPagesPendingStatus", handle,
                                                         default=0)),
                    row_remap_pending=bool(remap[2]),
                    row_remap_failed=bool(remap[3]),
                    hw_slowdown=bool(reasons & slowdown_mask),
                    recovery_action=self._recovery_action(handle),
                )
            )
        return readings


def read_gpu_health() -> GpuHealth:
    try:
        import pynvml
    except ImportError:
        return GpuHealth(detail="GPU checks unavailable: pynvml not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return GpuHealth(detail=f"GPU checks unavailable: {error}")
    try:
        return judge_gpus(NvmlBackend(pynvml).read())
    except pynvml.NVMLError as error:
        return GpuHealth(detail=f"GPU checks unavailable: {error}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


GPU_ACTIVITY_WINDOW_S = 1.0
"""A rank's GPU is busy when NVML sampled its process using SMs or memory bandwidth within this long."""


class GpuActivity:
    """Which processes used a GPU lately, as NVML samples it (`nvmlDeviceGetProcessUtilization`): a rank whose
    kernels run (a long evaluation batch, a rank waiting on its GPU with a blocking sync) is busy though its CPU
    sleeps. Where NVML cannot tell (no GPU, no driver, an old driver), no process is busy by it, and the agent
    judges from CPU and I/O alone; a missing library is not asked again."""

    def __init__(self, nvml: Any | None = None, clock: Any = time.time) -> None:
        self._nvml = nvml
        self._clock = clock
        self._unavailable = False

    def _library(self) -> Any | None:
        if self._nvml is None and not self._unavailable:
            try:
                import pynvml
            except ImportError:
                self._unavailable = True
                return None
            self._nvml = pynvml
        return None if self._unavailable else self._nvml

    def busy_pids(self, window_s: float = GPU_ACTIVITY_WINDOW_S) -> set[int]:
        nvml = self._library()
        if nvml is None:
            return set()
        try:
            nvml.nvmlInit()
        except nvml.NVMLError:
            self._unavailable = True
            return set()
        busy: set[int] = set()
        since_us = int((self._clock() - window_s) * 1e6)
        if getattr(nvml, "nvmlDeviceGetProcessUtilization", None) is None:  # a binding without it
            self._unavailable = True
            nvml.nvmlShutdown()
            return busy
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                try:
                    samples = nvml.nvmlDeviceGetProcessUtilization(handle, since_us)
                except nvml.NVMLError:
                    continue  # no sample in the window (NOT_FOUND), or a driver without it
                busy.update(int(s.pid) for s in samples if getattr(s, "smUtil", 0) or getattr(s, "memUtil", 0))
        except nvml.NVMLError:
            return busy
        finally:
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError:
                pass
        return busy


CRITICAL_XIDS = frozenset({13, 31, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 119, 120, 121, 140})
"""XIDs after which the GPU (or the job on it) cannot go on: graphics/memory faults, ECC, fallen off the bus,
NVLink, GSP errors. NVML's critical-XID event reports any XID; these are the ones a node is cordoned for."""

XID_WAIT_MS = 1000
"""How long one NVML event wait blocks: the thread checks for shutdown this often."""


class XidEvents:
    """Waits on NVML's XID events in a thread and keeps the first critical one: a fault is seen as it
    happens, not at the next periodic check. Chaos (`gpu-fault`) hands the same `on_xid` an event as NVML would.

    Without NVML (no driver, no GPU: every machine this project is tested on) the thread is not started and
    the NVML path is exercised only against a stand-in `pynvml` in tests/unit/test_health.py."""

    def __init__(self, nvml: Any | None = None) -> None:
        self.nvml = nvml
        self.fault: str | None = None
        self.fault_at: float | None = None
        self.available = False
        self._stop = False

    def on_xid(self, gpu: int, xid: int, at: float, note: str = "") -> None:
        """One XID event, from NVML or from chaos. Thread-safe enough: one writer wins, both are faults."""
        if xid not in CRITICAL_XIDS:
            log.warning("GPU %d: XID %d%s (not one a node is cordoned for)", gpu, xid, note)
            return
        if self.fault is not None:
            return
        self.fault, self.fault_at = f"GPU {gpu}: XID {xid}{note}", at
        log.warning("GPU %d: critical XID %d%s: the node is reported unhealthy", gpu, xid, note)

    def start(self) -> bool:
        """Subscribe every GPU to critical-XID events and wait on them in a daemon thread. False (and no
        thread) without NVML."""
        import threading

        nvml: Any = self.nvml
        if nvml is None:
            try:
                import pynvml
            except ImportError:
                return False
            nvml = pynvml
        try:
            nvml.nvmlInit()
            events = nvml.nvmlEventSetCreate()
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            for handle in handles:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
        except nvml.NVMLError as error:
            log.info("GPU XID events unavailable: %s", error)
            return False
        self.nvml, self.available = nvml, True
        log.info("GPU XID events: waiting on %d GPUs%s", len(handles),
                 " (a stand-in NVML)" if getattr(nvml, "STANDIN", False) else "")
        indexes = {self._key(h): i for i, h in enumerate(handles)}
        threading.Thread(target=self._wait, args=(events, indexes), name="trainguard-xid-events", daemon=True).start()
        return True

    @staticmethod
    def _key(handle: Any) -> Any:
        value = getattr(handle, "value", None)  # a ctypes handle's address; the same device, the same value
        return value if value is not None else id(handle)

    def _wait(self, events: Any, indexes: dict[Any, int]) -> None:
        import time

        nvml: Any = self.nvml
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        while not self._stop:
            try:
                data = wait(events, XID_WAIT_MS)
            except nvml.NVMLError as error:
                if isinstance(error, getattr(nvml, "NVMLError_Timeout", ())) or "Timeout" in type(error).__name__:
                    continue
                log.warning("GPU XID event wait failed: %s", error)
                time.sleep(1.0)
                continue
            if data.eventType & nvml.nvmlEventTypeXidCriticalError:
                gpu = indexes.get(self._key(data.device), -1)
                self.on_xid(gpu, int(data.eventData), time.time())

    def stop(self) -> None:
        self._stop = True


class NodeHealth:
    """This node's GPU health as its agent sees it: NVML's periodic counters (`check`) and its XID events as
    they happen (`xid`). A chaos `gpu` fault enters as an XID event through `xid.on_xid`, the path a real
    event takes, so the whole remediation path can be rehearsed on machines without GPUs."""

    def __init__(self, xid: XidEvents | None = None) -> None:
        self.xid = xid or XidEvents()
        self._raised_at: float | None = None
        self.flips_bits = False
        """chaos `bitflip --recurring`: this node's GPU flips a bit in every attempt it runs ranks of, until the
        agent restarts (`RankWatch` carries it out once a local rank fingerprinted)."""
        self.flipped: set[tuple[str, str, int]] = set()
        """(run, chain, attempt) a bit was flipped in, by chaos or by the sick GPU."""

    @property
    def injected(self) -> str | None:
        """The XID fault seen (by NVML's event or chaos), for the watch to report at its next poll."""
        return self.xid.fault

    @property
    def injected_at(self) -> float | None:
        """When the fault happened: when chaos raised it at the NVML layer, else when its event was seen."""
        if self.xid.fault is None:
            return None
        return self._raised_at if self._raised_at is not None else self.xid.fault_at

    def inject(self, detail: str, at: float) -> str:
        """chaos gpu-fault: an XID 79 event. With an NVML that can raise one (the stand-in,
        `infra/bench/nvml_standin`) it is raised there, and reaches this agent through its event wait as a
        real XID would; otherwise it is handed to `on_xid` as that wait would. Returns which path it took."""
        raise_xid = getattr(self.xid.nvml, "inject_xid", None) if self.xid.available else None
        if raise_xid is not None:
            self._raised_at = at  # before the event: its wait thread may see it at once
            if raise_xid(0, 79):
                log.info("chaos gpu-fault: XID 79 raised at the NVML layer")
                return "nvml-event"
            self._raised_at = None
        self.xid.on_xid(0, 79, at, f": {detail}")
        return "direct"

    def check(self) -> GpuHealth:
        if self.xid.fault is not None:
            return GpuHealth(available=True, healthy=False, detail=self.xid.fault)
        return read_gpu_health()


class HealthActivities:
    def __init__(self, node: str, host: str, health: NodeHealth | None = None) -> None:
        self.node = node
        self.host = host
        self.health = health or NodeHealth()

    @activity.defn(name=names.CHECK_NODE)
    async def check_node(self, request: CheckNodeInput) -> CheckNodeResult:
        """Answer from the node: its rendezvous address and its GPUs' health."""
        return CheckNodeResult(node=self.node, host=self.host, gpu=self.health.check())
