"""The real GPU backend: NVIDIA's NVML through nvidia-ml-py (``import pynvml``).

What the backend promises, whatever one card or the driver does:

- **A metric a card cannot answer is ``None``** ("n/a"), never a failed report: GeForce cards
  have no MIG, some boards report no power, older drivers lack the newer versioned calls
  (:meth:`NvmlBackend._query`).
- **A card that fell off the bus is reported ``lost``** with the facts last read from it, and one
  that does not answer within the round's time bound is reported ``unresponsive``: each card is
  read in a thread of its own, so one hung card never stalls the host's report.
- **A process list that could not be read is ``None``** (unknown), never an empty list (idle).
- **A broken card logs one warning per kind of trouble per ``WARNING_EVERY_SECONDS``**, not one
  every telemetry round.

NVML counts memory in bytes; the report carries MiB (the ``*_mb`` fields), as nvidia-smi shows.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import replace
from time import monotonic
from typing import Any, TypeVar

import psutil
import pynvml

from gpus.inventory import BackendUnavailable, CardState, GPUInfo, HostInfo, ProcessInfo, Snapshot
from gpus.procinfo import describe_processes

log = logging.getLogger(__name__)

T = TypeVar("T")

MIB = 2**20
UNKNOWN_NAME = "Unknown GPU"
WARNING_EVERY_SECONDS = 10 * 60

# nvmlDeviceGetMemoryInfo v1 (drivers without the _v2 call, before R510) has no `reserved`, and
# its `used` includes the driver's reservation. Bookable memory is total - reserved - headroom, so
# reporting reserved=0 would offer memory the driver holds. The estimate depends on the total
# alone, so it never changes between rounds (a changed card fact costs the ingest an upsert).
# Drivers that report it reserve a few hundred MiB, around 1 % of the card: at least 1 GiB or
# 1/32 of the card errs on the side of booking less.
V1_RESERVED_MIN_BYTES = 2**30
V1_RESERVED_FRACTION = 32

# The unversioned process call is wrapped by pynvml's @throwOnVersionMismatch, which turns a
# missing _v3 symbol (NVMLError_FunctionNotFound) into NVMLLibraryMismatchError, a plain
# Exception and NOT an NVMLError. Bindings older than that wrapper raise FunctionNotFound itself.
_MISSING_SYMBOL: tuple[type[Exception], ...] = (
    pynvml.NVMLError_FunctionNotFound,
    getattr(pynvml, "NVMLLibraryMismatchError", pynvml.NVMLError_FunctionNotFound),
)
# How a driver older than the bindings turns down a newer versioned call: no such symbol, or a
# struct version it does not know. NotSupported: some boards answer only the classic call.
_OLDER_DRIVER: tuple[type[Exception], ...] = (
    pynvml.NVMLError_FunctionNotFound,
    pynvml.NVMLError_ArgumentVersionMismatch,
    pynvml.NVMLError_NotSupported,
)
# The card is gone until someone acts (Xid 79 "fallen off the bus", or a reset is needed): every
# further call on it fails the same way, so the whole card is reported lost.
_CARD_LOST: tuple[type[Exception], ...] = (pynvml.NVMLError_GpuIsLost, pynvml.NVMLError_ResetRequired)


class NvmlNotInstalled(BackendUnavailable):
    """No NVML library on this machine at all: it has no NVIDIA driver, so no GPUs to report."""


def nvml_library_found() -> bool:
    """Whether NVML's library loads here, without starting NVML (which may hang on a sick card):
    the one that pynvml loads, so False exactly where opening the backend raises NvmlNotInstalled."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def _text(value: str | bytes) -> str:
    # nvidia-ml-py >= 12 decodes strings itself; older bindings hand back bytes.
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _mib(value: int | None) -> int | None:
    return None if value is None else value // MIB


def _v1_reserved(total: int) -> int:
    return min(total, max(V1_RESERVED_MIN_BYTES, total // V1_RESERVED_FRACTION))


def _memory(handle: Any) -> tuple[int, int, int]:
    """(total, reserved, used) in bytes; reserved is only known through the v2 call."""
    version = getattr(pynvml, "nvmlMemory_v2", None)  # absent from old bindings
    if version is not None:
        try:
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            return mem.total, mem.reserved, mem.used
        except _OLDER_DRIVER:
            pass
    mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return mem.total, _v1_reserved(mem.total), mem.used


def _temperature(handle: Any) -> int:
    read_versioned = getattr(pynvml, "nvmlDeviceGetTemperatureV", None)  # absent from old bindings
    if read_versioned is not None:
        try:
            return read_versioned(handle, pynvml.NVML_TEMPERATURE_GPU)
        except _OLDER_DRIVER:
            pass
    # Deprecated, but every driver still answers it.
    return pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)


def _mig_mode(handle: Any) -> str:
    current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    return "enabled" if current == pynvml.NVML_DEVICE_MIG_ENABLE else "disabled"


def _mig_devices(handle: Any) -> list[Any]:
    """Handles of the card's MIG instances; slots without an instance answer NotFound."""
    devices = []
    for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            devices.append(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot))
        except pynvml.NVMLError_NotFound:
            continue
    return devices


def _compute_processes(handle: Any) -> list[Any]:
    try:
        return pynvml.nvmlDeviceGetComputeRunningProcesses(handle)  # calls the _v3 symbol
    except _MISSING_SYMBOL:
        return pynvml.nvmlDeviceGetComputeRunningProcesses_v2(handle)


def _graphics_processes(handle: Any) -> list[Any]:
    """Graphics contexts hold card memory too (an X server, an OpenGL or Vulkan renderer, a
    notebook's plotting window): a booking binds them like compute processes. A device that
    cannot run graphics (a MIG instance, a compute-only board) answers NotSupported: it has none,
    and its compute list alone decides whether the card's list is known."""
    try:
        try:
            return pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle)  # calls the _v3 symbol
        except _MISSING_SYMBOL:
            return pynvml.nvmlDeviceGetGraphicsRunningProcesses_v2(handle)
    except pynvml.NVMLError_NotSupported:
        return []


def _device_processes(compute: list[Any], graphics: list[Any]) -> list[tuple[int, int | None]]:
    """One device's (pid, MiB), one entry per pid: a process with both a compute and a graphics
    context is listed by both calls with the same figure (its memory on the device), so the
    larger of the two is taken, never their sum."""
    memory: dict[int, int | None] = {}
    for entry in (*compute, *graphics):
        used = _mib(entry.usedGpuMemory)
        known = memory.get(entry.pid)
        memory[entry.pid] = used if known is None else max(known, used or 0)
    return list(memory.items())


def _watts(milliwatts: int | None) -> float | None:
    return None if milliwatts is None else milliwatts / 1000


def _cuda_version(version: int | None) -> str:
    # NVML encodes CUDA 12.4 as 12040.
    return "" if not version else f"{version // 1000}.{version % 1000 // 10}"


def _in_thread(name: str, fn: Callable[[int], T], arg: int) -> Future[T]:
    """Run fn(arg) in a daemon thread: a call stuck in the driver must not keep the worker from exiting."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn(arg))
        except BaseException as exc:  # anything left unset would read as "still running" forever
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class NvmlBackend:
    """Reads this host's NVIDIA GPUs; holds an NVML session until :meth:`close`.

    Remembers, per NVML index, each card's UUID and its last good report: a card that is lost or
    unresponsive later is still reported under its key, with the facts known from before.
    """

    def __init__(self, server_name: str, round_timeout: float = 2.0) -> None:
        """`round_timeout`: how long one round waits for the cards (NVML_ROUND_TIMEOUT_SECONDS, which
        get_backend passes)."""
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound as exc:
            raise NvmlNotInstalled(
                f"NVML library (libnvidia-ml.so.1) not found, is the NVIDIA driver installed? ({exc})"
            ) from exc
        except pynvml.NVMLError_DriverNotLoaded as exc:
            raise BackendUnavailable(f"NVIDIA kernel driver is not loaded ({exc})") from exc
        except pynvml.NVMLError as exc:
            raise BackendUnavailable(f"NVML failed to initialise: {exc}") from exc
        self.round_timeout = round_timeout
        self._closed = False
        self._uuids: dict[int, str] = {}
        self._known: dict[int, GPUInfo] = {}  # each card's last report from a read that answered
        self._states: dict[int, str] = {}
        self._reads: dict[int, Future[GPUInfo]] = {}
        self._quiet_until: dict[tuple[str, str], float] = {}  # written from the cards' threads
        self._warn_lock = threading.Lock()
        # Fixed while NVML is initialised: a driver upgrade needs a reload, hence a new backend.
        driver = self._query("host", pynvml.nvmlSystemGetDriverVersion)
        self.host = HostInfo(
            name=server_name,
            hostname=socket.gethostname(),
            driver_version=_text(driver) if driver else "",
            cuda_version=_cuda_version(self._query("host", pynvml.nvmlSystemGetCudaDriverVersion)),
            cpu_count=os.cpu_count() or 0,
            ram_mb=psutil.virtual_memory().total // MIB,
            simulated=False,
        )

    def snapshot(self) -> Snapshot:
        """Every card, read in parallel and waited for at most ``round_timeout`` seconds in all.

        Raises BackendUnavailable when NVML itself stopped answering (driver unloaded or
        reloaded): the caller opens a new backend.
        """
        if self._closed:
            raise BackendUnavailable("NVML backend is closed")
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            raise BackendUnavailable(f"NVML stopped answering: {exc}") from exc
        reads = {index: self._read(index) for index in range(count)}
        wait(reads.values(), timeout=self.round_timeout)
        cards = (self._card(index, read) for index, read in reads.items())
        return Snapshot(host=self.host, gpus=tuple(card for card in cards if card is not None))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not all(read.done() for read in self._reads.values()):
            # The hung call may hold NVML's own locks, so nvmlShutdown could hang behind it: the
            # session ends with the process instead.
            log.warning("NVML left open: a GPU read is still stuck in the driver")
            return
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.warning("nvmlShutdown failed: %s", exc)

    def _read(self, index: int) -> Future[GPUInfo]:
        # A read still stuck from an earlier round is waited on again rather than joined by a
        # second one: a hung card holds one thread, however long it hangs.
        read = self._reads.get(index)
        if read is None or read.done():
            read = self._reads[index] = _in_thread(f"nvml-gpu{index}", self._read_card, index)
        return read

    def _card(self, index: int, read: Future[GPUInfo]) -> GPUInfo | None:
        """The card's report from its read: answered, lost, unresponsive, or None (cannot be keyed)."""
        if not read.done():
            return self._stale(index, CardState.UNRESPONSIVE, f"did not answer within {self.round_timeout}s")
        try:
            gpu = read.result()
        except _CARD_LOST as exc:
            return self._stale(index, CardState.LOST, f"is lost ({exc})")
        except Exception as exc:
            # Without its UUID a card cannot be keyed; report the others.
            self._warn(f"GPU {index}", type(exc).__name__, "Skipping GPU %d: %s", index, exc)
            return None
        if self._states.get(index, CardState.OK) != CardState.OK:
            log.info("GPU %d (%s) answers again", index, gpu.uuid)
            self._forget_warnings(f"GPU {index}")  # the next trouble is news again
        self._states[index] = CardState.OK
        self._known[index] = gpu
        return gpu

    def _stale(self, index: int, state: str, trouble: str) -> GPUInfo | None:
        """A card that could not be read this round, described by what was known of it before."""
        uuid = self._uuids.get(index)
        if uuid is None:
            self._warn(f"GPU {index}", state, "Skipping GPU %d, never identified: it %s", index, trouble)
            return None
        self._warn(f"GPU {index}", state, "GPU %d (%s) %s", index, uuid, trouble)
        self._states[index] = state
        known = self._known.get(index) or GPUInfo(
            uuid=uuid, index=index, name=UNKNOWN_NAME, pci_bus_id="", memory_total_mb=0
        )
        return replace(
            known,
            memory_used_mb=None,
            utilization_pct=None,
            temperature_c=None,
            power_w=None,
            processes=None,
            state=state,
        )

    def _read_card(self, index: int) -> GPUInfo:
        """One card's report; runs in the card's own thread. Raises when the card is lost or
        cannot be identified."""
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = self._uuids[index] = _text(pynvml.nvmlDeviceGetUUID(handle))
        where = f"GPU {index}"
        name = self._query(where, pynvml.nvmlDeviceGetName, handle)
        pci = self._query(where, pynvml.nvmlDeviceGetPciInfo, handle)
        total, reserved, used = self._query(where, _memory, handle) or (0, 0, None)
        utilization = self._query(where, pynvml.nvmlDeviceGetUtilizationRates, handle)
        mig_mode = self._query(where, _mig_mode, handle)
        return GPUInfo(
            uuid=uuid,
            index=index,
            name=_text(name) if name else UNKNOWN_NAME,
            pci_bus_id=_text(pci.busId) if pci is not None else "",
            memory_total_mb=total // MIB,
            memory_reserved_mb=reserved // MIB,
            memory_used_mb=_mib(used),
            utilization_pct=utilization.gpu if utilization is not None else None,
            temperature_c=self._query(where, _temperature, handle),
            power_w=_watts(self._query(where, pynvml.nvmlDeviceGetPowerUsage, handle)),
            power_limit_w=_watts(self._query(where, pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)),
            mig_mode=mig_mode,
            processes=self._processes(where, handle, mig_mode),
        )

    def _processes(self, where: str, handle: Any, mig_mode: str | None) -> tuple[ProcessInfo, ...] | None:
        """The card's compute and graphics processes; None when a list could not be read:
        unknown, not idle.

        NotSupported is unknown too: GeForce cards and Windows' WDDM driver keep no per-process
        accounting. With MIG enabled the card itself answers NoPermission to unprivileged callers,
        so each MIG instance is asked instead. Entries with pid <= 1 are dropped
        (gpus.procinfo.is_process_pid): NVML answers pid 0 when struct versions disagree.
        """
        devices = self._query(where, _mig_devices, handle) if mig_mode == "enabled" else [handle]
        if devices is None:
            return None
        listed: list[tuple[int, int | None]] = []
        for device in devices:
            compute = self._query(where, _compute_processes, device)
            graphics = self._query(where, _graphics_processes, device)
            if compute is None or graphics is None:
                return None
            listed.extend(_device_processes(compute, graphics))
        # usedGpuMemory is None where NVML cannot tell (WDDM, some containers).
        return describe_processes(listed)

    def _query(self, where: str, fn: Callable[..., T], *args: Any) -> T | None:
        """One NVML query for one metric; None when the card or driver cannot answer it.

        A lost card raises: every other query on it would fail too, and the card is reported lost.
        """
        try:
            return fn(*args)
        except pynvml.NVMLError_NotSupported:
            return None
        except _CARD_LOST:
            raise
        except pynvml.NVMLError as exc:
            # Unlike NotSupported this is unexpected (no permission, driver trouble…), so say so,
            # but one bad metric must not cost the whole report.
            name = getattr(fn, "__name__", repr(fn))
            self._warn(where, f"{name}: {type(exc).__name__}", "NVML %s failed on %s: %s", name, where, exc)
            return None

    def _warn(self, where: str, kind: str, message: str, *args: object) -> None:
        """A warning once per card and kind of trouble per WARNING_EVERY_SECONDS, not every round."""
        now = monotonic()
        with self._warn_lock:
            if now < self._quiet_until.get((where, kind), 0.0):
                return
            self._quiet_until[(where, kind)] = now + WARNING_EVERY_SECONDS
        log.warning(message, *args)

    def _forget_warnings(self, where: str) -> None:
        with self._warn_lock:
            self._quiet_until = {key: t for key, t in self._quiet_until.items() if key[0] != where}
