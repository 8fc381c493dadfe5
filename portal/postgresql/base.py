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

from typing import Any

import psycopg
from django.conf import settings
from django.db.backends.postgresql import base

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


class DatabaseWrapper(base.DatabaseWrapper):
    Database = _Driver()

    def get_connection_params(self) -> dict[str, Any]:
        params = super().get_connection_params()
        if seconds := statement_timeout_seconds():
            options = params.get("options", "")
            params["options"] = f"{options} -c statement_timeout={seconds * 1000}".strip()
        return params
