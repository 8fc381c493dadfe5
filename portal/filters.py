"""List filters (django-filter): the shared building blocks, and the team audit log's FilterSet.

One FilterSet per list, used by the page and the API alike: the page renders its form (a bad value
is an error beside the field, and the list is empty); the API's DjangoFilterBackend answers a bad
value with a 400 naming the parameter (portal/api_errors.py), and drf-spectacular documents every
filter in /api/v1/schema/. Messages say what to write instead. `filter_list` is the pages' half.
"""

from __future__ import annotations

from datetime import date, datetime, time, timedelta
from functools import partial
from typing import Any

import django_filters
from django import forms
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django_filters.constants import EMPTY_VALUES
from django_filters.widgets import BooleanWidget

from portal.models import AuditEntry


def unknown_choice(what: str, values: list[str]) -> dict[str, str]:
    """error_messages for a ChoiceFilter: 'Unknown status; use one of queued, running, ….'"""
    return {"invalid_choice": f"Unknown {what}; use one of {', '.join(values)}."}


class DayField(forms.DateField):
    """A calendar day written YYYY-MM-DD, between FIRST_DAY and LAST_DAY; a bad value is quoted back
    with what to write instead."""

    widget = forms.DateInput(attrs={"type": "date"})
    # The calendar's ends (0001-01-01, 9999-12-31) overflow once a day becomes a moment in a time
    # zone away from UTC, as the database query runs; no lab booked or ran anything outside these.
    FIRST_DAY = date(1900, 1, 1)
    LAST_DAY = date(9000, 12, 31)

    def to_python(self, value: Any) -> date | None:
        if value in self.empty_values:
            return None
        if isinstance(value, date):
            day, text = value, value.isoformat()
        else:
            text = str(value)
            try:
                day = date.fromisoformat(text.strip())
            except ValueError:
                # The value goes in params: django-filter %-formats the message for the API.
                raise ValidationError(
                    "%(value)r is not a date; write it as YYYY-MM-DD.", code="invalid", params={"value": text}
                ) from None
        if not self.FIRST_DAY <= day <= self.LAST_DAY:
            raise ValidationError(
                "%(value)r is out of range; give a date between %(first)s and %(last)s.",
                code="invalid",
                params={"value": text, "first": self.FIRST_DAY, "last": self.LAST_DAY},
            )
        return day


class SpanForm(forms.Form):
    """A filter form whose `until` may not come before its `since` (the usage reports, the jobs)."""

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        since, until = data.get("since"), data.get("until")
        if since and until and since > until:
            self.add_error("until", f"until ({until}) is before since ({since}); swap them.")
        return data


class QueryForm(SpanForm):
    """A list's filter form: the span's rule, and each parameter given once."""

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        for name in self.fields:
            given = self.data.getlist(name) if hasattr(self.data, "getlist") else []
            if len(given) > 1:
                self.add_error(name, f"{name} is given {len(given)} times; give it once.")
        return data


class YesNoField(forms.NullBooleanField):
    """1/true/yes/on, 0/false/no/off or empty; anything else is refused, not read as "either way"
    (django-filter's BooleanWidget turns an unknown word into None: the unfiltered list)."""

    refusal = "%(value)r: write true or false, or leave it out."

    def to_python(self, value: Any) -> bool | None:
        text = str(value).strip().lower() if value is not None else ""
        if text in ("", "none"):
            return None
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValidationError(self.refusal, code="invalid", params={"value": value})


class MineField(YesNoField):
    """?mine=: as YesNoField; anything else is refused, not read as "everyone's"."""

    refusal = "%(value)r: write mine=1 for only your own, or leave it out."


class RawBooleanWidget(BooleanWidget):
    def value_from_datadict(self, data: Any, files: Any, name: str) -> Any:
        value = super().value_from_datadict(data, files, name)
        return data.get(name) if value is None else value


class DayFilter(django_filters.DateFilter):
    """A day, inclusive: lookup_expr="gte" keeps rows from the day's first moment on (since=), "lte"
    up to its last (until=). field_name is a DateTimeField. The day is the viewer's (the request's
    current zone); `portal_days=True` makes it TIME_ZONE's, for tables whose days were written in it
    (the usage rollups), so that every viewer's day holds the same rows."""

    field_class = DayField

    def __init__(self, *args: Any, portal_days: bool = False, **kwargs: Any) -> None:
        self.portal_days = portal_days
        super().__init__(*args, **kwargs)
        if self.lookup_expr not in ("gte", "lte"):  # at class definition, not at the first query
            raise ImproperlyConfigured(
                f"DayFilter {self.field_name}: lookup_expr must be 'gte' or 'lte', not {self.lookup_expr!r}."
            )

    def filter(self, qs: QuerySet, value: date | None) -> QuerySet:
        if value in EMPTY_VALUES:
            return qs
        zone = timezone.get_default_timezone() if self.portal_days else timezone.get_current_timezone()
        if self.lookup_expr == "gte":
            return qs.filter(**{f"{self.field_name}__gte": datetime.combine(value, time.min, zone)})
        next_day = datetime.combine(value + timedelta(days=1), time.min, zone)
        return qs.filter(**{f"{self.field_name}__lt": next_day})


class YesNoFilter(django_filters.BooleanFilter):
    """A true/false filter whose unknown value is an error naming it (YesNoField)."""

    field_class = YesNoField

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("widget", RawBooleanWidget)
        super().__init__(*args, **kwargs)


class MineFilter(django_filters.BooleanFilter):
    """?mine=1 (or true): only the requesting user's own rows; field_name is the owner's foreign key."""

    field_class = MineField

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("widget", RawBooleanWidget)
        kwargs.setdefault("help_text", "1 or true: only your own.")
        super().__init__(*args, **kwargs)

    def filter(self, qs: QuerySet, value: bool | None) -> QuerySet:
        if not value:
            return qs
        return qs.filter(**{self.field_name: self.parent.request.user})


def filter_list(
    request: HttpRequest, filterset_class: type[django_filters.FilterSet], queryset: QuerySet
) -> tuple[forms.Form, QuerySet]:
    """A page's list filtered by its ?… parameters, and the form to render above it. A bad value is
    an error beside its field and the list is empty: never the unfiltered list, which would look
    like the answer."""
    filters = filterset_class(request.GET, queryset, request=request)
    return filters.form, (filters.qs if filters.is_valid() else queryset.none())


def _actor_choices(entries: QuerySet[AuditEntry]) -> list[tuple[str, str]]:
    """Whoever acted in these entries (a team's log: its members, and admins)."""
    names = entries.exclude(actor=None).order_by("actor__username").values_list("actor__username", flat=True)
    return [("", "anyone"), *((name, name) for name in names.distinct())]


class AuditEntryFilter(django_filters.FilterSet):
    """A team's audit log: /api/v1/teams/{slug}/audit/, and the team page's."""

    action = django_filters.ChoiceFilter(
        choices=AuditEntry.Action.choices,
        label="Action",
        empty_label="any action",
        help_text="What was done.",
        error_messages=unknown_choice("action", AuditEntry.Action.values),
    )
    # Free text (an unknown name lists nothing); the page offers the log's actors as a menu.
    actor = django_filters.CharFilter(
        field_name="actor__username",
        label="Who",
        max_length=150,
        widget=forms.Select,
        help_text="A username.",
    )
    target = django_filters.CharFilter(label="Target", help_text="What was acted on, e.g. 'reservation 12'.")
    since = DayFilter(field_name="at", lookup_expr="gte", label="Since", help_text="YYYY-MM-DD, inclusive.")
    until = DayFilter(field_name="at", lookup_expr="lte", label="Until", help_text="YYYY-MM-DD, inclusive.")

    class Meta:
        model = AuditEntry
        fields: list[str] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Read only when a page renders the menu (a callable), never in the API.
        if "actor" in self.form.fields:
            self.form.fields["actor"].widget.choices = partial(_actor_choices, self.queryset)
