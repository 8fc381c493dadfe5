"""The real GPU backend: NVIDIA's NVML through nvidia-ml-py (``import pynvml``).

Every per-card query goes through :func:`_query`, so one the card or driver cannot answer
becomes ``None`` ("n/a") instead of failing the whole report: GeForce cards have no MIG,
some boards report no power, older drivers lack the newer versioned calls.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import psutil
import pynvml

from gpus.inventory import BackendUnavailable, GPUInfo, HostInfo, ProcessInfo, Snapshot

log = logging.getLogger(__name__)

T = TypeVar("T")

MIB = 2**20
COMMAND_MAX_CHARS = 300

# The unversioned process call is wrapped by pynvml's @throwOnVersionMismatch, which turns a
# missing _v3 symbol (NVMLError_FunctionNotFound) into NVMLLibraryMismatchError, a plain
# Exception and NOT an NVMLError. Bindings older than that wrapper raise FunctionNotFound itself.
_MISSING_SYMBOL: tuple[type[Exception], ...] = (
    pynvml.NVMLError_FunctionNotFound,
    getattr(pynvml, "NVMLLibraryMismatchError", pynvml.NVMLError_FunctionNotFound),
)


def _text(value: str | bytes) -> str:
    # nvidia-ml-py >= 12 decodes strings itself; older bindings hand back bytes.
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _query(fn: Callable[..., T], *args: Any) -> T | None:
    """Run one NVML query for one metric; None when this card or driver cannot answer it."""
    try:
        return fn(*args)
    except pynvml.NVMLError_NotSupported:
        return None
    except pynvml.NVMLError as exc:
        # Unlike NotSupported this is unexpected (GPU lost, no permission…), so say so,
        # but one bad metric must not cost the whole report.
        log.warning("NVML %s failed: %s", getattr(fn, "__name__", fn), exc)
        return None


def _memory(handle: Any) -> tuple[int, int, int]:
    """(total, reserved, used) in bytes; reserved is only known through the v2 call."""
    version = getattr(pynvml, "nvmlMemory_v2", None)  # absent from old bindings
    if version is not None:
        try:
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            return mem.total, mem.reserved, mem.used
        except pynvml.NVMLError:
            pass  # older drivers lack nvmlDeviceGetMemoryInfo_v2: fall back to v1
    mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return mem.total, 0, mem.used


def _temperature(handle: Any) -> int:
    try:
        return pynvml.nvmlDeviceGetTemperatureV(handle, pynvml.NVML_TEMPERATURE_GPU)
    except (AttributeError, pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_NotSupported):
        # Old bindings (AttributeError) or drivers without the V call; the classic one is
        # deprecated but still answers everywhere.
        return pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)


def _mig_mode(handle: Any) -> str:
    current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    return "enabled" if current == pynvml.NVML_DEVICE_MIG_ENABLE else "disabled"


def _compute_processes(handle: Any) -> list[Any]:
    try:
        return pynvml.nvmlDeviceGetComputeRunningProcesses(handle)  # calls the _v3 symbol
    except _MISSING_SYMBOL:
        return pynvml.nvmlDeviceGetComputeRunningProcesses_v2(handle)


def _owner_and_command(pid: int) -> tuple[str, str, int | None]:
    """OS user, command line and portal job id of a GPU process; ("?", "", None) when /proc
    does not show it.

    In a container NVML reports host PIDs, which this PID namespace usually does not have.
    The job id is PORTAL_JOB_ID in the process's environment: the worker runs jobs as its
    own user, so it can read their environment.
    """
    username, command, job_id = "?", "", None
    try:
        proc = psutil.Process(pid)
        username = proc.username()
        command = " ".join(proc.cmdline()) or proc.name()
        job_id = job_id_of(proc)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass  # exited since NVML listed it, or another user's process under hidepid
    return username, command[:COMMAND_MAX_CHARS], job_id


def job_id_of(proc: psutil.Process) -> int | None:
    try:
        value = proc.environ().get("PORTAL_JOB_ID", "")
    except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
        return None
    return int(value) if value.isdigit() else None


def _watts(milliwatts: int | None) -> float | None:
    return None if milliwatts is None else milliwatts / 1000


def _cuda_version(version: int | None) -> str:
    # NVML encodes CUDA 12.4 as 12040.
    return "" if not version else f"{version // 1000}.{version % 1000 // 10}"


class NvmlBackend:
    """Reads this host's NVIDIA GPUs; holds an NVML session until :meth:`close`."""

    def __init__(self, server_name: str) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound as exc:
            raise BackendUnavailable(
                f"NVML library (libnvidia-ml.so.1) not found, is the NVIDIA driver installed? ({exc})"
            ) from exc
        except pynvml.NVMLError_DriverNotLoaded as exc:
            raise BackendUnavailable(f"NVIDIA kernel driver is not loaded ({exc})") from exc
        except pynvml.NVMLError as exc:
            raise BackendUnavailable(f"NVML failed to initialise: {exc}") from exc
        self._closed = False
        # Fixed while NVML is initialised: a driver upgrade needs a reload, hence a new backend.
        driver = _query(pynvml.nvmlSystemGetDriverVersion)
        self.host = HostInfo(
            name=server_name,
            hostname=socket.gethostname(),
            driver_version=_text(driver) if driver else "",
            cuda_version=_cuda_version(_query(pynvml.nvmlSystemGetCudaDriverVersion)),
            cpu_count=os.cpu_count() or 0,
            ram_mb=psutil.virtual_memory().total // MIB,
            simulated=False,
        )

    def snapshot(self) -> Snapshot:
        if self._closed:
            raise BackendUnavailable("NVML backend is closed")
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            except pynvml.NVMLError as exc:
                # Without its UUID a card cannot be keyed; report the others.
                log.warning("Skipping GPU %d: %s", index, exc)
                continue
            gpus.append(self._gpu(index, uuid, handle))
        return Snapshot(host=self.host, gpus=tuple(gpus))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.warning("nvmlShutdown failed: %s", exc)

    def _gpu(self, index: int, uuid: str, handle: Any) -> GPUInfo:
        name = _query(pynvml.nvmlDeviceGetName, handle)
        pci = _query(pynvml.nvmlDeviceGetPciInfo, handle)
        total, reserved, used = _query(_memory, handle) or (0, 0, None)
        utilization = _query(pynvml.nvmlDeviceGetUtilizationRates, handle)
        processes = []
        for proc in _query(_compute_processes, handle) or ():
            username, command, job_id = _owner_and_command(proc.pid)
            used_bytes = proc.usedGpuMemory  # None where NVML cannot tell (WDDM, some containers)
            processes.append(
                ProcessInfo(
                    pid=proc.pid,
                    username=username,
                    command=command,
                    used_memory_mb=None if used_bytes is None else used_bytes // MIB,
                    job_id=job_id,
                )
            )
        return GPUInfo(
            uuid=uuid,
            index=index,
            name=_text(name) if name else "Unknown GPU",
            pci_bus_id=_text(pci.busId) if pci is not None else "",
            memory_total_mb=total // MIB,
            memory_reserved_mb=reserved // MIB,
            memory_used_mb=None if used is None else used // MIB,
            utilization_pct=utilization.gpu if utilization is not None else None,
            temperature_c=_query(_temperature, handle),
            power_w=_watts(_query(pynvml.nvmlDeviceGetPowerUsage, handle)),
            power_limit_w=_watts(_query(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)),
            mig_mode=_query(_mig_mode, handle),
            processes=tuple(processes),
        )
