"""One error body for the whole API: {"detail": ..., "code": ..., "errors": {field: [...]}}.

A 503 while the database or Redis is away adds "service" (portal/outage.py)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied
from django.http import Http404, JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from portal.errors import ServiceError, Unavailable


def _first_message(errors: Any) -> str:
    if isinstance(errors, dict):
        field, value = next(iter(errors.items()))
        prefix = "" if field == "non_field_errors" else f"{field}: "
        return prefix + _first_message(value)
    if isinstance(errors, list) and errors:
        return _first_message(errors[0])
    return str(errors)


def api_error_response(detail: str, *, code: str, status: int, **more: Any) -> JsonResponse:
    """The same body from outside DRF's views, e.g. django-axes' lockout (portal.views), an
    outage's 503 (portal.outage, with `service`), a NUL's 400 (portal.middleware, with `errors`)."""
    return JsonResponse({"detail": detail, "code": code, **more}, status=status)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, ServiceError):
        body: dict[str, Any] = {"detail": exc.message, "code": exc.code}
        if exc.errors:
            body["errors"] = {field or "non_field_errors": list(msgs) for field, msgs in exc.errors.items()}
        headers = (
            {"Retry-After": str(settings.OUTAGE_RETRY_AFTER_SECONDS)}
            if isinstance(exc, Unavailable)
            else None
        )
        return Response(body, status=exc.status, headers=headers)
    if isinstance(exc, exceptions.ValidationError):
        errors = exc.detail if isinstance(exc.detail, dict) else {"non_field_errors": exc.detail}
        return Response(
            {"detail": _first_message(errors), "code": "invalid", "errors": errors},
            status=status.HTTP_400_BAD_REQUEST,
        )
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied(str(exc) or None)
    response = drf_exception_handler(exc, context)
    if response is not None and isinstance(exc, exceptions.APIException):
        codes = exc.get_codes()
        response.data = {"detail": str(exc.detail), "code": codes if isinstance(codes, str) else "error"}
    return response
