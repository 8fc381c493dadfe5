"""What the Slurm cluster's worker checks and makes before a job goes to Slurm (issue 37;
docs/slurm.md): the owner's Unix account, a partition Slurm would hold for ever, the job's folder
on the shared filesystem, and where the cluster keeps its completion log. Used by the follower
before its sbatch (jobs/host/slurm_runner.py) and by the check the web asks for before it writes a
job (jobs/host/slurm_checks.py), so both refuse the same jobs in the same words.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
from pathlib import Path

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser

from gpus.models import SlurmCluster
from gpus.slurm_cli import SlurmCommands, SlurmError, SlurmRefused, records
from jobs.host.launch import LAUNCHER
from portal.accounts import unix_account_name


class SlurmSetupError(Exception):
    """The job cannot be sent to Slurm: its message says why and what to do; `field` is the
    submit field it is about."""

    def __init__(self, message: str, *, field: str = "server") -> None:
        super().__init__(message)
        self.field = field


def job_account(user: AbstractBaseUser) -> pwd.struct_passwd:
    """The Unix account `user`'s Slurm jobs run as, on this login node (the account mapping)."""
    name = unix_account_name(user)
    if name is None:
        raise SlurmSetupError(
            f"{user} has no Unix account the portal can vouch for: an admin sets theirs on their profile",
            field="account",
        )
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        raise SlurmSetupError(f"there is no account {name!r} on the login node", field="account") from None
    if account.pw_uid < settings.JOB_MIN_UID:
        raise SlurmSetupError(
            f"account {name!r} is a system account (uid below JOB_MIN_UID)", field="account"
        )
    return account


def partition_check(commands: SlurmCommands, partition: str) -> None:
    """Slurm takes a RootOnly partition's job from root's sbatch, then holds it for ever
    (PartitionConfig): it checks the submitter, and the portal submits as root for its users.
    Refused here, the cluster's default partition too; an unknown one is Slurm's to refuse.
    SlurmUnreachable when Slurm does not answer."""
    try:
        found = records(commands.show("partition", *([partition] if partition else [])))
    except SlurmRefused:
        return
    for record in found:
        if (partition or record.get("Default") == "YES") and record.get("RootOnly") == "YES":
            raise SlurmSetupError(
                f"partition {record.get('PartitionName')} takes root's jobs only (RootOnly): "
                "submit to another partition",
                field="partition",
            )


def job_folder(cluster: SlurmCluster, account: pwd.struct_passwd, job_id: int) -> Path:
    """Where job `job_id`'s script, launcher copy and output are: `<jobs' folder>/<account>/job-<id>`."""
    return Path(cluster.job_root) / account.pw_name / f"job-{job_id}"


def job_folder_make(folder: Path, account: pwd.struct_passwd, script: tuple[str, str] | None) -> None:
    """The job's own folder, made by root and handed to the account only once the launcher and
    the script (`script`: its name and text; None for a script on the cluster) are in it: nothing
    can be planted there first. The account's folder above it stays root's, so the account can
    never swap its job folder for a link while root writes there."""
    mine = folder.parent
    try:
        if not _root_only(mine.parent):  # else its account folders could be swapped for links
            raise SlurmSetupError(
                f"the jobs' folder {mine.parent} is not writable by root only; an admin makes it "
                "root's, mode 755"
            )
        mine.mkdir(mode=0o755, exist_ok=True)
        if not _root_only(mine):
            raise SlurmSetupError(f"{mine} is not a folder only root may change; an admin removes it")
        folder.mkdir(mode=0o700)
        shutil.copytree(LAUNCHER.parent, folder / "launcher")
        if script is not None:
            (folder / script[0]).write_text(script[1])
        for path in [folder, *folder.rglob("*")]:
            os.lchown(path, account.pw_uid, account.pw_gid)
    except OSError as exc:
        raise SlurmSetupError(f"cannot make its folder {folder}: {exc.strerror or exc}") from None


def jobcomp_location(commands: SlurmCommands) -> str:
    """The cluster's completion log (jobcomp/filetxt), where forgotten jobs are looked up; "" when
    it has none, or Slurm does not say."""
    try:
        config = commands.run("scontrol", ["show", "config"])
    except SlurmError:
        return ""
    for line in config.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "JobCompLoc" and value.strip().startswith("/"):
            return value.strip()
    return ""


def _root_only(path: Path) -> bool:
    """A folder itself (not a link) that only root may change."""
    found = os.lstat(path)
    return stat.S_ISDIR(found.st_mode) and found.st_uid == 0 and not found.st_mode & 0o022
