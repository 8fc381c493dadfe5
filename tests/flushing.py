"""A transactional test's flush, without making the content types and permissions again.

After each transactional test, Django's TransactionTestCase flushes every table and then emits
post_migrate, whose receivers (contenttypes' and auth's, the only ones here) make every content
type and permission again: 35 ms of CPU a test, with about 360 such tests. What they make is
what migrate made for the same models, so `registry_restored_after_flush` puts those rows back
as they were, ids included, from a copy taken once per test process; anything else (another
database, a process without them) gets Django's own post_migrate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from django.db import DEFAULT_DB_ALIAS, transaction


@contextlib.contextmanager
def registry_restored_after_flush(django_db_blocker) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """For the block: the flush command's post_migrate replaced by the copy's rows, read from
    the test database on entry."""
    from django.contrib.auth.models import Permission
    from django.contrib.contenttypes.models import ContentType
    from django.core.management.commands import flush

    with django_db_blocker.unblock():
        content_types, permissions = list(ContentType.objects.all()), list(Permission.objects.all())
    real = flush.emit_post_migrate_signal

    def emit(verbosity: int, interactive: bool, db: str, **kwargs: object) -> None:
        if db != DEFAULT_DB_ALIAS or not content_types:
            real(verbosity, interactive, db, **kwargs)
            return
        with transaction.atomic(using=db):
            ContentType.objects.using(db).bulk_create(content_types)
            Permission.objects.using(db).bulk_create(permissions)
        ContentType.objects.clear_cache()  # as contenttypes' receiver does

    flush.emit_post_migrate_signal = emit
    try:
        yield
    finally:
        flush.emit_post_migrate_signal = real
