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
        return self.bookable_mb(self.memory_total_mb, self.memory_reserved_mb)

    @staticmethod
    def bookable_mb(total_mb: int, reserved_mb: int) -> int:
        """What bookings may share: total - driver reserved - the CUDA context headroom.

        A static method so the dashboard and timeline selectors, which read plain rows,
        use the same formula as the model."""
        return max(0, total_mb - reserved_mb - settings.GPU_CONTEXT_HEADROOM_MB)

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
    # The portal job this process belongs to (its PORTAL_JOB_ID), if any: a plain number, not a
    # foreign key, because jobs build on gpus and not the reverse; telemetry rows are replaced
    # every round, so they must never block a job's deletion either.
    job_id = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="The portal job (PORTAL_JOB_ID)."
    )

    class Meta:
        ordering = ["gpu", "-used_memory_mb", "pid"]

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.gpu_id}"

    @property
    def job_label(self) -> str:
        return f"job {self.job_id}" if self.job_id else "unmanaged"


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


class ReservationQuerySet(models.QuerySet):
    def visible_to(self, user) -> ReservationQuerySet:  # type: ignore[no-untyped-def]
        """Own bookings and those of every team the user belongs to; admins (staff) see all."""
        if user.is_staff:
            return self
        return self.filter(models.Q(owner=user) | models.Q(team__memberships__user=user)).distinct()

    def with_status(self, status: str, now: datetime) -> ReservationQuerySet:
        """Filter by the derived status in SQL (the same rules as Reservation.status_at)."""
        neither = self.filter(cancelled_at=None, released_at=None)
        return {
            "upcoming": lambda: neither.filter(start__gt=now),
            "active": lambda: neither.filter(start__lte=now, end__gt=now),
            "ended": lambda: neither.filter(end__lte=now),
            "cancelled": lambda: self.exclude(cancelled_at=None),
            "released": lambda: self.exclude(released_at=None),
            "open": lambda: neither.filter(end__gt=now),  # upcoming or active
        }[status]()

    def split_open(self, now: datetime, *, past_limit: int = 50) -> dict[str, list[Reservation]]:
        """Open bookings (soonest first) and the most recent others, for the list pages."""
        open_ = self.with_status("open", now)
        return {
            "open": list(open_.order_by("start", "id")),
            "past": list(self.exclude(pk__in=open_.values("pk")).order_by("-start", "-id")[:past_limit]),
        }


class Reservation(models.Model):
    """A booking of one or more cards (whole or a memory quota) for a time window.

    Status is derived, never stored: upcoming → active → ended by the clock;
    cancelled (before or during, by the owner or a leader/admin) and released (ended
    early by the owner) are recorded by their timestamps. Release moves `end` to the
    release time, so every conflict and quota query reads one window: [start, end).
    """

    class Status(models.TextChoices):
        UPCOMING = "upcoming", "Upcoming"
        ACTIVE = "active", "Active"
        ENDED = "ended", "Ended"
        CANCELLED = "cancelled", "Cancelled"
        RELEASED = "released", "Released early"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="reservations")
    team = models.ForeignKey("portal.Team", on_delete=models.PROTECT, related_name="reservations")
    start = models.DateTimeField()
    end = models.DateTimeField()
    booked_end = models.DateTimeField(help_text="The end as booked or extended, before any early release.")
    note = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    released_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    cancelled_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    cancel_reason = models.CharField(max_length=500, blank=True)

    objects = ReservationQuerySet.as_manager()

    class Meta:
        ordering = ["-start", "-id"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(end__gt=models.F("start")), name="reservation_end_after_start"
            )
        ]
        indexes = [
            models.Index(fields=["owner", "end"], name="reservation_owner_end"),
            models.Index(fields=["team", "end"], name="reservation_team_end"),
        ]

    def __str__(self) -> str:
        return f"reservation {self.pk}"

    def status_at(self, now: datetime) -> Reservation.Status:
        if self.cancelled_at:
            return self.Status.CANCELLED
        if self.released_at:
            return self.Status.RELEASED
        if now < self.start:
            return self.Status.UPCOMING
        return self.Status.ACTIVE if now < self.end else self.Status.ENDED

    @property
    def status(self) -> Reservation.Status:
        return self.status_at(timezone.now())

    @property
    def summary(self) -> str:
        """'box1 GPU 0, 1 · whole card' (prefetch allocations__gpu__server on lists)."""
        allocations = sorted(self.allocations.all(), key=lambda a: a.gpu.index)
        if not allocations:
            return "no cards"
        indices = ", ".join(str(a.gpu.index) for a in allocations)
        return f"{allocations[0].gpu.server.name} GPU {indices} · {allocations[0].memory_label}"

    @property
    def is_open(self) -> bool:
        """Still holding or about to hold its cards: it can be cancelled, released or extended."""
        return self.status in (self.Status.UPCOMING, self.Status.ACTIVE)


class Allocation(models.Model):
    """One card of a reservation: the whole card (memory_mb NULL) or a memory quota on it.

    `start`, `end` and `live` copy the reservation's window and state so the conflict
    sweep reads one indexed table; the booking services keep them in step.
    """

    reservation = models.ForeignKey(Reservation, on_delete=models.CASCADE, related_name="allocations")
    gpu = models.ForeignKey(GPU, on_delete=models.PROTECT, related_name="allocations")
    memory_mb = models.PositiveIntegerField(null=True, blank=True, help_text="Empty: the whole card.")
    start = models.DateTimeField()
    end = models.DateTimeField()
    live = models.BooleanField(default=True, help_text="False once the reservation is cancelled.")

    class Meta:
        ordering = ["gpu_id"]
        constraints = [
            models.UniqueConstraint(fields=["reservation", "gpu"], name="allocation_unique_gpu"),
            models.CheckConstraint(
                condition=models.Q(memory_mb__isnull=True) | models.Q(memory_mb__gt=0),
                name="allocation_memory_positive",
            ),
            models.CheckConstraint(
                condition=models.Q(end__gt=models.F("start")), name="allocation_end_after_start"
            ),
        ]
        indexes = [
            models.Index(fields=["gpu", "end"], condition=models.Q(live=True), name="allocation_live_gpu_end")
        ]

    def __str__(self) -> str:
        return f"{self.gpu_id} ({self.memory_label}) for reservation {self.reservation_id}"

    @property
    def whole(self) -> bool:
        return self.memory_mb is None

    @property
    def memory_label(self) -> str:
        return "whole card" if self.memory_mb is None else format_mb(self.memory_mb)


def format_mb(mb: int) -> str:
    """16384 → '16 GB', 1536 → '1.5 GB', 500 → '500 MB'."""
    if mb < 1024:
        return f"{mb} MB"
    gb = mb / 1024
    return f"{gb:.0f} GB" if gb == int(gb) else f"{gb:.1f} GB"
