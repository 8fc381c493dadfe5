"""Servers, their GPUs, the latest telemetry, and a bounded history for charts.

A server is "online" while its worker keeps reporting: the status is derived from
`last_seen` on every read, so a host that dies shows offline without any task running.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone


class ServerQuerySet(models.QuerySet):
    def online(self) -> ServerQuerySet:
        cutoff = timezone.now() - timedelta(seconds=settings.SERVER_OFFLINE_AFTER_SECONDS)
        return self.filter(last_seen__gte=cutoff)


class Server(models.Model):
    class Status(models.TextChoices):
        ONLINE = "online", "Online"
        OFFLINE = "offline", "Offline"
        DRAINING = "draining", "Draining"

    name = models.SlugField(
        max_length=63, unique=True, help_text="Also names the worker's queue, host.<name>."
    )
    hostname = models.CharField(max_length=255, blank=True)
    draining = models.BooleanField(default=False, help_text="No new bookings or jobs; running work goes on.")
    simulated = models.BooleanField(default=False)
    driver_version = models.CharField(max_length=32, blank=True)
    cuda_version = models.CharField(max_length=16, blank=True)
    cpu_count = models.PositiveIntegerField(default=0)
    ram_mb = models.PositiveBigIntegerField(default=0)
    last_seen = models.DateTimeField(null=True, blank=True)
    last_history_at = models.DateTimeField(null=True, blank=True)

    objects = ServerQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def ram_gb(self) -> int:
        return round(self.ram_mb / 1024)

    @property
    def queue(self) -> str:
        return f"host.{self.name}"

    @property
    def status(self) -> Server.Status:
        return self.status_for(self.last_seen, self.draining)

    @classmethod
    def status_for(
        cls, last_seen: datetime | None, draining: bool, now: datetime | None = None
    ) -> Server.Status:
        offline_after = timedelta(seconds=settings.SERVER_OFFLINE_AFTER_SECONDS)
        if last_seen is None or (now or timezone.now()) - last_seen > offline_after:
            return cls.Status.OFFLINE
        return cls.Status.DRAINING if draining else cls.Status.ONLINE


class GPU(models.Model):
    """One card, keyed by its NVML UUID (indices change when cards move; UUIDs do not)."""

    uuid = models.CharField(max_length=64, primary_key=True)
    server = models.ForeignKey(Server, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    name = models.CharField(max_length=100)
    pci_bus_id = models.CharField(max_length=32, blank=True)
    memory_total_mb = models.PositiveIntegerField()
    memory_reserved_mb = models.PositiveIntegerField(default=0)
    mig_mode = models.CharField(max_length=16, blank=True)
    # Latest telemetry; NULL means the driver does not report it ("n/a").
    memory_used_mb = models.PositiveIntegerField(null=True, blank=True)
    utilization_pct = models.PositiveSmallIntegerField(null=True, blank=True)
    temperature_c = models.SmallIntegerField(null=True, blank=True)
    power_w = models.FloatField(null=True, blank=True)
    power_limit_w = models.FloatField(null=True, blank=True)
    updated_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["server__name", "index"]
        verbose_name = "GPU"

    def __str__(self) -> str:
        return f"{self.server.name}:{self.index} {self.name}"

    @property
    def memory_bookable_mb(self) -> int:
        return max(0, self.memory_total_mb - self.memory_reserved_mb - settings.GPU_CONTEXT_HEADROOM_MB)

    @property
    def memory_used_pct(self) -> float | None:
        if self.memory_used_mb is None or not self.memory_total_mb:
            return None
        return round(100 * self.memory_used_mb / self.memory_total_mb, 1)

    @property
    def bookable_pct(self) -> float:
        return round(100 * self.memory_bookable_mb / self.memory_total_mb, 1) if self.memory_total_mb else 0.0


class GPUProcess(models.Model):
    """A process holding memory on a card, as of the latest report (replaced each round)."""

    gpu = models.ForeignKey(GPU, on_delete=models.CASCADE, related_name="processes")
    pid = models.PositiveIntegerField()
    username = models.CharField(max_length=64, blank=True)
    command = models.CharField(max_length=300, blank=True)
    used_memory_mb = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["gpu", "-used_memory_mb", "pid"]

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.gpu_id}"

    @property
    def job_label(self) -> str:
        # Processes started by the portal's job runner get linked in the jobs issue.
        return "unmanaged"


class TelemetrySample(models.Model):
    """A downsampled point for charts: one per card per TELEMETRY_HISTORY_SECONDS."""

    gpu = models.ForeignKey(GPU, on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField(db_index=True)
    memory_used_mb = models.PositiveIntegerField(null=True)
    utilization_pct = models.PositiveSmallIntegerField(null=True)
    temperature_c = models.SmallIntegerField(null=True)
    power_w = models.FloatField(null=True)

    class Meta:
        indexes = [models.Index(fields=["gpu", "at"], name="sample_gpu_at")]
        ordering = ["gpu", "at"]

    def __str__(self) -> str:
        return f"{self.gpu_id} at {self.at:%Y-%m-%d %H:%M:%S}"
