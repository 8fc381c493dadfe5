"""Many rows in a few statements, for the telemetry round (gpus/services.py): raw SQL, because
the ORM misses the ingest goal several times over.

`make bench` (bench_inventory, one round of 64 reports / 512 GPUs): through the ORM, `bulk_update`
(a CASE per column and row) took the round to 445 ms on SQLite and 570-750 ms on PostgreSQL, and
`bulk_create(update_conflicts=True)` of the 512 cards' figures alone took 52-64 ms on PostgreSQL
(issue 40, measured beside these). On PostgreSQL the rows go by COPY, its bulk-load path, whose
rows psycopg formats in C: parameters in arrays (`unnest(%s::int[])`, what this did before) are
quoted element by element in Python, 5-8 ms of CPU a round for 14,000 values. On SQLite,
`executemany` runs the statement in a C loop.

Tested on both databases (tests/test_bulk.py: `make test` on SQLite, CI on PostgreSQL), and
through the telemetry tests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from django.db import connection
from django.db.models import Model
from django.db.models.functions import Now
from django.db.models.sql import Query


def rows_insert(model: type[Model], fields: Sequence[str], rows: Sequence[tuple]) -> None:
    """INSERT `rows` (each: the fields' values, in order) into the model's table: one COPY on
    PostgreSQL, one `executemany` on SQLite. Nothing when there are none."""
    if not rows:
        return
    table, columns = _table(model), _columns(model, fields)
    if connection.vendor == "postgresql":
        _copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN", rows)
        return
    marks = ", ".join(["%s"] * len(columns))
    with connection.cursor() as cursor:
        cursor.executemany(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})", rows)


def rows_update(
    model: type[Model],
    fields: Sequence[str],
    key: str,
    rows: Sequence[tuple],
    *,
    now_fields: Sequence[str] = (),
) -> None:
    """UPDATE the rows of the model's table named by `key` (each row: the fields' values, then the
    key's). `now_fields` are set to the database's `Now()` (compiled by Django for the backend), in
    the same statement. Rows whose key matches nothing change nothing.

    PostgreSQL: the rows are copied into a temporary table of this connection (made once, emptied
    at each commit and before each use), and one UPDATE … FROM joins it. SQLite: `executemany`."""
    if not rows:
        return
    table, columns = _table(model), _columns(model, [*fields, key])
    quote = connection.ops.quote_name
    now_sql, _ = Query(model).get_compiler(connection=connection).compile(Now())
    now_set = "".join(f", {quote(model._meta.get_field(f).column)} = {now_sql}" for f in now_fields)
    if connection.vendor == "postgresql":
        staged = _staging_table(table, columns)
        assignments = ", ".join(f"{c} = v.{c}" for c in columns[:-1])
        _copy(f"COPY {staged} ({', '.join(columns)}) FROM STDIN", rows)
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {table} AS t SET {assignments}{now_set} FROM {staged} AS v"
                f" WHERE t.{columns[-1]} = v.{columns[-1]}"
            )
        return
    assignments = ", ".join(f"{c} = %s" for c in columns[:-1])
    with connection.cursor() as cursor:
        cursor.executemany(f"UPDATE {table} SET {assignments}{now_set} WHERE {columns[-1]} = %s", rows)


def _table(model: type[Model]) -> str:
    return connection.ops.quote_name(model._meta.db_table)


def _columns(model: type[Model], fields: Sequence[str]) -> list[str]:
    return [connection.ops.quote_name(model._meta.get_field(f).column) for f in fields]


def _staging_table(table: str, columns: list[str]) -> str:
    """This connection's temporary table for updates of `columns` of `table`, empty. Named by its
    columns: another caller's set gets a table of its own. ON COMMIT DELETE ROWS empties it at each
    commit; the DELETE, before each use inside one longer transaction (a test's, a caller's)."""
    digest = hashlib.sha256(f"{table}:{','.join(columns)}".encode()).hexdigest()[:10]
    staged = connection.ops.quote_name(f"bulk_{table.strip(chr(34))[:40]}_{digest}")
    with connection.cursor() as cursor:  # two statements, one round trip (no parameters)
        cursor.execute(
            f"CREATE TEMPORARY TABLE IF NOT EXISTS {staged} ON COMMIT DELETE ROWS"
            f" AS SELECT {', '.join(columns)} FROM {table} WITH NO DATA; DELETE FROM {staged}"
        )
    return staged


def _copy(sql: str, rows: Sequence[tuple]) -> None:
    """COPY … FROM STDIN of `rows` through Django's cursor: its errors become Django's
    (DatabaseError: the collector's retry), and it is counted and logged as a query (the tests'
    and the bench's query counts, `connection.queries`)."""
    with (
        connection.cursor() as cursor,
        _logged(cursor, sql, len(rows)),
        connection.wrap_database_errors,
        cursor.cursor.copy(sql) as copy,
    ):
        for row in rows:
            copy.write_row(row)


@contextmanager
def _logged(cursor: object, sql: str, count: int) -> Iterator[None]:
    debug_sql = getattr(cursor, "debug_sql", None)  # CursorDebugWrapper's, while queries are logged
    if debug_sql is None:
        yield
        return
    with debug_sql(f"{sql} ({count} rows)"):
        yield
