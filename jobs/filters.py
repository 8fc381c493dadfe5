"""The job list's filters: /api/v1/jobs/ (JobFilter), and the pages History and My jobs."""

from __future__ import annotations

from functools import partial
from typing import Any

import django_filters
from django import forms
from django.contrib.auth.models import AbstractBaseUser

from gpus.filters import server_choices
from jobs.models import InteractiveSession, Job
from portal.access import CHANGE
from portal.filters import DayFilter, MineFilter, QueryForm, unknown_choice
from portal.models import Team


def _team_choices(user: AbstractBaseUser | None) -> list[tuple[str, str]]:
    """The teams whose jobs the user sees in History: those they lead (admins: all)."""
    teams = Team.objects.none() if user is None else Team.objects.restrict(user, CHANGE).order_by("name")
    return [("", "any team"), *((t.slug, t.name) for t in teams)]


class JobFilter(django_filters.FilterSet):
    """Team and server are free text (an unknown one lists nothing); the page offers them as menus."""

    user = django_filters.CharFilter(
        field_name="owner__username", label="User", max_length=150, help_text="A username."
    )
    team = django_filters.CharFilter(field_name="team__slug", label="Team", widget=forms.Select)
    server = django_filters.CharFilter(field_name="server__name", label="Server", widget=forms.Select)
    status = django_filters.ChoiceFilter(
        choices=Job.Status.choices,
        label="Status",
        empty_label="any status",
        error_messages=unknown_choice("status", Job.Status.values),
    )
    since = DayFilter(
        field_name="created_at", lookup_expr="gte", label="Since", help_text="YYYY-MM-DD, inclusive."
    )
    until = DayFilter(
        field_name="created_at", lookup_expr="lte", label="Until", help_text="YYYY-MM-DD, inclusive."
    )
    mine = MineFilter(field_name="owner", label="Mine")
    array = django_filters.NumberFilter(
        field_name="array_id",
        label="Array",
        help_text="An array's id: its tasks.",
        min_value=1,
        max_value=2**63 - 1,
    )

    class Meta:
        model = Job
        fields: list[str] = []
        form = QueryForm

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The menus' options are read only when the page renders them (callables), not in the API.
        user = getattr(self.request, "user", None)
        fields = self.form.fields
        if "team" in fields:
            fields["team"].widget.choices = partial(_team_choices, user)
        if "server" in fields:
            fields["server"].widget.choices = server_choices


# The pages show the same filters less those their list makes moot.


class JobHistoryFilter(JobFilter):
    """Job history: ?mine= is what My jobs is for."""

    mine = None  # type: ignore[assignment]


class MyJobFilter(JobHistoryFilter):
    """My jobs: the user's own jobs already, so no user or team either."""

    user = None  # type: ignore[assignment]
    team = None  # type: ignore[assignment]


class SessionFilter(django_filters.FilterSet):
    """Interactive sessions (jobs.sessions.services): by booking, status, kind, server; `mine`."""

    reservation = django_filters.NumberFilter(
        field_name="reservation_id", label="Booking", min_value=1, max_value=2**63 - 1
    )
    status = django_filters.ChoiceFilter(
        choices=InteractiveSession.Status.choices,
        label="Status",
        empty_label="any status",
        error_messages=unknown_choice("status", InteractiveSession.Status.values),
    )
    kind = django_filters.ChoiceFilter(
        choices=InteractiveSession.Kind.choices,
        label="Kind",
        empty_label="any kind",
        error_messages=unknown_choice("kind", InteractiveSession.Kind.values),
    )
    server = django_filters.CharFilter(field_name="server__name", label="Server")
    mine = MineFilter(field_name="owner", label="Mine")

    class Meta:
        model = InteractiveSession
        fields: list[str] = []
