"""NvmlBackend through the real pynvml wrappers, over a fake NVML C library (tests/fake_nvml.py).

Only the library object pynvml loads is replaced, so the wrappers' argument handling, struct
decoding, version fallbacks and error mapping run as they do against a driver. The processes
NVML lists are real ones, described by gpus.procinfo.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pynvml
import pytest

from gpus import nvml
from gpus.inventory import BackendUnavailable, CardState
from gpus.nvml import NvmlBackend, NvmlNotInstalled
from tests.conftest import Clock
from tests.fake_nvml import GIB, MIB, FakeMigInstance, FakeNvmlLib, finish_reads, install, uninstall

NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
NO_PERMISSION = pynvml.NVML_ERROR_NO_PERMISSION
GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
VERSION_MISMATCH = pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
UUID_0 = "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd"
UUID_1 = "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd"


@pytest.fixture
def lib(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNvmlLib]:
    yield install(monkeypatch, FakeNvmlLib(process_pid=os.getpid()))
    finish_reads()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(nvml, "monotonic", clock)
    return clock


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gpus.nvml" and r.levelno == logging.WARNING]


# --- a healthy host ------------------------------------------------------------------------


def test_it_reports_a_healthy_two_gpu_host(lib: FakeNvmlLib) -> None:
    snapshot = NvmlBackend("node1").snapshot()

    host = snapshot.host
    assert (host.name, host.hostname, host.simulated) == ("node1", socket.gethostname(), False)
    assert (host.driver_version, host.cuda_version) == ("550.90.07", "12.4")
    assert (host.cpu_count, host.ram_mb) == (os.cpu_count(), psutil.virtual_memory().total // MIB)
    first, second = snapshot.gpus
    assert (first.uuid, first.index, first.state) == (UUID_0, 0, CardState.OK)
    assert (first.name, first.pci_bus_id) == ("NVIDIA A100-SXM4-40GB", "00000000:07:00.0")
    assert (first.memory_total_mb, first.memory_reserved_mb, first.memory_used_mb) == (40960, 512, 10240)
    assert (first.utilization_pct, first.temperature_c) == (87, 64)
    assert (first.power_w, first.power_limit_w, first.mig_mode) == (312.456, 400.0, "disabled")
    (process,) = first.processes
    assert (process.pid, process.used_memory_mb, process.session_id) == (
        os.getpid(),
        9216,
        os.getsid(0) or None,
    )
    assert process.username == psutil.Process().username()
    assert "pytest" in process.command or "python" in process.command
    assert process.job_id is None  # resolved at ingest from the session, never by the backend
    assert (second.uuid, second.pci_bus_id, second.utilization_pct, second.processes) == (
        UUID_1,
        "00000000:08:00.0",
        0,
        (),
    )
    assert not lib.called("nvmlDeviceGetComputeRunningProcesses_v2")
    assert not lib.called("nvmlDeviceGetTemperature")
    assert not lib.called("nvmlDeviceGetMemoryInfo")


@pytest.mark.parametrize(("raw", "expected"), [(12040, "12.4"), (11080, "11.8"), (13000, "13.0")])
def test_it_formats_the_cuda_version(lib: FakeNvmlLib, raw: int, expected: str) -> None:
    lib.cuda_version = raw

    assert NvmlBackend("node1").host.cuda_version == expected


def test_it_decodes_bytes_from_older_bindings(lib: FakeNvmlLib, monkeypatch: pytest.MonkeyPatch) -> None:
    # Bindings before nvidia-ml-py 11.5 returned bytes: the same wrappers without @convertStrBytes.
    for name in ("nvmlSystemGetDriverVersion", "nvmlDeviceGetUUID", "nvmlDeviceGetName"):
        monkeypatch.setattr(pynvml, name, getattr(pynvml, name).__wrapped__)
    lib.cards[0].name = "Tesla V100-PCIE-16GB"

    snapshot = NvmlBackend("node1").snapshot()

    assert snapshot.host.driver_version == "550.90.07"
    first = snapshot.gpus[0]
    assert (first.uuid, first.name, first.pci_bus_id) == (UUID_0, "Tesla V100-PCIE-16GB", "00000000:07:00.0")


@pytest.mark.parametrize(
    ("mode", "expected"), [((1, 1), "enabled"), ((0, 1), "disabled"), ((1, 0), "enabled")]
)
def test_it_reports_the_current_mig_mode(lib: FakeNvmlLib, mode: tuple[int, int], expected: str) -> None:
    lib.cards[0].mig = mode

    assert NvmlBackend("node1").snapshot().gpus[0].mig_mode == expected


# --- metrics a card cannot answer ----------------------------------------------------------


@pytest.mark.parametrize(
    ("symbols", "field"),
    [
        (["nvmlDeviceGetPowerUsage"], "power_w"),
        (["nvmlDeviceGetEnforcedPowerLimit"], "power_limit_w"),
        (["nvmlDeviceGetUtilizationRates"], "utilization_pct"),
        (["nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"], "temperature_c"),
        (["nvmlDeviceGetMigMode"], "mig_mode"),
    ],
)
def test_it_reports_an_unsupported_metric_as_none(
    lib: FakeNvmlLib, caplog: pytest.LogCaptureFixture, symbols: list[str], field: str
) -> None:
    for symbol in symbols:
        lib.cards[0].fail[symbol] = NOT_SUPPORTED

    first, second = NvmlBackend("node1").snapshot().gpus

    assert getattr(first, field) is None
    assert getattr(second, field) is not None
    assert (first.memory_used_mb, first.state) == (10240, CardState.OK)  # the rest still reports
    assert warnings(caplog) == []  # "not supported" is a fact about the card, not trouble


def test_it_warns_about_an_unexpected_error_once_per_card_and_kind(
    lib: FakeNvmlLib, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    lib.cards[0].fail["nvmlDeviceGetPowerUsage"] = NO_PERMISSION
    backend = NvmlBackend("node1")

    first, _ = backend.snapshot().gpus
    clock.now += 3
    backend.snapshot()
    clock.now += nvml.WARNING_EVERY_SECONDS
    backend.snapshot()

    assert first.power_w is None
    assert warnings(caplog) == ["NVML nvmlDeviceGetPowerUsage failed on GPU 0: Insufficient Permissions"] * 2


def test_it_reports_zero_total_and_unknown_used_when_memory_cannot_be_read(lib: FakeNvmlLib) -> None:
    lib.cards[0].fail["nvmlDeviceGetMemoryInfo_v2"] = NO_PERMISSION

    first, _ = NvmlBackend("node1").snapshot().gpus

    assert (first.memory_total_mb, first.memory_reserved_mb, first.memory_used_mb) == (0, 0, None)


# --- older drivers and bindings ----------------------------------------------------------


@pytest.mark.parametrize("older", ["binding", "driver symbol", "version mismatch", "not supported"])
def test_it_falls_back_to_the_legacy_temperature_call(
    lib: FakeNvmlLib, monkeypatch: pytest.MonkeyPatch, older: str
) -> None:
    if older == "binding":
        monkeypatch.delattr(pynvml, "nvmlDeviceGetTemperatureV")
    elif older == "driver symbol":
        lib.missing.add("nvmlDeviceGetTemperatureV")
    else:
        code = VERSION_MISMATCH if older == "version mismatch" else NOT_SUPPORTED
        lib.cards[0].fail["nvmlDeviceGetTemperatureV"] = code

    first, _ = NvmlBackend("node1").snapshot().gpus

    assert first.temperature_c == 64
    assert lib.called("nvmlDeviceGetTemperature")


@pytest.mark.parametrize("older", ["binding", "driver symbol", "version mismatch"])
def test_it_falls_back_to_v1_memory_and_estimates_the_reservation(
    lib: FakeNvmlLib, monkeypatch: pytest.MonkeyPatch, older: str
) -> None:
    if older == "binding":
        monkeypatch.delattr(pynvml, "nvmlMemory_v2")
    elif older == "driver symbol":
        lib.missing.add("nvmlDeviceGetMemoryInfo_v2")
    else:
        lib.cards[0].fail["nvmlDeviceGetMemoryInfo_v2"] = VERSION_MISMATCH
    lib.cards[1].memory = (16 * GIB, 256 * MIB, 0)
    backend = NvmlBackend("node1")

    first, second = backend.snapshot().gpus
    lib.cards[0].memory = (40 * GIB, 512 * MIB, 30 * GIB)  # busier: the estimate stays put

    # v1's used includes the driver's reservation, which it does not report: never 0 reserved.
    assert (first.memory_total_mb, first.memory_reserved_mb, first.memory_used_mb) == (40960, 1280, 10752)
    assert backend.snapshot().gpus[0].memory_reserved_mb == 1280  # 1/32 of 40 GiB
    if older != "version mismatch":  # that one is card 0's alone
        assert (second.memory_total_mb, second.memory_reserved_mb) == (16384, 1024)  # the 1 GiB floor
    assert lib.called("nvmlDeviceGetMemoryInfo")


def test_it_falls_back_to_v2_processes_when_the_v3_symbol_is_missing(lib: FakeNvmlLib) -> None:
    lib.missing.add("nvmlDeviceGetComputeRunningProcesses_v3")
    NvmlBackend("node1")  # pynvml is initialised from here on
    # pynvml's unversioned wrapper turns that into an exception outside the NVMLError tree
    with pytest.raises(pynvml.NVMLLibraryMismatchError):
        pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(0))

    first, _ = NvmlBackend("node1").snapshot().gpus

    assert [p.pid for p in first.processes] == [os.getpid()]
    assert lib.called("nvmlDeviceGetComputeRunningProcesses_v2")


# --- processes: unknown is not empty ---------------------------------------------------------


@pytest.mark.parametrize("code", [NO_PERMISSION, NOT_SUPPORTED, pynvml.NVML_ERROR_UNKNOWN])
def test_it_reports_an_unreadable_process_list_as_unknown(lib: FakeNvmlLib, code: int) -> None:
    lib.cards[0].fail["nvmlDeviceGetComputeRunningProcesses_v3"] = code

    first, second = NvmlBackend("node1").snapshot().gpus

    assert first.processes is None  # unknown, which is not idle
    assert second.processes == ()  # read, and empty: idle
    assert first.memory_used_mb == 10240


def test_it_reads_processes_per_mig_instance(lib: FakeNvmlLib, procs: list[subprocess.Popen]) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    procs.append(other)
    card = lib.cards[0]
    card.mig = (1, 1)
    card.fail["nvmlDeviceGetComputeRunningProcesses_v3"] = NO_PERMISSION  # unprivileged, as usual
    card.processes = []
    card.mig_instances = {
        0: FakeMigInstance(processes=[(os.getpid(), 5 * GIB)]),
        2: FakeMigInstance(processes=[(other.pid, None)]),  # slot 1 is empty: NotFound
        3: FakeMigInstance(),
    }

    first, _ = NvmlBackend("node1").snapshot().gpus

    assert first.mig_mode == "enabled"
    assert [(p.pid, p.used_memory_mb) for p in first.processes] == [(os.getpid(), 5120), (other.pid, None)]


def test_one_unreadable_mig_instance_makes_the_cards_processes_unknown(lib: FakeNvmlLib) -> None:
    card = lib.cards[0]
    card.mig = (1, 1)
    card.mig_instances = {
        0: FakeMigInstance(processes=[(os.getpid(), 5 * GIB)]),
        1: FakeMigInstance(fail={"nvmlDeviceGetComputeRunningProcesses_v3": NO_PERMISSION}),
    }

    first, second = NvmlBackend("node1").snapshot().gpus

    assert first.processes is None
    assert second.processes == ()


def test_a_mig_card_without_instances_runs_no_processes(lib: FakeNvmlLib) -> None:
    lib.cards[0].mig = (1, 1)
    lib.cards[0].fail["nvmlDeviceGetComputeRunningProcesses_v3"] = NO_PERMISSION

    assert NvmlBackend("node1").snapshot().gpus[0].processes == ()


def test_it_keeps_unknown_process_memory_as_none(lib: FakeNvmlLib) -> None:
    lib.cards[0].processes = [(os.getpid(), None)]  # WDDM, some containers

    (process,) = NvmlBackend("node1").snapshot().gpus[0].processes

    assert process.used_memory_mb is None
    assert process.username == psutil.Process().username()


def test_a_process_that_exited_before_inspection_leaves_the_round_intact(lib: FakeNvmlLib) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    lib.cards[1].processes = [(gone.pid, 2 * GIB)]

    first, second = NvmlBackend("node1").snapshot().gpus

    (process,) = second.processes
    assert (process.pid, process.username, process.command, process.session_id) == (gone.pid, "?", "", None)
    assert process.used_memory_mb == 2048
    assert [p.pid for p in first.processes] == [os.getpid()]


def test_another_users_process_leaves_the_round_intact(lib: FakeNvmlLib) -> None:
    me = os.getuid()
    theirs = next(
        (p.pid for p in psutil.process_iter(["uids"]) if p.pid > 1 and p.info["uids"].real != me), None
    )
    if theirs is None:
        pytest.skip("no other user's process on this machine")
    lib.cards[1].processes = [(theirs, 1 * GIB)]

    first, second = NvmlBackend("node1").snapshot().gpus

    (process,) = second.processes
    assert (process.pid, process.used_memory_mb, process.job_id) == (theirs, 1024, None)
    assert [p.pid for p in first.processes] == [os.getpid()]


@pytest.mark.parametrize("pid", [0, 1])
def test_pid_0_and_1_from_nvml_are_dropped(lib: FakeNvmlLib, pid: int) -> None:
    """NVML answers pid 0 when its struct versions disagree; getsid(0) is our own session, and
    kill(0) our own process group: such an entry never reaches the watchdog."""
    lib.cards[0].processes = [(pid, 1 * GIB), (os.getpid(), 2 * GIB)]
    lib.cards[1].graphics = [(pid, 1 * GIB)]

    first, second = NvmlBackend("node1").snapshot().gpus

    assert [p.pid for p in first.processes] == [os.getpid()]
    assert second.processes == ()


def test_graphics_processes_are_listed_once_beside_compute_ones(
    lib: FakeNvmlLib, procs: list[subprocess.Popen]
) -> None:
    renderer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    procs.append(renderer)
    lib.cards[0].graphics = [(renderer.pid, 1 * GIB), (os.getpid(), 9 * GIB)]  # ours: C+G, one figure

    first, _ = NvmlBackend("node1").snapshot().gpus

    assert sorted((p.pid, p.used_memory_mb) for p in first.processes) == sorted(
        [(os.getpid(), 9216), (renderer.pid, 1024)]
    )
    assert lib.called("nvmlDeviceGetGraphicsRunningProcesses_v3")


def test_a_card_that_runs_no_graphics_still_lists_its_compute_processes(lib: FakeNvmlLib) -> None:
    lib.cards[0].fail["nvmlDeviceGetGraphicsRunningProcesses_v3"] = NOT_SUPPORTED

    first, _ = NvmlBackend("node1").snapshot().gpus

    assert [p.pid for p in first.processes] == [os.getpid()]


def test_processes_carry_their_start_time(lib: FakeNvmlLib) -> None:
    (process,) = NvmlBackend("node1").snapshot().gpus[0].processes
    assert process.started == psutil.Process().create_time()


def test_a_process_hidden_from_this_user_leaves_the_round_intact(
    lib: FakeNvmlLib, monkeypatch: pytest.MonkeyPatch
) -> None:
    def denied(self: psutil.Process) -> str:
        raise psutil.AccessDenied(self.pid)

    # What hidepid=2 or another user's process answers: the process exists, its details do not.
    monkeypatch.setattr(psutil.Process, "username", denied)
    monkeypatch.setattr(psutil.Process, "cmdline", denied)
    monkeypatch.setattr(psutil.Process, "name", denied)

    first, second = NvmlBackend("node1").snapshot().gpus

    (process,) = first.processes
    assert (process.pid, process.username, process.command, process.used_memory_mb) == (
        os.getpid(),
        "?",
        "",
        9216,
    )
    assert second.state == CardState.OK


def test_it_truncates_long_command_lines(lib: FakeNvmlLib, procs: list[subprocess.Popen]) -> None:
    long = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "x" * 500])
    procs.append(long)
    lib.cards[1].processes = [(long.pid, GIB)]

    (process,) = NvmlBackend("node1").snapshot().gpus[1].processes

    assert len(process.command) == 300
    assert process.command.endswith("xxx")


# --- cards that fall off the bus --------------------------------------------------------------


def test_a_card_that_falls_off_the_bus_is_reported_lost_with_its_known_facts(
    lib: FakeNvmlLib, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    backend = NvmlBackend("node1")
    healthy, _ = backend.snapshot().gpus
    lib.cards[0].lost = True  # every call on it, the handle included, answers GPU_IS_LOST

    lost, other = backend.snapshot().gpus
    clock.now += 3
    again, _ = backend.snapshot().gpus

    assert (lost.uuid, lost.index, lost.state) == (UUID_0, 0, CardState.LOST)
    assert (lost.name, lost.pci_bus_id, lost.memory_total_mb, lost.memory_reserved_mb) == (
        healthy.name,
        healthy.pci_bus_id,
        40960,
        512,
    )
    assert (lost.memory_used_mb, lost.utilization_pct, lost.temperature_c, lost.power_w) == (None,) * 4
    assert lost.processes is None
    assert again == lost
    assert other.state == CardState.OK
    assert warnings(caplog) == [f"GPU 0 ({UUID_0}) is lost (GPU is lost)"]  # not one per round

    lib.cards[0].lost = False
    with caplog.at_level(logging.INFO, logger="gpus.nvml"):
        back, _ = backend.snapshot().gpus

    assert back == healthy
    assert f"GPU 0 ({UUID_0}) answers again" in caplog.text


@pytest.mark.parametrize("code", [GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED])
def test_a_card_lost_midway_is_reported_lost_under_the_uuid_it_gave(lib: FakeNvmlLib, code: int) -> None:
    lib.cards[1].fail["nvmlDeviceGetUtilizationRates"] = code

    _, lost = NvmlBackend("node1").snapshot().gpus

    assert (lost.uuid, lost.index, lost.state, lost.processes) == (UUID_1, 1, CardState.LOST, None)
    assert (lost.name, lost.memory_total_mb) == ("Unknown GPU", 0)  # placeholders: never seen whole


def test_it_skips_a_card_it_never_identified(lib: FakeNvmlLib, caplog: pytest.LogCaptureFixture) -> None:
    lib.cards[0].lost = True

    (only,) = NvmlBackend("node1").snapshot().gpus

    assert only.index == 1
    assert warnings(caplog) == ["Skipping GPU 0, never identified: it is lost (GPU is lost)"]


def test_it_skips_a_card_whose_uuid_is_unreadable(lib: FakeNvmlLib, caplog: pytest.LogCaptureFixture) -> None:
    lib.cards[0].fail["nvmlDeviceGetUUID"] = pynvml.NVML_ERROR_UNKNOWN

    (only,) = NvmlBackend("node1").snapshot().gpus

    assert only.index == 1
    assert warnings(caplog) == ["Skipping GPU 0: Unknown Error"]


# --- a card that hangs ------------------------------------------------------------------------


def test_a_hung_card_is_reported_unresponsive_without_stalling_the_round(
    lib: FakeNvmlLib, caplog: pytest.LogCaptureFixture
) -> None:
    backend = NvmlBackend("node1", round_timeout=0.3)
    _, healthy = backend.snapshot().gpus
    hang = threading.Event()
    lib.cards[1].block["nvmlDeviceGetUtilizationRates"] = hang
    try:
        started = time.monotonic()
        first, hung = backend.snapshot().gpus
        took = time.monotonic() - started
        _, still = backend.snapshot().gpus

        assert took < 5  # bounded by round_timeout, not by the hung call
        assert first.state == CardState.OK and first.utilization_pct == 87
        assert (hung.uuid, hung.state, hung.memory_total_mb, hung.name) == (
            UUID_1,
            CardState.UNRESPONSIVE,
            40960,
            healthy.name,
        )
        assert (hung.utilization_pct, hung.memory_used_mb, hung.processes) == (None, None, None)
        assert still.state == CardState.UNRESPONSIVE
        assert lib.blocked_calls == 1  # the stuck read is waited on again, not joined by another
        assert warnings(caplog) == [f"GPU 1 ({UUID_1}) did not answer within 0.3s"]
        backend.close()  # a hung read may hold NVML's locks: no nvmlShutdown behind it
        assert not lib.called("nvmlShutdown")
    finally:
        hang.set()


def test_a_card_that_answers_again_is_ok_again(lib: FakeNvmlLib) -> None:
    backend = NvmlBackend("node1", round_timeout=0.3)
    hang = threading.Event()
    lib.cards[1].block["nvmlDeviceGetPowerUsage"] = hang
    try:
        assert backend.snapshot().gpus[1].state == CardState.UNRESPONSIVE
    finally:
        hang.set()
    backend.round_timeout = 30  # the stuck read returns now: this round waits for it, no longer

    _, back = backend.snapshot().gpus

    assert (back.state, back.utilization_pct, back.processes) == (CardState.OK, 0, ())


def test_a_card_that_hangs_before_giving_its_uuid_is_skipped(lib: FakeNvmlLib) -> None:
    hang = threading.Event()
    lib.cards[0].block["nvmlDeviceGetHandleByIndex_v2"] = hang
    try:
        (only,) = NvmlBackend("node1", round_timeout=0.3).snapshot().gpus
    finally:
        hang.set()

    assert (only.index, only.state) == (1, CardState.OK)


# --- start and end ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "failed to initialise"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "failed to initialise"),
    ],
)
def test_it_is_unavailable_without_a_working_driver(lib: FakeNvmlLib, code: int, message: str) -> None:
    lib.init_results = [code]

    with pytest.raises(BackendUnavailable, match=message) as raised:
        NvmlBackend("node1")

    assert not isinstance(raised.value, NvmlNotInstalled)  # a driver is there: worth retrying


def test_it_is_not_installed_without_the_nvml_library(monkeypatch: pytest.MonkeyPatch) -> None:
    uninstall(monkeypatch)

    with pytest.raises(NvmlNotInstalled, match=r"libnvidia-ml\.so\.1"):
        NvmlBackend("node1")


def test_it_is_unavailable_on_a_host_without_nvidia_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    # The real pynvml and the real library lookup: on this CI host there is no libnvidia-ml.
    install(monkeypatch, None)
    try:
        backend = NvmlBackend("node1")
    except NvmlNotInstalled as exc:
        assert "NVIDIA driver" in str(exc)
    else:
        backend.close()
        pytest.skip("this host has a working NVIDIA driver")


def test_it_is_unavailable_when_nvml_stops_answering(lib: FakeNvmlLib) -> None:
    backend = NvmlBackend("node1")
    lib.count_result = pynvml.NVML_ERROR_UNINITIALIZED

    with pytest.raises(BackendUnavailable, match="stopped answering"):
        backend.snapshot()


def test_it_closes_idempotently(lib: FakeNvmlLib) -> None:
    backend = NvmlBackend("node1")

    backend.close()
    backend.close()

    assert lib.calls.count("nvmlShutdown") == 1
    assert pynvml._nvmlLib_refcount == 0
    with pytest.raises(BackendUnavailable, match="closed"):
        backend.snapshot()
