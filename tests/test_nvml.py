"""NvmlBackend against a fake NVML: the pynvml functions are replaced at the module boundary.

The process listing patches only the versioned ``_v3``/``_v2`` calls, so pynvml's own
unversioned wrapper (and its exception translation) runs for real.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import psutil
import pynvml
import pytest

from gpus import nvml
from gpus.inventory import BackendUnavailable, ProcessInfo
from gpus.nvml import NvmlBackend

GIB = 2**30
MIB = 2**20


def _gpu(index: int, **overrides: Any) -> dict[str, Any]:
    gpu = {
        "uuid": f"GPU-0000000{index}-aaaa-bbbb-cccc-dddddddddddd",
        "name": "NVIDIA A100-SXM4-40GB",
        "bus_id": f"00000000:{0x07 + index:02X}:00.0",
        "memory": (40 * GIB, 512 * MIB, 10 * GIB),  # total, reserved, used
        "utilization": 87,
        "temperature": 64,
        "power_mw": 312_456,
        "power_limit_mw": 400_000,
        "mig": [0, 0],
        "processes": [],
    }
    gpu.update(overrides)
    return gpu


class FakeNvml:
    """Just enough NVML for NvmlBackend; a value that is an exception is raised instead."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gpus = [
            _gpu(0, processes=[SimpleNamespace(pid=101, usedGpuMemory=9 * GIB)]),
            _gpu(1, utilization=0, processes=[]),
        ]
        self.init_error: Exception | None = None
        self.memory_v2_error: Exception | None = None
        self.temperature_v_error: Exception | None = None
        self.v3_error: Exception | None = None
        self.calls: list[str] = []
        self.owners: dict[int, tuple[str, list[str]] | Exception] = {
            101: ("alice", ["python", "train.py", "--epochs", "90"])
        }
        fakes = {
            "nvmlInit": self.init,
            "nvmlShutdown": lambda: self.calls.append("shutdown"),
            "nvmlSystemGetDriverVersion": lambda: "550.90.07",
            "nvmlSystemGetCudaDriverVersion": lambda: 12040,
            "nvmlDeviceGetCount": lambda: len(self.gpus),
            "nvmlDeviceGetHandleByIndex": lambda index: self.get(index, "handle", index),
            "nvmlDeviceGetUUID": lambda h: self.get(h, "uuid"),
            "nvmlDeviceGetName": lambda h: self.get(h, "name"),
            "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId=self.get(h, "bus_id")),
            "nvmlDeviceGetMemoryInfo": self.memory,
            "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(
                gpu=self.get(h, "utilization"), memory=0
            ),
            "nvmlDeviceGetTemperatureV": self.temperature_v,
            "nvmlDeviceGetTemperature": self.temperature,
            "nvmlDeviceGetPowerUsage": lambda h: self.get(h, "power_mw"),
            "nvmlDeviceGetEnforcedPowerLimit": lambda h: self.get(h, "power_limit_mw"),
            "nvmlDeviceGetMigMode": lambda h: self.get(h, "mig"),
            "nvmlDeviceGetComputeRunningProcesses_v3": self.processes_v3,
            "nvmlDeviceGetComputeRunningProcesses_v2": self.processes_v2,
        }
        for name, fake in fakes.items():
            monkeypatch.setattr(pynvml, name, fake)
        monkeypatch.setattr(nvml.psutil, "Process", self.process)
        monkeypatch.setattr(nvml.psutil, "virtual_memory", lambda: SimpleNamespace(total=512 * GIB))
        monkeypatch.setattr(nvml.socket, "gethostname", lambda: "gpu-node-1")
        monkeypatch.setattr(nvml.os, "cpu_count", lambda: 64)

    def get(self, handle: int, key: str, default: Any = None) -> Any:
        value = self.gpus[handle].get(key, default)
        if isinstance(value, Exception):
            raise value
        return value

    def init(self) -> None:
        if self.init_error:
            raise self.init_error
        self.calls.append("init")

    def memory(self, handle: int, version: int | None = None) -> SimpleNamespace:
        total, reserved, used = self.get(handle, "memory")
        if version is None:
            self.calls.append("memory_v1")
            return SimpleNamespace(total=total, free=total - used, used=used)
        assert version == pynvml.nvmlMemory_v2
        if self.memory_v2_error:
            raise self.memory_v2_error
        return SimpleNamespace(
            version=version, total=total, reserved=reserved, free=total - reserved - used, used=used
        )

    def temperature_v(self, handle: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        if self.temperature_v_error:
            raise self.temperature_v_error
        return self.get(handle, "temperature")

    def temperature(self, handle: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        self.calls.append("temperature_legacy")
        return self.get(handle, "temperature")

    def processes_v3(self, handle: int) -> list[SimpleNamespace]:
        if self.v3_error:
            raise self.v3_error
        return self.get(handle, "processes")

    def processes_v2(self, handle: int) -> list[SimpleNamespace]:
        self.calls.append("processes_v2")
        return self.get(handle, "processes")

    def process(self, pid: int) -> SimpleNamespace:
        owner = self.owners.get(pid, psutil.NoSuchProcess(pid))
        if isinstance(owner, Exception):
            raise owner
        username, cmdline = owner
        # pid 101 was started by the portal as job 7 (the worker reads its environment).
        environ = {"PORTAL_JOB_ID": "7"} if pid == 101 else {"HOME": "/root"}
        return SimpleNamespace(
            username=lambda: username,
            cmdline=lambda: cmdline,
            name=lambda: cmdline[0],
            environ=lambda: environ,
        )


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    return FakeNvml(monkeypatch)


def not_supported() -> pynvml.NVMLError:
    return pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


def test_it_reports_a_healthy_two_gpu_host(fake: FakeNvml) -> None:
    snapshot = NvmlBackend("node1").snapshot()

    host = snapshot.host
    assert (host.name, host.hostname, host.simulated) == ("node1", "gpu-node-1", False)
    assert (host.driver_version, host.cuda_version) == ("550.90.07", "12.4")
    assert (host.cpu_count, host.ram_mb) == (64, 512 * 1024)
    first, second = snapshot.gpus
    assert first.uuid == "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd"
    assert (first.index, first.name, first.pci_bus_id) == (0, "NVIDIA A100-SXM4-40GB", "00000000:07:00.0")
    assert (first.memory_total_mb, first.memory_reserved_mb, first.memory_used_mb) == (40960, 512, 10240)
    assert (first.utilization_pct, first.temperature_c) == (87, 64)
    assert (first.power_w, first.power_limit_w, first.mig_mode) == (312.456, 400.0, "disabled")
    (process,) = first.processes
    assert process == ProcessInfo(
        pid=101, username="alice", command="python train.py --epochs 90", used_memory_mb=9216, job_id=7
    )
    assert (second.index, second.pci_bus_id, second.utilization_pct, second.processes) == (
        1,
        "00000000:08:00.0",
        0,
        (),
    )
    assert "processes_v2" not in fake.calls
    assert "temperature_legacy" not in fake.calls


@pytest.mark.parametrize(
    ("key", "field"),
    [
        ("power_mw", "power_w"),
        ("power_limit_mw", "power_limit_w"),
        ("utilization", "utilization_pct"),
        ("temperature", "temperature_c"),
        ("mig", "mig_mode"),
    ],
)
def test_it_reports_an_unsupported_metric_as_none(fake: FakeNvml, key: str, field: str) -> None:
    fake.gpus[0][key] = not_supported()

    first, second = NvmlBackend("node1").snapshot().gpus

    assert getattr(first, field) is None
    assert getattr(second, field) is not None
    assert first.memory_used_mb == 10240  # the rest of the card still reports


def test_it_logs_an_unexpected_nvml_error_and_reports_none(
    fake: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    fake.gpus[0]["power_mw"] = pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    with caplog.at_level(logging.WARNING, logger="gpus.nvml"):
        (first, _) = NvmlBackend("node1").snapshot().gpus

    assert first.power_w is None
    assert "Insufficient Permissions" in caplog.text


def test_it_reports_no_processes_when_listing_them_is_unsupported(fake: FakeNvml) -> None:
    fake.gpus[0]["processes"] = not_supported()

    first, _ = NvmlBackend("node1").snapshot().gpus

    assert first.processes == ()


@pytest.mark.parametrize("missing", ["binding", "driver symbol", "not supported"])
def test_it_falls_back_to_the_legacy_temperature_call(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    if missing == "binding":
        monkeypatch.delattr(pynvml, "nvmlDeviceGetTemperatureV")
    elif missing == "driver symbol":
        fake.temperature_v_error = pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    else:
        fake.temperature_v_error = not_supported()

    first, _ = NvmlBackend("node1").snapshot().gpus

    assert first.temperature_c == 64
    assert "temperature_legacy" in fake.calls


def test_it_falls_back_to_v2_processes_when_the_v3_symbol_is_missing(fake: FakeNvml) -> None:
    fake.v3_error = pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    # pynvml's unversioned wrapper turns that into an exception outside the NVMLError tree
    with pytest.raises(pynvml.NVMLLibraryMismatchError):
        pynvml.nvmlDeviceGetComputeRunningProcesses(0)

    first, _ = NvmlBackend("node1").snapshot().gpus

    assert [p.pid for p in first.processes] == [101]
    assert "processes_v2" in fake.calls


def test_it_falls_back_to_v1_memory_without_reserved(fake: FakeNvml) -> None:
    fake.memory_v2_error = pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    first, _ = NvmlBackend("node1").snapshot().gpus

    assert (first.memory_total_mb, first.memory_reserved_mb, first.memory_used_mb) == (40960, 0, 10240)
    assert "memory_v1" in fake.calls


def test_it_reports_zero_total_and_unknown_used_when_memory_cannot_be_read(fake: FakeNvml) -> None:
    fake.gpus[0]["memory"] = not_supported()

    first, _ = NvmlBackend("node1").snapshot().gpus

    assert (first.memory_total_mb, first.memory_reserved_mb, first.memory_used_mb) == (0, 0, None)


def test_it_keeps_unknown_process_memory_as_none(fake: FakeNvml) -> None:
    fake.gpus[0]["processes"] = [SimpleNamespace(pid=101, usedGpuMemory=None)]

    (process,) = NvmlBackend("node1").snapshot().gpus[0].processes

    assert process.used_memory_mb is None
    assert process.username == "alice"


@pytest.mark.parametrize("error", [psutil.AccessDenied(202), psutil.NoSuchProcess(202)])
def test_it_shows_an_unknown_owner_for_a_hidden_process(fake: FakeNvml, error: Exception) -> None:
    fake.owners[202] = error
    fake.gpus[1]["processes"] = [SimpleNamespace(pid=202, usedGpuMemory=2 * GIB)]

    (process,) = NvmlBackend("node1").snapshot().gpus[1].processes

    assert (process.pid, process.username, process.command, process.used_memory_mb) == (202, "?", "", 2048)


def test_it_truncates_long_command_lines(fake: FakeNvml) -> None:
    fake.owners[101] = ("alice", ["python", "train.py", "--tags", "x" * 500])

    (process,) = NvmlBackend("node1").snapshot().gpus[0].processes

    assert len(process.command) == 300
    assert process.command.startswith("python train.py --tags xxx")


def test_it_decodes_bytes_from_older_bindings(fake: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pynvml, "nvmlSystemGetDriverVersion", lambda: b"470.256.02")
    fake.gpus[0].update(uuid=b"GPU-bytes", name=b"Tesla V100-PCIE-16GB", bus_id=b"00000000:3B:00.0")

    snapshot = NvmlBackend("node1").snapshot()

    assert snapshot.host.driver_version == "470.256.02"
    first = snapshot.gpus[0]
    assert (first.uuid, first.name, first.pci_bus_id) == (
        "GPU-bytes",
        "Tesla V100-PCIE-16GB",
        "00000000:3B:00.0",
    )


def test_it_skips_a_card_it_cannot_identify(fake: FakeNvml) -> None:
    fake.gpus[0]["handle"] = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    (only,) = NvmlBackend("node1").snapshot().gpus

    assert only.index == 1


@pytest.mark.parametrize(
    ("mode", "expected"), [([1, 1], "enabled"), ([0, 1], "disabled"), ([1, 0], "enabled")]
)
def test_it_reports_the_current_mig_mode(fake: FakeNvml, mode: list[int], expected: str) -> None:
    fake.gpus[0]["mig"] = mode

    assert NvmlBackend("node1").snapshot().gpus[0].mig_mode == expected


@pytest.mark.parametrize(("raw", "expected"), [(12040, "12.4"), (11080, "11.8"), (13000, "13.0")])
def test_it_formats_the_cuda_version(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch, raw: int, expected: str
) -> None:
    monkeypatch.setattr(pynvml, "nvmlSystemGetCudaDriverVersion", lambda: raw)

    assert NvmlBackend("node1").host.cuda_version == expected


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "failed to initialise"),
    ],
)
def test_it_is_unavailable_without_a_working_driver(fake: FakeNvml, code: int, message: str) -> None:
    fake.init_error = pynvml.NVMLError(code)

    with pytest.raises(BackendUnavailable, match=message):
        NvmlBackend("node1")


def test_it_is_unavailable_on_a_host_without_nvidia_driver() -> None:
    # The real pynvml, unpatched: on this CI host there is no libnvidia-ml.
    try:
        backend = NvmlBackend("node1")
    except BackendUnavailable as exc:
        assert "NVML" in str(exc) or "NVIDIA" in str(exc)
    else:
        backend.close()
        pytest.skip("this host has a working NVIDIA driver")


def test_it_closes_idempotently(fake: FakeNvml) -> None:
    backend = NvmlBackend("node1")

    backend.close()
    backend.close()

    assert fake.calls.count("shutdown") == 1
    with pytest.raises(BackendUnavailable, match="closed"):
        backend.snapshot()
