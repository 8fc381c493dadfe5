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

The worker's other folders, JOB_SPOOL_DIR (jobs/host/spool.py) and DCGM_HPC_JOB_MAPPING_DIR
(jobs/host/dcgm.py), follow the same rule through the same code (`worker_folder_open`): the folder
and every folder above it root's or the worker's and writable by nobody else, every file in
them opened O_NOFOLLOW through a descriptor of the folder and checked to be a regular file of
the worker's (`own_file_open`), and replaced whole by a fresh temporary file and a rename
(`own_file_replace`). The host worker checks all three when it starts, and the account its jobs
run as can pass through to JOB_FOLDERS (`job_folders_check`), and refuses to start otherwise
(jobs.host.worker.host_worker_check).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pwd
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from portal.accounts import JOB_USER_OWNER

log = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class FolderError(OSError):
    """A folder the worker writes into, or a file in it, is not safe to use; the message says
    what to fix. An OSError, so every caller that copes with a folder it cannot write (a log
    line, the next refresh) copes with this one alike."""


class JobFolderError(FolderError):
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


def _check_tree(path: Path, setting: str) -> None:
    """Every folder above `path` (the folder `setting` names) is root's or the worker's and
    writable by nobody else; one that is missing is made (mode 0755) and then checked alike.

    A writable folder above would let someone swap the path of the folder itself."""
    me = os.geteuid()
    for folder in reversed(path.parents):
        try:
            st = _lstat_or_make(folder)
        except OSError as exc:
            raise FolderError(
                f"Cannot check {folder} above {setting} ({path}): {exc.strerror}. Fix: make {folder}"
                f" (root's or the worker's, mode 0755), or give {setting} a folder on a writable disk"
            ) from None
        if stat.S_ISLNK(st.st_mode):
            raise FolderError(
                f"{folder}, above {setting} ({path}), is a symlink: give {setting} as a real path."
            )
        if st.st_uid not in (0, me) or _others_may_write(st):
            raise FolderError(
                f"{folder}, above {setting} ({path}), may be written by others (owner uid {st.st_uid},"
                f" mode {stat.S_IMODE(st.st_mode):o}): put {setting} in a tree only root and the worker"
                f" can write, or fix that folder: chown root {folder} && chmod go-w {folder}"
            )


def _lstat_or_make(folder: Path) -> os.stat_result:
    try:
        return os.lstat(folder)
    except FileNotFoundError:
        # Its parent has just passed: whoever made this folder first, root, the worker or
        # (under a sticky parent) someone else, the check that follows judges who owns it.
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o755)
        return os.lstat(folder)


def worker_folder_open(path: Path, setting: str, *, mode: int, owners: tuple[int, ...] = ()) -> int:
    """A descriptor of the folder `setting` names, made with `mode` on first use. It must belong
    to one of `owners` (default: root or the worker) and be writable by its owner alone, and so
    must every folder above it: else FolderError, naming the setting and the fix. A symlink, at
    the folder or above it, is refused."""
    me = os.geteuid()
    owners = owners or (0, me)
    _check_tree(path, setting)
    try:
        made = False
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, mode)
            made = True
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        raise FolderError(
            f"Cannot open {setting} ({path}) as a real folder: {exc.strerror}. It must be a folder of"
            " the worker's own, not a symlink."
        ) from None
    st = os.fstat(fd)
    if made and st.st_uid == me:
        os.fchmod(fd, mode)  # whatever the umask
        st = os.fstat(fd)
    if st.st_uid not in owners or stat.S_IMODE(st.st_mode) & 0o022:
        os.close(fd)
        who = "the worker's account" if owners == (me,) else "root or the worker's account"
        raise FolderError(
            f"{setting} ({path}) must belong to {who} (uid {me}) and be writable by it alone; it has"
            f" owner uid {st.st_uid} and mode {stat.S_IMODE(st.st_mode):o}. Fix: chown {me} {path} &&"
            f" chmod {mode:04o} {path}"
        )
    return fd


def own_file_open(dir_fd: int, name: str, flags: int, mode: int = 0o600) -> int:
    """`name` in the folder `dir_fd`, opened O_NOFOLLOW (with O_CREAT: made `mode` if missing) and
    kept only if it is a regular file of the worker's with no other name: a symlink, a folder, a
    file someone else made or a hard link to one is refused (FolderError, which says which).
    O_NONBLOCK, which a regular file ignores, so a FIFO planted there is refused, not waited on."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FolderError(f"{name} is a symlink: refused, never followed.") from None
        raise
    st = os.fstat(fd)
    why = (
        "is not a regular file"
        if not stat.S_ISREG(st.st_mode)
        else f"belongs to uid {st.st_uid}, not the worker's {os.geteuid()}"
        if st.st_uid != os.geteuid()
        else f"has {st.st_nlink} names (a hard link)"
        if st.st_nlink > 1  # 0: unlinked by the lock's holder just now, which is no plant
        else ""
    )
    if why:
        os.close(fd)
        raise FolderError(f"{name} {why}: refused.")
    return fd


def own_file_read(dir_fd: int, name: str) -> bytes | None:
    """The whole of `name` (own_file_open's checks); None when there is no such file."""
    try:
        fd = own_file_open(dir_fd, name, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as file:
        return file.read()


def own_file_replace(dir_fd: int, name: str, data: bytes, *, mode: int, sync: bool = False) -> None:
    """`name` in the folder `dir_fd` holds `data`, replaced whole: a fresh temporary file
    (O_CREAT|O_EXCL|O_NOFOLLOW, so never one planted there), then a rename, which replaces a
    link at `name` and never follows it. A reader sees the old file or the new one, never half."""
    temporary = f".{name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(temporary, _NEW_FILE_FLAGS, mode, dir_fd=dir_fd)
    try:
        try:
            os.fchmod(fd, mode)  # whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=dir_fd)
        raise


def job_folders_check(*, job_user: str) -> None:
    """For the host worker's start: JOB_FOLDERS is safe, as every job's start checks it, and
    the account the jobs run as (`job_user`: JOB_USER) can pass through every folder down to
    it, or each job would fail at its start with errno 13.

    A named account is judged by the owner, group (its primary group: a job drops every other)
    and other execute bits; under @owner, where any person's account may run a job, by the
    other execute bit. ACLs are not read: a folder that lets the account through by an ACL alone
    needs the plain bit as well."""
    root = Path(settings.JOB_FOLDERS)
    os.close(_open_root(root))
    if not job_user:
        return  # the worker's own account: it has just been through
    if job_user == JOB_USER_OWNER:
        who = "every job owner's account (JOB_USER=@owner: any account, so the execute bit for others)"

        def passes(st: os.stat_result) -> bool:
            return bool(st.st_mode & stat.S_IXOTH)
    else:
        try:
            account = pwd.getpwnam(job_user)
        except KeyError:
            raise FolderError(f"JOB_USER={job_user}: there is no such account on this host.") from None
        who = f"JOB_USER={job_user} (uid {account.pw_uid})"

        def passes(st: os.stat_result) -> bool:
            return account.pw_uid == 0 or bool(st.st_mode & _execute_bit(st, account))

    for folder in [*reversed(root.parents), root]:
        st = os.stat(folder)
        if not passes(st):
            raise FolderError(
                f"{folder}, on the way to JOB_FOLDERS ({root}), does not let {who} through (owner uid"
                f" {st.st_uid}, group {st.st_gid}, mode {stat.S_IMODE(st.st_mode):o}): every job would"
                f" fail at its start. Fix: chmod o+x {folder}, or move JOB_FOLDERS where that account"
                " can reach (e.g. /srv/gpu-job-folders)"
            )


def _execute_bit(st: os.stat_result, account: pwd.struct_passwd) -> int:
    if st.st_uid == account.pw_uid:
        return stat.S_IXUSR
    if st.st_gid == account.pw_gid:
        return stat.S_IXGRP
    return stat.S_IXOTH


def _open_root(root: Path) -> int:
    """A descriptor of JOB_FOLDERS, made (mode 0711) on first use, and checked to be the worker's."""
    try:
        return worker_folder_open(root, "JOB_FOLDERS", mode=0o711, owners=(os.geteuid(),))
    except FolderError as exc:
        raise JobFolderError(str(exc)) from None


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


def job_folder_keep(name: str, *, account: pwd.struct_passwd | None) -> Path:
    """`<JOB_FOLDERS>/<name>`, made on first use and kept: a folder a job keeps across its runs (a
    preemptible job's checkpoints, jobs/host/checkpoints.py), handed to `account` (None: the
    worker's). JOB_FOLDERS is the worker's alone, so only the worker made what is there; it is
    still opened O_NOFOLLOW and checked to be a folder of the worker's or the account's, never
    followed. `name` is the caller's, a plain file name that names one job for good."""
    if not plain_file_name(name):
        raise JobFolderError(f"{name!r} is not a plain folder name.")
    root = Path(settings.JOB_FOLDERS)
    root_fd = _open_root(root)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=root_fd)
        folder_fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
        try:
            st = os.fstat(folder_fd)
            owners = {os.geteuid(), *((account.pw_uid,) if account is not None else ())}
            if st.st_uid not in owners:
                raise JobFolderError(
                    f"{root / name} belongs to uid {st.st_uid}, neither the worker nor the job"
                )
            if account is not None and (st.st_uid, st.st_gid) != (account.pw_uid, account.pw_gid):
                os.fchown(folder_fd, account.pw_uid, account.pw_gid)
        finally:
            os.close(folder_fd)
    except JobFolderError:
        raise
    except OSError as exc:
        raise JobFolderError(f"Cannot keep the job's folder {root / name}: {exc}") from None
    finally:
        os.close(root_fd)
    return root / name


def job_folder_names(prefix: str) -> list[str]:
    """The names in JOB_FOLDERS that start with `prefix` (none while it does not exist yet)."""
    root = Path(settings.JOB_FOLDERS)
    if not root.exists():
        return []
    root_fd = _open_root(root)
    try:
        return sorted(name for name in os.listdir(root_fd) if name.startswith(prefix))
    finally:
        os.close(root_fd)


def job_folder_remove(name: str) -> bool:
    """`<JOB_FOLDERS>/<name>` and everything in it, removed through descriptors (`_tree_empty`:
    a link, a FIFO or a device its owner swaps in mid-walk is unlinked, never opened or followed);
    a link in its place is unlinked alone. Whether anything was there."""
    if not plain_file_name(name):
        raise JobFolderError(f"{name!r} is not a plain folder name.")
    root_fd = _open_root(Path(settings.JOB_FOLDERS))
    try:
        try:
            top = os.open(name, _WALK_FLAGS, dir_fd=root_fd)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            os.unlink(name, dir_fd=root_fd)
            return True
        try:
            _tree_empty(top)
        finally:
            os.close(top)
        os.rmdir(name, dir_fd=root_fd)
        return True
    finally:
        os.close(root_fd)


# A job's folder is its account's: anything in it may be swapped while the worker walks it. A
# folder is entered only as a folder (O_DIRECTORY: a FIFO or a device is refused before its open
# could block or arm anything), never through a link (O_NOFOLLOW).
_WALK_FLAGS = _DIR_FLAGS | os.O_NONBLOCK
_WALK_DEPTH = 32  # folders open at once; a deeper one is moved up to the top first
_WALK_ROUNDS = 10  # passes over a tree its owner keeps refilling before the removal gives up


def _tree_empty(top: int) -> None:
    """Everything inside the folder `top`, removed. Iterative, with at most _WALK_DEPTH folders
    open: a tree made deeper (beyond the recursion limit, or the descriptors the worker has) is
    flattened as it goes, its deep folders moved up beside the others. A pass ends; another is
    needed only for what its owner added meanwhile."""
    owner = os.fstat(top).st_uid
    for _ in range(_WALK_ROUNDS):
        if not _walk_once(top, owner):
            return
    raise JobFolderError(f"its owner still fills it after {_WALK_ROUNDS} passes; the next sweep tries again")


def _walk_once(top: int, owner: int) -> bool:
    """One pass over what it lists: all of it goes; whether another pass is needed (a folder
    refilled meanwhile). Only the folder's `owner`'s folders are emptied: one of another account,
    moved in, holds what its owner could not remove, and neither may the worker for them."""
    again = False
    stack: list[tuple[int, list[str], str]] = [(top, os.listdir(top), "")]
    try:
        while stack:
            fd, pending, _ = stack[-1]
            if not pending:
                _, _, name = stack.pop()
                if stack:
                    os.close(fd)
                    again |= not _rmdir_if_empty(stack[-1][0], name)
                continue
            name = pending.pop()
            try:
                sub = os.open(name, _WALK_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                    raise
                again |= exc.errno != errno.ENOENT and not _unlink_name(fd, name)
                continue
            if (uid := os.fstat(sub).st_uid) != owner:
                os.close(sub)
                raise JobFolderError(f"{name}, a folder of uid {uid}, not its owner's: left for an admin")
            if len(stack) >= _WALK_DEPTH:  # moved up to the top, and walked from there in this pass
                os.close(sub)
                moved = f".deep-{secrets.token_hex(8)}"
                os.rename(name, moved, src_dir_fd=fd, dst_dir_fd=top)
                stack[0][1].append(moved)
                continue
            stack.append((sub, os.listdir(sub), name))
    finally:
        for fd, _, _ in stack[1:]:
            os.close(fd)
    return again


def _unlink_name(dir_fd: int, name: str) -> bool:
    """A file, a link, a FIFO: the name alone goes. False if a folder took its place meanwhile."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        return False
    return True


def _rmdir_if_empty(dir_fd: int, name: str) -> bool:
    """`name` removed if it is an empty folder; False if it was refilled meanwhile."""
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            return False
        raise
    return True
