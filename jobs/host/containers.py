"""Containers on a GPU host (issue 34, docs/containers.md): whether this host can run them, and
getting an image onto it. The executor that runs work in them is jobs/host/executors/podman.py.

CONTRACT (filled in by the executor's work): `runtime_status()` is called by the host's worker
when it starts (its answer goes to Server.containers_ok/containers_detail), `image_pull()` by the
pre-pull task and before a job's first run in an image.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable


class ContainerError(Exception):
    """A container could not be had: the message says what happened and what to do."""


def runtime_status() -> tuple[bool, str]:
    """Whether containers can run on this host, and what was found (the runtime and its version,
    or what is missing and how to install it)."""
    podman = shutil.which("podman")
    if podman is None:
        return False, "podman is not installed on this host (apt install podman runc uidmap)."
    return True, f"podman at {podman}"


def image_pull(reference: str, say: Callable[[str], None]) -> None:
    """Get `reference` onto this host (cached: a second call is quick), saying its progress in
    lines ("pulling tf-2.17: 1.2 / 4.8 GB"); ContainerError when it cannot."""
    raise ContainerError(f"Cannot pull {reference}: pulling images is not built yet.")
