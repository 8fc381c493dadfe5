"""The booking and inventory lists' filters: /api/v1/gpus/ and /api/v1/reservations/."""

from __future__ import annotations

import django_filters
from django.db.models import QuerySet
from django.utils import timezone

from gpus.models import GPU, Reservation
from portal.filters import MineFilter, unknown_choice

# The derived statuses (Reservation.Status), and "open" for upcoming or active; the rules are
# ReservationQuerySet.with_status, the model's, so a list and a booking's page always agree.
RESERVATION_STATUSES = [*Reservation.Status.choices, ("open", "Open (upcoming or active)")]


class GPUFilter(django_filters.FilterSet):
    server = django_filters.CharFilter(field_name="server__name", help_text="A server's name.")

    class Meta:
        model = GPU
        fields: list[str] = []


class ReservationFilter(django_filters.FilterSet):
    status = django_filters.ChoiceFilter(
        choices=RESERVATION_STATUSES,
        method="filter_status",
        help_text="The status now.",
        error_messages=unknown_choice("status", [value for value, _ in RESERVATION_STATUSES]),
    )
    server = django_filters.CharFilter(
        field_name="allocations__gpu__server__name",
        distinct=True,
        help_text="A server's name: bookings with a card on it.",
    )
    team = django_filters.CharFilter(field_name="team__slug", help_text="A team's slug.")
    mine = MineFilter(field_name="owner")

    class Meta:
        model = Reservation
        fields: list[str] = []

    def filter_status(self, queryset: QuerySet[Reservation], name: str, value: str) -> QuerySet[Reservation]:
        return queryset.with_status(value, timezone.now())  # type: ignore[attr-defined]
