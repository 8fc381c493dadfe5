"""Log records never hold a capability URL: a calendar feed's address is its secret
(/calendar/<secret>.ics, gpus/calendars.py), and a log line, an access log or an error mail that
quoted it whole would hand the feed to whoever reads the log. The secret is cut to its first four
characters, enough to tell two apart.

Attached where the lines are made, so that every handler gets them cut (the console, an admin's
error mail, a test's capture): Django's request loggers ("Not Found: …", "Internal Server Error:
…", at start-up: portal.apps) and the web server's access loggers (portal.asgi_worker, once it has
set them up); and, for any other line, the console handler (settings.LOGGING).
"""

from __future__ import annotations

import logging
import re

_SECRET_PATH = re.compile(r"(/calendar/)([A-Za-z0-9_\-]{4})[A-Za-z0-9_\-]*")


def redact(text: str) -> str:
    return _SECRET_PATH.sub(r"\1\2…", text)


class NoTracebackForClientErrors(logging.Filter):
    """Django logs a 403 (PermissionDenied: a member asking for what only a leader may do) with
    the exception's whole traceback, as if the code had failed. A 4xx is the request's fault and
    its line says which; only a 5xx keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and getattr(record, "status_code", 500) < 500:
            record.exc_info, record.exc_text = None, None
        return True


class RedactSecretPaths(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "/calendar/" in message:
            record.msg, record.args = redact(message), ()
        return True


def redact_request_logs() -> None:
    """The loggers that name request paths: Django's, gunicorn's and uvicorn's access logs; and
    Django's request log, without a traceback for a client's error."""
    for name in ("django.request", "django.server", "uvicorn.access", "gunicorn.access"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecretPaths) for f in logger.filters):
            logger.addFilter(RedactSecretPaths())
    request = logging.getLogger("django.request")
    if not any(isinstance(f, NoTracebackForClientErrors) for f in request.filters):
        request.addFilter(NoTracebackForClientErrors())
