"""DCGM exporter's job mapping: which portal jobs and sessions run on each GPU of this host, so the
`hpc_job` label of DCGM's series names them (docs/integrations.md, "DCGM job mapping").

What DCGM exporter reads (NVIDIA/dcgm-exporter, internal/pkg/transformation/hpc.go, `hpcMapper`,
on when it runs with `--hpc-job-mapping-dir DIR` or DCGM_HPC_JOB_MAPPING_DIR=DIR): on every scrape
it lists DIR and takes each regular file whose name parses as an integer (`strconv.Atoi`) as a GPU
index, the same string as its `gpu` label; every line of that file is one job, and each series of
that GPU is exported once per line with `hpc_job="<the line>"`. Files with other names are skipped
(so our lock file and temporary files are never read), and a GPU without a file has no `hpc_job`.

What we write there, with DCGM_HPC_JOB_MAPPING_DIR set to the same folder on the GPU host: one file
per GPU index with a job or session on it, one line each, `job-<id>` or `session-<id>` (the
portal's Job and InteractiveSession ids: the prefix keeps a job and a session of the same number
apart). Two jobs on one shared card are two lines, so DCGM exports that card's series twice, once
per job. A file goes as soon as nothing runs on its index.

When it is written:
- the worker's runner adds a job when its process starts and takes it out when it ends, and the
  JupyterLab supervisor does the same for a lab (`work_started`, `work_ended`): at once, and the
  end without the database, which may be away just then. The end is taken out once more after the
  row records it, in case a refresh read the row between the two;
- every REFRESH_SECONDS, from the host's watchdog round, and when the worker starts, the folder is
  rebuilt from the database (`DcgmMapping`, the worker's for its life): the running jobs and the
  active sessions on this host. That is how `gpu exec` and `gpu shell` sessions are found (they run
  in the user's terminal, not under the worker, which learns of them only through their rows), and
  how a worker killed in the middle of a job leaves no file behind for longer than one refresh.

Each change is made under an flock on DIR/.portal.lock (the worker's pool processes and its
reporter thread all write here) and each file is replaced whole (a temporary file and a rename),
so DCGM never reads half a file. Nothing here ever fails a job, a lab or a watchdog round: an error
is logged and the next refresh puts the folder right.

The worker writes here as root, and the files are world-readable: DIR and every folder above it
must be root's or the worker's and writable by nobody else (jobs.host.folders.worker_folder_open,
checked at the worker's start and at every change), and every file in DIR, the lock too, is
opened O_NOFOLLOW through a descriptor of DIR and used only if it is a regular file of the
worker's. A link or someone else's file at an index is never read (its text never lands in a
mapping) and is replaced by a rename, which never follows it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path

from django.conf import settings
from django.db import DatabaseError

from gpus.models import GPU
from jobs.host.folders import FolderError, own_file_open, own_file_read, own_file_replace, worker_folder_open
from jobs.models import InteractiveSession, Job
from portal.clock import db_now, since

log = logging.getLogger(__name__)

REFRESH_SECONDS = 15  # how stale a file may get when a hook was missed (a killed worker, a gpu exec)
LOCK_NAME = ".portal.lock"  # no integer: DCGM exporter skips it
RUNNING_JOBS = (Job.Status.STARTING, Job.Status.RUNNING)


def job_name(pk: int) -> str:
    return f"job-{pk}"


def session_name(pk: int) -> str:
    return f"session-{pk}"


def mapping_dir() -> Path | None:
    """The folder, or None when the mapping is off (DCGM_HPC_JOB_MAPPING_DIR empty)."""
    return Path(settings.DCGM_HPC_JOB_MAPPING_DIR) if settings.DCGM_HPC_JOB_MAPPING_DIR else None


def mapping_check() -> None:
    """For the host worker's start: the folder is safe to write (made if missing), or FolderError."""
    if (folder := mapping_dir()) is not None:
        os.close(_folder_open(folder))


# --- the hooks -----------------------------------------------------------------------------------


def work_started(name: str, gpu_uuids: Iterable[str]) -> None:
    """`name` (job_name / session_name) now runs on these cards: added to their indices' files."""
    folder = mapping_dir()
    if folder is None:
        return
    try:
        indices = set(GPU.objects.filter(uuid__in=list(gpu_uuids)).values_list("index", flat=True))
        with _locked(folder) as dir_fd:
            for index in indices:
                _write(dir_fd, index, _read(dir_fd, str(index)) | {name})
    except (DatabaseError, OSError) as exc:
        log.warning("DCGM job mapping: could not add %s (%s); the next refresh will", name, exc)


def work_ended(name: str) -> None:
    """`name` no longer runs: out of every file, with no database (it may be away as a job ends)."""
    folder = mapping_dir()
    if folder is None:
        return
    try:
        with _locked(folder) as dir_fd:
            for index, file_name in _index_files(dir_fd).items():
                names = _read(dir_fd, file_name)
                if name in names:
                    _write(dir_fd, index, names - {name})
    except OSError as exc:
        log.warning("DCGM job mapping: could not remove %s (%s); the next refresh will", name, exc)


class DcgmMapping:
    """This host's mapping folder as its worker keeps it, for the worker's life (jobs.signals.HostWorker
    makes one, its watchdog refreshes it): when the worker started, when the folder was last
    rebuilt, and whether rebuilding fails (said once). A second worker, or a test, starts from
    nothing."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.worker_started_at: datetime | None = (
            None  # jobs that beat only before it ran under a dead worker
        )
        self.refreshed_at = float("-inf")
        self.refresh_failing = False

    def start(self) -> None:
        """When the host's worker starts (after jobs.host.worker.kill_orphans): what a killed
        worker left goes. Its jobs' rows may still say RUNNING for up to JOB_LOST_AFTER_SECONDS,
        but nothing has beaten for them since this worker started, so they are left out from now on."""
        if mapping_dir() is None:
            return
        try:
            self.worker_started_at = db_now()  # compared with heartbeats: the database's clock (portal.clock)
            self.rebuild()
        except (DatabaseError, OSError) as exc:
            log.warning("DCGM job mapping: could not rebuild %s at start (%s)", mapping_dir(), exc)

    def refresh(self) -> None:
        """The periodic rebuild, at most every REFRESH_SECONDS (the host's watchdog calls it each
        round); never raises. A failure is logged once until a refresh works again, not every time."""
        if mapping_dir() is None or time.monotonic() - self.refreshed_at < REFRESH_SECONDS:
            return
        self.refreshed_at = time.monotonic()
        try:
            self.rebuild()
        except (DatabaseError, OSError) as exc:
            if not self.refresh_failing:
                log.warning("DCGM job mapping: could not refresh %s (%s); trying again", mapping_dir(), exc)
            self.refresh_failing = True
            return
        if self.refresh_failing:
            log.warning("DCGM job mapping: %s refreshed again", mapping_dir())
        self.refresh_failing = False

    def rebuild(self) -> dict[int, set[str]]:
        return mapping_rebuild(self.server, worker_started_at=self.worker_started_at)


def mapping_rebuild(server: str, *, worker_started_at: datetime | None = None) -> dict[int, set[str]]:
    """Make the folder say exactly what the database says runs on `server`: its STARTING and
    RUNNING jobs (that beat since `worker_started_at`) and its active sessions, by the index of
    each of their cards. Returns that map.
    Read and written under the lock, so no hook's change lands between the read and the write."""
    folder = mapping_dir()
    if folder is None:
        return {}
    with _locked(folder) as dir_fd:
        wanted = mapping_from_database(server, worker_started_at=worker_started_at)
        for index, name in _index_files(dir_fd).items():
            if index not in wanted:
                os.unlink(name, dir_fd=dir_fd)  # the name itself: a link is never followed
        for index, names in wanted.items():
            _write(dir_fd, index, names)
    return wanted


def mapping_from_database(server: str, *, worker_started_at: datetime | None = None) -> dict[int, set[str]]:
    """GPU index → the names running on it: three queries, whatever the number of jobs. A job
    counts while its worker beats for it (the reconciler's rule for LOST), and only if it beat since
    this worker started (`worker_started_at`, when known)."""
    indices = dict(GPU.objects.filter(server__name=server).values_list("uuid", "index"))
    jobs = Job.objects.filter(
        server__name=server, status__in=RUNNING_JOBS, heartbeat_at__gte=since(settings.JOB_LOST_AFTER_SECONDS)
    )
    if worker_started_at is not None:
        jobs = jobs.filter(heartbeat_at__gte=worker_started_at)
    work = [(job_name(pk), uuids) for pk, uuids in jobs.values_list("pk", "gpu_uuids")]
    work += [
        (session_name(pk), uuids)
        for pk, uuids in InteractiveSession.objects.filter(
            server__name=server, status__in=InteractiveSession.ACTIVE
        ).values_list("pk", "gpu_uuids")
    ]
    wanted: dict[int, set[str]] = {}
    for name, uuids in work:
        for uuid in uuids or ():
            if uuid in indices:
                wanted.setdefault(indices[uuid], set()).add(name)
    return wanted


# --- the files -----------------------------------------------------------------------------------


def _folder_open(folder: Path) -> int:
    return worker_folder_open(folder, "DCGM_HPC_JOB_MAPPING_DIR", mode=0o755)


@contextmanager
def _locked(folder: Path) -> Iterator[int]:
    """A descriptor of the folder, checked, with its lock held."""
    dir_fd = _folder_open(folder)
    try:
        lock = own_file_open(dir_fd, LOCK_NAME, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield dir_fd
        finally:
            os.close(lock)  # the lock goes with it
    finally:
        os.close(dir_fd)


def _index_files(dir_fd: int) -> dict[int, str]:
    """The names DCGM exporter would read: those of an integer, whatever they are (a link there
    is not ours either, and goes like a stale file)."""
    found = {}
    for name in os.listdir(dir_fd):
        if name.isdigit() and not stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            found[int(name)] = name
    return found


def _read(dir_fd: int, name: str) -> set[str]:
    """The names in the worker's own file `name`; none for a file that is not its own (a link,
    someone else's: said in the log, never read, and replaced at the next write)."""
    try:
        data = own_file_read(dir_fd, name)
    except FolderError as exc:
        log.warning(
            "DCGM job mapping: %s (in %s); never read, and replaced at its next write", exc, mapping_dir()
        )
        return set()
    text = (data or b"").decode(errors="replace")
    return {line.strip() for line in text.splitlines() if line.strip()}


def _sort_key(name: str) -> tuple[str, int]:
    kind, _, number = name.rpartition("-")
    return (kind, int(number)) if number.isdigit() else (name, 0)


def _write(dir_fd: int, index: int, names: set[str]) -> None:
    """The index's file holding `names` (none: no file), replaced whole; untouched if the
    worker's own file already says so, so DCGM's reads and the file's mtime only change with the
    work on the card."""
    name = str(index)
    if not names:
        with suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)  # the name itself: a link is never followed
        return
    text = "".join(f"{n}\n" for n in sorted(names, key=_sort_key)).encode()
    with suppress(FolderError):
        if own_file_read(dir_fd, name) == text:
            return
    own_file_replace(dir_fd, name, text, mode=0o644)  # DCGM exporter often runs as another account
