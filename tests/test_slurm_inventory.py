"""A Slurm cluster's inventory (issue 37): `scontrol -o` text as nodes, cards and their holders,
and a round stored by the telemetry ingest. Recorded output of Slurm 22.05 (tests/slurm/), no
cluster needed; the real cluster's tier is tests/test_slurm.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpus.inventory import BackendUnavailable, snapshot_from_json, snapshot_to_json
from gpus.models import GPU, Server, SlurmCluster, SlurmNode
from gpus.services import servers_report_ingest
from gpus.slurm_cli import (
    JobGres,
    SlurmCommands,
    SlurmUnreachable,
    hostnames,
    indices,
    job_gres,
    node_state,
    pairs,
)
from gpus.slurm_inventory import SlurmBackend, cluster_snapshot, slurm_gpu_uuid

RECORDED = Path(__file__).parent / "slurm"
NODES = (RECORDED / "nodes.txt").read_text()
JOBS = (RECORDED / "jobs.txt").read_text()


def test_it_reads_values_with_spaces_and_repeated_keys():
    found = pairs("NodeName=vm OS=Linux 6.1 #1 SMP  RealMemory=2000 Nodes=a GRES=gpu:1(IDX:0) Nodes=b")
    assert found == [
        ("NodeName", "vm"),
        ("OS", "Linux 6.1 #1 SMP"),
        ("RealMemory", "2000"),
        ("Nodes", "a"),
        ("GRES", "gpu:1(IDX:0)"),
        ("Nodes", "b"),
    ]


def test_it_expands_hostlists_and_index_lists():
    assert hostnames("gpu[01-03,07],login") == ["gpu01", "gpu02", "gpu03", "gpu07", "login"]
    assert hostnames("node[1-2]-ib,r[1-2]n[1-2]") == ["node1-ib", "node2-ib", "r1n1", "r1n2", "r2n1", "r2n2"]
    assert indices("0-2,5") == [0, 1, 2, 5]


@pytest.mark.parametrize(
    ("slurm", "portal"),
    [
        ("IDLE", "idle"),
        ("MIXED", "mixed"),
        ("ALLOCATED", "allocated"),
        ("IDLE+DRAIN", "drained"),
        ("MIXED+DRAIN", "drained"),
        ("DRAINED", "drained"),
        ("DOWN*", "down"),
        ("IDLE*", "down"),
        ("IDLE+NOT_RESPONDING", "down"),
        ("COMPLETING", "allocated"),
        ("FUTURE", "other"),
    ],
)
def test_it_names_node_states_as_the_portal_shows_them(slurm, portal):
    assert node_state(slurm) == portal


def test_it_finds_which_job_holds_which_gpu():
    held = {g.job_id: g.held for g in job_gres(JOBS)}
    assert held == {"1": (("vm", 0), ("vm", 1)), "3": (("gpu02", 1), ("gpu02", 2))}


def test_a_gres_other_than_gpus_holds_no_gpu():
    line = "JobId=5 JobState=RUNNING Nodes=vm CPU_IDs=0 Mem=10 GRES=nic:1(IDX:0),gpu:a100:1(IDX:2)"
    assert job_gres(line) == [JobGres("5", (("vm", 2),))]  # the NIC's IDX 0 is no card


def test_it_builds_a_snapshot_of_nodes_cards_and_holders():
    snap = cluster_snapshot("cluster-a", NODES, JOBS)
    nodes = {n.name: n for n in snap.nodes}
    assert {n: (v.state, v.gpus, v.gpus_used) for n, v in nodes.items()} == {
        "vm": ("mixed", 4, 2),
        "gpu02": ("drained", 3, 2),
        "cpu01": ("down", 0, 0),
    }
    assert nodes["gpu02"].reason == "Kill task failed [root@2026-11-29T10:21:00]"
    cards = [(g.node, g.index, g.name, g.slurm_job) for g in snap.gpus]
    assert cards == [
        ("vm", 0, "GPU", "1"),
        ("vm", 1, "GPU", "1"),
        ("vm", 2, "GPU", ""),
        ("vm", 3, "GPU", ""),
        ("gpu02", 0, "A100", ""),
        ("gpu02", 1, "A100", "3"),
        ("gpu02", 2, "V100", "3"),
    ]
    assert all(g.processes is None for g in snap.gpus)  # unknown, not idle
    assert snapshot_from_json(snapshot_to_json(snap)) == snap


def test_it_shows_only_the_partitions_asked_for():
    snap = cluster_snapshot("cluster-a", NODES, JOBS, partitions=["long"])
    assert [n.name for n in snap.nodes] == ["gpu02"]


def test_a_long_name_still_makes_a_card_id_that_fits():
    assert slurm_gpu_uuid("c", "n1", 3) == "slurm:c:n1:3"
    long = slurm_gpu_uuid("c" * 63, "node-with-a-long-name", 7)
    assert len(long) <= 64 and long.endswith(":7")


@pytest.mark.django_db
def test_the_ingest_stores_nodes_and_cards_and_replaces_them_each_round():
    servers_report_ingest(snapshots=[cluster_snapshot("cluster-a", NODES, JOBS)])
    server = Server.objects.get(name="cluster-a")
    assert server.cpu_count == 98
    assert SlurmNode.objects.filter(server=server).count() == 3
    card = GPU.objects.get(uuid=slurm_gpu_uuid("cluster-a", "gpu02", 1))
    assert (card.node, card.index, card.slurm_job, card.processes_known) == ("gpu02", 1, "3", False)
    servers_report_ingest(snapshots=[cluster_snapshot("cluster-a", NODES, "")])
    card.refresh_from_db()
    assert card.slurm_job == ""
    assert SlurmNode.objects.filter(server=server).count() == 3
    assert SlurmNode.objects.get(server=server, name="vm").gpus_used == 0


@pytest.mark.django_db
def test_a_cluster_that_does_not_answer_is_unavailable(tmp_path):
    server = Server.objects.create(name="cluster-b", kind=Server.Kind.SLURM)
    hangs = tmp_path / "scontrol"
    hangs.write_text("#!/bin/sh\nexec sleep 30\n")
    hangs.chmod(0o755)
    SlurmCluster.objects.create(
        server=server, bin_dir=str(tmp_path), job_root=str(tmp_path), command_timeout_seconds=1
    )
    with pytest.raises(BackendUnavailable, match="does not answer: scontrol did not answer within 1 s"):
        SlurmBackend("cluster-b").snapshot()


@pytest.mark.django_db
def test_a_server_that_is_no_cluster_says_how_to_make_it_one():
    Server.objects.create(name="box1")
    with pytest.raises(BackendUnavailable, match="kind: Slurm cluster"):
        SlurmBackend("box1")


def test_a_missing_command_is_a_cluster_that_does_not_answer(tmp_path):
    with pytest.raises(SlurmUnreachable, match="cannot run"):
        SlurmCommands(bin_dir=str(tmp_path)).show("node")
