"""The booking and inventory lists' filters: /api/v1/gpus/, /api/v1/images/, /api/v1/reservations/
and the page My reservations; the usage reports' (the Reports page, its CSV, /api/v1/usage/)."""

from __future__ import annotations

from functools import partial
from typing import Any

import django_filters
from django import forms
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Q, QuerySet
from django.utils import timezone

from gpus.models import GPU, ContainerImage, Reservation, Server, UsageFigures, Violation
from gpus.usage import portal_today
from portal.access import VIEW, is_admin, teams_led_by
from portal.filters import DayFilter, MineFilter, SpanForm, YesNoFilter, unknown_choice
from portal.models import Team

# The derived statuses (Reservation.Status), and "open" for upcoming or active; the rules are
# ReservationQuerySet.with_status, the model's, so a list and a booking's page always agree.
RESERVATION_STATUSES = [*Reservation.Status.choices, ("open", "Open (upcoming or active)")]


def server_choices() -> list[tuple[str, str]]:
    """Every server: the dashboard shows them all to everyone."""
    names = Server.objects.order_by("name").values_list("name", flat=True)
    return [("", "any server"), *((name, name) for name in names)]


def _team_choices(user: AbstractBaseUser | None) -> list[tuple[str, str]]:
    """The teams whose bookings the user sees (Reservation.objects.restrict): their own; admins all."""
    teams = Team.objects.none() if user is None else Team.objects.restrict(user, VIEW)
    return [("", "any team"), *((t.slug, t.name) for t in teams.order_by("name"))]


class GPUFilter(django_filters.FilterSet):
    server = django_filters.CharFilter(field_name="server__name", help_text="A server's name.")

    class Meta:
        model = GPU
        fields: list[str] = []


class ImageFilter(django_filters.FilterSet):
    server = django_filters.CharFilter(
        field_name="servers__name", distinct=True, help_text="A server's name: the images it has."
    )

    class Meta:
        model = ContainerImage
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


class ViolationFilter(django_filters.FilterSet):
    """The Violations page and /api/v1/violations/."""

    kind = django_filters.ChoiceFilter(
        choices=Violation.Kind.choices,
        empty_label="any kind",
        help_text="The rule broken.",
        error_messages=unknown_choice("kind", Violation.Kind.values),
    )
    action = django_filters.ChoiceFilter(
        choices=Violation.Action.choices,
        empty_label="any action",
        help_text="What the watchdog did.",
        error_messages=unknown_choice("action", Violation.Action.values),
    )
    server = django_filters.CharFilter(
        field_name="server__name", label="Server", widget=forms.Select, help_text="A server's name."
    )
    open = YesNoFilter(
        field_name="ended_at",
        lookup_expr="isnull",
        label="Still running",
        help_text="true: the process is still on the card; false: it is gone.",
    )
    mine = MineFilter(field_name="user", label="Mine")
    since = DayFilter(
        field_name="first_seen",
        lookup_expr="gte",
        label="Since",
        help_text="First seen, YYYY-MM-DD, inclusive.",
    )
    until = DayFilter(
        field_name="first_seen",
        lookup_expr="lte",
        label="Until",
        help_text="First seen, YYYY-MM-DD, inclusive.",
    )

    class Meta:
        model = Violation
        fields: list[str] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if "server" in self.form.fields:
            self.form.fields["server"].widget.choices = server_choices


# --- usage reports -----------------------------------------------------------------------------

USAGE_GROUPS = [
    ("user", "User"),
    ("team", "Team"),
    ("server", "Server"),
    ("gpu", "Card"),
    ("day", "Day"),
    ("week", "Week"),
    ("month", "Month"),
]


def _usage_user_choices(user: AbstractBaseUser | None) -> list[tuple[str, str]]:
    """The people whose usage the viewer sees: themselves and the members of the teams they lead;
    admins everyone (gpus.reports.UsageScope)."""
    people = get_user_model().objects.order_by("username")
    if user is None:
        people = people.none()
    elif not is_admin(user):
        led = teams_led_by(user)
        people = people.filter(Q(pk=user.pk) | Q(memberships__team_id__in=led)).distinct()
    return [("", "anyone"), *((name, name) for name in people.values_list("username", flat=True))]


class UsageFilter(django_filters.FilterSet):
    """The usage reports: the Reports page, its CSV export and /api/v1/usage/ (docs/reports.md).

    With neither since nor until given, the period is this month so far, on all three alike.
    `group_by` is read by the selectors (gpus.reports.usage_rows); as a filter it only validates.
    The filters apply to every usage table: each has `start`, and the ones a table lacks are empty
    whenever that table is read (gpus.reports.usage_heatmap)."""

    since = DayFilter(
        field_name="start",
        lookup_expr="gte",
        portal_days=True,
        label="Since",
        help_text=(
            "YYYY-MM-DD, inclusive, in the portal's time zone. With until also empty: the first of "
            "this month."
        ),
    )
    until = DayFilter(
        field_name="start",
        lookup_expr="lte",
        portal_days=True,
        label="Until",
        help_text="YYYY-MM-DD, inclusive, in the portal's time zone.",
    )
    team = django_filters.CharFilter(
        field_name="team__slug", label="Team", widget=forms.Select, help_text="A team's slug."
    )
    user = django_filters.CharFilter(
        field_name="user__username",
        label="User",
        max_length=150,
        widget=forms.Select,
        help_text="A username.",
    )
    server = django_filters.CharFilter(
        field_name="server__name", label="Server", widget=forms.Select, help_text="A server's name."
    )
    group_by = django_filters.ChoiceFilter(
        choices=USAGE_GROUPS,
        method="filter_group_by",
        label="Group by",
        empty_label=None,
        help_text="One row per user (the default), team, server, card (gpu), day, week or month.",
        error_messages=unknown_choice("group_by", [value for value, _ in USAGE_GROUPS]),
    )

    class Meta:
        model = UsageFigures  # abstract: the filters serve every usage table
        fields: list[str] = []
        form = SpanForm

    def __init__(self, data: Any = None, *args: Any, **kwargs: Any) -> None:
        if data is not None and "since" not in data and "until" not in data:
            data = data.copy()
            data["since"] = portal_today().replace(day=1).isoformat()
        super().__init__(data, *args, **kwargs)
        # The menus' options are read only when a page renders them (callables), not in the API.
        user = getattr(self.request, "user", None)
        fields = self.form.fields
        fields["team"].widget.choices = partial(_team_choices, user)
        fields["user"].widget.choices = partial(_usage_user_choices, user)
        fields["server"].widget.choices = server_choices

    def filter_group_by(self, queryset: QuerySet, name: str, value: str) -> QuerySet:
        return queryset  # grouping is the selector's

    @property
    def grouping(self) -> str:
        """The valid group_by, "user" when none was given (call after is_valid())."""
        return self.form.cleaned_data.get("group_by") or "user"
