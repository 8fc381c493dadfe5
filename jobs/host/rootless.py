"""Rootless mode (CONTAINER_MODE=rootless, docs/containers.md): the job's account runs its own
Podman. What that account needs from the host, and what the worker (root) prepares for it:

- subordinate uid and gid ranges (/etc/subuid, /etc/subgid), which its user namespace maps;
- its image storage, the portal's for it: <CONTAINER_ROOTLESS_STORAGE_DIR>/<uid> (overlay, on a
  local disk), apart from whatever storage the account keeps for its own use of Podman (a second
  driver in one storage is refused by Podman);
- its runtime folder (XDG_RUNTIME_DIR, where its containers' state and Podman's pause process
  live): <CONTAINER_ROOTLESS_RUN_DIR>/<uid> (/run/portal-ctr/...), never /run/user/<uid>, which
  logind empties at the account's last logout under a running job.

Each of the account's folders is the account's alone (0700); their parents are root's, and let
others pass but not list (0711), so no account can plant one for another.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
from pathlib import Path

from django.conf import settings

SUBID_FILES = ("/etc/subuid", "/etc/subgid")
RUN_ROOT_MAX = 50  # Podman's limit on a run root's length (its `container cleanup` refuses longer)


class AccountError(Exception):
    """The account cannot run rootless containers here: the message says what an admin does."""


def storage_dir(account: pwd.struct_passwd) -> Path:
    base = settings.CONTAINER_ROOTLESS_STORAGE_DIR or Path(settings.VAR_DIR) / "rootless-storage"
    return _own_folder(Path(base), account)


def run_dir(account: pwd.struct_passwd) -> Path:
    """The account's runtime folder. Short: Podman refuses a run root (<this>/containers) longer
    than RUN_ROOT_MAX characters in the cleanup it runs as each container exits, and the client
    then waits 20 s for an exit code that never comes (measured: Podman 4.3)."""
    instance = hashlib.sha256(settings.PORTAL_INSTANCE_ID.encode()).hexdigest()[:8]
    base = settings.CONTAINER_ROOTLESS_RUN_DIR or f"/run/portal-ctr/{instance}"
    if len(f"{base}/{account.pw_uid}/containers") > RUN_ROOT_MAX:
        raise AccountError(
            f"CONTAINER_ROOTLESS_RUN_DIR ({base}) is too long: Podman takes a run root of at most"
            f" {RUN_ROOT_MAX} characters ({base}/{account.pw_uid}/containers); set a shorter folder."
        )
    return _own_folder(Path(base), account)


def _own_folder(base: Path, account: pwd.struct_passwd) -> Path:
    """<base>/<uid>, made (or taken back) the account's alone; <base> root's, passable (0711)."""
    base.mkdir(mode=0o711, parents=True, exist_ok=True)
    if base.stat().st_uid == os.geteuid():
        base.chmod(0o711)
    folder = base / str(account.pw_uid)
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    found = os.lstat(folder)
    if not os.path.isdir(folder) or os.path.islink(folder):
        raise AccountError(f"{folder} is not a folder: an admin removes it.")
    if (found.st_uid, found.st_gid) != (account.pw_uid, account.pw_gid):
        os.chown(folder, account.pw_uid, account.pw_gid, follow_symlinks=False)
    if found.st_mode & 0o777 != 0o700:
        os.chmod(folder, 0o700, follow_symlinks=False)
    return folder


def subid_ranges(account: pwd.struct_passwd, path: str) -> int:
    """How many subordinate ids `path` (/etc/subuid or /etc/subgid) gives the account (by name or
    by uid, as shadow-utils reads it); 0 when none or the file is missing."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return 0
    total = 0
    for line in lines:
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[0] in (account.pw_name, str(account.pw_uid)) and parts[2].isdigit():
            total += int(parts[2])
    return total


def account_check(account: pwd.struct_passwd) -> None:
    """AccountError unless the account has subordinate uids and gids (what its user namespace
    maps: without them Podman cannot start a container as it)."""
    for path in SUBID_FILES:
        if subid_ranges(account, path) == 0:
            raise AccountError(
                f"The account {account.pw_name} has no range in {path}, which rootless Podman needs:"
                f" an admin adds one (usermod --add-subuids 100000-165535 --add-subgids 100000-165535"
                f" {account.pw_name}, each account its own range; docs/containers.md)."
            )


def as_account(account: pwd.struct_passwd | None) -> dict[str, object]:
    """Popen's arguments that start a process as `account` with the account's own groups (never
    the worker's); none for None (root mode: the worker's own Podman)."""
    if account is None:
        return {}
    return {
        "user": account.pw_uid,
        "group": account.pw_gid,
        "extra_groups": os.getgrouplist(account.pw_name, account.pw_gid),
    }
