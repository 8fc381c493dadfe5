"""The GPU watchdog's records: a violation (one process of one kind that breaks a booking) and
the admins' policy per kind. Apart from gpus/models.py for that module's length and imported
there, so callers import every model from gpus.models.

The watchdog on each GPU host writes the violations (jobs/host/watchdog.py); people only ask
things of an open one (gpus/violations.py): "stop it now", or "resolved" with a note, which the
host's watchdog reads at its next round.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from portal.access import VIEW, check_action, is_admin, teams_led_by
from portal.models import WatchdogKind


class ViolationQuerySet(models.QuerySet):
    def restrict(self, user, action: str = VIEW) -> ViolationQuerySet:  # type: ignore[no-untyped-def]
        """Admins: all. Others: the ones they caused, those on their own bookings, and those of the
        people and bookings of the teams they lead. "change" (stop it now) is the same people: who
        caused it may stop their own process too. Who may also mark one resolved (calling off its
        stop) is `resolvable_by`. The watchdog's record itself is never edited by anyone."""
        check_action(action)
        if is_admin(user):
            return self
        return self.filter(models.Q(user=user) | _managed_by(user)).distinct()

    def resolvable_by(self, user) -> ViolationQuerySet:  # type: ignore[no-untyped-def]
        """The ones `user` may mark resolved: admins all; the owner of the booking it broke and the
        leaders of the teams concerned, never its offender alone (that would call off its own stop)."""
        if is_admin(user):
            return self
        return self.filter(_managed_by(user)).distinct()


def _managed_by(user) -> models.Q:  # type: ignore[no-untyped-def]
    """Violations on `user`'s own bookings, and those of the people and bookings of the teams they lead."""
    led = teams_led_by(user)
    return (
        models.Q(reservation__owner=user)
        | models.Q(reservation__team_id__in=led)
        | models.Q(user__memberships__team_id__in=led)
    )


class Violation(models.Model):
    """One process of one kind that breaks a booking, as the GPU watchdog saw it (jobs/watchdog/rules.py).

    Updated while the process lives (`last_seen`, the most memory measured, the action taken),
    never created anew each round; `ended_at` is set when the process is gone from the card.
    Actions: observed → warned (its people were told) → stopped (NVML shows it gone after the
    stop) or stop_failed (the signal was refused, or it outlived SIGKILL). `job_id` is a plain
    number, as on GPUProcess: jobs build on gpus, not the reverse.
    """

    Kind = WatchdogKind  # the one list of the watchdog's kinds, declared in portal

    class Action(models.TextChoices):
        OBSERVED = "observed", "Observed"
        WARNED = "warned", "Warned"
        STOPPED = "stopped", "Stopped"
        STOP_FAILED = "stop_failed", "Could not stop"

    kind = models.CharField(max_length=20, choices=Kind.choices)
    gpu = models.ForeignKey("gpus.GPU", on_delete=models.CASCADE, related_name="violations")
    server = models.ForeignKey("gpus.Server", on_delete=models.CASCADE, related_name="violations")
    pid = models.PositiveIntegerField()
    # With the pid, the process for good (portal.pids): a later process that reuses the pid is
    # another violation, never this one's continuation, and is never signalled for it.
    process_started = models.FloatField(null=True, blank=True, help_text="Its start (psutil create_time).")
    session_id = models.PositiveIntegerField(null=True, blank=True)
    os_user = models.CharField(max_length=64, blank=True, help_text="The process's OS user.")
    command = models.CharField(max_length=300, blank=True)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="gpu_violations",
        help_text="The portal user behind the process: the job's owner, or the OS user's account.",
    )
    job_id = models.PositiveBigIntegerField(null=True, blank=True, help_text="The portal job, if any.")
    reservation = models.ForeignKey(
        "gpus.Reservation",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="violations",
        help_text="The booking concerned: the job's own, or the one whose card was taken.",
    )
    memory_mb = models.PositiveIntegerField(null=True, blank=True, help_text="The most MiB measured.")
    booked_mb = models.PositiveIntegerField(null=True, blank=True, help_text="over_memory: MiB booked.")
    first_seen = models.DateTimeField(db_index=True)
    last_seen = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True, help_text="Gone from the card.")
    action = models.CharField(max_length=12, choices=Action.choices, default=Action.OBSERVED)
    action_at = models.DateTimeField(null=True, blank=True, help_text="The watchdog's latest step.")
    # Kept apart from action_at, which each later step (a note, the stop) moves on: the page says
    # "Warned at 14:02:03; stopped at 14:07:05", never the stop twice (issue 41).
    warned_at = models.DateTimeField(
        null=True, blank=True, help_text="When the people concerned were warned."
    )
    stopped_at = models.DateTimeField(null=True, blank=True)
    message = models.CharField(max_length=500, blank=True, help_text="What the watchdog did and why.")
    # What a person asked of it (gpus/violations.py); the host's watchdog reads it each round.
    # "Stop it now": stopped at its next round, whatever the kind's policy or grace.
    stop_requested_at = models.DateTimeField(null=True, blank=True)
    stop_requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # A database default on the columns added since the previous release: its GPU hosts' watchdogs
    # insert violations without them during an upgrade (docs/deploy.md, "Upgrading").
    stop_reason = models.CharField(
        max_length=500, blank=True, default="", db_default="", help_text="Why it was stopped by hand."
    )
    # "Resolved": dealt with, in the words of who did; an open one is never stopped from then on
    # (a stop already under way goes on).
    resolved_at = models.DateTimeField(null=True, blank=True)
    resolved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    resolution = models.CharField(
        max_length=500, blank=True, default="", db_default="", help_text="How it was resolved."
    )

    objects = ViolationQuerySet.as_manager()

    class Meta:
        ordering = ["-first_seen", "-id"]
        indexes = [
            models.Index(fields=["server", "ended_at"], name="violation_server_open"),
            models.Index(fields=["user", "-first_seen"], name="violation_user_first_seen"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} pid {self.pid} on {self.gpu_id}"

    def why_not_stoppable(self) -> str:
        """Why "stop it now" cannot be asked of it (the page shows this in place of the button);
        "" when it can."""
        if self.ended_at is not None:
            return "It has ended: the process is gone from the card, or back within its booking."
        if self.action in (self.Action.STOPPED, self.Action.STOP_FAILED):
            return f"The watchdog has acted already: {self.get_action_display().lower()}."
        if self.kind == self.Kind.OWNER_OUTSIDE_JOB:
            return "The booking owner's own process within their booking is never stopped by the portal."
        if self.stop_requested_at is not None:
            return "Its stop was asked for already: the watchdog stops it at its next round."
        if self.resolved_at is not None:
            return "It was marked resolved: the portal leaves it running."
        return ""

    def why_not_resolvable(self) -> str:
        """Why it cannot be marked resolved; "" when it can (an ended one can, for the record)."""
        if self.resolved_at is not None:
            return "It was marked resolved already."
        return ""


class WatchdogPolicy(models.Model):
    """What the watchdog does about one kind of violation; admins set it in the admin.

    A kind without a row uses the defaults from settings (`policy_defaults`)."""

    class Action(models.TextChoices):
        OBSERVE = "observe", "Observe: record only"
        WARN = "warn", "Warn: record and tell the people concerned"
        STOP = "stop", "Stop: warn at once, stop the process after the grace period"

    kind = models.CharField(max_length=20, choices=Violation.Kind.choices, unique=True)
    action = models.CharField(max_length=8, choices=Action.choices)
    grace_seconds = models.PositiveIntegerField(
        default=60, help_text="Stop: how long after it is first seen the process is stopped."
    )

    class Meta:
        ordering = ["kind"]
        verbose_name_plural = "watchdog policies"
        constraints = [
            # Never punished: the owner's own process on their own booking is only shown.
            models.CheckConstraint(
                condition=~models.Q(kind="owner_outside_job", action="stop"), name="owner_never_stopped"
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind}: {self.action}"

    @staticmethod
    def defaults() -> dict[str, tuple[str, int]]:
        """{kind: (action, grace seconds)} from settings, before any admin's row."""
        stop_after = settings.WATCHDOG_STOP_AFTER_SECONDS
        return {
            Violation.Kind.ESCAPED: (WatchdogPolicy.Action.STOP, stop_after),
            Violation.Kind.OVER_MEMORY: (WatchdogPolicy.Action.STOP, stop_after),
            Violation.Kind.INTRUDER: (WatchdogPolicy.Action.STOP, stop_after),
            Violation.Kind.ZOMBIE: (WatchdogPolicy.Action.STOP, settings.WATCHDOG_ZOMBIE_STOP_AFTER_SECONDS),
            Violation.Kind.UNBOOKED: (WatchdogPolicy.Action.WARN, stop_after),
            Violation.Kind.OWNER_OUTSIDE_JOB: (WatchdogPolicy.Action.OBSERVE, stop_after),
        }

    @classmethod
    def current(cls) -> dict[str, tuple[str, int]]:
        """The policy of every kind: the admins' rows over the defaults (one query)."""
        policies = cls.defaults()
        policies.update(
            {
                kind: (action, grace)
                for kind, action, grace in cls.objects.values_list("kind", "action", "grace_seconds")
            }
        )
        return policies
