"""Pre-pulling container images on this host (issue 34): the task jobs.tasks.pull_images, and
`manage.py images_pull --here`. Each image listed for this server is pulled (cached by the
runtime: a second pull is quick) through jobs.host.containers.image_pull, and its outcome kept as
the pair's last pull (gpus.models.ImagePull, shown in the admin) and in the worker's log.
"""

from __future__ import annotations

import logging
import pwd
from collections.abc import Sequence
from dataclasses import dataclass

from gpus.images import image_pull_record
from gpus.models import ContainerImage, Server
from jobs.host import containers

log = logging.getLogger(__name__)

SAID_MAX = 50  # lines of a pull's progress kept for its outcome; its log has them all


@dataclass(frozen=True)
class Pulled:
    image: str
    ok: bool
    detail: str


def images_pull_here(server: Server, image_ids: Sequence[int] | None = None) -> list[Pulled]:
    """Pull each image listed for `server` (only `image_ids`, if given; an id no longer listed
    there is skipped), one after the other; one that fails never stops the rest."""
    images = ContainerImage.objects.filter(servers=server).order_by("name")
    if image_ids is not None:
        images = images.filter(pk__in=list(image_ids))
    return [_pull(server, image) for image in images]


def _pull(server: Server, image: ContainerImage) -> Pulled:
    said: list[str] = []

    def say(line: str) -> None:
        log.info("Pulling %s on %s: %s", image.name, server.name, line)
        said[:] = [*said[-(SAID_MAX - 1) :], line]

    try:
        containers.image_pull(image.reference, say, account=_pulling_account(), name=image.name)
    except containers.ContainerError as exc:
        ok, detail = False, str(exc)
    except Exception as exc:  # a bug or fault in one pull: recorded, and the next image goes on
        log.exception("Pulling %s on %s failed", image.name, server.name)
        ok, detail = False, f"The pull failed unexpectedly ({exc!r}); see the worker's log."
    else:
        ok, detail = True, said[-1] if said else f"{image.name} is on {server.name}."
    if ok:
        log.info("Pulled %s on %s: %s", image.name, server.name, detail)
    else:
        log.warning("Could not pull %s on %s: %s", image.name, server.name, detail)
    image_pull_record(image=image, server=server, ok=ok, detail=detail)
    return Pulled(image.name, ok, detail)


def _pulling_account() -> pwd.struct_passwd | None:
    """Whose storage a pre-pull fills: root's in root mode (every job's), JOB_USER's in rootless
    mode (containers.host_account; ContainerError, said as the pull's outcome, under @owner)."""
    return containers.host_account()
