"""Writes to the inventory. The telemetry loop of every GPU host calls these."""

from __future__ import annotations

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


@transaction.atomic
def server_report_ingest(*, snapshot: Snapshot, now: datetime | None = None) -> Server:
    """Record one telemetry round of one host: a fixed handful of queries however many GPUs.

    Registers the server on its first report. Re-running it with the same snapshot only
    moves `last_seen`; the process list is replaced, never appended to.
    """
    now = now or timezone.now()
    host = snapshot.host
    fields = {
        "hostname": host.hostname,
        "simulated": host.simulated,
        "driver_version": host.driver_version,
        "cuda_version": host.cuda_version,
        "cpu_count": host.cpu_count,
        "ram_mb": host.ram_mb,
        "last_seen": now,
    }
    # Plain SELECT + UPDATE (not update_or_create, which adds a savepoint): this runs
    # every few seconds on every host. `draining` is the admins' and is never touched.
    server = Server.objects.filter(name=host.name).first()
    if server is None:
        server = Server.objects.create(name=host.name, **fields)
    else:
        Server.objects.filter(pk=server.pk).update(**fields)
    gpus = [
        GPU(
            uuid=g.uuid,
            server=server,
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
        for g in snapshot.gpus
    ]
    if gpus:
        # One INSERT … ON CONFLICT (uuid) DO UPDATE for all cards of the host.
        GPU.objects.bulk_create(
            gpus, update_conflicts=True, unique_fields=["uuid"], update_fields=_GPU_UPDATE_FIELDS
        )
    GPUProcess.objects.filter(gpu__server_id=server.pk).delete()
    GPUProcess.objects.bulk_create(
        GPUProcess(
            gpu_id=g.uuid,
            pid=p.pid,
            username=p.username[:64],
            command=p.command[:300],
            used_memory_mb=p.used_memory_mb,
        )
        for g in snapshot.gpus
        for p in g.processes
    )
    history_due = server.last_history_at is None or now - server.last_history_at >= timedelta(
        seconds=settings.TELEMETRY_HISTORY_SECONDS
    )
    if history_due and gpus:
        TelemetrySample.objects.bulk_create(
            TelemetrySample(
                gpu_id=g.uuid,
                at=now,
                memory_used_mb=g.memory_used_mb,
                utilization_pct=g.utilization_pct,
                temperature_c=g.temperature_c,
                power_w=g.power_w,
            )
            for g in gpus
        )
        Server.objects.filter(pk=server.pk).update(last_history_at=now)
    return server


def telemetry_prune(*, now: datetime | None = None) -> int:
    """Delete history older than TELEMETRY_RETENTION_HOURS; returns the rows deleted."""
    cutoff = (now or timezone.now()) - timedelta(hours=settings.TELEMETRY_RETENTION_HOURS)
    deleted, _ = TelemetrySample.objects.filter(at__lt=cutoff).delete()
    return deleted


def server_set_draining(*, server: Server, draining: bool) -> None:
    Server.objects.filter(pk=server.pk).update(draining=draining)
    server.draining = draining
