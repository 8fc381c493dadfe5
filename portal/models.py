"""Teams, their members, the quotas leaders and admins set, and the audit log.

Quota limits are nullable: NULL means "no limit at this level". A member's limits sit
inside the team's (checked when a leader sets them), and a booking must pass both.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models


class QuotaFields(models.Model):
    """Limits shared by team and member quotas. NULL = unlimited."""

    max_cards = models.PositiveIntegerField(
        null=True, blank=True, help_text="Whole cards held at any one time. Empty: no limit."
    )
    max_gb = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="GPU memory held at any one time, in GB (a whole card counts its full memory).",
    )
    gpu_hours_per_week = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="GPU-hours per calendar week (Monday to Sunday); a shared booking counts its "
        "fraction of the card.",
    )

    class Meta:
        abstract = True


class Team(QuotaFields):
    """A lab group. Admins set its quota; its leaders set each member's within it."""

    name = models.CharField(max_length=100, unique=True)
    slug = models.SlugField(max_length=100, unique=True)
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, through="Membership", related_name="teams")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Membership(QuotaFields):
    class Role(models.TextChoices):
        MEMBER = "member", "Member"
        LEADER = "leader", "Leader"

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)
    max_booking_hours = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Longest single booking, in hours. Empty: the portal's limit (BOOKING_MAX_HOURS).",
    )

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "user"], name="membership_unique_team_user")]
        ordering = ["team", "user__username"]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} ({self.role})"

    @property
    def is_leader(self) -> bool:
        return self.role == self.Role.LEADER


class AuditEntry(models.Model):
    """Who did what, when: every booking action and quota change. Never edited."""

    class Action(models.TextChoices):
        RESERVATION_CREATE = "reservation.create", "Booked"
        RESERVATION_CANCEL = "reservation.cancel", "Cancelled"
        RESERVATION_RELEASE = "reservation.release", "Released early"
        RESERVATION_EXTEND = "reservation.extend", "Extended"
        QUOTA_TEAM = "quota.team", "Team quota changed"
        QUOTA_MEMBER = "quota.member", "Member quota changed"

    at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    team = models.ForeignKey(Team, null=True, on_delete=models.SET_NULL, related_name="audit_entries")
    action = models.CharField(max_length=32, choices=Action.choices)
    target = models.CharField(max_length=200, help_text="What was acted on, e.g. 'reservation 12'.")
    message = models.TextField()
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["team", "-at"], name="audit_team_at")]
        verbose_name_plural = "audit entries"

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M} {self.actor}: {self.message}"
