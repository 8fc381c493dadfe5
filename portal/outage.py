"""While the database or Redis is away, a request answers 503 with Retry-After, never a 500.

An outage is an exception that says a service could not be reached, not that a query was wrong
(`outage_of`): the database refusing or dropping the connection, starting up or shutting down,
out of connection slots, or (SQLite) locked or unopenable; Redis refusing or timing out, and
Celery failing to hand a message to it. Anything else stays a 500: a retried programming error
would only fail again.

Two places turn one into the answer, because Django turns an exception inside any middleware
into a 500 response before an outer middleware sees it (`convert_exception_to_response`):

- `OutageMiddleware.process_exception`, for the views (DRF's views re-raise what
  portal.api_errors.exception_handler does not answer);
- `server_error`, the project's handler500, for the middleware (the session, the user, axes),
  from `sys.exc_info()` while Django handles the exception. With DEBUG on, Django shows its
  technical 500 page instead and never asks handler500.

Each outage request logs one WARNING line, not a traceback at ERROR: the response is marked
logged, which `django.utils.log.log_response` honours. The answer is JSON for the API and for
`Accept: application/json`, else templates/503.html, which needs nothing from the database.

A 503 says the work could not be done, not that none of it was: a connection lost while
committing leaves the outcome unknown. Clients repeat only what is safe to repeat (docs/api.md).
"""

from __future__ import annotations

import logging
import sys

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.template.loader import render_to_string
from django.views.defaults import server_error as django_server_error

from portal.api_errors import api_error_response
from portal.unreachable import WHAT, outage_of

log = logging.getLogger(__name__)


def wants_json(request: HttpRequest) -> bool:
    return request.path_info.startswith("/api/") or "application/json" in request.headers.get("Accept", "")


def service_unavailable(request: HttpRequest, service: str, exc: BaseException) -> HttpResponse:
    """The 503 for a request that `service` being away stopped; logs one WARNING line."""
    retry_after = settings.OUTAGE_RETRY_AFTER_SECONDS
    what = WHAT[service]
    detail = f"The portal cannot reach {what} just now; try again in {retry_after} s."
    if wants_json(request):
        response: HttpResponse = api_error_response(
            detail, code="service_unavailable", status=503, service=service
        )
    else:
        page = render_to_string(
            "503.html", {"what": what, "retry_after": retry_after, "reload": request.method == "GET"}
        )
        response = HttpResponse(page, status=503)
    response["Retry-After"] = str(retry_after)
    # No "Service Unavailable" record with a traceback from Django's handler: this line is all.
    response._has_been_logged = True  # type: ignore[attr-defined]
    first_line = (str(exc).strip().splitlines() or [""])[0][:200]
    log.warning(
        "503 for %s %s: %s is unavailable (%s: %s)",
        request.method,
        request.path.encode("unicode_escape").decode("ascii"),  # as log_response escapes it
        what,
        type(exc).__name__,
        first_line,
    )
    return response


class OutageMiddleware:
    """503 for an outage raised in a view (DRF's views included)."""

    def __init__(self, get_response) -> None:  # type: ignore[no-untyped-def]
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        service = outage_of(exception)
        return service_unavailable(request, service, exception) if service else None


def server_error(request: HttpRequest) -> HttpResponse:
    """handler500: Django calls it while it handles the exception, so `sys.exc_info()` holds it.
    An outage inside a middleware gets its 503 here; everything else Django's own 500."""
    exc = sys.exc_info()[1]
    service = outage_of(exc)
    if service and exc is not None:
        return service_unavailable(request, service, exc)
    return django_server_error(request)
