"""The migrated test database, made once and copied by every test process (conftest's
`django_db_keepdb` and `django_db_setup`).

A full migrate is about 6 s of CPU (12 s of a loaded machine's wall time), and every test
process of a run used to make its own: four migrates at the start of each `make test`, all but
one for nothing. Now the first process to get there migrates while the others wait on a lock,
and everyone else copies what it made:

- **SQLite**: the migrated file, kept across runs under VAR_BASE, named by the migrations and
  the pinned requirements (`migrations_digest`); copied into each process's own folder. The
  lock is a file lock beside it.
- **PostgreSQL**: a database on the server, `<name>_migrated_<digest>` (`test_migrated_…` in
  CI), kept across runs on that server; each process's own test database is made from it with
  `CREATE DATABASE … TEMPLATE`, which Django's test set-up does when TEST["TEMPLATE"] is set
  (its migrate then finds nothing to do). The lock is an advisory lock on the server, so two
  checkouts sharing one server share it too. The template is made under a name of its own and
  renamed when whole: a name that exists is a finished template.

Whoever makes it holds the lock from before its migrate until the copy is in place, so no
process copies half a database or migrates while another does. A process waits for it at most
LOCK_WAIT_SECONDS (a maker whose set-up failed holds it until its run ends), then migrates its
own as before. A process copying a PostgreSQL template holds a shared "use" lock on it
meanwhile; templates of other migrations (other branches, older commits) are dropped when a new
one is made, but never one somebody is copying.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
from django.db import connection
from psycopg import sql

from tests.isolation import ROOT, VAR_BASE

LOCK_WAIT_SECONDS = 120

# Held by the process that is making the template, from the decision to its end.
_making: dict[str, object] = {}
# The configured PostgreSQL database's name, read before Django's test set-up puts the test
# database's name in its place: every kept template's name starts with it.
_configured: dict[str, str] = {}


@functools.cache  # one per process: a migration edited during a run never renames its template
def migrations_digest() -> str:
    """A digest of everything that shapes a migrated database: the project's migrations and the
    pinned requirements (the third-party apps' migrations)."""
    key = hashlib.sha256()
    for path in [*sorted(ROOT.glob("*/migrations/*.py")), ROOT / "requirements.txt"]:
        key.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return key.hexdigest()[:16]


def sqlite_template() -> Path:
    return VAR_BASE / "test-db-templates" / f"sqlite-{migrations_digest()}.sqlite3"


def remember(database: dict) -> None:
    """The configured PostgreSQL database's name, before Django's test set-up replaces it with
    the test database's (conftest's django_db_modify_db_settings)."""
    _configured.setdefault("name", database["NAME"])


def _prefix() -> str:
    # At most 20 characters of the configured name: with the digest, a module's suffix and
    # "_partial", 63 bytes, PostgreSQL's limit (a longer name is cut, silently).
    return f"{_configured['name'][:20]}_migrated_"


def postgres_kept_name(suffix: str = "") -> str:
    """A kept PostgreSQL template's name: the migrated test database's, or with `suffix` (8
    characters) a migration test module's (tests/migrating.py). It starts with the configured
    database's name, so two projects' tests on one server never share one."""
    name = _prefix() + migrations_digest() + (f"_{suffix}" if suffix else "")
    assert len(f"{name}_partial".encode()) <= 63, name
    return name


@contextlib.contextmanager
def postgres_lock(database: dict, name: str) -> Iterator[bool]:
    """Holding the advisory lock on the kept template `name` (for every process and checkout
    using the server): whether it is made. Made by the block if not, under that name, renamed
    into it when whole. Raises LockNotAvailable after LOCK_WAIT_SECONDS."""
    with _server(database) as server:
        _advisory_lock(server, name)
        yield _exists(server, name)


def postgres_use(database: dict, name: str) -> psycopg.Connection:
    """A connection holding the shared "use" lock on the template `name`: no run drops it while
    the connection is open (close it once the copies are made)."""
    server = _server(database)
    # Held exclusively only for a moment, by a run dropping the template; never waited on forever.
    server.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(f"{LOCK_WAIT_SECONDS}s")))
    server.execute("SELECT pg_advisory_lock_shared(hashtext(%s))", [f"use:{name}"])
    return server


def copy_or_make(database: dict) -> bool:
    """Before Django's test set-up: True when the test database was copied from the kept one
    (set up with keepdb, nothing to migrate); False when Django must make it, from the kept
    PostgreSQL template where there is one, or migrated (this process then keeps it: `keep`)."""
    if database["ENGINE"].endswith("sqlite3"):
        return _sqlite_copy_or_make(database)
    _postgres_template_or_make(database)
    return False


def keep(database: dict) -> None:
    """After Django's test set-up, in the process that migrated: its database becomes the kept
    one, and the others waiting on the lock go on."""
    if using := _making.pop("using", None):
        using.close()  # type: ignore[attr-defined] - the copy is made
    if "sqlite" in _making:
        lock = _making.pop("sqlite")
        try:
            sqlite_keep(connection.settings_dict["NAME"], sqlite_template())
        finally:
            lock.close()  # type: ignore[attr-defined]
    elif "postgres" in _making:
        server = _making.pop("postgres")
        try:
            _postgres_keep(server, database)  # type: ignore[arg-type]
        finally:
            server.close()  # type: ignore[attr-defined]


# --- SQLite ------------------------------------------------------------------------------------


def _sqlite_copy_or_make(database: dict) -> bool:
    template = sqlite_template()
    template.parent.mkdir(parents=True, exist_ok=True)
    lock = open(template.with_name(template.name + ".lock"), "a")  # noqa: SIM115 - held until keep()
    deadline = time.monotonic() + LOCK_WAIT_SECONDS
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                lock.close()
                return False  # migrate this process's own, keep nothing
            time.sleep(0.1)
    if template.exists():
        lock.close()
        try:
            shutil.copyfile(template, database["TEST"]["NAME"])
        except FileNotFoundError:  # removed by a run with other migrations since: migrate
            return False
        return True
    _making["sqlite"] = lock
    return False


def sqlite_keep(source: str, kept: Path) -> None:
    """The SQLite database `source` copied to `kept`, put in place in one rename (processes racing
    here each write their own file; the last rename wins, with the same content); the files of
    other migrations of the same name's stem removed."""
    kept.parent.mkdir(parents=True, exist_ok=True)
    partial = kept.with_name(f"{kept.name}.{os.getpid()}.partial")
    sqlite_copy(source, str(partial))
    os.replace(partial, kept)
    for stale in kept.parent.glob(kept.name.rsplit("-", 1)[0] + "-*.sqlite3"):
        if stale != kept:
            stale.unlink(missing_ok=True)


def sqlite_copy(source: str, target: str) -> None:
    """SQLite's online backup: the whole database, whatever is still in its write-ahead log. The
    source opened without creating it (mode=rw, not read-only: that would leave its WAL files
    behind): one gone meanwhile is an error, not an empty file made in its place, which
    the next runs would take as the template from then on."""
    read = sqlite3.connect(f"{Path(source).resolve().as_uri()}?mode=rw", uri=True)
    write = sqlite3.connect(target)
    try:
        read.backup(write)
    finally:
        read.close()
        write.close()


# --- PostgreSQL --------------------------------------------------------------------------------


def _server(database: dict) -> psycopg.Connection:
    """A connection to the server's maintenance database, as the test database's user."""
    return psycopg.connect(
        dbname="postgres",
        user=database.get("USER") or None,
        password=database.get("PASSWORD") or None,
        host=database.get("HOST") or None,
        port=database.get("PORT") or None,
        autocommit=True,
        connect_timeout=10,
    )


def _exists(server: psycopg.Connection, name: str) -> bool:
    return server.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone() is not None


def _advisory_lock(server: psycopg.Connection, name: str) -> None:
    """Held until `server` closes."""
    server.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(f"{LOCK_WAIT_SECONDS}s")))
    server.execute("SELECT pg_advisory_lock(hashtext(%s))", [name])


def _postgres_template_or_make(database: dict) -> None:
    remember(database)
    name = postgres_kept_name()
    server = _server(database)
    try:
        _advisory_lock(server, name)
    except psycopg.errors.LockNotAvailable:
        server.close()
        return  # migrate this process's own, keep nothing
    if _exists(server, name):
        _making["using"] = postgres_use(database, name)  # until Django's set-up has copied it
        server.close()  # the make lock with it
        database["TEST"]["TEMPLATE"] = name
        return
    _making["postgres"] = server


def _postgres_keep(server: psycopg.Connection, database: dict) -> None:
    from django.db import connections

    name = postgres_kept_name()
    partial = f"{name}_partial"
    # CREATE DATABASE … TEMPLATE needs the source without sessions: this process's own.
    for alias in connections:
        connections[alias].close()
    own = database["TEST"]["NAME"]
    server.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(partial)))
    server.execute(
        sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(partial), sql.Identifier(own))
    )
    rename = sql.SQL("ALTER DATABASE {} RENAME TO {}")
    server.execute(rename.format(sql.Identifier(partial), sql.Identifier(name)))
    # Other migrations' templates (older commits, other branches), the migration test modules'
    # included: dropped where nobody is copying one (its "use" lock free) nor making one.
    for (stale,) in server.execute(
        "SELECT datname FROM pg_database WHERE starts_with(datname, %s) AND NOT starts_with(datname, %s)"
        " AND NOT datname LIKE '%%\\_partial'",
        [_prefix(), name],
    ).fetchall():
        use = f"use:{stale}"
        if server.execute("SELECT pg_try_advisory_lock(hashtext(%s))", [use]).fetchone()[0]:
            with contextlib.suppress(psycopg.Error):
                server.execute(sql.SQL("DROP DATABASE {}").format(sql.Identifier(stale)))
            server.execute("SELECT pg_advisory_unlock(hashtext(%s))", [use])
