"""A Slurm cluster's inventory as a telemetry backend (GPU_BACKEND=slurm; issue 37, docs/slurm.md).

The worker on the cluster's login node reads, every round, `scontrol show node -o` (each node, its
state and its GRES) and `scontrol show job -d -o` (which running job holds which GPU, by the IDX
of its GRES detail), and publishes them as any host's snapshot: the collector stores them by the
same path, no NVML on any node. A round is two commands, each with the cluster's deadline; a
controller that does not answer is `BackendUnavailable`, so the reporter publishes nothing and the
server goes offline by itself, as a dead GPU host does.

Slurm knows a card's node, index and type, not its memory or load: those are unknown (None), and
a card's id is made from the cluster, node and IDX (`slurm_gpu_uuid`), stable while the node's
GRES stays as it is.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Sequence

from gpus.inventory import BackendUnavailable, GPUInfo, HostInfo, NodeInfo, Snapshot
from gpus.models import Server, SlurmCluster
from gpus.slurm_cli import SlurmCommands, SlurmError, gpu_types, job_gres, node_state, records

UUID_MAX = 64  # GPU.uuid's length


def slurm_gpu_uuid(server: str, node: str, idx: int) -> str:
    """A Slurm card's key: readable where it fits GPU.uuid, a digest of the names where not."""
    uuid = f"slurm:{server}:{node}:{idx}"
    if len(uuid) <= UUID_MAX:
        return uuid
    return f"slurm:{hashlib.sha256(f'{server}:{node}'.encode()).hexdigest()[:32]}:{idx}"


def commands_for(cluster: SlurmCluster) -> SlurmCommands:
    return SlurmCommands(cluster.bin_dir, cluster.slurm_conf, float(cluster.command_timeout_seconds))


def cluster_snapshot(
    server: str, nodes_text: str, jobs_text: str, partitions: Sequence[str] = (), hostname: str = ""
) -> Snapshot:
    """One round's snapshot from the two commands' text: pure, for the tests and `make bench`.
    `partitions`: the nodes shown are those in one of them (none given: every node)."""
    wanted = set(partitions)
    holders = {(node, idx): g.job_id for g in job_gres(jobs_text) for node, idx in g.held}
    nodes, cards = [], []
    for record in records(nodes_text):
        name = record.get("NodeName", "")
        in_partitions = [p for p in record.get("Partitions", "").split(",") if p]
        if not name or (wanted and not wanted.intersection(in_partitions)):
            continue
        types = gpu_types(record.get("Gres", ""))
        held = [holders.get((name, idx), "") for idx in range(len(types))]
        slurm_state = record.get("State", "")
        nodes.append(
            NodeInfo(
                name=name,
                state=node_state(slurm_state),
                slurm_state=slurm_state,
                reason=_null(record.get("Reason", "")),
                partitions=",".join(in_partitions),
                cpus=_int(record.get("CPUTot", "")),
                memory_mb=_int(record.get("RealMemory", "")),
                gpus=len(types),
                gpus_used=sum(1 for h in held if h),
            )
        )
        cards.extend(
            GPUInfo(
                uuid=slurm_gpu_uuid(server, name, idx),
                index=idx,
                name=kind.upper() if kind else "GPU",
                pci_bus_id="",
                memory_total_mb=0,  # Slurm does not say
                processes=None,  # nor what runs on it: unknown, which is not idle
                node=name,
                slurm_job=held[idx],
            )
            for idx, kind in enumerate(types)
        )
    host = HostInfo(
        name=server,
        hostname=hostname,
        cpu_count=sum(n.cpus for n in nodes),
        ram_mb=sum(n.memory_mb for n in nodes),
    )
    return Snapshot(host=host, gpus=tuple(cards), nodes=tuple(nodes))


class SlurmBackend:
    """The inventory of the Slurm cluster `server_name` (its `SlurmCluster` row), read with its
    commands from this login node."""

    def __init__(self, server_name: str) -> None:
        try:
            cluster = SlurmCluster.objects.get(server__name=server_name, server__kind=Server.Kind.SLURM)
        except SlurmCluster.DoesNotExist:
            raise BackendUnavailable(
                f"server {server_name!r} is no Slurm cluster: add it in the admin (kind: Slurm cluster,"
                " with its Slurm settings) or set GPU_BACKEND for a GPU host"
            ) from None
        self.server = server_name
        self.commands = commands_for(cluster)
        self.partitions = cluster.partition_list
        self.hostname = socket.gethostname()

    def snapshot(self) -> Snapshot:
        try:
            nodes = self.commands.show("node")
            jobs = self.commands.run("scontrol", ["show", "job", "-d", "-o"])
        except SlurmError as exc:
            raise BackendUnavailable(f"Slurm cluster {self.server} does not answer: {exc}") from exc
        return cluster_snapshot(self.server, nodes, jobs, self.partitions, self.hostname)

    def close(self) -> None:
        pass


def _int(value: str) -> int:
    return int(value) if value.isdigit() else 0


def _null(value: str) -> str:
    return "" if value in ("(null)", "None", "N/A") else value
