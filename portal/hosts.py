"""Which GPU hosts this machine stands for, asked by `make run` (runportal) and answered by the app
that knows GPUs: gpus registers its answer in its AppConfig.ready(), so portal never names gpus.
"""

from __future__ import annotations

from collections.abc import Callable

# (server names, whether they are simulated)
HostDiscovery = Callable[[], tuple[list[str], bool]]

_discovery: HostDiscovery | None = None


class HostDiscoveryError(Exception):
    """This machine's GPUs cannot be found as configured (e.g. GPU_BACKEND=nvml without NVML)."""


def host_discovery_register(discovery: HostDiscovery) -> None:
    """Set the one answer (gpus' AppConfig.ready()); registering again replaces it."""
    global _discovery
    _discovery = discovery


def worker_hosts() -> tuple[list[str], bool]:
    """The servers this machine runs a host worker for, and whether they are simulated; none when
    no app registered an answer."""
    if _discovery is None:
        return [], False
    return _discovery()
