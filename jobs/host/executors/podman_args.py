"""What a run's container is given, as `podman run` arguments (jobs/host/executors/podman.py): the
booked cards and nothing else, the job's folders at their own paths, the account, no privileges.

The cards: by CDI (`--device nvidia.com/gpu=<UUID>`) where the host has an NVIDIA CDI spec
(nvidia-ctk cdi generate), else the booked /dev/nvidia<N> nodes, nvidiactl and nvidia-uvm*, and the
driver's user-space libraries, read-only, as the NVIDIA Container Toolkit would mount them. Never
the host's /dev, never a runtime's socket.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

from django.conf import settings

from jobs.host.containers import LABEL_INSTANCE, LABEL_SERVER, LABEL_WORK, ContainerError, local_name
from jobs.host.executors.base import RunSpec

# The control nodes every CUDA process opens besides its cards' (those the host has).
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
# The driver's user-space libraries the toolkit mounts for "compute,utility" (libnvidia-container's
# list): CUDA's driver API, NVML, the PTX JIT and NVVM, and their helpers.
DRIVER_LIBRARIES = (
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-ml.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-cfg.so",
    "libnvidia-gpucomp.so",
    "libnvidia-allocator.so",
    "libnvidia-opencl.so",
)
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def run_argv(spec: RunSpec, container: str, folder: Path, *, rootless: bool = False) -> list[str]:
    """`podman run`'s arguments (after the program) for `spec` in its image, named `container`;
    `folder` is the run's own (its environment file; where Podman writes its id and conmon's pid).
    `rootless`: run by the account's own Podman, whose user namespace maps the account to itself
    (--userns keep-id: the uid inside is the job's, and the files it writes are the account's)."""
    image = spec.image
    assert image is not None
    uid, gid = (spec.account.pw_uid, spec.account.pw_gid) if spec.account else (os.getuid(), os.getgid())
    work = container.rsplit("-", 2)
    argv = [
        # No --rm: the worker reads how it ended (OOMKilled) before it removes it (`podman rm`).
        "run", "--replace", "--name", container,  # --replace: a dead worker's leftover of this run
        "--label", f"{LABEL_INSTANCE}={settings.PORTAL_INSTANCE_ID}",
        "--label", f"{LABEL_WORK}={'-'.join(work[-2:])}",
        "--label", f"{LABEL_SERVER}={settings.WORKER_SERVER}",
        "--init",  # catatonit: a session leader that hands signals on and reaps
        *(("--userns", "keep-id") if rootless else ()),
        "--user", f"{uid}:{gid}",
        "--cap-drop", "all", "--security-opt", "no-new-privileges",
        "--network", "host" if image.network else "none",
        "--log-driver", "none",  # the worker keeps the log; Podman need not keep a second copy
        "--env-file", str(folder / "env"),
        "--cidfile", str(folder / "cid"), "--conmon-pidfile", str(folder / "conmon.pid"),
        "--workdir", str(spec.cwd),
    ]  # fmt: skip
    if spec.pass_fds:  # a lab's listening socket: the client holds them from 3 on (podman._preexec)
        argv += ["--preserve-fds", str(len(spec.pass_fds))]
    argv += mount_args(spec.mounts)
    argv += device_args(spec.gpu_uuids, spec.gpu_minors)
    if image.reference.startswith("/") and not rootless:
        # A folder of the hosts: an overlay over it (:O), so nothing a run writes reaches the folder.
        # --rootfs is a flag, its path the positional image: last, after "--" as any image (below).
        argv += ["--rootfs", "--", f"{image.reference}:O"]
    else:
        # Pulled before (image_pull); a folder, rootless: imported into the account's storage.
        # "--": whatever the reference says, Podman reads it as the image, never as an option.
        argv += ["--pull", "never", "--", local_name(image.reference, spec.account if rootless else None)]
    return [*argv, *spec.argv]


def mount_args(mounts: Sequence[tuple[str, bool]]) -> list[str]:
    """Each host folder at its own path (writable or read-only), those that exist."""
    argv: list[str] = []
    for path, writable in mounts:
        if "," in path or ":" in path:
            raise ContainerError(
                f"The folder {path} cannot be mounted into a container (',' or ':' in its path)."
            )
        if Path(path).exists():
            argv += ["--volume", f"{path}:{path}:{'rw' if writable else 'ro'}"]
    return argv


def device_args(uuids: Sequence[str], minors: Sequence[int]) -> list[str]:
    """The booked cards, and only them (see the module's docstring)."""
    if cdi_spec_found():
        return [arg for uuid in uuids for arg in ("--device", f"nvidia.com/gpu={uuid}")]
    folder = Path(settings.CONTAINER_DEVICE_DIR)
    argv: list[str] = []
    for uuid, minor in zip(uuids, minors, strict=True):
        node = folder / f"nvidia{minor}"
        if not node.exists():
            raise ContainerError(
                f"The booked card {uuid} has no device node {node} on this host: the NVIDIA driver is"
                " not loaded, or CONTAINER_DEVICE_DIR is wrong (docs/containers.md)."
            )
        argv += ["--device", f"{node}:/dev/nvidia{minor}:rw"]
    if uuids:
        for name in CONTROL_NODES:
            if (folder / name).exists():
                argv += ["--device", f"{folder / name}:/dev/{name}:rw"]
        for path in driver_libraries():
            argv += ["--volume", f"{os.path.realpath(path)}:{path}:ro"]
    return argv


def cdi_spec_found() -> bool:
    """Whether an NVIDIA CDI spec (kind nvidia.com/gpu) is in one of CONTAINER_CDI_DIRS."""
    for folder in settings.CONTAINER_CDI_DIRS:
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        for name in names:
            if name.endswith((".json", ".yaml", ".yml")):
                try:
                    if "nvidia.com/gpu" in (Path(folder) / name).read_text(errors="replace"):
                        return True
                except OSError:
                    continue
    return False


@functools.cache
def driver_libraries() -> tuple[str, ...]:
    """The driver's libraries as the host's loader cache lists them (none without a driver)."""
    try:
        listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ()
    found: list[str] = []
    for line in listed.splitlines():
        name, _, path = line.strip().partition(" => ")
        if (
            path.startswith("/")
            and name.split(" ", 1)[0].startswith(DRIVER_LIBRARIES)
            and not any(part in path for part in ("/lib32/", "/i386-"))  # the 32-bit copies: not for CUDA
        ):
            found.append(path.strip())
    return tuple(dict.fromkeys(found))


def env_file_text(env: dict[str, str]) -> str:
    """The container's environment as Podman's --env-file reads it: one NAME=value a line, so a
    name or value with a line break cannot be passed (said, with the variable's name)."""
    lines = []
    for name, value in env.items():
        if not ENV_NAME.fullmatch(name):
            raise ContainerError(f"The variable name {name!r} cannot be passed into a container.")
        if "\n" in value or "\r" in value or "\0" in value:
            raise ContainerError(
                f"The value of {name} holds a line break, which a container's environment cannot"
                " take: set it without one."
            )
        lines.append(f"{name}={value}\n")
    return "".join(lines)
