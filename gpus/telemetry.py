"""Telemetry: each GPU host publishes, one collector writes.

Every GPU host's worker runs a *reporter* thread that reads its backend every
TELEMETRY_INTERVAL_SECONDS and overwrites its entry in one Redis hash. The portal's own
worker (the one consuming the `portal` queue) runs the *collector* thread, which takes
the whole hash atomically each second and writes all hosts in one bulk transaction
(`servers_report_ingest`): a fixed handful of queries per round for 512 GPUs instead of
a transaction per host, and GPU hosts need no database round trip to stay "online".

Why threads inside the workers rather than beat or separate daemons: a host reports
exactly while its worker is alive, so "online" on the dashboard means "can run jobs
now"; when the worker dies its server goes offline by itself once `last_seen` ages
past SERVER_OFFLINE_AFTER_SECONDS. The threads are `portal.periodic.PeriodicThread`s: the
worker's shutdown stops them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import monotonic

import redis
from django.conf import settings
from django.db import DatabaseError, close_old_connections
from django.dispatch import Signal

from gpus.backends import get_backend
from gpus.inventory import Backend, BackendUnavailable, Snapshot, snapshot_from_json, snapshot_to_json
from gpus.models import Server
from gpus.services import servers_report_ingest
from gpus.usage import UsageRollup, start_rollup, usage_flush
from portal.names import redis_key
from portal.periodic import PeriodicThread, start_thread

log = logging.getLogger(__name__)

# Sent on a GPU host, in the reporter's thread, with every `snapshot` it reads: the GPU watchdog
# (jobs) judges the same processes the dashboard shows. A signal, because jobs builds on gpus.
snapshot_read = Signal()


def reports_key() -> str:
    """This portal's hash of host reports: two portals sharing a Redis must not take each other's."""
    return redis_key("telemetry", "reports")


def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=5)


def publish_snapshot(client: redis.Redis, snapshot: Snapshot) -> None:
    client.hset(reports_key(), snapshot.host.name, snapshot_to_json(snapshot))


def take_reports(client: redis.Redis) -> list[Snapshot]:
    """Every host's latest unread report; HGETALL + DEL in one MULTI so none is lost."""
    pipe = client.pipeline(transaction=True)
    key = reports_key()
    pipe.hgetall(key)
    pipe.delete(key)
    raw, _ = pipe.execute()
    snapshots = []
    for host, payload in raw.items():
        try:
            snapshots.append(snapshot_from_json(payload))
        except (ValueError, TypeError, KeyError):
            log.warning("Dropped a malformed telemetry report from %r", host.decode(errors="replace"))
    return snapshots


def collect_once(client: redis.Redis, rollup: UsageRollup | None = None) -> int:
    began = monotonic()
    snapshots = take_reports(client)
    if snapshots:
        servers_report_ingest(snapshots=snapshots, rollup=rollup)
        round_time_record([s.host.name for s in snapshots], monotonic() - began)
    return len(snapshots)


def round_time_record(servers: list[str], seconds: float) -> None:
    """How long the collector's round took, on each server it wrote, for /metrics: one UPDATE,
    after the round's own transaction, and never the round's failure."""
    try:
        Server.objects.filter(name__in=servers).update(telemetry_round_seconds=seconds)
    except DatabaseError as exc:
        log.debug("Could not record the telemetry round's time: %s", exc)


class TelemetryReporter(PeriodicThread):
    """Reads this host's cards every WATCHDOG_INTERVAL_SECONDS for the watchdog (`snapshot_read`)
    and publishes a snapshot every TELEMETRY_INTERVAL_SECONDS.

    The backend is opened here, in the loop, and opened again whenever it fails as a whole: a
    driver that is not ready when the worker starts, or is reloaded under it, costs the reports
    until NVML answers again (the server shows offline meanwhile), never the host's telemetry for
    the rest of the worker's life. Attempts back off 1, 2, 4 … seconds up to
    NVML_INIT_RETRY_MAX_SECONDS; the failure is logged as an ERROR when it is new, then once per
    ERROR_EVERY_SECONDS.
    """

    ERROR_EVERY_SECONDS = 10 * 60

    def __init__(
        self, open_backend: Callable[[], Backend] = get_backend, interval: float | None = None
    ) -> None:
        every = min(settings.TELEMETRY_INTERVAL_SECONDS, settings.WATCHDOG_INTERVAL_SECONDS)
        super().__init__("gpu-telemetry-reporter", interval or every)
        self.publish_every = interval or settings.TELEMETRY_INTERVAL_SECONDS
        self._published_at = float("-inf")
        self.open_backend = open_backend
        self.backend: Backend | None = None
        self.client = redis_client()
        self.failures = 0
        self._retry_at = 0.0
        self._logged: tuple[str, float] = ("", 0.0)  # the last ERROR and when

    def step(self) -> None:
        backend = self._open()
        if backend is None:
            return
        try:
            snapshot = backend.snapshot()
        except BackendUnavailable as exc:
            backend.close()
            self.backend = None
            self._failed(exc)
            return
        now = monotonic()
        if now - self._published_at >= self.publish_every - 0.05:  # a tick early is not a round late
            publish_snapshot(self.client, snapshot)
            self._published_at = now
        for receiver, error in snapshot_read.send_robust(sender=TelemetryReporter, snapshot=snapshot):
            if isinstance(error, Exception):
                log.error("%s failed on this snapshot", receiver, exc_info=error)

    def finish(self) -> None:
        if self.backend is not None:
            self.backend.close()

    def _open(self) -> Backend | None:
        if self.backend is not None or monotonic() < self._retry_at:
            return self.backend
        try:
            self.backend = self.open_backend()
        except BackendUnavailable as exc:
            self._failed(exc)
            return None
        if self.failures:
            log.info("GPU backend opened after %d failed attempts; reporting again", self.failures)
        self.failures = 0
        return self.backend

    def _failed(self, exc: BackendUnavailable) -> None:
        self.failures += 1
        delay = min(2 ** min(self.failures - 1, 30), settings.NVML_INIT_RETRY_MAX_SECONDS)
        now = monotonic()
        self._retry_at = now + delay
        message = str(exc)
        last, logged_at = self._logged
        if message != last or now - logged_at >= self.ERROR_EVERY_SECONDS:
            self._logged = (message, now)
            log.error(
                "GPU backend unavailable, so %s sends no telemetry: %s (attempt %d, next in %ss)",
                settings.WORKER_SERVER,
                message,
                self.failures,
                delay,
            )
        else:
            log.debug("GPU backend still unavailable: %s (attempt %d)", message, self.failures)


class TelemetryCollector(PeriodicThread):
    """The portal's one collector; it keeps the usage rollup its rounds feed, and writes what the
    rollup holds when the worker's shutdown stops it."""

    def __init__(self, interval: float = 1.0, rollup: UsageRollup | None = None) -> None:
        super().__init__("gpu-telemetry-collector", interval)
        self.client = redis_client()
        self.rollup = rollup

    def step(self) -> None:
        close_old_connections()  # a restarted database must not kill the loop
        collect_once(self.client, self.rollup)

    def finish(self) -> None:
        if self.rollup is not None:
            usage_flush(self.rollup)


def start_reporter() -> None:
    log.info(
        "Telemetry reporter for %s every %ss", settings.WORKER_SERVER, settings.TELEMETRY_INTERVAL_SECONDS
    )
    start_thread(TelemetryReporter())


def start_collector() -> None:
    log.info("Telemetry collector started")
    start_thread(TelemetryCollector(rollup=start_rollup()))  # the rollup before the first round
