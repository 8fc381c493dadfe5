"""Choose the GPU backend for this host: real NVML, or the labelled simulation."""

from __future__ import annotations

import logging
from pathlib import Path

from django.conf import settings

from gpus.inventory import Backend, BackendUnavailable

log = logging.getLogger(__name__)


def get_backend(kind: str | None = None, server_name: str | None = None) -> Backend:
    """`nvml` fails loudly without a driver; `auto` falls back to the simulation with a log line."""
    kind = kind or settings.GPU_BACKEND
    server_name = server_name or settings.WORKER_SERVER
    if kind in ("nvml", "auto"):
        from gpus.nvml import NvmlBackend

        try:
            return NvmlBackend(server_name)
        except BackendUnavailable as exc:
            if kind == "nvml":
                raise
            log.warning("No NVIDIA driver answered (%s); GPU_BACKEND=auto uses the SIMULATED inventory.", exc)
    from gpus.simulated import SimulatedBackend

    path = Path(settings.SIMULATED_INVENTORY) if settings.SIMULATED_INVENTORY else None
    return SimulatedBackend(server_name, path)
