"""One clock for every heartbeat and its cut-off: the database's.

A heartbeat is written by one host (a GPU host's worker, a web server answering `gpu`, the
collector) and judged by another (the reconciler, a page, /metrics). Their clocks may disagree
by minutes; the database's is the one both can read. So a beat is written as `Now()` in its
UPDATE, a cut-off is compared in the query (`since(seconds)`), and an age that must be shown is
measured against `db_now()`, never against the reading host's `timezone.now()`.

PostgreSQL's `Now()` (Django: STATEMENT_TIMESTAMP()) is the statement's time, not its
transaction's; SQLite's is the time of the host that opened the file, which is the only host.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import Expression
from django.db.models.functions import Now
from django.db.models.sql import Query


def since(seconds: float) -> Expression:
    """The database's now minus `seconds`: a cut-off evaluated by the database, in the query."""
    return Now() - timedelta(seconds=seconds)


def db_now(using: str = DEFAULT_DB_ALIAS) -> datetime:
    """The database's current time (aware), for ages shown or compared outside a query.

    Compiled from `Now()` so that each backend's own SQL and converters are used (SQLite returns
    text, PostgreSQL a timestamp); one small query."""
    connection = connections[using]
    expression = Now()
    sql, params = Query(None).get_compiler(using=using).compile(expression)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {sql}", params)
        value = cursor.fetchone()[0]
    for converter in connection.ops.get_db_converters(expression):
        value = converter(value, expression, connection)
    return value
