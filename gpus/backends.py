"""Choose the GPU backend for this host: real NVML, or the labelled simulation."""

from __future__ import annotations

import logging
from pathlib import Path

from django.conf import settings

from gpus.inventory import Backend
from gpus.nvml import NvmlBackend, NvmlNotInstalled, nvml_library_found
from gpus.simulated.backend import SimulatedBackend
from gpus.simulated.inventory import DEFAULT_INVENTORY, InventoryError, server_names
from gpus.slurm_inventory import SlurmBackend

log = logging.getLogger(__name__)


def get_backend(kind: str | None = None, server_name: str | None = None) -> Backend:
    """The backend `kind` (default GPU_BACKEND) names; raises BackendUnavailable for the caller to retry.

    `auto` falls back to the simulation only where there is no NVML library at all: a machine
    without an NVIDIA driver. On a host with a driver whose NVML fails to start, made-up cards
    would hide a broken GPU host, so `auto` raises like `nvml` does, which never falls back.
    """
    kind = kind or settings.GPU_BACKEND
    server_name = server_name or settings.WORKER_SERVER
    if kind == "slurm":  # a Slurm cluster, read from its login node (docs/slurm.md)
        return SlurmBackend(server_name)
    if kind in ("nvml", "auto"):
        try:
            return NvmlBackend(server_name, round_timeout=settings.NVML_ROUND_TIMEOUT_SECONDS)
        except NvmlNotInstalled as exc:
            if kind == "nvml":
                raise
            log.warning(
                "No NVIDIA driver on this host (%s); GPU_BACKEND=auto uses the SIMULATED inventory.", exc
            )
    path = Path(settings.SIMULATED_INVENTORY) if settings.SIMULATED_INVENTORY else None
    return SimulatedBackend(server_name, path, processes_file=Path(settings.SIMULATED_PROCESSES_FILE))


def simulated_server_problem() -> str:
    """Why this host's worker cannot report its server from the simulated inventory ("" when it
    can, or when it reports real cards): WORKER_SERVER names no server there, or the file is
    malformed. Asked before the worker starts, so a typo stops it, naming the servers it knows,
    instead of a worker that says it is ready while its reporter fails every round."""
    simulating = settings.GPU_BACKEND == "simulated" or (
        settings.GPU_BACKEND == "auto" and not nvml_library_found()
    )
    if not simulating:
        return ""
    path = Path(settings.SIMULATED_INVENTORY) if settings.SIMULATED_INVENTORY else None
    try:
        known = server_names(path)
    except InventoryError as exc:
        return f"SIMULATED_INVENTORY: {exc}"
    if settings.WORKER_SERVER in known:
        return ""
    return (
        f"WORKER_SERVER={settings.WORKER_SERVER!r} is no server of the simulated inventory"
        f" {path or DEFAULT_INVENTORY}, which knows {', '.join(known)}. Set WORKER_SERVER to one of"
        " them, or SIMULATED_INVENTORY to a file of your own that names this server (docs/deploy.md,"
        ' "Trying it on servers without GPUs")'
    )
