"""JupyterLab in a container image (issue 34; docs/sessions.md, docs/containers.md): what a lab's
supervisor (jobs.host.lab) does differently for a session whose image is set.

The lab runs through the Podman executor, as a job in an image does (jobs/host/executors/podman.py):
as its owner's account (root-run Podman with --user, or the account's own rootless Podman), with
the booked cards alone, no capabilities, the image's network setting, and stopped whole (its
container removed). What a lab adds:

- **Its listening socket.** The worker makes it on the host before the lab exists, as for a lab on
  the host, and hands it into the container (Podman's `--preserve-fds`) as fd 3. A socket stays
  in the network namespace it was made in, so the portal's proxy reaches it at the host's
  SESSION_BIND_ADDRESS whatever the container's network (none by default), no port is published,
  and the listener's proof (jobs/host/lab_listener.py) is the host lab's: that very socket, by
  inode, held by the lab's command (the container init's child).
- **Its folders.** The owner's home (the lab's root folder, as on the host) and JOB_ROOTS,
  writable at their own paths; the portal's kernel spec and the job launcher read-only, so each
  kernel applies the booking's caps as on the host.
- **The image's Python.** The image's `python3` (first on the image's PATH) runs the lab's launcher
  and JupyterLab: the image must have them (an admin marks it: ContainerImage.has_jupyterlab).
  Jupyter's runtime files (the kernels' connection files and keys) stay in the container's /tmp.
"""

from __future__ import annotations

import os
import pwd
import socket
from collections.abc import Callable, Mapping
from dataclasses import replace

from django.conf import settings

from gpus.models import GPU
from jobs.environment import INHERITED_ENV, JobSetupError
from jobs.host.containers import ContainerError, card_minors
from jobs.host.executors.base import ImageSpec, RunSpec
from jobs.host.executors.podman import FIRST_PASSED_FD
from jobs.host.launch import HOST_ONLY_ENV, IMAGE_PYTHON, IMAGE_VAR, LAUNCHER, image_ready_for
from jobs.models import InteractiveSession

LISTEN_FD_INSIDE = FIRST_PASSED_FD  # the one descriptor the lab is passed
RUNTIME_DIR = "/tmp/portal-jupyter-runtime"  # inside the container: its own /tmp, thrown away with it


def lab_image(session: InteractiveSession) -> ImageSpec | None:
    """The image the lab runs in, as the host needs it; None: on the host."""
    if session.image_id is None:
        return None
    image = session.image
    assert image is not None
    return ImageSpec(image.name, image.reference, image.network)


def lab_image_ready(
    image: ImageSpec,
    account: pwd.struct_passwd | None,
    say: Callable[[str], None],
    beat: Callable[[], bool],
) -> None:
    """Never as root; containers working here, the image pulled on its first use (saying so,
    `beat` kept meanwhile); JobSetupError saying what to do otherwise."""
    if account is None and os.geteuid() == 0:
        raise JobSetupError(
            f"labs in container images never run as root, and this host's worker ({socket.gethostname()})"
            f" runs as root with no JOB_USER: an admin sets JOB_USER=@owner there"
        )
    image_ready_for(image, account, say, beat)


def lab_image_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The worker's variables a lab in an image inherits: INHERITED_ENV, but not those that name
    the host's files (PATH, LD_LIBRARY_PATH...), which would hide the image's own."""
    return {name: environ[name] for name in INHERITED_ENV if name in environ and name not in HOST_ONLY_ENV}


def in_image(spec: RunSpec, session: InteractiveSession, image: ImageSpec, kernels: str) -> RunSpec:
    """`spec` (the lab as the host would run it, its socket in pass_fds) in `image`: the socket
    named by the number it gets inside, the booked cards named for the NVIDIA runtime too, the
    image's name, Jupyter's runtime files in the container, and what the container sees of the
    host (the lab's root folder and JOB_ROOTS writable; `kernels`, the launcher read-only)."""
    env = {
        **spec.env,
        "PORTAL_LAB_LISTEN_FD": str(LISTEN_FD_INSIDE),  # jobs.host.lab.LISTEN_FD_ENV
        "NVIDIA_VISIBLE_DEVICES": ",".join(session.gpu_uuids) or "void",
        IMAGE_VAR: image.name,
        "JUPYTER_PATH": kernels,  # the portal's kernel spec; the image's own come after it
        "JUPYTER_RUNTIME_DIR": RUNTIME_DIR,
    }
    indexes = dict(GPU.objects.filter(pk__in=session.gpu_uuids).values_list("pk", "index"))
    try:
        minors = card_minors(session.gpu_uuids, indexes)
    except ContainerError as exc:
        raise JobSetupError(f"{exc} (on {socket.gethostname()})") from None
    folders = dict.fromkeys([str(spec.cwd), *(str(root) for root in settings.JOB_ROOTS)])
    mounts = (*((path, True) for path in folders), (kernels, False), (str(LAUNCHER.parent), False))
    argv = [IMAGE_PYTHON, *spec.argv[1:]]
    return replace(spec, argv=argv, env=env, image=image, gpu_minors=minors, mounts=mounts)
