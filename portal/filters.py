"""List filters (django-filter): the shared building blocks, and the team audit log's FilterSet.

One FilterSet per list, used by the page and the API alike: the page renders its form (a bad value
is an error beside the field, and the list is empty); the API's DjangoFilterBackend answers a bad
value with a 400 naming the parameter (portal/api_errors.py), and drf-spectacular documents every
filter in /api/v1/schema/. Messages say what to write instead.
"""

from __future__ import annotations

from datetime import date, datetime, time, timedelta
from typing import Any

import django_filters
from django import forms
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.db.models import QuerySet
from django.utils import timezone
from django_filters.constants import EMPTY_VALUES
from django_filters.widgets import BooleanWidget

from portal.models import AuditEntry


def unknown_choice(what: str, values: list[str]) -> dict[str, str]:
    """error_messages for a ChoiceFilter: 'Unknown status; use one of queued, running, ….'"""
    return {"invalid_choice": f"Unknown {what}; use one of {', '.join(values)}."}


class DayField(forms.DateField):
    """A calendar day written YYYY-MM-DD; a bad value is quoted back with the format to use."""

    widget = forms.DateInput(attrs={"type": "date"})

    def to_python(self, value: Any) -> date | None:
        if value in self.empty_values:
            return None
        if isinstance(value, date):
            return value
        try:
            return date.fromisoformat(str(value).strip())
        except ValueError:
            # The value goes in params: django-filter %-formats the message for the API.
            raise ValidationError(
                "%(value)r is not a date; write it as YYYY-MM-DD.", code="invalid", params={"value": value}
            ) from None


class DayFilter(django_filters.DateFilter):
    """A day in the portal's time zone, inclusive: lookup_expr="gte" keeps rows from the day's first
    moment on (since=), "lte" up to its last (until=). field_name is a DateTimeField."""

    field_class = DayField

    def filter(self, qs: QuerySet, value: date | None) -> QuerySet:
        if value in EMPTY_VALUES:
            return qs
        zone = timezone.get_current_timezone()
        try:
            if self.lookup_expr == "gte":
                return qs.filter(**{f"{self.field_name}__gte": datetime.combine(value, time.min, zone)})
            if self.lookup_expr == "lte":
                next_day = datetime.combine(value + timedelta(days=1), time.min, zone)
                return qs.filter(**{f"{self.field_name}__lt": next_day})
        except OverflowError:  # 0001-01-01 or 9999-12-31: the end of the calendar bounds nothing
            return qs
        raise ImproperlyConfigured(f"DayFilter {self.field_name}: lookup_expr must be 'gte' or 'lte'.")


class MineFilter(django_filters.BooleanFilter):
    """?mine=1 (or true): only the requesting user's own rows; field_name is the owner's foreign key."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("widget", BooleanWidget)
        kwargs.setdefault("help_text", "1 or true: only your own.")
        super().__init__(*args, **kwargs)

    def filter(self, qs: QuerySet, value: bool | None) -> QuerySet:
        if not value:
            return qs
        return qs.filter(**{self.field_name: self.parent.request.user})


class AuditEntryFilter(django_filters.FilterSet):
    """A team's audit log (/api/v1/teams/{slug}/audit/)."""

    action = django_filters.ChoiceFilter(
        choices=AuditEntry.Action.choices,
        help_text="What was done.",
        error_messages=unknown_choice("action", AuditEntry.Action.values),
    )
    actor = django_filters.CharFilter(field_name="actor__username", max_length=150, help_text="A username.")
    target = django_filters.CharFilter(help_text="What was acted on, e.g. 'reservation 12'.")
    since = DayFilter(field_name="at", lookup_expr="gte", help_text="YYYY-MM-DD, inclusive.")
    until = DayFilter(field_name="at", lookup_expr="lte", help_text="YYYY-MM-DD, inclusive.")

    class Meta:
        model = AuditEntry
        fields: list[str] = []
