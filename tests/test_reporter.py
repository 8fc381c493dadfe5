"""The telemetry reporter starts NVML inside its loop, retries it with backoff, and never hides
a broken GPU host behind the simulated inventory. NVML is the real pynvml over the fake C
library of tests/fake_nvml.py."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pynvml
import pytest
from django.conf import settings

from gpus import telemetry
from gpus.backends import get_backend
from gpus.inventory import BackendUnavailable, Snapshot, snapshot_from_json
from gpus.nvml import NvmlBackend, NvmlNotInstalled
from gpus.simulated.backend import SimulatedBackend
from gpus.telemetry import TelemetryReporter, redis_client, reports_key, take_reports
from tests.conftest import Clock
from tests.fake_nvml import FakeNvmlLib, finish_reads, install, uninstall
from tests.waiting import wait_for

UNKNOWN = pynvml.NVML_ERROR_UNKNOWN
SIMULATED = "sim-rtx-4x24"  # a server of gpus/simulated_inventory.yaml


@pytest.fixture
def lib(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNvmlLib]:
    yield install(monkeypatch, FakeNvmlLib(process_pid=os.getpid()))
    finish_reads()


@pytest.fixture(autouse=True)
def _settings(settings) -> None:  # type: ignore[no-untyped-def]
    settings.GPU_BACKEND = "auto"
    settings.WORKER_SERVER = "node1"
    settings.NVML_INIT_RETRY_MAX_SECONDS = 60


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(telemetry, "monotonic", clock)
    return clock


class FakeRedis:
    """Where publish_snapshot writes: the host's latest report."""

    def __init__(self) -> None:
        self.reports: dict[str, Snapshot] = {}

    def hset(self, key: str, field: str, value: str) -> None:
        assert key == reports_key()
        self.reports[field] = snapshot_from_json(value)


@pytest.fixture
def reporter() -> Iterator[TelemetryReporter]:
    reporter = TelemetryReporter()
    reporter.client = FakeRedis()  # type: ignore[assignment]
    yield reporter
    reporter.finish()


def published(reporter: TelemetryReporter, host: str = "node1") -> Snapshot | None:
    return reporter.client.reports.pop(host, None)  # type: ignore[attr-defined]


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]


# --- which backend ---------------------------------------------------------------------------


def test_auto_uses_the_simulation_only_without_an_nvml_library(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    uninstall(monkeypatch)

    backend = get_backend(server_name=SIMULATED)

    assert isinstance(backend, SimulatedBackend)
    assert "GPU_BACKEND=auto uses the SIMULATED inventory" in caplog.text


def test_auto_does_not_hide_a_driver_that_fails_behind_the_simulation(lib: FakeNvmlLib) -> None:
    lib.init_results = [pynvml.NVML_ERROR_DRIVER_NOT_LOADED]

    with pytest.raises(BackendUnavailable, match="driver is not loaded"):
        get_backend()


def test_nvml_never_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    uninstall(monkeypatch)

    with pytest.raises(NvmlNotInstalled):
        get_backend("nvml")


def test_it_passes_the_round_timeout_setting(lib: FakeNvmlLib, settings) -> None:  # type: ignore[no-untyped-def]
    settings.NVML_ROUND_TIMEOUT_SECONDS = 4

    backend = get_backend()

    assert isinstance(backend, NvmlBackend) and backend.round_timeout == 4
    backend.close()


# --- the reporter starts NVML in its loop -------------------------------------------------


def test_it_retries_nvml_until_it_starts_then_publishes(
    lib: FakeNvmlLib, reporter: TelemetryReporter, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    lib.init_results = [UNKNOWN, UNKNOWN]

    reporter.step()  # fails: next attempt in 1 s
    clock.now += 1
    with caplog.at_level(logging.DEBUG, logger="gpus.telemetry"):
        reporter.step()  # fails: next in 2 s
    assert published(reporter) is None
    clock.now += 2
    with caplog.at_level(logging.INFO, logger="gpus.telemetry"):
        reporter.step()

    snapshot = published(reporter)
    assert snapshot is not None and not snapshot.host.simulated
    assert [g.uuid for g in snapshot.gpus] == [c.uuid for c in lib.cards]
    assert lib.calls.count("nvmlInitWithFlags") == 3
    assert errors(caplog) == [  # once, not once per attempt
        "GPU backend unavailable, so node1 sends no telemetry:"
        " NVML failed to initialise: Unknown Error (attempt 1, next in 1s)"
    ]
    assert "opened after 2 failed attempts" in caplog.text
    clock.now += reporter.publish_every
    reporter.step()
    assert published(reporter) is not None


def test_it_backs_off_up_to_the_cap(
    lib: FakeNvmlLib, reporter: TelemetryReporter, clock: Clock, settings
) -> None:  # type: ignore[no-untyped-def]
    settings.NVML_INIT_RETRY_MAX_SECONDS = 5
    lib.init_results = [UNKNOWN] * 10
    attempts_at = []
    for second in range(30):
        clock.now = 1000.0 + second
        before = lib.calls.count("nvmlInitWithFlags")
        reporter.step()
        if lib.calls.count("nvmlInitWithFlags") > before:
            attempts_at.append(second)

    assert attempts_at == [0, 1, 3, 7, 12, 17, 22, 27]  # 1, 2, 4, then the 5 s cap


def test_it_logs_the_error_again_when_it_changes_or_after_a_while(
    lib: FakeNvmlLib, reporter: TelemetryReporter, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    not_loaded = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    lib.init_results = [UNKNOWN, not_loaded, not_loaded, not_loaded]
    quiet = TelemetryReporter.ERROR_EVERY_SECONDS

    for at in (0, 60, 120, 60 + quiet):  # new, changed, the same again, the same a while later
        clock.now = 1000.0 + at
        reporter.step()

    logged = errors(caplog)
    assert len(logged) == 3
    assert "Unknown Error" in logged[0]
    assert "driver is not loaded" in logged[1] and "(attempt 2," in logged[1]
    assert "driver is not loaded" in logged[2] and "(attempt 4," in logged[2]


def test_it_opens_nvml_again_when_it_stops_answering(
    lib: FakeNvmlLib, reporter: TelemetryReporter, clock: Clock
) -> None:
    reporter.step()
    assert published(reporter) is not None
    lib.count_result = pynvml.NVML_ERROR_UNINITIALIZED  # e.g. the driver was reloaded

    reporter.step()

    assert published(reporter) is None
    assert reporter.backend is None and lib.called("nvmlShutdown")
    lib.count_result = pynvml.NVML_SUCCESS
    clock.now += reporter.publish_every  # past the 1 s retry, and a report is due again
    reporter.step()
    assert published(reporter) is not None
    assert lib.calls.count("nvmlInitWithFlags") == 2


def test_it_reads_for_the_watchdog_often_and_publishes_at_the_telemetry_interval(
    lib: FakeNvmlLib, reporter: TelemetryReporter, clock: Clock
) -> None:
    read: list[Snapshot] = []

    def watch(sender: object, *, snapshot: Snapshot, **kwargs: object) -> None:
        read.append(snapshot)

    telemetry.snapshot_read.connect(watch)
    try:
        assert reporter.interval == min(
            settings.WATCHDOG_INTERVAL_SECONDS, settings.TELEMETRY_INTERVAL_SECONDS
        )
        reporter.step()
        assert published(reporter) is not None
        clock.now += reporter.interval  # 2 s: the watchdog's round, no report due yet (3 s)
        reporter.step()
        assert published(reporter) is None
        clock.now += reporter.interval
        reporter.step()
        assert published(reporter) is not None
        assert len(read) == 3  # every read went to the watchdog
    finally:
        telemetry.snapshot_read.disconnect(watch)


@pytest.mark.django_db  # the simulation reads the bookings: no invented process on a booked card
def test_a_host_without_a_driver_reports_the_simulation(
    monkeypatch: pytest.MonkeyPatch, reporter: TelemetryReporter, settings
) -> None:  # type: ignore[no-untyped-def]
    uninstall(monkeypatch)
    settings.WORKER_SERVER = SIMULATED

    reporter.step()

    snapshot = published(reporter, SIMULATED)
    assert snapshot is not None and snapshot.host.simulated


def test_starting_the_reporter_opens_no_backend(monkeypatch: pytest.MonkeyPatch, settings) -> None:  # type: ignore[no-untyped-def]
    # GPU_BACKEND=nvml on a host whose driver is missing: the worker starts all the same.
    uninstall(monkeypatch)
    settings.GPU_BACKEND = "nvml"
    started: list[TelemetryReporter] = []
    monkeypatch.setattr(telemetry, "start_thread", started.append)

    telemetry.start_reporter()

    (thread,) = started
    assert thread.backend is None
    thread.step()  # the first attempt, in the loop
    assert thread.backend is None and thread.failures == 1


def test_the_reporter_thread_publishes_to_redis_once_nvml_starts(lib: FakeNvmlLib) -> None:
    lib.init_results = [UNKNOWN]
    client = redis_client()
    client.delete(reports_key())
    reporter = TelemetryReporter(interval=0.05)
    reporter.start()
    try:
        (snapshot,) = wait_for(lambda: take_reports(client), timeout=10, what="a report")  # type: ignore[misc]
    finally:
        reporter.stop()
        reporter.join(timeout=10)
        client.delete(reports_key())

    assert (snapshot.host.name, len(snapshot.gpus), reporter.failures) == ("node1", 2, 0)
    assert lib.called("nvmlShutdown")  # finish() closed the backend
