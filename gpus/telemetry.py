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

import redis
from django.conf import settings
from django.db import close_old_connections

from gpus.backends import get_backend
from gpus.inventory import Backend, Snapshot, snapshot_from_json, snapshot_to_json
from gpus.services import servers_report_ingest
from portal.periodic import PeriodicThread, start_thread

log = logging.getLogger(__name__)

REPORTS_KEY = "portal:telemetry:reports"


def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=5)


def publish_snapshot(client: redis.Redis, snapshot: Snapshot) -> None:
    client.hset(REPORTS_KEY, snapshot.host.name, snapshot_to_json(snapshot))


def take_reports(client: redis.Redis) -> list[Snapshot]:
    """Every host's latest unread report; HGETALL + DEL in one MULTI so none is lost."""
    pipe = client.pipeline(transaction=True)
    pipe.hgetall(REPORTS_KEY)
    pipe.delete(REPORTS_KEY)
    raw, _ = pipe.execute()
    snapshots = []
    for host, payload in raw.items():
        try:
            snapshots.append(snapshot_from_json(payload))
        except (ValueError, TypeError, KeyError):
            log.warning("Dropped a malformed telemetry report from %r", host.decode(errors="replace"))
    return snapshots


def collect_once(client: redis.Redis) -> int:
    snapshots = take_reports(client)
    if snapshots:
        servers_report_ingest(snapshots=snapshots)
    return len(snapshots)


class TelemetryReporter(PeriodicThread):
    def __init__(self, backend: Backend, interval: float | None = None) -> None:
        super().__init__("gpu-telemetry-reporter", interval or settings.TELEMETRY_INTERVAL_SECONDS)
        self.backend = backend
        self.client = redis_client()

    def step(self) -> None:
        publish_snapshot(self.client, self.backend.snapshot())

    def finish(self) -> None:
        self.backend.close()


class TelemetryCollector(PeriodicThread):
    def __init__(self, interval: float = 1.0) -> None:
        super().__init__("gpu-telemetry-collector", interval)
        self.client = redis_client()

    def step(self) -> None:
        close_old_connections()  # a restarted database must not kill the loop
        collect_once(self.client)


def start_reporter() -> None:
    log.info(
        "Telemetry reporter for %s every %ss", settings.WORKER_SERVER, settings.TELEMETRY_INTERVAL_SECONDS
    )
    start_thread(TelemetryReporter(get_backend()))


def start_collector() -> None:
    log.info("Telemetry collector started")
    start_thread(TelemetryCollector())
