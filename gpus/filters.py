"""The booking and inventory lists' filters: /api/v1/gpus/, /api/v1/reservations/ and the page
My reservations."""

from __future__ import annotations

from functools import partial
from typing import Any

import django_filters
from django import forms
from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet
from django.utils import timezone

from gpus.models import GPU, Reservation, Server
from portal.access import is_admin
from portal.filters import MineFilter, unknown_choice
from portal.models import Team

# The derived statuses (Reservation.Status), and "open" for upcoming or active; the rules are
# ReservationQuerySet.with_status, the model's, so a list and a booking's page always agree.
RESERVATION_STATUSES = [*Reservation.Status.choices, ("open", "Open (upcoming or active)")]


def server_choices() -> list[tuple[str, str]]:
    """Every server: the dashboard shows them all to everyone."""
    names = Server.objects.order_by("name").values_list("name", flat=True)
    return [("", "any server"), *((name, name) for name in names)]


def _team_choices(user: AbstractBaseUser | None) -> list[tuple[str, str]]:
    """The teams whose bookings the user sees (Reservation.objects.visible_to): their own; admins all."""
    teams = Team.objects.order_by("name")
    if user is None:
        teams = teams.none()
    elif not is_admin(user):
        teams = teams.filter(memberships__user=user)
    return [("", "any team"), *((t.slug, t.name) for t in teams)]


class GPUFilter(django_filters.FilterSet):
    server = django_filters.CharFilter(field_name="server__name", help_text="A server's name.")

    class Meta:
        model = GPU
        fields: list[str] = []


class ReservationFilter(django_filters.FilterSet):
    """Team and server are free text (an unknown one lists nothing); the page offers them as menus."""

    status = django_filters.ChoiceFilter(
        choices=RESERVATION_STATUSES,
        method="filter_status",
        label="Status",
        empty_label="any status",
        help_text="The status now.",
        error_messages=unknown_choice("status", [value for value, _ in RESERVATION_STATUSES]),
    )
    server = django_filters.CharFilter(
        field_name="allocations__gpu__server__name",
        distinct=True,
        label="Server",
        widget=forms.Select,
        help_text="A server's name: bookings with a card on it.",
    )
    team = django_filters.CharFilter(
        field_name="team__slug", label="Team", widget=forms.Select, help_text="A team's slug."
    )
    mine = MineFilter(field_name="owner", label="Mine")

    class Meta:
        model = Reservation
        fields: list[str] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The menus' options are read only when a page renders them (callables), not in the API.
        fields = self.form.fields
        if "team" in fields:
            fields["team"].widget.choices = partial(_team_choices, getattr(self.request, "user", None))
        if "server" in fields:
            fields["server"].widget.choices = server_choices

    def filter_status(self, queryset: QuerySet[Reservation], name: str, value: str) -> QuerySet[Reservation]:
        return queryset.with_status(value, timezone.now())  # type: ignore[attr-defined]


class MyReservationFilter(ReservationFilter):
    """My reservations: the user's own bookings already, so ?mine= is moot."""

    mine = None  # type: ignore[assignment]
