"""Which GPU hosts this machine stands for (`make run`): registered with portal.hooks in
GpusConfig.ready().

With real NVML that is this host; with the simulated inventory it is every simulated server.
"""

from __future__ import annotations

import logging
from pathlib import Path

from django.conf import settings

from gpus.inventory import BackendUnavailable
from gpus.nvml import NvmlBackend, NvmlNotInstalled
from gpus.simulated.inventory import server_names
from portal.hooks import HostDiscoveryError

log = logging.getLogger(__name__)


def worker_servers() -> tuple[list[str], bool]:
    """This host when NVML is installed, else every server of the simulated inventory.

    A driver that is installed but fails to initialise is still this host's: its worker starts
    with GPU_BACKEND=nvml, says so loudly and retries (gpus/telemetry.py), rather than showing
    a simulation in place of a broken real machine."""
    if settings.GPU_BACKEND == "slurm":  # a Slurm cluster's login node: the cluster is the server
        return [settings.WORKER_SERVER], False
    if settings.GPU_BACKEND != "simulated":
        try:
            NvmlBackend(settings.WORKER_SERVER).close()
        except NvmlNotInstalled as exc:
            if settings.GPU_BACKEND == "nvml":
                raise HostDiscoveryError(f"GPU_BACKEND=nvml but NVML is not installed: {exc}") from exc
        except BackendUnavailable as exc:
            log.error("NVML is installed but failed to start (%s); the host worker will keep retrying", exc)
            return [settings.WORKER_SERVER], False
        else:
            return [settings.WORKER_SERVER], False
    return server_names(Path(settings.SIMULATED_INVENTORY) if settings.SIMULATED_INVENTORY else None), True
