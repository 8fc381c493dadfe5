"""A transactional test's flush, cheaper on both counts where it was dear.

After each transactional test (about 360 of them), Django's TransactionTestCase flushes every
table and then emits post_migrate:

- **The emptying.** On PostgreSQL Django empties the tables with one `TRUNCATE` of all of them,
  which gives each table, index and TOAST table new files and drops the old ones at commit:
  0.4-0.8 s of the server's time a test on a VM's disk, against 30 ms for a `DELETE` of each
  table's few test rows. So the test database is emptied with `DELETE`s, in one transaction
  that first locks the tables against writers as `TRUNCATE` did, its foreign keys checked at
  the commit (Django makes them all `DEFERRABLE INITIALLY DEFERRED`): every table ends as
  empty as `TRUNCATE` leaves it, and sequences go on counting in both. Where Django's flush
  would do more (reset the sequences, or CASCADE for a test's `available_apps`), it runs.
- **The registry.** post_migrate's receivers (contenttypes' and auth's, the only ones here) make
  every content type and permission again: 35 ms of CPU a test. What they make is what migrate
  made for the same models, so those rows are put back as they were, ids included, from a copy
  taken once per test process; anything else (another database, a process without them) gets
  Django's own post_migrate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from django.db import DEFAULT_DB_ALIAS, transaction


def _deleting_flush(real):  # type: ignore[no-untyped-def]
    """flush's `sql_flush`, with `DELETE`s for `TRUNCATE` on PostgreSQL (module docstring)."""

    def sql_flush(style, connection, reset_sequences=True, allow_cascade=False) -> list[str]:  # type: ignore[no-untyped-def]
        if connection.vendor != "postgresql" or reset_sequences or allow_cascade:
            # Django's own: sequences back to 1, or (a test's `available_apps`) a CASCADE into
            # tables of other apps, which DELETEs of these tables alone would not empty.
            return real(style, connection, reset_sequences=reset_sequences, allow_cascade=allow_cascade)
        tables = sorted(connection.introspection.django_table_names(only_existing=True, include_views=False))
        names = [connection.ops.quote_name(table) for table in tables]
        # SHARE: what TRUNCATE's lock did against writers, without stopping readers. The flush
        # waits for a transaction still writing (a server thread's, a worker's) and holds off new
        # ones until its commit, so no row is left behind and no child row slips in between two
        # DELETEs to fail the foreign keys' check.
        lock = f"LOCK TABLE {', '.join(names)} IN SHARE MODE"
        return ["SET CONSTRAINTS ALL DEFERRED", lock, *(f"DELETE FROM {name}" for name in names)]

    return sql_flush


@contextlib.contextmanager
def registry_restored_after_flush(django_db_blocker) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """For the block: the flush command's tables emptied with DELETEs on PostgreSQL, and its
    post_migrate replaced by the copy's rows, read from the test database on entry."""
    from django.contrib.auth.models import Permission
    from django.contrib.contenttypes.models import ContentType
    from django.core.management.commands import flush

    with django_db_blocker.unblock():
        content_types, permissions = list(ContentType.objects.all()), list(Permission.objects.all())
    real, real_sql_flush = flush.emit_post_migrate_signal, flush.sql_flush

    def emit(verbosity: int, interactive: bool, db: str, **kwargs: object) -> None:
        if db != DEFAULT_DB_ALIAS or not content_types:
            real(verbosity, interactive, db, **kwargs)
            return
        with transaction.atomic(using=db):
            ContentType.objects.using(db).bulk_create(content_types)
            Permission.objects.using(db).bulk_create(permissions)
        ContentType.objects.clear_cache()  # as contenttypes' receiver does

    flush.emit_post_migrate_signal = emit
    flush.sql_flush = _deleting_flush(real_sql_flush)
    try:
        yield
    finally:
        flush.emit_post_migrate_signal = real
        flush.sql_flush = real_sql_flush
