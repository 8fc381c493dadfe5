"""The usage rollups (written by gpus/usage.py only; docs/reports.md): what the cards did, by hour,
day and team. Apart from gpus/models.py for its length; gpus.models imports them, so Django and
every caller find them there."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class UsageFigures(models.Model):
    """What every usage rollup row counts. A GPU-hour is one card for one hour; a memory share
    counts its fraction of the card (memory / card total), as the quotas do (gpus/quotas.py)."""

    gpu_hours_booked = models.FloatField(default=0, help_text="GPU-hours held by bookings.")
    gpu_hours_used = models.FloatField(
        default=0, help_text="Utilization-weighted GPU-hours: a card at 50 % for an hour is 0.5."
    )
    gpu_hours_unbooked = models.FloatField(
        default=0, help_text="GPU-hours nobody had booked, while the card reported (rows without a user)."
    )
    idle_hours = models.FloatField(
        default=0,
        help_text="GPU-hours booked while the card was idle (no process, utilization below IDLE_UTIL_PCT).",
    )
    memory_gb_hours_booked = models.FloatField(
        default=0, help_text="GiB booked × hours (a whole card: all of it)."
    )
    peak_memory_mb = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="The most memory used on the card meanwhile, MiB (the card's, on a share too).",
    )
    jobs_succeeded = models.PositiveIntegerField(default=0)
    jobs_failed = models.PositiveIntegerField(default=0)
    jobs_other = models.PositiveIntegerField(default=0, help_text="Cancelled, timed out or lost.")
    sessions = models.PositiveIntegerField(
        default=0, help_text="Interactive sessions (gpu exec, gpu shell, JupyterLab) that ended."
    )

    SUMMED = (
        "gpu_hours_booked",
        "gpu_hours_used",
        "gpu_hours_unbooked",
        "idle_hours",
        "memory_gb_hours_booked",
        "jobs_succeeded",
        "jobs_failed",
        "jobs_other",
        "sessions",
    )

    class Meta:
        abstract = True

    @staticmethod
    def utilization_pct(used: float, booked: float, unbooked: float = 0.0) -> float | None:
        """Used ÷ the card time the rows cover: of a booker's rows, their booked GPU-hours; of the
        unbooked rows, the free card time; of both, the cards'. None when they cover nothing. Three
        decimals, as the GPU-hours: a card barely used is not "0.0 %" (portal.figures prints it)."""
        covered = booked + unbooked
        return round(100 * used / covered, 3) if covered > 0 else None


# The heatmap groups by this in SQL: 168 groups, rather than a moment per hour to load and convert.
HOUR_OF_WEEK_HELP = (
    "The hour's place in its week in TIME_ZONE when written: Monday 0 h is 0, Sunday 23 h is 167."
)


class UsageHour(UsageFigures):
    """One card's hour for one booker; `user` empty: the card's time nobody had booked, and what it
    did meanwhile. The record the other usage tables are summed from."""

    start = models.DateTimeField(help_text="The hour's first moment (whole UTC hours).")
    hour_of_week = models.PositiveSmallIntegerField(help_text=HOUR_OF_WEEK_HELP)
    gpu = models.ForeignKey("gpus.GPU", on_delete=models.CASCADE, related_name="+")
    server = models.ForeignKey("gpus.Server", on_delete=models.CASCADE, related_name="+")
    team = models.ForeignKey(
        "portal.Team", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )

    class Meta:
        ordering = ["start", "gpu_id"]
        constraints = [
            # Two partial constraints: NULLs are distinct in a unique index, so one over (start, gpu,
            # user) would let a card's hour hold two unbooked rows.
            models.UniqueConstraint(
                fields=["start", "gpu", "user"],
                condition=models.Q(user__isnull=False),
                name="usagehour_one_per_booker",
            ),
            models.UniqueConstraint(
                fields=["start", "gpu"], condition=models.Q(user__isnull=True), name="usagehour_one_unbooked"
            ),
        ]
        indexes = [
            # The partial unique indexes serve no query that does not name the user: the writes and
            # the period reads need their own.
            models.Index(fields=["start"], name="usagehour_start"),
            models.Index(fields=["user", "start"], name="usagehour_user_start"),
            models.Index(fields=["team", "start"], name="usagehour_team_start"),
            models.Index(fields=["server", "start"], name="usagehour_server_start"),
        ]

    def __str__(self) -> str:
        return f"{self.gpu_id} at {self.start:%Y-%m-%d %H:00} for {self.user_id or 'nobody'}"


class UsageDay(UsageFigures):
    """A day (in TIME_ZONE) of one booker on one server, summed from UsageHour: what the reports
    read, so a year is ~60k rows rather than millions."""

    start = models.DateTimeField(help_text="The day's first moment in TIME_ZONE.")
    # The same day as a date: the reports group by it, and a date loads far cheaper than a moment.
    day = models.DateField(help_text="The day in TIME_ZONE.")
    server = models.ForeignKey("gpus.Server", on_delete=models.CASCADE, related_name="+")
    team = models.ForeignKey(
        "portal.Team", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )

    class Meta:
        ordering = ["start", "server_id"]
        indexes = [
            models.Index(fields=["start"], name="usageday_start"),
            models.Index(fields=["user", "start"], name="usageday_user_start"),
            models.Index(fields=["team", "start"], name="usageday_team_start"),
            models.Index(fields=["server", "start"], name="usageday_server_start"),
        ]

    def __str__(self) -> str:
        return f"{self.server_id} on {self.start:%Y-%m-%d} for {self.user_id or 'nobody'}"


class UsageTeamHour(UsageFigures):
    """An hour of one team (empty: the time nobody booked) over every card, summed from UsageHour:
    the hour-of-the-week heatmap of a whole team or of the lab, in ~50k rows a year."""

    start = models.DateTimeField(help_text="The hour's first moment (whole UTC hours).")
    hour_of_week = models.PositiveSmallIntegerField(help_text=HOUR_OF_WEEK_HELP)
    team = models.ForeignKey(
        "portal.Team", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["start", "team_id"]
        indexes = [
            models.Index(fields=["start"], name="usageteamhour_start"),
            models.Index(fields=["team", "start"], name="usageteamhour_team_start"),
        ]

    def __str__(self) -> str:
        return f"team {self.team_id or 'nobody'} at {self.start:%Y-%m-%d %H:00}"
