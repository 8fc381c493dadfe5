"""Fields the REST API's serializers share."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.utils import timezone
from rest_framework import serializers
from rest_framework.exceptions import ValidationError


class LocalDateTimeField(serializers.DateTimeField):
    """A moment; one written without an offset is read in the request's zone (its person's). A time
    that zone skips or repeats the night its clocks change is refused, naming the field, as the
    booking form refuses it: DRF's own check lets a skipped one through, read an hour off."""

    def enforce_timezone(self, value: datetime) -> datetime:
        zone = self.timezone if hasattr(self, "timezone") else self.default_timezone()
        if zone is not None and timezone.is_naive(value):
            offsets = {value.replace(tzinfo=zone, fold=fold).utcoffset() for fold in (0, 1)}
            if len(offsets) > 1:
                raise ValidationError(
                    f"{value:%Y-%m-%d %H:%M} does not exist, or happens twice, in {zone}: the clocks "
                    "change then. Give another time, or add its UTC offset (e.g. +01:00)."
                )
        return super().enforce_timezone(value)


class KnownFieldsOnly(serializers.Serializer):
    # An input serializer that names a key it has no field for, rather than dropping it: a typo
    # ({"memory": "8G"}, {"lable": …}) would otherwise be answered as done, with the default.
    # A comment, not a docstring: drf-spectacular describes each subclass's body in the schema
    # by the first docstring up its classes, and this one is no words for the API's users.

    def to_internal_value(self, data: Any) -> Any:
        # A session's HTML form posts Django's CSRF token beside the fields (SessionAuthentication).
        unknown = (
            sorted(set(data.keys()) - set(self.fields) - {"csrfmiddlewaretoken"})
            if hasattr(data, "keys")
            else []
        )
        if not unknown:
            return super().to_internal_value(data)
        errors = {unknown[0]: [f"Unknown field; use {', '.join(self.fields)} (GET /api/v1/schema/)."]}
        try:  # the known fields' own errors too: one 400 names every bad field
            super().to_internal_value(data)
        except ValidationError as error:
            errors = {**error.detail, **errors} if isinstance(error.detail, dict) else errors
        raise ValidationError(errors)
