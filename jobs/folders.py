"""Each job's own folder, made by the worker where no job can plant anything.

A job runs as JOB_USER (one account for all jobs, or each owner's own), and the job roots
(JOB_ROOTS) are folders such accounts can write. The worker, meanwhile, holds CAP_CHOWN and
CAP_SETUID. Any path a job could have prepared is therefore a trap for the worker: a symlink
planted at the next job's folder name makes a `mkdir(exist_ok=True)` succeed, a write go
through it and a `chown` hand its target (/etc, the portal's code) to the job's account.

So the rule, by construction rather than by checking paths:

- job folders live under JOB_FOLDERS, a tree that only the worker (or root) can write: every
  folder on the way is checked when a folder is made (owned by root or the worker, writable by
  nobody else unless sticky), and JOB_FOLDERS itself must be the worker's and mode 0711 or
  stricter in what others may do;
- each folder is made fresh with `mkdir` (mode 0700) through a descriptor of JOB_FOLDERS, and
  everything after goes through a descriptor of that new folder opened O_NOFOLLOW|O_DIRECTORY:
  the upload is created with O_CREAT|O_EXCL|O_NOFOLLOW, and `fchown` hands the folder and the
  upload to the job's account. No path is looked up twice;
- anything a job chose (its script_path, its working directory) is entered only by the job's
  own process, after it has dropped the worker's privileges (portal.processes): the worker
  itself never opens, writes or changes it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.utils import timezone

log = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class JobFolderError(Exception):
    """The job's folder cannot be made safely here; the message says what to fix."""


@dataclass(frozen=True)
class JobFolder:
    path: Path
    moved_aside: str | None  # a leftover of the same name (an earlier database's job), renamed


def plain_file_name(name: str) -> bool:
    """A name that stays inside the folder it is created in: one component, no control chars."""
    return (
        bool(name)
        and name not in (".", "..")
        and "/" not in name
        and not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in name)
    )


def _others_may_write(st: os.stat_result) -> bool:
    """True when someone other than root or the worker may add or replace entries here."""
    if st.st_mode & stat.S_ISVTX:  # sticky (/tmp): others may add names, never replace ours
        return False
    if st.st_mode & stat.S_IWOTH:
        return True
    return bool(st.st_mode & stat.S_IWGRP) and st.st_gid not in (0, os.getegid())


def _check_tree(root: Path) -> None:
    """Every folder above JOB_FOLDERS is root's or the worker's and writable by nobody else.

    A writable ancestor would let someone swap the path of JOB_FOLDERS itself."""
    me = os.geteuid()
    for folder in reversed(root.parents):
        try:
            st = os.lstat(folder)
        except OSError as exc:
            raise JobFolderError(f"Cannot check {folder} above JOB_FOLDERS ({root}): {exc}") from None
        if stat.S_ISLNK(st.st_mode):
            raise JobFolderError(
                f"{folder}, above JOB_FOLDERS ({root}), is a symlink: give JOB_FOLDERS as a real path."
            )
        if st.st_uid not in (0, me) or _others_may_write(st):
            raise JobFolderError(
                f"{folder}, above JOB_FOLDERS ({root}), may be written by others (owner uid {st.st_uid},"
                f" mode {stat.S_IMODE(st.st_mode):o}): put JOB_FOLDERS in a tree only root and the worker"
                " can write."
            )


def _open_root(root: Path) -> int:
    """A descriptor of JOB_FOLDERS, made (mode 0711) on first use, and checked to be the worker's."""
    _check_tree(root)
    try:
        made = False
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, 0o711)
            made = True
        fd = os.open(root, _DIR_FLAGS)
    except OSError as exc:
        raise JobFolderError(
            f"Cannot open JOB_FOLDERS ({root}) as a real folder: {exc.strerror}. It must be a folder of"
            " the worker's own, not a symlink."
        ) from None
    st = os.fstat(fd)
    if made and st.st_uid == os.geteuid():
        os.fchmod(fd, 0o711)  # whatever the umask: job accounts must pass through to their folder
        st = os.fstat(fd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
        os.close(fd)
        raise JobFolderError(
            f"JOB_FOLDERS ({root}) must belong to the worker's account (uid {os.geteuid()}) and be"
            f" writable by it alone; it has owner uid {st.st_uid} and mode {stat.S_IMODE(st.st_mode):o}."
            f" Fix: chown {os.geteuid()} {root} && chmod 0711 {root}"
        )
    return fd


def job_folder_make(
    job_id: int, *, upload: tuple[str, str] | None, account: pwd.struct_passwd | None
) -> JobFolder:
    """Make `<JOB_FOLDERS>/job-<id>` fresh, write `upload` (name, text) into it, and hand both
    to `account` (None: they stay the worker's, which is then also the job's account).

    A folder of that name can only be the worker's own leftover (JOB_FOLDERS is the worker's
    alone): one from a database that has since been reset, whose job ids start again. It is
    renamed aside, never reused or followed, and the new folder is made with `mkdir`, which
    refuses any name that exists."""
    root = Path(settings.JOB_FOLDERS)
    name = f"job-{job_id}"
    if upload is not None and not plain_file_name(upload[0]):
        raise JobFolderError(f"The script's name {upload[0]!r} is not a plain file name.")
    root_fd = _open_root(root)
    if account is not None and not os.fstat(root_fd).st_mode & stat.S_IXOTH:
        os.close(root_fd)
        raise JobFolderError(
            f"JOB_FOLDERS ({root}) does not let the job's account {account.pw_name} through to its"
            f" folder: chmod 0711 {root}"
        )
    try:
        moved_aside = _mkdir_fresh(root_fd, name)
        folder_fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
        try:
            if upload is not None:
                _write_new(folder_fd, upload[0], upload[1].encode(), account)
            if account is not None:
                # After the upload: a worker that is not root could not write there once it is theirs.
                os.fchown(folder_fd, account.pw_uid, account.pw_gid)
        finally:
            os.close(folder_fd)
    except OSError as exc:
        raise JobFolderError(f"Cannot make the job's folder {root / name}: {exc}") from None
    finally:
        os.close(root_fd)
    return JobFolder(path=root / name, moved_aside=moved_aside)


def _mkdir_fresh(root_fd: int, name: str) -> str | None:
    moved = None
    try:
        os.mkdir(name, 0o700, dir_fd=root_fd)
    except FileExistsError:
        moved = f"{name}.earlier-{timezone.now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
        os.rename(name, moved, src_dir_fd=root_fd, dst_dir_fd=root_fd)  # renames a link, never its target
        log.info("%s existed already (an earlier database's job): renamed to %s", name, moved)
        os.mkdir(name, 0o700, dir_fd=root_fd)  # FileExistsError again: a race nobody should win
    return moved


def _write_new(folder_fd: int, name: str, data: bytes, account: pwd.struct_passwd | None) -> None:
    fd = os.open(name, _NEW_FILE_FLAGS, 0o600, dir_fd=folder_fd)
    try:
        if account is not None:
            os.fchown(fd, account.pw_uid, account.pw_gid)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
