"""Django's PostgreSQL backend, with a deadline on every wait for the server.

A frozen server (its processes stopped, its kernel still acknowledging packets) never answers and
never closes: TCP keepalives and `tcp_user_timeout` see a healthy peer, and a query, a commit or
Django's health check (`SELECT 1`) would wait for ever. Two deadlines, from one setting:

- `statement_timeout` (DATABASE_STATEMENT_TIMEOUT_SECONDS) on every connection: a server that
  is alive but slow cancels the query itself (SQLSTATE 57014), and the connection stays usable;
- DEADLINE_MARGIN_SECONDS later, the client gives up on a server that did not even do that:
  psycopg's wait ends (`Connection.wait(timeout=...)`), the connection is closed (its protocol
  state is unknown) and an OperationalError without SQLSTATE says the server is unreachable,
  which portal.outage turns into a 503.

Connecting has its own deadline, libpq's `connect_timeout` (portal.env.POSTGRES_DEFAULT_OPTIONS).
0 turns both off (a long `migrate` on a huge table, run by hand).
"""

from __future__ import annotations

import datetime
from functools import lru_cache
from typing import Any

import psycopg
from django.conf import settings
from django.db.backends.postgresql import base
from psycopg.adapt import AdaptersMap
from psycopg.pq import Format

DEADLINE_MARGIN_SECONDS = 1.0


class NoAnswer(psycopg.OperationalError):
    """The server did not answer within the deadline; the connection is closed."""


class DeadlineConnection(psycopg.Connection):
    """A psycopg connection whose every wait for the server ends after `deadline` seconds."""

    deadline: float | None = None

    def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        limit = timeout if timeout is not None else self.deadline
        try:
            return super().wait(gen, interval=interval, timeout=limit)
        except psycopg.errors._WaitTimeout as exc:  # psycopg's own deadline error
            self.pgconn.finish()  # mid-protocol: nothing more can be read from it
            raise NoAnswer(f"the database did not answer within {limit:g} s") from exc


def statement_timeout_seconds() -> int:
    return settings.DATABASE_STATEMENT_TIMEOUT_SECONDS


class _Driver:
    """psycopg as Django's backend uses it (`Database`), connecting with DeadlineConnection."""

    def __getattr__(self, name: str) -> Any:
        return getattr(psycopg, name)

    @staticmethod
    def connect(*args: Any, **kwargs: Any) -> DeadlineConnection:
        connection = DeadlineConnection.connect(*args, **kwargs)
        if seconds := statement_timeout_seconds():
            connection.deadline = seconds + DEADLINE_MARGIN_SECONDS
        return connection


# psycopg's own loader of timestamptz text: its C one where psycopg has its C module.
_PSYCOPG_TIMESTAMPTZ = psycopg.adapters.get_loader(psycopg.postgres.types["timestamptz"].oid, Format.TEXT)


class UtcTimestamptzLoader:
    """Times read as psycopg's own loader reads them, where Django wants them in UTC.

    Django's loader subclasses psycopg's pure-Python one and then replaces each value's tzinfo:
    about 4.5 µs a value against 0.4 µs for psycopg's C loader, which gives the same aware
    datetime in `datetime.timezone.utc` on a connection whose TimeZone is UTC (Django sets it to
    its zone as it connects). 512 cards' `updated_at` on each `GET /api/v1/gpus/`, 20,000 booking
    times a scheduler pass (issue 40). `timezone` is what Django's `create_cursor` compares with
    the zone it wants: where they differ (USE_TZ off, a database TIME_ZONE) it registers its own
    loader on the cursor, as it does without this class. Making one makes psycopg's loader, so
    psycopg's C row loading sees its own class."""

    timezone = datetime.UTC
    format = Format.TEXT

    def __new__(cls, oid: int, context: Any = None) -> Any:
        return _PSYCOPG_TIMESTAMPTZ(oid, context)


@lru_cache
def _adapters(django_template: AdaptersMap) -> AdaptersMap:
    """Django's adapters (one map per USE_TZ and zone), with UtcTimestamptzLoader."""
    adapters = AdaptersMap(django_template)
    adapters.register_loader("timestamptz", UtcTimestamptzLoader)
    return adapters


class DatabaseWrapper(base.DatabaseWrapper):
    Database = _Driver()

    def get_connection_params(self) -> dict[str, Any]:
        params = super().get_connection_params()
        params["context"] = _adapters(params["context"])
        if seconds := statement_timeout_seconds():
            options = params.get("options", "")
            params["options"] = f"{options} -c statement_timeout={seconds * 1000}".strip()
        return params
