"""Whether an exception means the database or Redis cannot be reached for now (`outage_of`).

Apart from portal.outage, which turns an outage into a request's 503: the workers classify their
own failures with it, and need nothing of the web's (DRF, templates) to do so.
"""

from __future__ import annotations

import sqlite3

import kombu.exceptions
import redis.exceptions
from django.db import InterfaceError, OperationalError

DATABASE = "database"
REDIS = "redis"
WHAT = {DATABASE: "the database", REDIS: "Redis (the task queue)"}

# PostgreSQL's SQLSTATEs for a server that cannot serve now: class 08 (connection exception),
# admin or crash shutdown, starting up ("cannot_connect_now"), out of connection slots, a
# statement cancelled at DATABASE_STATEMENT_TIMEOUT_SECONDS ("query_canceled": too busy to answer
# in time). A client-side failure has no SQLSTATE at all: connecting failed, or the server gave
# no answer in time (portal.postgresql.base.NoAnswer).
_PG_UNAVAILABLE = frozenset({"57P01", "57P02", "57P03", "53300", "57014"})
# SQLite's primary result codes for a file that is busy, locked, unreadable or unopenable.
_SQLITE_UNAVAILABLE = frozenset(
    {sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN}
)
_REDIS_ERRORS = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    kombu.exceptions.OperationalError,  # .delay() / apply_async when the broker is away
)


def outage_of(exc: BaseException | None) -> str | None:
    """DATABASE or REDIS when `exc` (or what it was raised from) means that service is
    unreachable for now; None for any other error."""
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, InterfaceError) or (isinstance(exc, OperationalError) and _unreachable(exc)):
            return DATABASE
        if isinstance(exc, _REDIS_ERRORS):
            return REDIS
        exc, seen = exc.__cause__, seen + 1
    return None


def _unreachable(exc: OperationalError) -> bool:
    """Whether the driver's error under Django's OperationalError is about the connection."""
    driver = exc.__cause__
    if isinstance(driver, sqlite3.Error):
        return (getattr(driver, "sqlite_errorcode", 0) & 0xFF) in _SQLITE_UNAVAILABLE
    sqlstate = getattr(driver, "sqlstate", None) or getattr(driver, "pgcode", None)  # psycopg 3, 2
    if sqlstate:
        return sqlstate.startswith("08") or sqlstate in _PG_UNAVAILABLE
    # psycopg's own OperationalError without a SQLSTATE: connecting failed, or the server
    # closed the connection. A Django OperationalError with no driver error under it is not known to be.
    return driver is not None
