"""Writes to the inventory. The telemetry loop of every GPU host calls these."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from gpus.inventory import Snapshot
from gpus.models import GPU, GPUProcess, Server, TelemetrySample

_GPU_UPDATE_FIELDS = [
    "server",
    "index",
    "name",
    "pci_bus_id",
    "memory_total_mb",
    "memory_reserved_mb",
    "mig_mode",
    "memory_used_mb",
    "utilization_pct",
    "temperature_c",
    "power_w",
    "power_limit_w",
    "updated_at",
]


_SERVER_UPDATE_FIELDS = ["hostname", "simulated", "driver_version", "cuda_version", "cpu_count", "ram_mb", "last_seen"]


@transaction.atomic
def servers_report_ingest(*, snapshots: Sequence[Snapshot], now: datetime | None = None) -> None:
    """Record one telemetry round of many hosts in a fixed handful of bulk queries.

    The collector calls this with every host's latest report; the query count does not
    grow with the number of servers or GPUs. Registers unknown servers; re-running it
    with the same snapshots only moves `last_seen`; process lists are replaced, never
    appended to; `draining` is the admins' and is never touched.
    """
    if not snapshots:
        return
    now = now or timezone.now()
    latest = {s.host.name: s for s in snapshots}  # a host's newer report wins
    Server.objects.bulk_create(
        [
            Server(
                name=name,
                hostname=s.host.hostname,
                simulated=s.host.simulated,
                driver_version=s.host.driver_version,
                cuda_version=s.host.cuda_version,
                cpu_count=s.host.cpu_count,
                ram_mb=s.host.ram_mb,
                last_seen=now,
            )
            for name, s in latest.items()
        ],
        update_conflicts=True,
        unique_fields=["name"],
        update_fields=_SERVER_UPDATE_FIELDS,
    )
    rows = Server.objects.filter(name__in=latest).values_list("name", "pk", "last_history_at")
    server_ids = {name: pk for name, pk, _ in rows}
    history_every = timedelta(seconds=settings.TELEMETRY_HISTORY_SECONDS)
    history_due = {name for name, _, at in rows if at is None or now - at >= history_every}
    gpus = [
        GPU(
            uuid=g.uuid,
            server_id=server_ids[name],
            index=g.index,
            name=g.name,
            pci_bus_id=g.pci_bus_id,
            memory_total_mb=g.memory_total_mb,
            memory_reserved_mb=g.memory_reserved_mb,
            mig_mode=g.mig_mode or "",
            memory_used_mb=g.memory_used_mb,
            utilization_pct=g.utilization_pct,
            temperature_c=g.temperature_c,
            power_w=g.power_w,
            power_limit_w=g.power_limit_w,
            updated_at=now,
        )
        for name, s in latest.items()
        for g in s.gpus
    ]
    if gpus:
        # One INSERT … ON CONFLICT (uuid) DO UPDATE for every card of every host.
        GPU.objects.bulk_create(
            gpus, update_conflicts=True, unique_fields=["uuid"], update_fields=_GPU_UPDATE_FIELDS
        )
    GPUProcess.objects.filter(gpu__server_id__in=server_ids.values()).delete()
    GPUProcess.objects.bulk_create(
        GPUProcess(
            gpu_id=g.uuid,
            pid=p.pid,
            username=p.username[:64],
            command=p.command[:300],
            used_memory_mb=p.used_memory_mb,
        )
        for s in latest.values()
        for g in s.gpus
        for p in g.processes
    )
    if history_due:
        TelemetrySample.objects.bulk_create(
            TelemetrySample(
                gpu_id=g.uuid,
                at=now,
                memory_used_mb=g.memory_used_mb,
                utilization_pct=g.utilization_pct,
                temperature_c=g.temperature_c,
                power_w=g.power_w,
            )
            for name in history_due
            for g in latest[name].gpus
        )
        Server.objects.filter(name__in=history_due).update(last_history_at=now)


def server_report_ingest(*, snapshot: Snapshot, now: datetime | None = None) -> Server:
    """Record one host's report on its own (tests, `report_telemetry --direct`)."""
    servers_report_ingest(snapshots=[snapshot], now=now)
    return Server.objects.get(name=snapshot.host.name)


def telemetry_prune(*, now: datetime | None = None) -> int:
    """Delete history older than TELEMETRY_RETENTION_HOURS; returns the rows deleted."""
    cutoff = (now or timezone.now()) - timedelta(hours=settings.TELEMETRY_RETENTION_HOURS)
    deleted, _ = TelemetrySample.objects.filter(at__lt=cutoff).delete()
    return deleted


def server_set_draining(*, server: Server, draining: bool) -> None:
    Server.objects.filter(pk=server.pk).update(draining=draining)
    server.draining = draining
