"""GPU health: the pure judgment over NVML readings, the NVML backend against a fake `pynvml`, and the
no-GPU path that must never fail a run."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from activities.health import MAX_GPU_TEMPERATURE_C, GpuReading, NvmlBackend, judge_gpus, read_gpu_health

# ------------------------------------------------------------------------------------------ judge_gpus


@pytest.mark.parametrize(
    ("reading", "problem"),
    [
        pytest.param(GpuReading(index=0, ecc_uncorrectable=3), "GPU 0: 3 uncorrectable ECC errors", id="ecc"),
        pytest.param(GpuReading(index=1, retired_pages_pending=True), "GPU 1: retired pages pending",
                     id="retired-pages"),
        pytest.param(GpuReading(index=0, row_remap_pending=True), "GPU 0: row remap pending",
                     id="row-remap-pending"),
        pytest.param(GpuReading(index=0, row_remap_failed=True), "GPU 0: row remap failed",
                     id="row-remap-failed"),
        pytest.param(GpuReading(index=0, row_remap_pending=True, row_remap_failed=True), "row remap failed",
                     id="row-remap-failed-wins"),
        pytest.param(GpuReading(index=2, recovery_action=2), "GPU 2: NVML recovery action 2 requested",
                     id="recovery-action"),
        pytest.param(GpuReading(index=0, temperature_c=MAX_GPU_TEMPERATURE_C), f"{MAX_GPU_TEMPERATURE_C} C",
                     id="hot"),
        pytest.param(GpuReading(index=0, hw_slowdown=True), "GPU 0: hardware slowdown", id="hw-slowdown"),
    ],
)
def test_judge_gpus_flags_problems(reading: GpuReading, problem: str) -> None:
    health = judge_gpus([GpuReading(index=9, temperature_c=40), reading])

    assert health.available is True
    assert health.healthy is False
    assert problem in health.detail
    assert "GPU 9" not in health.detail
    assert health.num_gpus == 2


@pytest.mark.parametrize(
    "readings",
    [
        pytest.param([GpuReading(index=0, temperature_c=MAX_GPU_TEMPERATURE_C - 1)], id="warm-but-fine"),
        pytest.param([GpuReading(index=0), GpuReading(index=1, temperature_c=None)], id="no-temperature"),
    ],
)
def test_judge_gpus_healthy(readings: list[GpuReading]) -> None:
    health = judge_gpus(readings)

    assert (health.available, health.healthy) == (True, True)
    assert health.detail == f"{len(readings)} GPUs healthy"
    assert health.num_gpus == len(readings)


def test_judge_gpus_lists_every_problem() -> None:
    health = judge_gpus([GpuReading(index=0, ecc_uncorrectable=1), GpuReading(index=1, hw_slowdown=True)])

    assert health.detail == ("GPU 0: 1 uncorrectable ECC errors; "
                             "GPU 1: hardware slowdown (thermal or power brake)")


# ---------------------------------------------------------------------------------- a fake pynvml


class FakeNVMLError(Exception):
    pass


@dataclass
class FakeGpu:
    temperature_c: int = 40
    ecc_uncorrectable: int = 0
    retired_pages_pending: int = 0
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)
    throttle_reasons: int = 0
    recovery_action: int = 0
    """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, read through nvmlDeviceGetFieldValues."""
    unsupported: set[str] = field(default_factory=set)
    """Queries this GPU's driver answers with NVMLError (NOT_SUPPORTED on many consumer boards)."""


class FakeNvml:
    """The slice of `pynvml` the backend uses: module-level functions and constants."""

    NVMLError = FakeNVMLError
    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 271
    nvmlClocksThrottleReasonHwSlowdown = 0x8

    def __init__(self, gpus: list[FakeGpu], fail_init: bool = False) -> None:
        self.gpus = gpus
        self.fail_init = fail_init
        self.calls: list[str] = []

    def _gpu(self, name: str, handle: int) -> FakeGpu:
        self.calls.append(name)
        gpu = self.gpus[handle]
        if name in gpu.unsupported:
            raise FakeNVMLError(f"{name}: Not Supported")
        return gpu

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.fail_init:
            raise FakeNVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._gpu("temperature", handle).temperature_c

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter: int) -> int:
        assert (error_type, counter) == (self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self.NVML_VOLATILE_ECC)
        return self._gpu("ecc", handle).ecc_uncorrectable

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int) -> int:
        return self._gpu("retired_pages", handle).retired_pages_pending

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, int, int]:
        return self._gpu("remapped_rows", handle).remapped_rows

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: int) -> int:
        return self._gpu("throttle", handle).throttle_reasons

    def nvmlDeviceGetFieldValues(self, handle: int, field_ids: list[int]) -> list[Any]:
        gpu = self._gpu("field_values", handle)
        assert field_ids == [self.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
        # NVML answers each field with its own return code: 3 is NVML_ERROR_NOT_SUPPORTED.
        code = 3 if "recovery_action" in gpu.unsupported else 0
        return [SimpleNamespace(fieldId=field_ids[0], nvmlReturn=code,
                                value=SimpleNamespace(uiVal=gpu.recovery_action, ullVal=gpu.recovery_action))]


# ---------------------------------------------------------------------------------------- NvmlBackend


def test_nvml_backend_reads_every_gpu() -> None:
    nvml = FakeNvml([
        FakeGpu(temperature_c=45),
        FakeGpu(temperature_c=70, ecc_uncorrectable=2, retired_pages_pending=1, remapped_rows=(4, 1, 1, 0),
                throttle_reasons=0x8 | 0x4),
        FakeGpu(remapped_rows=(0, 3, 0, 1), throttle_reasons=0x4),
    ])

    readings = NvmlBackend(nvml).read()

    assert readings[0] == GpuReading(index=0, temperature_c=45)
    assert readings[1] == GpuReading(index=1, temperature_c=70, ecc_uncorrectable=2,
                                     retired_pages_pending=True, row_remap_pending=True,
                                     row_remap_failed=False, hw_slowdown=True)
    assert readings[2] == GpuReading(index=2, temperature_c=40, row_remap_failed=True, hw_slowdown=False)


def _reading(**changes: Any) -> GpuReading:
    """What `_troubled_gpu` reads as when every query answers, with `changes` applied."""
    full = {"index": 0, "temperature_c": 40, "ecc_uncorrectable": 5, "retired_pages_pending": True,
            "row_remap_pending": True, "row_remap_failed": False, "hw_slowdown": True}
    return GpuReading(**{**full, **changes})


def _troubled_gpu(unsupported: set[str]) -> FakeGpu:
    return FakeGpu(temperature_c=40, ecc_uncorrectable=5, retired_pages_pending=1, remapped_rows=(0, 0, 1, 0),
                   throttle_reasons=0x8, unsupported=unsupported)


@pytest.mark.parametrize(
    ("unsupported", "expected"),
    [
        pytest.param(set(), _reading(), id="everything-supported"),
        pytest.param({"temperature"}, _reading(temperature_c=None), id="no-temperature-sensor"),
        pytest.param({"ecc"}, _reading(ecc_uncorrectable=0), id="no-ecc"),
        pytest.param({"retired_pages"}, _reading(retired_pages_pending=False), id="no-page-retirement"),
        pytest.param({"remapped_rows"}, _reading(row_remap_pending=False), id="no-row-remapping"),
        pytest.param({"throttle"}, _reading(hw_slowdown=False), id="no-throttle-reasons"),
        pytest.param({"temperature", "ecc", "retired_pages", "remapped_rows", "throttle", "field_values"},
                     GpuReading(index=0), id="nothing-supported"),
    ],
)
def test_nvml_backend_skips_queries_the_driver_refuses(unsupported: set[str], expected: GpuReading) -> None:
    nvml = FakeNvml([_troubled_gpu(unsupported)])

    assert NvmlBackend(nvml).read() == [expected]


@pytest.mark.parametrize(
    ("gpu", "recovery_action"),
    [
        pytest.param(FakeGpu(recovery_action=2), 2, id="reset-requested"),
        pytest.param(FakeGpu(recovery_action=0), 0, id="none-needed"),
        pytest.param(FakeGpu(recovery_action=2, unsupported={"recovery_action"}), 0,
                     id="field-not-supported"),
        pytest.param(FakeGpu(recovery_action=2, unsupported={"field_values"}), 0, id="field-values-refused"),
    ],
)
def test_nvml_backend_reads_the_recovery_action(gpu: FakeGpu, recovery_action: int) -> None:
    [reading] = NvmlBackend(FakeNvml([gpu])).read()

    assert reading.recovery_action == recovery_action


def test_recovery_action_makes_the_node_unhealthy() -> None:
    health = judge_gpus(NvmlBackend(FakeNvml([FakeGpu(recovery_action=2)])).read())

    assert health.healthy is False
    assert "GPU 0: NVML recovery action 2 requested" in health.detail


def test_nvml_backend_skips_queries_the_binding_lacks() -> None:
    class OldNvml(FakeNvml):
        def __getattribute__(self, name: str) -> Any:
            if name == "nvmlDeviceGetRetiredPagesPendingStatus":
                raise AttributeError(name)
            return super().__getattribute__(name)

    readings = NvmlBackend(OldNvml([FakeGpu()])).read()

    assert readings == [GpuReading(index=0, temperature_c=40)]


# ------------------------------------------------------------------------------------ read_gpu_health


def test_read_gpu_health_judges_what_nvml_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml([FakeGpu(), FakeGpu(ecc_uncorrectable=1)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)

    health = read_gpu_health()

    assert (health.available, health.healthy, health.num_gpus) == (True, False, 2)
    assert "GPU 1: 1 uncorrectable ECC errors" in health.detail
    assert nvml.calls[0] == "nvmlInit"
    assert nvml.calls[-1] == "nvmlShutdown"


def test_read_gpu_health_without_a_driver_is_unavailable_not_unhealthy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([], fail_init=True))

    health = read_gpu_health()

    assert (health.available, health.healthy) == (False, True)
    assert health.detail == "GPU checks unavailable: NVML Shared Library Not Found"


def test_read_gpu_health_without_pynvml_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError

    health = read_gpu_health()

    assert (health.available, health.healthy) == (False, True)
    assert "pynvml not installed" in health.detail


def _machine_has_nvml() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_machine_has_nvml(), reason="this machine has an NVIDIA driver")
def test_read_gpu_health_on_a_machine_without_gpus() -> None:
    health = read_gpu_health()

    assert health.available is False
    assert health.healthy is True
    assert "unavailable" in health.detail
    assert health.num_gpus == 0


# ------------------------------------------------------------------- XID events (a stand-in pynvml)
class _FakeNvml:
    """The slice of pynvml the XID watcher uses: an event set that raises what NVML raises. No GPU here."""

    class NVMLError(Exception):
        pass

    class NVMLError_Timeout(NVMLError):  # pynvml's name
        pass

    nvmlEventTypeXidCriticalError = 0x8

    def __init__(self, gpus: int = 2) -> None:
        import queue

        self.gpus = [object() for _ in range(gpus)]
        self.events: queue.Queue[Any] = queue.Queue()
        self.registered: list[Any] = []

    def nvmlInit(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: return len(self.gpus)
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: return self.gpus[index]
    def nvmlEventSetCreate(self) -> str: return "set"
    def nvmlDeviceRegisterEvents(self, handle: Any, types: int, events: str) -> None:
        self.registered.append((handle, types))

    def nvmlEventSetWait_v2(self, events: str, timeout_ms: int) -> Any:
        import queue
        from types import SimpleNamespace

        try:
            gpu, xid = self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise self.NVMLError_Timeout() from None
        return SimpleNamespace(device=self.gpus[gpu], eventType=self.nvmlEventTypeXidCriticalError, eventData=xid)

    def raise_xid(self, gpu: int, xid: int) -> None:
        self.events.put((gpu, xid))


def _until(predicate: Any, timeout_s: float = 2.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.01)
    return predicate()


def test_a_critical_xid_event_is_seen_as_it_happens_on_the_path_chaos_takes_too() -> None:
    import time

    from activities.health import NodeHealth, XidEvents

    nvml = _FakeNvml()
    xid = XidEvents(nvml)
    assert xid.start() and len(nvml.registered) == 2
    health = NodeHealth(xid)
    nvml.raise_xid(1, 31)  # a GPU memory page fault on GPU 1
    raised = time.time()
    assert _until(lambda: health.injected is not None)
    assert health.injected == "GPU 1: XID 31" and health.injected_at is not None
    assert health.injected_at >= raised  # stamped as the event arrives, not at the next periodic check
    assert not health.check().healthy and "XID 31" in health.check().detail
    xid.stop()


def test_a_non_critical_xid_is_logged_not_a_fault_and_chaos_enters_as_an_xid_event() -> None:
    from activities.health import NodeHealth, XidEvents

    nvml = _FakeNvml(gpus=1)
    xid = XidEvents(nvml)
    assert xid.start()
    nvml.raise_xid(0, 999)
    assert not _until(lambda: xid.fault is not None, timeout_s=0.3)
    health = NodeHealth(xid)
    health.inject("injected by chaos", 123.0)
    assert (health.injected, health.injected_at) == ("GPU 0: XID 79: injected by chaos", 123.0)
    xid.stop()


def test_without_nvml_no_xid_thread_starts() -> None:
    from activities.health import XidEvents

    class Broken(_FakeNvml):
        def nvmlInit(self) -> None:
            raise self.NVMLError("NVML Shared Library Not Found")

    xid = XidEvents(Broken())
    assert xid.start() is False and not xid.available


def _standin() -> Any:
    """A fresh copy of the stand-in NVML the benchmarks put on an agent's path (infra/bench/nvml_standin)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "infra" / "bench" / "nvml_standin" / "pynvml.py"
    name = f"pynvml_standin_{len([m for m in sys.modules if m.startswith('pynvml_standin_')])}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_chaos_raises_its_xid_at_the_nvml_layer_where_nvml_can_and_the_event_wait_reports_it() -> None:
    import time

    from activities.health import NodeHealth, XidEvents

    nvml = _standin()
    xid = XidEvents(nvml)
    assert xid.start()
    health = NodeHealth(xid)
    raised = time.time()
    assert health.inject("injected by chaos", raised) == "nvml-event"
    assert _until(lambda: health.injected is not None)
    assert health.injected == "GPU 0: XID 79"
    assert [(gpu, code) for gpu, code, _ in nvml.delivered] == [(0, 79)]  # through nvmlEventSetWait_v2
    assert health.injected_at == raised  # the fault's time is when it was raised, as a real XID's would be
    assert not health.check().healthy
    xid.stop()

    unsubscribed = NodeHealth(XidEvents(_standin()))  # its thread never started: handed to on_xid instead
    assert unsubscribed.inject("injected by chaos", 5.0) == "direct" and unsubscribed.injected_at == 5.0
