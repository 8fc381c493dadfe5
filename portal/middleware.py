"""A NUL character in the path, a query parameter, a cookie or a header: 400 naming it.

PostgreSQL text cannot hold NUL (SQLite can), so a NUL that reaches a query is a 500 on one
database and a stored value on the other. Forms' and DRF's CharFields already refuse NUL in a
body's fields, beside the field; what a view reads from the URL or the headers by hand (a
`?script=`, a cookie's session key, the User-Agent django-axes records) is checked here, before
the session, the user or any view reads it. Other control characters are PostgreSQL's to keep
and the fields' to refuse where they matter (job paths, jobs/paths.py).
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest

from portal.api_errors import api_error_response
from portal.outage import wants_json

NUL = "\x00"
# Header values in the WSGI environ that are not HTTP_*.
_PLAIN_HEADERS = {"CONTENT_TYPE": "Content-Type", "CONTENT_LENGTH": "Content-Length"}


class RefuseNulMiddleware:
    def __init__(self, get_response) -> None:  # type: ignore[no-untyped-def]
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        found = nul_in(request)
        if found is None:
            return self.get_response(request)
        name, message = found
        if wants_json(request):
            return api_error_response(
                f"{name}: {message}", code="invalid", status=400, errors={name: [message]}
            )
        return HttpResponseBadRequest(f"{name}: {message}\n", content_type="text/plain; charset=utf-8")


def nul_in(request: HttpRequest) -> tuple[str, str] | None:
    """(the name to blame, the message) for the first NUL found, else None."""
    if NUL in request.path:
        return "path", "Null characters are not allowed in the address."
    for name, values in request.GET.lists():
        if NUL in name:
            return _shown(name), "Null characters are not allowed in a parameter's name."
        if any(NUL in value for value in values):
            return name, "Null characters are not allowed."  # as Django's and DRF's fields say it
    for key, value in request.META.items():
        header = _PLAIN_HEADERS.get(key) or (key.startswith("HTTP_") and _header_name(key))
        if header and isinstance(value, str) and NUL in value:
            return header, "Null characters are not allowed in this header."
    for name, value in request.COOKIES.items():  # a quoted cookie may spell one as \000
        if NUL in name or NUL in value:
            return _shown(name), "Null characters are not allowed in this cookie."
    return None


def _header_name(key: str) -> str:
    """HTTP_USER_AGENT → User-Agent."""
    return "-".join(part.capitalize() for part in key.removeprefix("HTTP_").split("_"))


def _shown(name: str) -> str:
    return name.replace(NUL, "\\x00")
