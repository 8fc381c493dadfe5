"""A fake NVML C library for the real ``pynvml`` wrappers.

:func:`install` puts a :class:`FakeNvmlLib` where pynvml keeps the ``CDLL("libnvidia-ml.so.1")``
it loads (``pynvml.nvmlLib``). Everything above the C calls then runs for real: the wrappers'
argument handling, struct decoding, version fallbacks and the mapping of return codes to
``NVMLError_*`` classes. The fake's functions get what pynvml passes to C (``byref`` structs
and integers, string buffers, device handles), write their answers into them, and return NVML
return codes.

- **A missing symbol** (``lib.missing``) is an AttributeError on the library object, which
  pynvml turns into NVMLError_FunctionNotFound, like a driver too old to have the call. pynvml
  caches every symbol it finds, so set ``missing`` before the first call.
- **Per card**, ``fail`` maps a C symbol to the return code that card answers it with,
  ``block`` maps a symbol to a threading.Event the call waits for (a hung card), and ``lost``
  answers every call on the card with NVML_ERROR_GPU_IS_LOST.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

GIB = 2**30
MIB = 2**20
SUCCESS = pynvml.NVML_SUCCESS
NOT_AVAILABLE = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value  # usedGpuMemory "unknown"

Process = tuple[int, int | None]  # pid, used memory in bytes (None: NVML cannot tell)


@dataclass
class FakeMigInstance:
    processes: list[Process] = field(default_factory=list)
    graphics: list[Process] = field(default_factory=list)
    fail: dict[str, int] = field(default_factory=dict)


@dataclass
class FakeCard:
    index: int
    name: str = "NVIDIA A100-SXM4-40GB"
    memory: tuple[int, int, int] = (40 * GIB, 512 * MIB, 10 * GIB)  # total, reserved, used (bytes)
    utilization: int = 87
    temperature: int = 64
    power_mw: int = 312_456
    power_limit_mw: int = 400_000
    mig: tuple[int, int] = (0, 0)  # current, pending
    mig_instances: dict[int, FakeMigInstance] = field(default_factory=dict)  # by slot
    max_mig_devices: int = 7
    processes: list[Process] = field(default_factory=list)
    graphics: list[Process] = field(default_factory=list)  # nvmlDeviceGetGraphicsRunningProcesses
    fail: dict[str, int] = field(default_factory=dict)
    block: dict[str, threading.Event] = field(default_factory=dict)
    lost: bool = False

    @property
    def uuid(self) -> str:
        return f"GPU-0000000{self.index}-aaaa-bbbb-cccc-dddddddddddd"

    @property
    def bus_id(self) -> str:
        return f"00000000:{0x07 + self.index:02X}:00.0"


class _CFunction:
    """One exported symbol. An object rather than a bound method, because pynvml sets attributes
    on what it looks up (``fn.restype = c_char_p`` for nvmlErrorString)."""

    def __init__(self, lib: FakeNvmlLib, name: str, impl: Callable[..., int]) -> None:
        self.lib, self.name, self.impl = lib, name, impl

    def __call__(self, *args: Any) -> Any:
        self.lib.calls.append(self.name)
        return self.impl(*args)


def _out(ref: Any) -> Any:
    """The ctypes object behind a ``byref(...)`` argument."""
    return ref._obj


def _handle_id(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def _set_handle(ref: Any, handle_id: int) -> None:
    device = _out(ref)  # a c_nvmlDevice_t, an opaque pointer: the fake's handles are small numbers
    ctypes.cast(ctypes.pointer(device), ctypes.POINTER(ctypes.c_void_p)).contents.value = handle_id


def _handle_of(card: int, slot: int | None = None) -> int:
    return 0x1000 * (card + 1) + (0 if slot is None else 0x10 * (slot + 1))


class FakeNvmlLib:
    """Two healthy A100s by default; card 0 runs this test process (9 GiB)."""

    def __init__(self, process_pid: int) -> None:
        self.cards = [FakeCard(0, processes=[(process_pid, 9 * GIB)]), FakeCard(1, utilization=0)]
        self.driver_version = "550.90.07"
        self.cuda_version = 12040
        self.init_results: list[int] = []  # return codes of the next nvmlInitWithFlags calls
        self.count_result = SUCCESS
        self.missing: set[str] = set()
        self.calls: list[str] = []
        self.blocked_calls = 0

    def __getattr__(self, name: str) -> _CFunction:
        # Only reached for names that are not attributes: the C symbols.
        impl = getattr(type(self), f"_{name}", None) if name.startswith("nvml") else None
        if impl is None or name in self.missing:
            raise AttributeError(f"undefined symbol: {name}")
        return _CFunction(self, name, impl.__get__(self))

    def called(self, name: str) -> bool:
        return name in self.calls

    # --- looking up the device a handle names ------------------------------------------------

    def _device(self, symbol: str, handle: Any) -> tuple[FakeCard | FakeMigInstance | None, int]:
        """The card or MIG instance behind a handle, and the code the call answers with first."""
        handle_id = _handle_id(handle)
        card = self.cards[handle_id // 0x1000 - 1]
        slot = (handle_id % 0x1000) // 0x10 - 1
        event = card.block.get(symbol)
        if event is not None:
            self.blocked_calls += 1
            event.wait()
        if card.lost:
            return None, pynvml.NVML_ERROR_GPU_IS_LOST
        device = card if slot < 0 else card.mig_instances[slot]
        return device, device.fail.get(symbol, SUCCESS)

    def _card(self, symbol: str, handle: Any) -> tuple[FakeCard, int]:
        device, code = self._device(symbol, handle)
        assert device is None or isinstance(device, FakeCard), f"{symbol} on a MIG instance"
        return device, code  # type: ignore[return-value]

    # --- the C functions ---------------------------------------------------------------------

    def _nvmlInitWithFlags(self, flags: int) -> int:
        return self.init_results.pop(0) if self.init_results else SUCCESS

    def _nvmlShutdown(self) -> int:
        return SUCCESS

    def _nvmlErrorString(self, code: int) -> bytes:
        return f"fake NVML error {code}".encode()

    def _nvmlSystemGetDriverVersion(self, buffer: Any, size: ctypes.c_uint) -> int:
        buffer.value = self.driver_version.encode()[: size.value - 1]
        return SUCCESS

    def _nvmlSystemGetCudaDriverVersion(self, version: Any) -> int:
        _out(version).value = self.cuda_version
        return SUCCESS

    def _nvmlDeviceGetCount_v2(self, count: Any) -> int:
        _out(count).value = len(self.cards)
        return self.count_result

    def _nvmlDeviceGetHandleByIndex_v2(self, index: ctypes.c_uint, device: Any) -> int:
        if index.value >= len(self.cards):
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        card = self.cards[index.value]
        _set_handle(device, _handle_of(card.index))
        event = card.block.get("nvmlDeviceGetHandleByIndex_v2")
        if event is not None:
            self.blocked_calls += 1
            event.wait()
        if card.lost:
            return pynvml.NVML_ERROR_GPU_IS_LOST
        return card.fail.get("nvmlDeviceGetHandleByIndex_v2", SUCCESS)

    def _string(self, symbol: str, handle: Any, buffer: Any, size: ctypes.c_uint, read: str) -> int:
        card, code = self._card(symbol, handle)
        if code == SUCCESS:
            buffer.value = getattr(card, read).encode()[: size.value - 1]
        return code

    def _nvmlDeviceGetUUID(self, handle: Any, buffer: Any, size: ctypes.c_uint) -> int:
        return self._string("nvmlDeviceGetUUID", handle, buffer, size, "uuid")

    def _nvmlDeviceGetName(self, handle: Any, buffer: Any, size: ctypes.c_uint) -> int:
        return self._string("nvmlDeviceGetName", handle, buffer, size, "name")

    def _nvmlDeviceGetPciInfo_v3(self, handle: Any, info: Any) -> int:
        card, code = self._card("nvmlDeviceGetPciInfo_v3", handle)
        if code == SUCCESS:
            _out(info).busId = card.bus_id.encode()
        return code

    def _nvmlDeviceGetMemoryInfo_v2(self, handle: Any, memory: Any) -> int:
        card, code = self._card("nvmlDeviceGetMemoryInfo_v2", handle)
        if code != SUCCESS:
            return code
        out = _out(memory)
        if out.version != pynvml.nvmlMemory_v2:
            return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        out.total, out.reserved, out.used = card.memory
        out.free = out.total - out.reserved - out.used
        return SUCCESS

    def _nvmlDeviceGetMemoryInfo(self, handle: Any, memory: Any) -> int:
        card, code = self._card("nvmlDeviceGetMemoryInfo", handle)
        if code == SUCCESS:
            total, reserved, used = card.memory
            out = _out(memory)
            # v1 knows no reservation: it is part of `used`, as on drivers before R510.
            out.total, out.used, out.free = total, reserved + used, total - reserved - used
        return code

    def _nvmlDeviceGetUtilizationRates(self, handle: Any, utilization: Any) -> int:
        card, code = self._card("nvmlDeviceGetUtilizationRates", handle)
        if code == SUCCESS:
            _out(utilization).gpu, _out(utilization).memory = card.utilization, 0
        return code

    def _nvmlDeviceGetTemperatureV(self, handle: Any, temperature: Any) -> int:
        card, code = self._card("nvmlDeviceGetTemperatureV", handle)
        out = _out(temperature)
        if code == SUCCESS and out.version != pynvml.nvmlTemperature_v1:
            return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        if code == SUCCESS:
            assert out.sensorType == pynvml.NVML_TEMPERATURE_GPU
            out.temperature = card.temperature
        return code

    def _nvmlDeviceGetTemperature(self, handle: Any, sensor: ctypes.c_uint, temperature: Any) -> int:
        card, code = self._card("nvmlDeviceGetTemperature", handle)
        if code == SUCCESS:
            assert sensor.value == pynvml.NVML_TEMPERATURE_GPU
            _out(temperature).value = card.temperature
        return code

    def _nvmlDeviceGetPowerUsage(self, handle: Any, milliwatts: Any) -> int:
        card, code = self._card("nvmlDeviceGetPowerUsage", handle)
        if code == SUCCESS:
            _out(milliwatts).value = card.power_mw
        return code

    def _nvmlDeviceGetEnforcedPowerLimit(self, handle: Any, milliwatts: Any) -> int:
        card, code = self._card("nvmlDeviceGetEnforcedPowerLimit", handle)
        if code == SUCCESS:
            _out(milliwatts).value = card.power_limit_mw
        return code

    def _nvmlDeviceGetMigMode(self, handle: Any, current: Any, pending: Any) -> int:
        card, code = self._card("nvmlDeviceGetMigMode", handle)
        if code == SUCCESS:
            _out(current).value, _out(pending).value = card.mig
        return code

    def _nvmlDeviceGetMaxMigDeviceCount(self, handle: Any, count: Any) -> int:
        card, code = self._card("nvmlDeviceGetMaxMigDeviceCount", handle)
        if code == SUCCESS:
            _out(count).value = card.max_mig_devices
        return code

    def _nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, slot: ctypes.c_uint, device: Any) -> int:
        card, code = self._card("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        if code != SUCCESS:
            return code
        if slot.value not in card.mig_instances:
            return pynvml.NVML_ERROR_NOT_FOUND
        _set_handle(device, _handle_of(card.index, slot.value))
        return SUCCESS

    def _processes(self, symbol: str, handle: Any, count: Any, infos: Any) -> int:
        device, code = self._device(symbol, handle)
        if code != SUCCESS:
            return code
        listed = device.graphics if "Graphics" in symbol else device.processes  # type: ignore[union-attr]
        out = _out(count)
        if infos is None or out.value < len(listed):  # pynvml asks for the size first
            out.value = len(listed)
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE if listed else SUCCESS
        for info, (pid, used) in zip(infos, listed, strict=False):
            info.pid, info.usedGpuMemory = pid, NOT_AVAILABLE if used is None else used
        out.value = len(listed)
        return SUCCESS

    def _nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any, count: Any, infos: Any) -> int:
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v3", handle, count, infos)

    def _nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any, count: Any, infos: Any) -> int:
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v2", handle, count, infos)

    def _nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: Any, count: Any, infos: Any) -> int:
        return self._processes("nvmlDeviceGetGraphicsRunningProcesses_v3", handle, count, infos)

    def _nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: Any, count: Any, infos: Any) -> int:
        return self._processes("nvmlDeviceGetGraphicsRunningProcesses_v2", handle, count, infos)


def install(monkeypatch: pytest.MonkeyPatch, lib: Any) -> Any:
    """Make `lib` the library pynvml has loaded, with pynvml's module state fresh for this test."""
    monkeypatch.setattr(pynvml, "nvmlLib", lib)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    monkeypatch.setattr(pynvml, "_nvmlLib_refcount", 0)
    # NVMLError.__str__ caches the messages it fetched through nvmlErrorString.
    monkeypatch.setattr(pynvml.NVMLError, "_errcode_to_string", dict(pynvml.NVMLError._errcode_to_string))
    return lib


def uninstall(monkeypatch: pytest.MonkeyPatch) -> None:
    """No library loaded, and none to load: a machine without an NVIDIA driver."""

    def no_library(name: str, *args: Any, **kwargs: Any) -> Any:
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    install(monkeypatch, None)
    monkeypatch.setattr(pynvml, "CDLL", no_library)


def finish_reads() -> None:
    """Wait for the backend's card reads a test released: one still running after its test would
    go on calling into the next test's fake."""
    for thread in threading.enumerate():
        if thread.name.startswith("nvml-gpu"):
            thread.join(timeout=10)
            assert not thread.is_alive(), f"{thread.name} is still stuck: release its event"
