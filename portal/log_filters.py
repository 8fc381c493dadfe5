"""Log records never hold a capability URL: a calendar feed's address is its secret
(/calendar/<secret>.ics, gpus/calendars.py), and a log line, an access log or an error mail that
quoted it whole would hand the feed to whoever reads the log. The secret is cut to its first four
characters, enough to tell two apart.

Attached to the portal's console handler (Django's own lines: "Not Found: …", "Internal Server
Error: …") and to the web server's access loggers (portal.asgi_worker).
"""

from __future__ import annotations

import logging
import re

_SECRET_PATH = re.compile(r"(/calendar/)([A-Za-z0-9_\-]{4})[A-Za-z0-9_\-]*")


def redact(text: str) -> str:
    return _SECRET_PATH.sub(r"\1\2…", text)


class RedactSecretPaths(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "/calendar/" in message:
            record.msg, record.args = redact(message), ()
        return True


def redact_access_logs() -> None:
    """The access loggers of gunicorn and uvicorn (which the worker sets up itself)."""
    for name in ("uvicorn.access", "gunicorn.access", "django.server"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecretPaths) for f in logger.filters):
            logger.addFilter(RedactSecretPaths())
