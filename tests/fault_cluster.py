"""The fault suite's PostgreSQL (tests/test_faults.py): one throwaway cluster per test process with
a migrated template database holding the demo users, of which each test gets a copy.

The cluster itself starts as a copy of a stopped one kept across runs in
var/test-db-templates/postgres-<key>/ (a data directory, `kept_cluster`), so that neither initdb
nor a migrate from nothing (about 6 s of CPU together) runs in every test process of every run: a
copy is 0.15 s. The first process that finds none makes it, under a lock the others wait on.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

from tests.fault_servers import START_TIMEOUT, Portal, ThrowawayPostgres, own_logs, postgres_bin
from tests.isolation import ROOT, VAR_BASE
from tests.waiting import WaitTimedOut, wait_for

KEPT = VAR_BASE / "test-db-templates"
TEMPLATE = "portal_template"
# What the kept cluster is made of, besides the migrations: the pinned requirements (the third-
# party apps' migrations), the demo users' seed and how this suite makes and prepares a cluster.
SHAPED_BY = (
    "requirements.txt",
    "portal/services.py",
    "portal/management/commands/seed_demo.py",
    "tests/fault_servers.py",
    "tests/fault_cluster.py",
)


def kept_cluster() -> Path:
    """Where the stopped cluster with the migrated template is kept, named by everything that
    shapes it (as tests/kept_database.py's) and by the PostgreSQL server's version."""
    key = hashlib.sha256(str(postgres_bin()).encode())
    for path in [*sorted(ROOT.glob("*/migrations/*.py")), *(ROOT / name for name in SHAPED_BY)]:
        key.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return KEPT / f"postgres-{key.hexdigest()[:16]}"


@contextlib.contextmanager
def _kept_lock() -> Iterator[None]:
    """One process at a time makes, copies or removes a kept cluster (a run's xdist workers, and
    two runs in one checkout)."""
    KEPT.mkdir(parents=True, exist_ok=True)
    with open(KEPT / "postgres.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _keep(kept: Path, *, tag: str, logs: Path) -> None:
    """A new cluster with the migrated, seeded, sealed template, stopped cleanly (a shutdown
    checkpoint: its data directory is whole) and put in place at `kept` in one rename; the kept
    clusters of other migrations (other branches) removed. Under the lock."""
    server = ThrowawayPostgres(tag=tag, name="postgres-kept", logs=logs)
    try:
        server.start()
        Portal.prepare(server.create_database(TEMPLATE), logs)
        server.seal_template(TEMPLATE)
        server.stop("fast")
        partial = kept.with_name(f"{kept.name}.{os.getpid()}.partial")
        subprocess.run(["cp", "-a", str(server.data), str(partial)], check=True, capture_output=True)
        os.replace(partial, kept)
    finally:
        server.close()
    for stale in KEPT.glob("postgres-*"):
        if stale != kept:
            shutil.rmtree(stale, ignore_errors=True)


class TemplateCluster:
    """One ThrowawayPostgres for a whole test session (an xdist worker's), holding a migrated
    template database with the demo users: each test gets a copy of its own (`database`, a file
    copy in the server), instead of initdb and a migrate (a Django start-up) of its own.

    Tests stop, restart and freeze the cluster under their portal: `recover` makes it running,
    thawed and answering again after each, and replaces it with a new one (a copy of the kept
    cluster) when it cannot. `close` stops and reaps it, and deletes it."""

    TEMPLATE = TEMPLATE

    def __init__(self, *, tag: str, logs: Path) -> None:
        self.tag = tag
        self.logs = own_logs(logs, tag)
        self.replaced = 0
        self.server = self._new()

    def _new(self) -> ThrowawayPostgres:
        # A replacement logs beside the one it replaces (postgres-1.log, ...), which keeps its log.
        name = f"postgres-{self.replaced}" if self.replaced else "postgres"
        with _kept_lock():
            kept = kept_cluster()
            if not kept.is_dir():
                _keep(kept, tag=self.tag, logs=self.logs)
            server = ThrowawayPostgres(tag=self.tag, name=name, logs=self.logs, copy_of=kept)
        try:
            server.start()
        except BaseException:
            server.close()
            raise
        return server

    def database(self, name: str) -> str:
        """A new database `name`, a copy of the template: its URL."""
        return self.server.create_database(name, template=self.TEMPLATE)

    def recover(self) -> None:
        """The cluster running, thawed and answering, whatever a test left it as; else a new one."""
        try:
            self.server.thaw()
            if not self.server.running:
                self.server.start()
            wait_for(self.server._ready, timeout=START_TIMEOUT, interval=0.05, what="PostgreSQL to answer")
        except (RuntimeError, OSError, WaitTimedOut) as exc:
            # Said, not hidden: a test that breaks the cluster is worth a look.
            warnings.warn(f"the fault suite's PostgreSQL was replaced: {exc}", stacklevel=2)
            self.server.close()
            self.replaced += 1
            self.server = self._new()

    def drop(self, name: str) -> None:
        """The test's database gone (its portal stopped first: nobody may be connected to it)."""
        self.recover()
        self.server.drop_database(name)

    def close(self) -> None:
        self.server.close()
