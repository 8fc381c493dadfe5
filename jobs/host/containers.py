"""Containers on a GPU host (issue 34, docs/containers.md): whether this host can run them, getting
an image onto it, and the few Podman commands the executor (jobs/host/executors/podman.py) and a
restarted worker need. Every `podman` the portal runs goes through `podman_command`, with the
containers.conf the portal writes (`containers_conf`) and an environment of its own: nothing of a
job's environment ever reaches Podman itself.

CONTRACT (with the submission side): `runtime_status()` is called by the host's worker when it
starts (its answer goes to Server.containers_ok/containers_detail), `image_pull()` by the pre-pull
task and before a job's first run in an image.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pynvml
from django.conf import settings

from jobs.host import pulls, rootless
from portal.accounts import JOB_USER_OWNER

log = logging.getLogger(__name__)

# Podman 4.3 on Debian 12 (docs/containers.md, "Install"): crun 1.8 refuses the hybrid cgroup
# layout, and Podman's default ulimits are above the hard limits a worker without
# CAP_SYS_RESOURCE may set; no journald on every host, so events go to a file.
CONTAINERS_CONF_TEXT = """\
# Written by the GPU portal (jobs/host/containers.py); changes here are overwritten.
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
PATH_FOR_PODMAN = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STATUS_CACHE_SECONDS = 300.0  # `podman info` costs ~0.1 s and a runtime check: once per 5 minutes
COMMAND_SECONDS = 60.0  # inspect, kill, rm: Podman's own steps, never the job
LABEL_INSTANCE = "portal.instance"  # which portal started a container (a restarted worker's sweep)
LABEL_WORK = "portal.work"  # "job-12", "session-3"
LABEL_SERVER = "portal.server"  # the host's WORKER_SERVER: one machine may run two (a test's box1, box2)
ARCHIVE_PREFIXES = ("oci-archive:", "docker-archive:")

_status_lock = threading.RLock()  # runtime_status asks account_status under it
_status: tuple[str, float, tuple[bool, str]] | None = None
_accounts: dict[int, tuple[float, tuple[bool, str]]] = {}  # rootless: per uid


class ContainerError(Exception):
    """A container could not be had: the message says what happened and what to do."""


def containers_conf() -> Path:
    """The containers.conf every `podman` of the portal's reads (CONTAINERS_CONF), written if
    missing or changed; world-readable, as rootless Podman reads it as the job's account."""
    path = Path(settings.CONTAINER_CONF or Path(settings.VAR_DIR) / "containers.conf")
    try:
        if path.read_text() == CONTAINERS_CONF_TEXT:
            return path
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    partial.write_text(CONTAINERS_CONF_TEXT)
    partial.chmod(0o644)
    partial.replace(path)  # atomic: a podman starting meanwhile reads the old file or the new one
    return path


def podman_env(account: pwd.struct_passwd | None = None) -> dict[str, str]:
    """Podman's own environment: the portal's containers.conf, and (rootless) the account's home
    and the runtime folder the portal keeps for it (jobs.host.rootless.run_dir)."""
    env = {"PATH": PATH_FOR_PODMAN, "LANG": "C.UTF-8", "CONTAINERS_CONF": str(containers_conf())}
    if account is None:
        env["HOME"] = os.environ.get("HOME", "/root")
        return env
    env.update(HOME=account.pw_dir, USER=account.pw_name, LOGNAME=account.pw_name)
    env["XDG_RUNTIME_DIR"] = str(_account_folder(rootless.run_dir, account))
    return env


def _account_folder(which: Callable[[pwd.struct_passwd], Path], account: pwd.struct_passwd) -> Path:
    """One of the folders the portal keeps for the account (rootless.storage_dir, run_dir), made
    if missing; ContainerError saying which when it cannot be."""
    try:
        return which(account)
    except (rootless.AccountError, OSError) as exc:
        raise ContainerError(
            f"Could not prepare {account.pw_name}'s folder for rootless Podman on"
            f" {socket.gethostname()}: {exc}"
        ) from None


def podman_command(*args: str, account: pwd.struct_passwd | None = None) -> list[str]:
    """The podman command line; as `account` (rootless mode), in the storage the portal keeps for
    it, with the overlay driver (vfs, Podman's rootless default here, costs 3.5-5 s a start), and
    without the warnings rootless Podman prints on every run (they would land in the job's log)."""
    if account is None:
        return [settings.CONTAINER_PODMAN, *args]
    storage = ["--root", str(_account_folder(rootless.storage_dir, account)), "--storage-driver", "overlay"]
    return [settings.CONTAINER_PODMAN, *storage, "--log-level", "error", *args]


def podman(
    *args: str, account: pwd.struct_passwd | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """One short `podman` step (inspect, rm, image exists), as `account` in rootless mode;
    ContainerError when Podman cannot be run at all or does not answer in `timeout`
    (COMMAND_SECONDS, read at each call)."""
    timeout = COMMAND_SECONDS if timeout is None else timeout
    try:
        return subprocess.run(
            podman_command(*args, account=account),
            env=podman_env(account),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            cwd="/",
            **rootless.as_account(account),  # type: ignore[arg-type]
        )
    except FileNotFoundError:
        raise ContainerError(_not_installed()) from None
    except subprocess.TimeoutExpired:
        raise ContainerError(
            f"podman {args[0]} did not answer in {timeout:g} s on {socket.gethostname()}."
        ) from None


def _not_installed() -> str:
    return (
        f"podman ({settings.CONTAINER_PODMAN}) is not installed on {socket.gethostname()}:"
        " an admin installs it (apt install podman runc uidmap; docs/containers.md)."
    )


def runtime_status() -> tuple[bool, str]:
    """Whether containers can run on this host, and what was found (Podman's version, its runtime
    and storage, the mode), or what is missing and how to get it; cached STATUS_CACHE_SECONDS
    (per mode and JOB_USER, what the answer depends on)."""
    global _status
    key = f"{settings.CONTAINER_MODE} {settings.JOB_USER} {settings.CONTAINER_PODMAN}"
    with _status_lock:
        if _status is not None and _status[0] == key and time.monotonic() - _status[1] < STATUS_CACHE_SECONDS:
            return _status[2]
        found = _runtime_check()
        _status = (key, time.monotonic(), found)
        return found


def _runtime_check() -> tuple[bool, str]:
    host = socket.gethostname()
    if shutil.which(settings.CONTAINER_PODMAN) is None:
        return False, _not_installed()
    mode = settings.CONTAINER_MODE
    if os.geteuid() != 0:
        return False, (
            f"CONTAINER_MODE={mode} needs the worker on {host} to run as root (it runs as uid"
            f" {os.geteuid()}; docs/containers.md)."
        )
    if mode == "root":
        return _info_check(None)
    if not settings.JOB_USER:
        return (
            False,
            "CONTAINER_MODE=rootless needs JOB_USER (an account, or @owner): set it (docs/containers.md).",
        )
    missing = [
        name for name in ("newuidmap", "newgidmap") if shutil.which(name, path=PATH_FOR_PODMAN) is None
    ]
    if missing:
        return (
            False,
            f"{' and '.join(missing)} missing on {host}: an admin installs uidmap (apt install uidmap).",
        )
    if settings.JOB_USER == JOB_USER_OWNER:
        ok, detail = _info_check(None)
        return ok, (f"{detail}: each owner's account is checked at its job's start" if ok else detail)
    try:
        account = host_account()
    except ContainerError as exc:
        return False, str(exc)
    assert account is not None
    return account_status(account)


def host_account() -> pwd.struct_passwd | None:
    """Whose Podman holds this host's shared images and containers (a pre-pull's, a killed
    worker's leftovers): None in root mode (the worker's own); JOB_USER's in rootless mode.
    ContainerError where no one account holds them: JOB_USER unset or @owner (each owner's
    Podman has its own, pulled at its first job), or not an account here."""
    if settings.CONTAINER_MODE != "rootless":
        return None
    if settings.JOB_USER in ("", JOB_USER_OWNER):
        raise ContainerError(
            "CONTAINER_MODE=rootless with JOB_USER=@owner: each account keeps its own images and"
            " containers, in its own Podman (an image is pulled at its first job there)."
        )
    try:
        return pwd.getpwnam(settings.JOB_USER)
    except KeyError:
        raise ContainerError(
            f"JOB_USER {settings.JOB_USER} is not an account on {socket.gethostname()}."
        ) from None


def account_status(account: pwd.struct_passwd) -> tuple[bool, str]:
    """Whether `account` can run rootless containers here (its subordinate ids, its Podman
    answering in the portal's storage), or what an admin does; cached STATUS_CACHE_SECONDS."""
    with _status_lock:
        cached = _accounts.get(account.pw_uid)
        if cached is not None and time.monotonic() - cached[0] < STATUS_CACHE_SECONDS:
            return cached[1]
    try:
        rootless.account_check(account)
    except rootless.AccountError as exc:
        found = (False, str(exc))
    else:
        found = _info_check(account)
    with _status_lock:
        _accounts[account.pw_uid] = (time.monotonic(), found)
    return found


def _info_check(account: pwd.struct_passwd | None) -> tuple[bool, str]:
    """`podman info` (as `account`, rootless): Podman's version, runc, the storage driver."""
    host = socket.gethostname()
    whose = f" as {account.pw_name}" if account is not None else ""
    try:
        done = podman("info", "--format", "json", account=account)
    except ContainerError as exc:
        return False, str(exc)
    if done.returncode != 0:
        return False, f"podman info{whose} failed on {host}: {last_line(done.stderr)}"
    try:
        info = json.loads(done.stdout)
        runtime = info["host"]["ociRuntime"]
        version = info["version"]["Version"]
        driver = info["store"]["graphDriverName"]
    except (ValueError, KeyError, TypeError):
        return False, f"podman info{whose} on {host} answered something unexpected: {done.stdout[:200]!r}"
    if runtime.get("name") != "runc" or not Path(runtime.get("path") or "/nonexistent").exists():
        return False, f"podman on {host} has no runc (found {runtime.get('name')!r}): apt install runc."
    runc = str(runtime.get("version", "")).splitlines()[0] if runtime.get("version") else "runc"
    return True, f"podman {version}, {runc}, {driver} storage, {settings.CONTAINER_MODE} mode{whose}"


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no message)"


def card_minors(uuids: Sequence[str], indexes: Mapping[str, int]) -> tuple[int, ...]:
    """Each booked card's /dev/nvidia<N> number: NVML's minor number where the driver answers, else
    (the simulated inventory, GPU_BACKEND=simulated) its index in the inventory."""
    if settings.GPU_BACKEND != "simulated":
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:
            pass  # no driver here: the simulated inventory's indexes
        else:
            try:
                return tuple(
                    pynvml.nvmlDeviceGetMinorNumber(pynvml.nvmlDeviceGetHandleByUUID(uuid)) for uuid in uuids
                )
            except pynvml.NVMLError as exc:
                raise ContainerError(f"NVML could not give the booked cards' device numbers: {exc}") from None
            finally:
                pynvml.nvmlShutdown()
    missing = [uuid for uuid in uuids if uuid not in indexes]
    if missing:
        raise ContainerError(f"The booked cards {', '.join(missing)} are not in this host's inventory.")
    return tuple(indexes[uuid] for uuid in uuids)


def local_name(reference: str, account: pwd.struct_passwd | None = None) -> str:
    """What `podman run` is given for `reference`: a registry reference as is; an archive, the
    local name its pull tags it with (an archive has no name of its own to run by); a root
    filesystem folder in rootless mode, the name its import into the account's storage got
    (`import_folder`)."""
    if reference.startswith(ARCHIVE_PREFIXES):
        digest = hashlib.sha256(reference.encode()).hexdigest()[:16]
        return f"localhost/portal-archive-{digest}:latest"
    if reference.startswith("/") and account is not None:
        digest = hashlib.sha256(reference.encode()).hexdigest()[:16]
        return f"localhost/portal-rootfs-{digest}:latest"
    return reference


def image_pull(
    reference: str,
    say: Callable[[str], None],
    *,
    account: pwd.struct_passwd | None = None,
    name: str = "",
    stop: threading.Event | None = None,
) -> None:
    """Get `reference` onto this host (cached: a second call is quick), saying its progress in
    lines ("pulling tf-2.17: 1.2 / 4.8 GB": `name`, else the reference); ContainerError when it
    cannot, or when `stop` was set meanwhile (the run that needs it ended: the pull is killed). A
    root filesystem folder needs no pull in root mode, only to be there. `account`: whose
    storage (rootless)."""
    host = socket.gethostname()
    if reference.startswith("/") and not Path(reference).is_dir():
        raise ContainerError(
            f"The image's root filesystem {reference} is not on {host}: an admin copies it there,"
            " or takes this server off the image's servers."
        )
    if reference.startswith("/") and account is None:
        return
    local = local_name(reference, account)
    shown = name or reference
    if podman("image", "exists", "--", local, account=account).returncode == 0:
        return
    if reference.startswith(ARCHIVE_PREFIXES):
        path = Path(reference.split(":", 1)[1])
        if not path.is_file():
            raise ContainerError(f"The image archive {path} is not on {host}: an admin copies it there.")
        say(f"pulling {shown}: loading {reference} ({path.stat().st_size / 1e6:.0f} MB)")
    started = time.monotonic()
    if reference.startswith("/"):
        assert account is not None
        image_id = import_folder(reference, local, say, account)
    else:
        image_id = _pull(reference, shown, say, account, stop)
    if local != reference and podman("tag", "--", image_id, local, account=account).returncode != 0:
        raise ContainerError(f"Could not name the image loaded from {reference} on {host} ({local}).")
    size = podman("image", "inspect", "--format", "{{.Size}}", "--", local, account=account).stdout.strip()
    stored = f", {int(size) / 1e9:.2f} GB" if size.isdigit() else ""
    say(f"pulled {shown} in {time.monotonic() - started:.1f} s{stored}")


def import_folder(folder: str, name: str, say: Callable[[str], None], account: pwd.struct_passwd) -> str:
    """A root filesystem folder as an image in the account's storage (rootless mode), its id.

    Rootless Podman cannot run the folder itself (`--rootfs`): its files are root's, which the
    account's user namespace does not map, so Podman could create none of the mount points it
    needs (/etc/hostname, /run/.containerenv, a job folder's path). Imported, the files belong to
    the namespace's root, as any image's do. The worker (root) reads the folder; the account's
    Podman only reads the stream."""
    say(f"pulling {folder}: importing the folder into {account.pw_name}'s image storage")
    # tar's warnings to a file, read after: a pipe nobody reads while Podman imports would fill
    # (a warning per socket in the folder) and stop tar, and Podman with it.
    with tempfile.TemporaryFile() as errors:
        tar = subprocess.Popen(
            ["tar", "-C", folder, "--numeric-owner", "-cf", "-", "."],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors, cwd="/",
        )  # fmt: skip
        try:
            done = _import_stream(tar, name, account)
        finally:
            _tar_end(tar)
        errors.seek(0)
        tar_error = errors.read().decode(errors="replace")
    if done.returncode != 0 or tar.returncode != 0:
        why = last_line(done.stderr) if done.returncode != 0 else last_line(tar_error)
        raise ContainerError(
            f"Could not import {folder} for {account.pw_name} on {socket.gethostname()}: {why}"
        )
    return done.stdout.strip().removeprefix("sha256:")


def _import_stream(
    tar: subprocess.Popen[bytes], name: str, account: pwd.struct_passwd
) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            podman_command("import", "--quiet", "--", "-", name, account=account),
            env=podman_env(account), stdin=tar.stdout, capture_output=True, text=True, cwd="/",
            timeout=settings.CONTAINER_PULL_SECONDS, **rootless.as_account(account),  # type: ignore[arg-type]
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise ContainerError(
            f"Importing into {account.pw_name}'s storage took longer than CONTAINER_PULL_SECONDS"
            f" ({settings.CONTAINER_PULL_SECONDS} s)."
        ) from None


def _tar_end(tar: subprocess.Popen[bytes]) -> None:
    """tar, ended: its stream closed (it stops once Podman no longer reads), reaped within a
    minute or killed (an unreaped child of the worker's: its pid is still tar's)."""
    assert tar.stdout is not None
    tar.stdout.close()
    try:
        tar.wait(60)
    except subprocess.TimeoutExpired:
        tar.kill()
        tar.wait()


def _pull(
    reference: str,
    shown: str,
    say: Callable[[str], None],
    account: pwd.struct_passwd | None,
    stop: threading.Event | None,
) -> str:
    """`podman pull` under a terminal (jobs.host.pulls: its progress in bytes, said as
    "pulling tf-2.17: 1.2 / 4.8 GB", throttled); the image's id."""
    argv = podman_command("pull", "--", reference, account=account)
    try:
        pulled = pulls.pull_in_pty(
            argv,
            lambda progress: say(f"pulling {shown}: {progress}"),
            settings.CONTAINER_PULL_SECONDS,
            stop=stop,
            env=podman_env(account),
            cwd="/",
            **rootless.as_account(account),
        )
    except FileNotFoundError:
        raise ContainerError(_not_installed()) from None
    lines = pulled.progress.lines
    if pulled.code != 0:
        why = last_line("\n".join(lines))
        if pulled.code < 0 and stop is not None and stop.is_set():
            raise ContainerError(f"The pull of {reference} was stopped: the run that needed it ended.")
        if pulled.code < 0:
            why = f"it took longer than CONTAINER_PULL_SECONDS ({settings.CONTAINER_PULL_SECONDS} s)"
        raise ContainerError(
            f"Could not pull {reference} on {socket.gethostname()}: {why}. An admin checks the"
            " reference and the registry (or pre-pulls it: manage.py images_pull)."
        )
    ids = [line for line in lines if _is_id(line)]
    return ids[-1] if ids else reference


def _is_id(line: str) -> bool:
    return len(line) == 64 and all(c in "0123456789abcdef" for c in line)


def leftovers_remove(account: pwd.struct_passwd | None = None) -> list[tuple[str, str, str]]:
    """Remove this portal's containers on this host (no run of this worker holds one yet): what
    a worker killed mid-job left (the orphan sweep has ended what of them it could prove by
    the session the rows recorded; `rm --force` ends the rest, a process that left the session
    too). (name, its portal.work label: "job-12", its state: "running", "exited"...) of each removed."""
    done = podman(
        "ps", "-a", "--filter", f"label={LABEL_INSTANCE}={settings.PORTAL_INSTANCE_ID}",
        "--filter", f"label={LABEL_SERVER}={settings.WORKER_SERVER}",
        "--format", f'{{{{.Names}}}}\t{{{{index .Labels "{LABEL_WORK}"}}}}\t{{{{.State}}}}', account=account,
    )  # fmt: skip
    if done.returncode != 0:
        raise ContainerError(f"podman ps failed on {socket.gethostname()}: {last_line(done.stderr)}")
    found = [tuple(line.split("\t")) for line in done.stdout.splitlines() if line.count("\t") == 2]
    removed = []
    for name, work, state in found:
        # Only what Podman did remove is said removed; one it fails or hangs on is left to the
        # next start, and never keeps the others' removal (a kill) from being said.
        try:
            gone = podman("rm", "--force", "--ignore", "--time", "0", "--", name, account=account)
        except ContainerError as exc:
            why = str(exc)
        else:
            why = "" if gone.returncode == 0 else last_line(gone.stderr)
        if why:
            log.error(
                "Could not remove container %s (%s, %s), left by a previous worker: %s",
                name,
                work,
                state,
                why,
            )
            continue
        removed.append((name, work, state))
    return removed
