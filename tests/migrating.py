"""Migration tests on a database of their own, migrated forwards from nothing.

A test of a data migration needs the schema as it was before it. Migrating the test database
backwards to there renders the whole project's models again for every migration after the target
(Django's `_migrate_all_backwards`): 10 s of CPU a test by now, and more with each migration
added. An empty database migrated forwards to the old state is 0.4 s, and on to today's about 3 s.

`fresh_database()` points the default connection at an empty database for the block (SQLite: a
file of its own; PostgreSQL: a database made beside the test database) and back after it, and
drops it. Only the test's own connection sees it: no live server or worker may run meanwhile.

A module whose tests start at one old state migrates there once: `migrated_template(targets)`
is a module-scoped fixture holding an empty database at `targets`, and
`fresh_database(template=...)` starts each test on a copy of it (SQLite: the file, copied;
PostgreSQL: `CREATE DATABASE ... TEMPLATE`), the rows of one test never seen by the next. The
template is kept across runs as the migrated test database is (tests/kept_database.py), named
by the migrations and the targets.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader

from tests import kept_database
from tests.isolation import VAR_BASE
from tests.kept_database import migrations_digest, sqlite_copy, sqlite_keep

Target = tuple[str, str]
_KEPT = VAR_BASE / "test-db-templates"


@contextlib.contextmanager
def fresh_database(template: str | None = None) -> Iterator[None]:
    """The default connection on an empty database for the block, or on a copy of `template` (a
    name `migrated_template` gave)."""
    settings = connection.settings_dict
    original = settings["NAME"]
    connection.close()
    with tempfile.TemporaryDirectory(prefix="migrating-") as folder:
        if connection.vendor == "sqlite":
            name = str(Path(folder) / "db.sqlite3")
            if template is not None:
                sqlite_copy(template, name)
        else:
            name = f"{original}_migrating"
            _execute(f'DROP DATABASE IF EXISTS "{name}"')
            _execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
        settings["NAME"] = name
        try:
            yield
        finally:
            connection.close()
            settings["NAME"] = original
            if connection.vendor != "sqlite":
                _execute(f'DROP DATABASE IF EXISTS "{name}"')


def migrated_template(targets: list[Target]) -> Callable[..., Iterator[str]]:
    """A module-scoped fixture: an empty database migrated forwards to `targets`, made once for
    the module's tests to copy (`fresh_database(template=...)`), and kept. The database is
    reached only while making it."""

    @pytest.fixture(scope="module")
    def fixture(django_db_setup, django_db_blocker) -> Iterator[str]:  # type: ignore[no-untyped-def]
        if connection.vendor == "sqlite":
            with django_db_blocker.unblock():
                name = _template_make(targets)
            yield name
            return
        # Its "use" lock from before it is made or found until the module's tests have copied it:
        # no other run drops it meanwhile, not even between the make lock and the first copy.
        name = kept_database.postgres_kept_name(_suffix(targets))
        with kept_database.postgres_use(connection.settings_dict, name):
            with django_db_blocker.unblock():
                _template_make(targets)
            yield name

    return fixture


def _template_make(targets: list[Target]) -> str:
    """Kept across runs beside the migrated test database, named by the migrations and the
    targets (made again when either changes): SQLite's a file, PostgreSQL's a database on the
    server, made by one process while the others wait on its lock."""
    settings = connection.settings_dict
    suffix = _suffix(targets)
    if connection.vendor == "sqlite":
        name = str(_KEPT / f"migrated-{suffix}-{migrations_digest()}.sqlite3")
        if not Path(name).exists():
            with fresh_database():
                migrate(targets)
                connection.close()
                sqlite_keep(settings["NAME"], Path(name))
        return name
    name = kept_database.postgres_kept_name(suffix)
    with kept_database.postgres_lock(settings, name) as made:
        if not made:
            with fresh_database():
                migrate(targets)
                connection.close()
                # The migrated database becomes the template, whole: renamed, not copied.
                _execute(f'ALTER DATABASE "{settings["NAME"]}" RENAME TO "{name}"')
    return name


def _suffix(targets: list[Target]) -> str:
    return hashlib.sha256(repr(sorted(targets)).encode()).hexdigest()[:8]


def _execute(sql: str) -> None:
    with connection._nodb_cursor() as cursor:
        cursor.execute(sql)


def migrate(targets: list[Target] | None = None) -> MigrationExecutor:
    """The database at `targets` (None: today's leaves); a new executor, as each run needs."""
    executor = MigrationExecutor(connection)
    executor.migrate(targets if targets is not None else executor.loader.graph.leaf_nodes())
    return executor


def leaves(*apps: str) -> list[Target]:
    """Today's newest migration of each of `apps`: a target that migrates those apps (and what
    they depend on) to today and leaves the others where they are."""
    return [node for node in MigrationLoader(None).graph.leaf_nodes() if node[0] in apps]


def models_at(targets: list[Target]):  # type: ignore[no-untyped-def]
    """The historical models (an Apps) at `targets`. Rendered once per process for each
    `targets`: a test writes rows with them, never changes them."""
    return _models_at(tuple(targets))


@functools.cache
def _models_at(targets: tuple[Target, ...]):  # type: ignore[no-untyped-def]
    return MigrationLoader(None).project_state(list(targets)).apps
