"""Errors raised by services: the message names the field and the fix; nothing was written.

Forms put `message` beside `field`; the API answers `status` with
{"detail": message, "code": code, "errors": {field: [message]}} (portal/api_errors.py).
"""

from __future__ import annotations


class ServiceError(Exception):
    status = 400
    code = "invalid"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class Invalid(ServiceError):
    """Bad input: 400."""


class Conflict(ServiceError):
    """Clashes with another booking: 409."""

    status = 409
    code = "conflict"


class QuotaExceeded(ServiceError):
    """Would pass a member or team limit: 403."""

    status = 403
    code = "quota_exceeded"


class Forbidden(ServiceError):
    """Not this user's to do: 403."""

    status = 403
    code = "permission_denied"
