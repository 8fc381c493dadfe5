"""Range checks on what a host reports, before the ingest stores it.

A report is data from another machine, and parts of it (a process's command line, its user
name) come from users' processes. One out-of-range number must never abort the round's
transaction, which holds every host's telemetry: a value that does not fit its column
becomes "unknown" (None), a process without a usable pid is dropped, a card without a usable
UUID is dropped, and a host whose name is no server name is dropped whole.
"""

from __future__ import annotations

import logging
import operator
import re
from dataclasses import replace

from gpus.inventory import CardState, GPUInfo, HostInfo, NodeInfo, ProcessInfo, Snapshot, process_values

log = logging.getLogger(__name__)

# The columns' bounds (PostgreSQL integer / smallint; PositiveIntegerField checks >= 0).
INT_MAX = 2**31 - 1
SMALLINT_MAX = 2**15 - 1
BIGINT_MAX = 2**63 - 1
# Physical bounds, tighter than the columns where a value outside them can only be garbage.
TEMPERATURE_C = (-50, 150)
POWER_W = (0.0, 100_000.0)
UUID_MAX_CHARS = 64
NODE_STATES = ("idle", "mixed", "allocated", "drained", "down", "other")  # gpus.models.SlurmNode.State
SERVER_NAME = re.compile(r"^[-a-zA-Z0-9_]{1,63}$")


def int_in(value: object, low: int, high: int) -> int | None:
    """`value` when it is an int (not a bool) within [low, high]; otherwise None."""
    # A plain int (nearly every value: a bool's type is bool) is told by one comparison.
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, int)):
        return None
    return value if low <= value <= high else None


def float_in(value: object, low: float, high: float) -> float | None:
    if type(value) is not float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        value = float(value)
    return value if low <= value <= high else None  # NaN and the infinities are outside any bounds


def text(value: object, max_chars: int) -> str:
    if not isinstance(value, str):
        return ""
    if value.isprintable():  # nearly every value: no character to replace, one C call
        return value[:max_chars]
    return "".join(ch if ch.isprintable() else " " for ch in value)[:max_chars]


def checked_snapshot(snapshot: Snapshot) -> Snapshot | None:
    """The snapshot with every value in range, or None when its host cannot be named."""
    host = snapshot.host
    if not isinstance(host.name, str) or not SERVER_NAME.match(host.name):
        log.warning("Dropped a report from a host named %r: not a server name", host.name)
        return None
    gpus = tuple(card for g in snapshot.gpus if (card := _checked_card(g)) is not None)
    nodes = tuple(node for n in snapshot.nodes if (node := _checked_node(n)) is not None)
    return Snapshot(host=_checked_host(host), gpus=gpus, nodes=nodes)


def _checked_host(host: HostInfo) -> HostInfo:
    return HostInfo(
        name=host.name,
        hostname=text(host.hostname, 255),
        driver_version=text(host.driver_version, 32),
        cuda_version=text(host.cuda_version, 16),
        cpu_count=int_in(host.cpu_count, 0, INT_MAX) or 0,
        ram_mb=int_in(host.ram_mb, 0, BIGINT_MAX) or 0,
        simulated=host.simulated is True,
    )


def _checked_card(g: GPUInfo) -> GPUInfo | None:
    index = int_in(g.index, 0, SMALLINT_MAX)
    if not isinstance(g.uuid, str) or not 0 < len(g.uuid) <= UUID_MAX_CHARS or index is None:
        log.warning("Dropped a card reported as %r, index %r: no usable UUID or index", g.uuid, g.index)
        return None
    total = int_in(g.memory_total_mb, 0, INT_MAX) or 0
    processes = None
    if g.processes is not None:
        processes = tuple(p for p in map(_checked_process, g.processes) if p is not None)
        if len(processes) == len(g.processes) and all(map(operator.is_, processes, g.processes)):
            processes = g.processes
    checked = (
        index,
        text(g.name, 100) or "Unknown GPU",
        text(g.pci_bus_id, 32),
        total,
        int_in(g.memory_reserved_mb, 0, total) or 0,
        int_in(g.memory_used_mb, 0, INT_MAX),
        int_in(g.utilization_pct, 0, 100),
        int_in(g.temperature_c, *TEMPERATURE_C),
        float_in(g.power_w, *POWER_W),
        float_in(g.power_limit_w, *POWER_W),
        g.mig_mode if g.mig_mode in ("enabled", "disabled") else None,
        processes,
        g.state if g.state in CardState.ALL else CardState.OK,
        text(g.node, 64),
        text(g.slurm_job, 32),
    )
    if all(map(operator.is_, checked, _card_values(g))):
        return g  # every value in range as it came: the report's own card (see _unchanged)
    return replace(g, **dict(zip(_CARD_FIELDS, checked, strict=True)))


# A checked value that was in range is the reported object itself (int_in, text and float_in return
# it as it came): when all are, the report's own card or process serves rather than a copy, which
# was most of this module's cost at 512 cards a round.
_CARD_FIELDS = (
    "index",
    "name",
    "pci_bus_id",
    "memory_total_mb",
    "memory_reserved_mb",
    "memory_used_mb",
    "utilization_pct",
    "temperature_c",
    "power_w",
    "power_limit_w",
    "mig_mode",
    "processes",
    "state",
    "node",
    "slurm_job",
)
_card_values = operator.attrgetter(*_CARD_FIELDS)


def _checked_node(n: NodeInfo) -> NodeInfo | None:
    name = text(n.name, 64)
    if not name:
        return None
    return NodeInfo(
        name=name,
        state=n.state if n.state in NODE_STATES else "other",
        slurm_state=text(n.slurm_state, 100),
        reason=text(n.reason, 200),
        partitions=text(n.partitions, 200),
        cpus=int_in(n.cpus, 0, INT_MAX) or 0,
        memory_mb=int_in(n.memory_mb, 0, BIGINT_MAX) or 0,
        gpus=int_in(n.gpus, 0, SMALLINT_MAX) or 0,
        gpus_used=int_in(n.gpus_used, 0, SMALLINT_MAX) or 0,
    )


def _checked_process(p: ProcessInfo) -> ProcessInfo | None:
    pid = int_in(p.pid, 2, INT_MAX)  # 0 and 1 are no process a job or a user runs (portal.pids)
    if pid is None:
        return None
    checked = (
        pid,
        text(p.username, 64) or "?",
        text(p.command, 300),
        int_in(p.used_memory_mb, 0, INT_MAX),
        int_in(p.session_id, 1, INT_MAX),
        float_in(p.started, 0, 2**40),  # with the pid, the process's identity
        None,  # job_id and interactive_id: never taken from a report, the ingest resolves them
        None,
        int_in(p.parent_session_id, 1, INT_MAX),
    )
    if all(map(operator.is_, checked, process_values(p))):
        return p
    return ProcessInfo(*checked)
