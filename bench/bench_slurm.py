"""Slurm clusters (issue 37): a job's first line on its page after Slurm starts it, and the
inventory round of a 64-node cluster.

What is measured
    1. Inventory round, no cluster needed: `scontrol show node -o` text of 64 nodes × 8 GPUs and
       `scontrol show job -d -o` text of 192 running jobs holding 2 GPUs each (generated in 22.05's
       shapes, as tests/slurm/ records them) read into a snapshot (`cluster_snapshot`: the
       worker's share of a round), then stored by the collector (`servers_report_ingest`, SQLite
       under PORTAL_VAR_DIR or DATABASE_URL's database). Median of 30 rounds after 3 warm-up
       rounds, with the holders moving every round. Goal: parse + store ≤ 100 ms a round.
    2. First log line, on a real single-node Slurm 22.05 cluster (tests/slurm_cluster.py: needs
       slurm-wlm and root; skipped, saying why, elsewhere): 10 jobs one after another, each
       submitted by `job_submit` (Slurm asked first: `sbatch --test-only`, answered by the
       worker's thread) and followed by the cluster worker's follower
       (jobs/host/slurm_runner.py) in a thread. The job's first line is its own start time
       (`time.time()`, printed as the launcher hands over to the script: Slurm's start and the
       launcher's own cost); the bench polls the database every 10 ms for that line: what a page
       loaded then shows (the live stream gets it sooner: the follower publishes each line as it
       reads it). Goal: max ≤ 2 s from the script's start to the stored line. Submit → stored is
       printed beside it (Slurm's own scheduling is in it: sched_interval=1).

A missed goal prints MISSED; the exit code is non-zero only on errors.
"""

from __future__ import annotations

import statistics
import threading
import time

from bench.common import median_ms, report, setup_django_test_db, wait_for

NODES, GPUS, JOBS = 64, 8, 192
TRIALS = 10


def nodes_text() -> str:
    return "\n".join(
        f"NodeName=gpu{n:03d} Arch=x86_64 CoresPerSocket=32 CPUAlloc=8 CPUEfctv=128 CPUTot=128 CPULoad=3.01 "
        f"AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:h100:{GPUS}(S:0-1) NodeAddr=gpu{n:03d} "
        f"NodeHostName=gpu{n:03d} Version=22.05.8 OS=Linux 6.1.0-18-amd64 #1 SMP PREEMPT_DYNAMIC Debian "
        f"RealMemory=1024000 AllocMem=64000 FreeMem=900000 Sockets=2 Boards=1 State=MIXED ThreadsPerCore=2 "
        f"TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu,long BootTime=2026-11-01T08:00:00 "
        f"SlurmdStartTime=2026-11-01T08:01:00 LastBusyTime=2026-11-29T10:00:00 CfgTRES=cpu=128,mem=1000G "
        f"AllocTRES=cpu=8,mem=64000M,gres/gpu=4 CapWatts=n/a CurrentWatts=0 AveWatts=0"
        for n in range(NODES)
    )


def jobs_text(shift: int) -> str:
    lines = []
    for j in range(JOBS):
        slot = (j + shift) % (NODES * GPUS // 2)
        node, first = divmod(slot * 2, GPUS)
        lines.append(
            f"JobId={1000 + j} JobName=train-{j} UserId=user{j % 30}(1{j % 30:03d}) GroupId=lab(2000) "
            f"MCS_label=N/A Priority=4294901759 Nice=0 Account=lab QOS=normal JobState=RUNNING Reason=None "
            f"Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=01:00:00 "
            f"TimeLimit=04:00:00 Partition=gpu NodeList=gpu{node:03d} BatchHost=gpu{node:03d} NumNodes=1 "
            f"NumCPUs=4 TRES=cpu=4,mem=32000M,node=1,gres/gpu=2 JOB_GRES=gpu:h100:2 "
            f"Nodes=gpu{node:03d} CPU_IDs=0-3 Mem=32000 GRES=gpu:h100:2(IDX:{first}-{first + 1}) "
            f"MinCPUsNode=1 Features=(null) Command=/shared/jobs/train.sbatch WorkDir=/shared/jobs "
            f"StdOut=/shared/jobs/{j}.out TresPerNode=gres:gpu:2"
        )
    return "\n".join(lines)


def bench_inventory() -> None:
    from gpus.services import servers_report_ingest
    from gpus.slurm_inventory import cluster_snapshot

    nodes = nodes_text()
    rounds = [jobs_text(shift) for shift in range(0, 30, 3)]
    state = {"round": 0}

    def parse() -> object:
        state["round"] += 1
        return cluster_snapshot("bench-cluster", nodes, rounds[state["round"] % len(rounds)])

    def parse_and_store() -> None:
        servers_report_ingest(snapshots=[parse()])

    parse_ms = median_ms(parse, repeat=30)
    round_ms = median_ms(parse_and_store, repeat=30)
    print(f"Slurm inventory ({NODES} nodes × {GPUS} GPUs, {JOBS} running jobs; median of 30 rounds)")
    report("read scontrol's text into a snapshot", parse_ms, "ms", "(none)", True)
    report("one round: read and store", round_ms, "ms", "<= 100 ms", round_ms <= 100)


FIRST = b"import time\nprint('started', repr(time.time()), flush=True)\n"


def bench_first_line() -> None:
    from django.db import connection
    from django.test import override_settings

    from gpus.models import Server, SlurmCluster
    from jobs.host.slurm_checks import SlurmSubmitChecks
    from jobs.host.slurm_runner import slurm_job_run
    from jobs.logs.store import log_stream
    from jobs.models import Job
    from jobs.submit import ScriptUpload, job_submit
    from portal.models import Profile
    from tests.factories import MembershipFactory, TeamFactory, UserFactory
    from tests.slurm_cluster import ClusterUnavailable, cluster_start, cluster_stop

    try:
        cluster = cluster_start()
    except ClusterUnavailable as exc:
        print(f"Slurm first line: skipped ({exc})")
        return
    checks = SlurmSubmitChecks("bench-slurm")  # the worker's answer to job_submit's question
    checks.start()
    try:
        server = Server.objects.create(name="bench-slurm", kind=Server.Kind.SLURM)
        SlurmCluster.objects.create(
            server=server, slurm_conf=str(cluster.conf), job_root=str(cluster.job_root)
        )
        user = UserFactory(username="bench-slurm")
        MembershipFactory(user=user, team=TeamFactory(slug="bench-slurm"))
        Profile.objects.update_or_create(user=user, defaults={"unix_account": "nobody"})
        over, total = [], []
        # This process is the cluster's worker: it claims the cluster's jobs (jobs.host.launch).
        with override_settings(JOB_INTERPRETERS={"default": "/usr/bin/python3"}, WORKER_SERVER=server.name):
            for _ in range(TRIALS):
                began = time.time()
                job = job_submit(
                    user=user, server=server.name, gpu_count=1, script=ScriptUpload("first.py", FIRST)
                )
                follower = threading.Thread(target=_follow, args=(slurm_job_run, connection, job.pk))
                follower.start()

                def stored(pk: int = job.pk) -> float | None:
                    text = b"".join(log_stream(pk)).decode()
                    for line in text.splitlines():
                        if " started " in line:
                            return float(line.rsplit(" ", 1)[1])
                    return None

                started = wait_for(stored, 60, what="the job's first line stored", interval=0.01)
                seen = time.time()
                over.append(seen - started)
                total.append(seen - began)
                wait_for(lambda pk=job.pk: Job.objects.get(pk=pk).is_finished, 60, what="the job's end")
                follower.join(30)
    finally:
        checks.stop()
        checks.join(10)
        cluster_stop(cluster)
    print(f"Slurm first log line ({TRIALS} jobs on a real single-node cluster)")
    report("script's start -> line stored, median", statistics.median(over), "s", "(none)", True)
    report("script's start -> line stored, max", max(over), "s", "<= 2 s", max(over) <= 2)
    report(
        "submit -> line stored, median (Slurm's start in it)", statistics.median(total), "s", "(none)", True
    )


def _follow(run, connection, job_id: int) -> None:  # type: ignore[no-untyped-def]
    try:
        run(job_id)
    finally:
        connection.close()


def main() -> None:
    teardown = setup_django_test_db()
    try:
        bench_inventory()
        bench_first_line()
    finally:
        teardown()


if __name__ == "__main__":
    main()
