"""Errors raised by services: the message names the field and the fix; nothing was written.

Forms put `message` beside `field`; the API answers `status` with
{"detail": message, "code": code, "errors": {field: [message]}} (portal/api_errors.py). A service
that checks several independent fields reports them all at once (`Errors`): `errors` then holds
every field's messages, and `message`/`field` are the first.
"""

from __future__ import annotations


class ServiceError(Exception):
    status = 400
    code = "invalid"

    def __init__(
        self, message: str, *, field: str | None = None, errors: dict[str, list[str]] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.errors = errors or ({field: [message]} if field else {})


class Invalid(ServiceError):
    """Bad input: 400."""


class Conflict(ServiceError):
    """Clashes with another booking: 409."""

    status = 409
    code = "conflict"


class QuotaExceeded(Invalid):
    """Would pass a member or team limit (gpus.quotas.quota_check, for bookings and the queue alike):
    bad input for that request, 400, beside the field its user would change. Its own code, so an
    API client tells "ask for less" from other bad input."""

    code = "quota_exceeded"


class TooSoon(ServiceError):
    """Asked again before it may be (a channel's test): 429."""

    status = 429
    code = "too_soon"


class Unavailable(ServiceError):
    """What the request needs does not answer now (a Slurm cluster, its worker): 503, with
    Retry-After (OUTAGE_RETRY_AFTER_SECONDS); nothing was written, and it may be sent again."""

    status = 503
    code = "unavailable"


class Forbidden(ServiceError):
    """Not this user's to do: 403."""

    status = 403
    code = "permission_denied"


class Errors:
    """Every bad field of a request at once: each independent check runs through `check`, which
    keeps an Invalid's message under its field and answers None; `raise_any` then raises one
    Invalid with them all. Anything but Invalid (Forbidden, a quota) is raised at once."""

    def __init__(self) -> None:
        self.found: dict[str, list[str]] = {}

    def check(self, step, *args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return step(*args, **kwargs)
        except QuotaExceeded:
            raise  # its own code, and the team's channels may be told of it (gpus.quotas)
        except Invalid as error:
            for field, messages in error.errors.items() or {"": [error.message]}.items():
                self.found.setdefault(field, []).extend(messages)
            return None

    def add(self, field: str, message: str) -> None:
        """A problem found without a step of its own (a check of several fields at once)."""
        self.found.setdefault(field, []).append(message)

    def raise_any(self) -> None:
        if not self.found:
            return
        field, messages = next(iter(self.found.items()))
        raise Invalid(messages[0], field=field or None, errors=self.found)
