"""Servers, their GPUs, the latest telemetry, and a bounded history for charts.

A server is "online" while its worker keeps reporting: the status is derived from
`last_seen` on every read, so a host that dies shows offline without any task running.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone

from gpus.inventory import CardState
from portal.access import CHANGE, VIEW, check_action, is_admin, teams_led_by
from portal.clock import db_now, since


class ServerQuerySet(models.QuerySet):
    def online(self) -> ServerQuerySet:
        # `last_seen` is the database's clock: so is the cut-off (portal.clock).
        return self.filter(last_seen__gte=since(settings.SERVER_OFFLINE_AFTER_SECONDS))

    def portal_scheduled(self) -> ServerQuerySet:
        """The servers whose cards the portal books and queues onto: not a Slurm cluster's, which
        Slurm alone schedules (the portal never places work on its nodes twice; docs/slurm.md)."""
        return self.exclude(kind=Server.Kind.SLURM)


class GPUQuerySet(models.QuerySet):
    def portal_scheduled(self) -> GPUQuerySet:
        """The cards of `ServerQuerySet.portal_scheduled` servers."""
        return self.exclude(server__kind=Server.Kind.SLURM)


class Server(models.Model):
    class Status(models.TextChoices):
        ONLINE = "online", "Online"
        OFFLINE = "offline", "Offline"
        DRAINING = "draining", "Draining"

    class Kind(models.TextChoices):
        """A GPU host runs the portal's worker and its own jobs; a Slurm cluster is reached from a
        login node that runs the worker, and Slurm schedules its nodes (docs/slurm.md)."""

        HOST = "host", "GPU host"
        SLURM = "slurm", "Slurm cluster"

    name = models.SlugField(
        max_length=63, unique=True, help_text="Also names its worker's queue: host.NAME (WORKER_SERVER)."
    )
    hostname = models.CharField(max_length=255, blank=True)
    kind = models.CharField(max_length=8, choices=Kind.choices, default=Kind.HOST)
    draining = models.BooleanField(default=False, help_text="No new bookings or jobs; running work goes on.")
    # Columns added since the previous release have a database default (db_default): that release's
    # collector and workers insert servers without them during an upgrade (docs/deploy.md, "Upgrading").
    drain_reason = models.CharField(
        max_length=200,
        blank=True,
        default="",
        db_default="",
        help_text="Why it is draining, as the admin who drained it said.",
    )
    simulated = models.BooleanField(default=False)
    driver_version = models.CharField(max_length=32, blank=True)
    cuda_version = models.CharField("CUDA version", max_length=16, blank=True)
    cpu_count = models.PositiveIntegerField("CPU count", default=0)
    ram_mb = models.PositiveBigIntegerField("RAM (MiB)", default=0)
    last_seen = models.DateTimeField(null=True, blank=True)
    last_history_at = models.DateTimeField(null=True, blank=True)
    # The queue plans no more jobs onto a host than its worker runs at once (its pool's size).
    job_slots = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="How many jobs this host's worker runs at once, as it last said."
    )
    job_slots_at = models.DateTimeField(null=True, blank=True, help_text="When the worker last said so.")
    # How long its last rounds took, for /metrics (read at scrape time, so every web worker agrees).
    telemetry_round_seconds = models.FloatField(null=True, blank=True)
    watchdog_round_seconds = models.FloatField(null=True, blank=True)
    # Whether jobs in container images can run here, as the host's worker last found (issue 34):
    # the job form offers images only on servers where this is true.
    containers_ok = models.BooleanField(
        "containers work", default=False, help_text="As the host's worker last found (docs/containers.md)."
    )
    containers_detail = models.CharField(
        max_length=500, blank=True, help_text="What the worker found: the runtime, or what is missing."
    )
    # Shown to admins on the dashboard: a worker run as root with JOB_USER=root (or none, in
    # development) runs every job as root (jobs.host.worker.jobs_account_check).
    jobs_as_root = models.BooleanField(
        "jobs run as root",
        default=False,
        db_default=False,
        help_text="As the host's worker said at its start (JOB_USER=root).",
    )

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
        """`now`: the database's (portal.clock.db_now, read once for many servers), as
        `last_seen` is; read here when not given."""
        offline_after = timedelta(seconds=settings.SERVER_OFFLINE_AFTER_SECONDS)
        if last_seen is None or (now or db_now()) - last_seen > offline_after:
            return cls.Status.OFFLINE
        return cls.Status.DRAINING if draining else cls.Status.ONLINE


class GPU(models.Model):
    """One card, keyed by its NVML UUID (indices change when cards move; UUIDs do not)."""

    uuid = models.CharField(max_length=64, primary_key=True)
    server = models.ForeignKey(Server, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    name = models.CharField(max_length=100)
    pci_bus_id = models.CharField("PCI bus ID", max_length=32, blank=True)
    memory_total_mb = models.PositiveIntegerField("memory total (MiB)")
    memory_reserved_mb = models.PositiveIntegerField("memory reserved (MiB)", default=0)
    mig_mode = models.CharField("MIG mode", max_length=16, blank=True)
    # Latest telemetry; NULL means the driver does not report it ("n/a").
    memory_used_mb = models.PositiveIntegerField(null=True, blank=True)
    utilization_pct = models.PositiveSmallIntegerField(null=True, blank=True)
    temperature_c = models.SmallIntegerField(null=True, blank=True)
    power_w = models.FloatField(null=True, blank=True)
    power_limit_w = models.FloatField(null=True, blank=True)
    updated_at = models.DateTimeField(null=True, blank=True)
    state = models.CharField(
        max_length=16,
        choices=[(s, s) for s in CardState.ALL],
        default=CardState.OK,
        help_text="ok; lost (fell off the bus) or unresponsive (NVML did not answer): not bookable.",
    )
    # False when the last report could not read the card's process list (no permission, a MIG
    # card read without privileges): the list shown is then "unknown", not "idle".
    processes_known = models.BooleanField(default=True)
    # On a Slurm cluster: the node it is in (its index is Slurm's GRES IDX there) and the Slurm
    # job holding it, as the cluster last said; blank on a GPU host.
    node = models.CharField(max_length=64, blank=True)
    slurm_job = models.CharField("Slurm job", max_length=32, blank=True)
    # What the card's stored process rows are (gpus.services._digest): a telemetry round rewrites a
    # card's processes only when their digest moved, not every card's every second. "" is unknown.
    processes_digest = models.CharField(max_length=24, blank=True, editable=False, default="", db_default="")

    objects = GPUQuerySet.as_manager()

    class Meta:
        ordering = ["server__name", "node", "index"]
        verbose_name = "GPU"

    def __str__(self) -> str:
        node = f"{self.node}:" if self.node else ""  # a Slurm node's IDX is per node
        return f"{self.server.name}:{node}{self.index} {self.name}"

    @property
    def memory_bookable_mb(self) -> int:
        return self.bookable_mb(self.memory_total_mb, self.memory_reserved_mb)

    @staticmethod
    def bookable_mb(total_mb: int, reserved_mb: int) -> int:
        """What bookings may share: total - driver reserved - the CUDA context headroom.

        A static method so the dashboard and timeline selectors, which read plain rows,
        use the same formula as the model."""
        return max(0, total_mb - reserved_mb - settings.GPU_CONTEXT_HEADROOM_MB)

    @staticmethod
    def card_share(memory_mb: float | None, bookable_mb: int) -> float:
        """How full a booking makes a card, for booking (the room rule): 1 for the whole card, else
        its memory over the card's bookable memory, at most 1. The timeline's bars, the booking
        picker's card load and a job's CPU share read it. What a booking *costs* is `charged_share`."""
        if memory_mb is None or bookable_mb <= 0:
            return 1.0
        return min(1.0, memory_mb / bookable_mb)

    @staticmethod
    def charged_share(memory_mb: float | None, total_mb: int) -> float:
        """What a booking costs of a card (the charge rule): 1 for the whole card, else its memory
        over the card's total memory, at most 1: 12 GB of a 24 GB card is half a GPU-hour an hour.
        Quotas, the usage reports, the queue's fair share and its submit checks all charge by it.
        Over the total, not the bookable memory, so a card's price does not move with the driver's
        reserve or the portal's headroom (and the charges already reported keep their meaning)."""
        if memory_mb is None:
            return 1.0
        return min(1.0, memory_mb / total_mb) if total_mb > 0 else 0.0

    @property
    def bookable(self) -> bool:
        return self.state == CardState.OK

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
    used_memory_mb = models.PositiveIntegerField(null=True, blank=True, help_text="MiB, as NVML counts.")
    session_id = models.PositiveIntegerField(null=True, blank=True, help_text="os.getsid() of the process.")
    started = models.FloatField(
        null=True, blank=True, help_text="The start (psutil create_time): with the pid, its identity."
    )
    # The portal job this process belongs to, resolved from its session at ingest: a plain
    # number, not a foreign key, because jobs build on gpus and not the reverse; telemetry rows
    # are replaced every round, so they must never block a job's deletion either.
    job_id = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="The portal job whose session the process is in."
    )
    interactive_id = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="The interactive session (gpu exec, JupyterLab) it belongs to."
    )
    parent_session_id = models.PositiveIntegerField(
        null=True, blank=True, help_text="The session it left (setsid): its nearest ancestor's in another."
    )

    class Meta:
        ordering = ["gpu", "-used_memory_mb", "pid"]
        verbose_name = "GPU process"
        verbose_name_plural = "GPU processes"

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.gpu_id}"

    @property
    def job_label(self) -> str:
        return self.label(self.job_id, self.interactive_id)

    @staticmethod
    def label(job_id: int | None, interactive_id: int | None) -> str:
        """What runs it, in words: a static method so the API's plain rows (gpus/api_rows.py) say
        it as the model does."""
        if job_id:
            return f"job {job_id}"
        return f"session {interactive_id}" if interactive_id else "unmanaged"


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
    def loans_live(self, now: datetime) -> ReservationQuerySet:
        """Loans live now: the queue's bookings on lent cards (jobs/lending.py) that have not ended."""
        live = {"start__lte": now, "end__gt": now, "released_at": None, "cancelled_at": None}
        return self.filter(lent_from__isnull=False, **live)

    def restrict(self, user, action: str = VIEW) -> ReservationQuerySet:  # type: ignore[no-untyped-def]
        """The bookings `user` may see: their own and those of every team they belong to; or change
        (cancel): their own and those of the teams they lead. Admins (staff): all."""
        check_action(action)
        if is_admin(user):
            return self
        if action == CHANGE:
            return self.filter(models.Q(owner=user) | models.Q(team_id__in=teams_led_by(user)))
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
    # A loan: the queue's booking for a preemptible job on the cards of this idle booking, which
    # its owner takes back the moment they use it (jobs/lending.py). Ends no later than it.
    lent_from = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.CASCADE, related_name="loans"
    )
    note = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    released_at = models.DateTimeField(null=True, blank=True)
    released_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="Its owner; empty where the portal released it on a rule (release_reason says which).",
    )
    release_reason = models.CharField(max_length=500, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    cancelled_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    cancel_reason = models.CharField(max_length=500, blank=True)
    # The idle clock (gpus/idle.py, docs/booking.md "Idle bookings"): written by its checker only.
    idle_since = models.DateTimeField(
        null=True, blank=True, help_text="Start of the current idle stretch; empty while the cards are used."
    )
    idle_minutes = models.PositiveIntegerField(
        default=0, help_text="Whole minutes the booking's cards were idle, over its whole life."
    )
    idle_counted_until = models.DateTimeField(
        null=True,
        blank=True,
        help_text="How far the current stretch is counted into idle_minutes (the rest of a minute waits).",
    )
    idle_warned_at = models.DateTimeField(
        null=True, blank=True, help_text="When the owner was told of the current idle stretch."
    )
    # No-shows (gpus/noshow.py): written by the idle checker only.
    used_at = models.DateTimeField(
        null=True, blank=True, help_text="The first check that saw its cards used (or could not see them)."
    )
    no_show_at = models.DateTimeField(
        null=True, blank=True, help_text="When its owner was told it was unused from its start (a no-show)."
    )
    # A booking of whole nodes of a Slurm cluster (gpus/slurm_booking.py): the reservation Slurm holds
    # for it, made by the cluster's worker, or why Slurm would not make it.
    slurm_reservation = models.CharField(max_length=64, blank=True)
    slurm_error = models.CharField(max_length=500, blank=True)

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
            # /metrics reads the loans that ended since their last settle (jobs/lending_report.py):
            # the few of the last day, not a scan of every loan or booking ever made.
            models.Index(
                fields=["end"], condition=models.Q(lent_from__isnull=False), name="reservation_loan_end"
            ),
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


class AllocationQuerySet(models.QuerySet):
    """The one home of "which allocations hold a card when": every conflict, quota, timeline,
    usage and scheduler query reads its windows through these."""

    def live_between(self, start: datetime, end: datetime) -> AllocationQuerySet:
        """Live allocations overlapping [start, end): half-open, so one ending at 10:00 and a
        window starting at 10:00 do not meet."""
        return self.filter(live=True, start__lt=end, end__gt=start)

    def live_at(self, moment: datetime) -> AllocationQuerySet:
        """Live allocations holding their card at `moment` (start <= moment < end)."""
        return self.filter(live=True, start__lte=moment, end__gt=moment)


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

    objects = AllocationQuerySet.as_manager()

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
    """16384 → '16 GiB', 1536 → '1.5 GiB', 500 → '500 MiB': binary units, as NVML and
    nvidia-smi count card memory (every `*_mb` field of the portal is MiB)."""
    if mb < 1024:
        return f"{mb} MiB"
    gb = mb / 1024
    return f"{gb:.0f} GiB" if gb == int(gb) else f"{gb:.1f} GiB"


class CalendarFeed(models.Model):
    """A secret iCalendar address of bookings (gpus/calendars.py; docs "Calendars"): one per owner
    and scope. The scope is the owner's own bookings, a team's (its leaders) or a server's
    (admins); the right is checked again at every fetch, so a leader who stops leading, an admin
    who stops being one or a deactivated account gets 404 from then on.

    The secret is a capability: whoever holds the URL reads the feed, with no sign-in, as calendar
    apps must. It is stored as it is (not hashed) so the owner can be shown it again, as Google
    Calendar shows its "secret address"; a new secret replaces it on this row, ending the old URL.
    `etag` and `changed_at` record the last content served: the feed's Last-Modified is when its
    content last changed, as seen by a fetch (a booking records no time for an extension).
    """

    class Scope(models.TextChoices):
        USER = "user", "Own bookings"
        TEAM = "team", "A team's bookings"
        SERVER = "server", "A server's bookings"

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="calendar_feeds"
    )
    scope = models.CharField(max_length=8, choices=Scope.choices)
    team = models.ForeignKey("portal.Team", null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    server = models.ForeignKey(Server, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    secret = models.CharField(max_length=64, unique=True, help_text="URL-safe random token; the feed's URL.")
    created_at = models.DateTimeField(default=timezone.now, help_text="When the current secret was made.")
    last_fetched_at = models.DateTimeField(null=True, blank=True)
    etag = models.CharField(max_length=64, blank=True, help_text="A hash of the content last served.")
    changed_at = models.DateTimeField(null=True, blank=True, help_text="When a fetch first saw that content.")

    class Meta:
        ordering = ["owner_id", "scope", "id"]
        constraints = [
            models.CheckConstraint(
                condition=(
                    models.Q(scope="user", team__isnull=True, server__isnull=True)
                    | models.Q(scope="team", team__isnull=False, server__isnull=True)
                    | models.Q(scope="server", team__isnull=True, server__isnull=False)
                ),
                name="calendarfeed_scope_matches",
            ),
            # One feed per owner and scope; partial, as NULLs are distinct in a unique index.
            models.UniqueConstraint(
                fields=["owner"], condition=models.Q(scope="user"), name="calendarfeed_one_own"
            ),
            models.UniqueConstraint(
                fields=["owner", "team"], condition=models.Q(scope="team"), name="calendarfeed_one_per_team"
            ),
            models.UniqueConstraint(
                fields=["owner", "server"],
                condition=models.Q(scope="server"),
                name="calendarfeed_one_per_server",
            ),
        ]

    def __str__(self) -> str:
        what = self.team_id or self.server_id or "own"
        return f"calendar of {self.owner_id} ({self.scope} {what})"


# The usage rollups, the container images, Slurm clusters and the watchdog's records live apart
# for this module's length (gpus/usage_models.py, gpus/image_models.py, gpus/slurm_models.py,
# gpus/violation_models.py); imported here so that Django registers them with the app and callers
# import every model from gpus.models.
from gpus.image_models import ContainerImage, ImagePull  # noqa: E402, F401
from gpus.slurm_models import SlurmCluster, SlurmNode  # noqa: E402, F401
from gpus.usage_models import UsageDay, UsageFigures, UsageHour, UsageTeamHour  # noqa: E402, F401
from gpus.violation_models import Violation, WatchdogPolicy  # noqa: E402, F401
