"""What a GPU backend reports about its host: plain data, no Django.

Both backends (real NVML in ``gpus.nvml``, the simulated one in ``gpus.simulated``)
return a :class:`Snapshot`. ``None`` in a metric means "n/a": the driver does not
support that query on this card (``NVMLError_NotSupported``), which the UI shows as
"n/a" instead of failing the whole report.
"""

from __future__ import annotations

import json
import operator
from dataclasses import asdict, dataclass, field, fields
from typing import Protocol


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    username: str  # OS user owning the process, "?" when it cannot be read
    command: str  # command line, truncated to 300 characters
    used_memory_mb: int | None = None  # MiB, as NVML counts
    # os.getsid(pid): every job runs in a session of its own whose id is the pid the worker
    # recorded, so the session names the job without privileges, and the job cannot forge it.
    # None for a process that is gone, and for the simulation's invented processes.
    session_id: int | None = None
    # psutil's create_time: with the pid, the process for good (portal.pids). None where it could
    # not be read (gone, another PID namespace, the simulation's invented processes): such a
    # process is shown and judged, never signalled.
    started: float | None = None
    # The portal job, resolved from session_id at ingest (gpus.services); never read from the
    # process itself, whose environment is the job's to set.
    job_id: int | None = None
    # The interactive session (`gpu exec`, a JupyterLab kernel) whose session the process is in,
    # resolved at ingest as job_id is (jobs.sessions.services.sessions_by_session).
    interactive_id: int | None = None
    # For a process that left the session it was started in (a job's child that called setsid):
    # the session of its nearest ancestor in another session, while the line of parents holds
    # (gpus.procinfo.parent_session_of). A run is found by its session, else by this one, so such
    # a child stays its job's. None where the line broke, or could not be read.
    parent_session_id: int | None = None


# A process's fields in their declared order: the columns of its stored row (gpus.services) and
# what a checked report compares (gpus.sanitize), one list for both.
PROCESS_FIELDS = tuple(f.name for f in fields(ProcessInfo))
process_values = operator.attrgetter(*PROCESS_FIELDS)


class CardState:
    OK = "ok"
    LOST = "lost"  # fell off the bus (NVML_ERROR_GPU_IS_LOST): not bookable until it answers again
    UNRESPONSIVE = "unresponsive"  # NVML did not answer within the round's time bound
    ALL = (OK, LOST, UNRESPONSIVE)


@dataclass(frozen=True)
class GPUInfo:
    uuid: str  # NVML UUID, e.g. "GPU-8f6c…"; the stable key of a card
    index: int  # NVML index (PCI bus order)
    name: str
    pci_bus_id: str
    memory_total_mb: int
    memory_reserved_mb: int = 0  # held back by the driver (nvmlMemory_v2_t.reserved)
    memory_used_mb: int | None = None
    utilization_pct: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    mig_mode: str | None = None  # "enabled", "disabled", or None when not supported
    # None: the list could not be read (no permission, MIG without privileges): "unknown",
    # which is not the same as idle.
    processes: tuple[ProcessInfo, ...] | None = ()
    # CardState: a lost or unresponsive card's hardware facts above are placeholders, which the
    # ingest never stores over the known ones.
    state: str = CardState.OK
    # On a Slurm cluster (gpus/slurm_inventory.py): the node the card is in (its index is Slurm's
    # IDX there) and the Slurm job holding it; blank on a GPU host.
    node: str = ""
    slurm_job: str = ""


@dataclass(frozen=True)
class NodeInfo:
    """A Slurm node as `scontrol show node` describes it (gpus.models.SlurmNode)."""

    name: str
    state: str  # SlurmNode.State: idle, mixed, allocated, drained, down, other
    slurm_state: str = ""  # Slurm's own words (IDLE+DRAIN)
    reason: str = ""
    partitions: str = ""
    cpus: int = 0
    memory_mb: int = 0
    gpus: int = 0
    gpus_used: int = 0


@dataclass(frozen=True)
class HostInfo:
    name: str  # the server's name in the portal (WORKER_SERVER)
    hostname: str
    driver_version: str = ""
    cuda_version: str = ""
    cpu_count: int = 0
    ram_mb: int = 0
    simulated: bool = False


@dataclass(frozen=True)
class Snapshot:
    host: HostInfo
    gpus: tuple[GPUInfo, ...] = field(default_factory=tuple)
    nodes: tuple[NodeInfo, ...] = ()  # a Slurm cluster's nodes; none for a GPU host


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this host (e.g. no NVIDIA driver)."""


class Backend(Protocol):
    def snapshot(self) -> Snapshot: ...

    def close(self) -> None: ...


def snapshot_to_json(snapshot: Snapshot) -> str:
    return json.dumps(asdict(snapshot), separators=(",", ":"))


def snapshot_from_json(raw: str | bytes) -> Snapshot:
    data = json.loads(raw)
    gpus = tuple(
        GPUInfo(**{**g, "processes": _processes_from_json(g.get("processes", ()))})
        for g in data.get("gpus", ())
    )
    nodes = tuple(NodeInfo(**n) for n in data.get("nodes", ()))
    return Snapshot(host=HostInfo(**data["host"]), gpus=gpus, nodes=nodes)


def _processes_from_json(raw: list[dict] | None) -> tuple[ProcessInfo, ...] | None:
    return None if raw is None else tuple(ProcessInfo(**p) for p in raw)
