"""A real single-node Slurm cluster for the Slurm tier (tests/test_slurm.py; issue 37), started once
per test process: `slurmctld -D` and `slurmd -D` as plain children, SLURM_CONF in a folder of its
own, four fake GPUs (character devices 195:N, which gres.conf wants: plain files are refused).

auth/none and cred/none are for tests only (never for a cluster people use). Slurm's own
intervals are shortened so that a job starts within a second and is forgotten two seconds after
its end (MinJobAge). Where Slurm cannot run (no packages, not root: `sbatch --uid` is root's, no
mknod), the tier skips saying why, and fails on CI (CI=true), which installs the packages.

At the end every job is cancelled before the daemons stop: a job's slurmstepd outlives its slurmd
and ignores SIGTERM. Whatever is left is found by this cluster's SLURM_CONF in its environment,
taken as a psutil handle, and killed by that handle.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from gpus.slurm_cli import SlurmCommands, SlurmError
from tests.waiting import wait_for

GPUS = 4
START_SECONDS = 20


@dataclass
class Cluster:
    folder: Path
    conf: Path
    node: str
    jobcomp: Path
    ctld: subprocess.Popen[bytes]
    slurmd: subprocess.Popen[bytes]

    @property
    def commands(self) -> SlurmCommands:
        return SlurmCommands(slurm_conf=str(self.conf), timeout=5)

    @property
    def job_root(self) -> Path:
        return self.folder / "jobs"

    def jobs(self) -> list[str]:
        return self.commands.run("squeue", ["-h", "-o", "%i"]).split()

    def controller_stop(self) -> None:
        """The controller stopped (its state saved): every command fails; the node and its jobs
        run on under slurmd, as on a cluster whose controller is down."""
        self.ctld.terminate()
        self.ctld.wait(10)

    def controller_start(self) -> None:
        """The controller again, from its saved state (its jobs with it), once it answers."""
        if self.ctld.poll() is None:
            return
        env = {**os.environ, "SLURM_CONF": str(self.conf)}
        with open(self.folder / "log" / "daemons.out", "ab") as out:
            self.ctld = subprocess.Popen(
                ["slurmctld", "-D", "-i"], env=env, stdout=out, stderr=subprocess.STDOUT
            )
        wait_for(self._answers, START_SECONDS, what="the Slurm controller answering again")

    def _answers(self) -> bool:
        try:
            self.commands.run("scontrol", ["ping"])
        except SlurmError:
            return False
        return True

    def cancel_all(self) -> None:
        """Every job cancelled, and gone from squeue."""
        if ids := self.jobs():
            self.commands.run("scancel", ids)
        wait_for(lambda: not self.jobs(), 30, what="every Slurm job cancelled")


def _skip_or_fail(why: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"The Slurm tier cannot run on CI: {why}")
    pytest.skip(f"Slurm tier skipped: {why}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_conf(folder: Path, node: str) -> Path:
    for name in ("state", "spool", "log", "dev", "jobs"):
        (folder / name).mkdir()
    (folder / "jobs").chmod(0o755)
    for n in range(GPUS):
        os.mknod(folder / "dev" / f"nvidia{n}", 0o666 | 0o020000, os.makedev(195, n))
    cpus = max(2, os.cpu_count() or 2)
    conf = folder / "slurm.conf"
    conf.write_text(
        f"""ClusterName=portaltest
SlurmctldHost={node}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
JobCompType=jobcomp/filetxt
JobCompLoc={folder}/log/jobcomp.txt
SchedulerParameters=sched_interval=1,bf_interval=1,batch_sched_delay=0
MinJobAge=2
KillWait=2
ReturnToService=2
DefMemPerCPU=10
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/ctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/log/ctld.log
SlurmdLogFile={folder}/log/slurmd.log
NodeName={node} CPUs={cpus} RealMemory=1000 Gres=gpu:{GPUS} State=UNKNOWN
PartitionName=gpu Nodes={node} Default=YES MaxTime=INFINITE State=UP
PartitionName=other Nodes={node} MaxTime=INFINITE State=UP
PartitionName=admin Nodes={node} MaxTime=INFINITE State=UP RootOnly=YES
"""
    )
    (folder / "gres.conf").write_text(f"Name=gpu File={folder}/dev/nvidia[0-{GPUS - 1}]\n")
    return conf


def _leftovers(conf: Path) -> list[psutil.Process]:
    """This cluster's processes (a job's slurmstepd and what it ran), by the SLURM_CONF they carry."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("SLURM_CONF") == str(conf):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


class ClusterUnavailable(Exception):
    """Slurm cannot run here: the message says why."""


def cluster_start() -> Cluster:
    """The cluster, its node idle; ClusterUnavailable where Slurm cannot run. `cluster_stop` ends it.
    Also what bench/bench_slurm.py runs its jobs on."""
    missing = [c for c in ("slurmctld", "slurmd", "sbatch", "scontrol") if shutil.which(c) is None]
    if missing:
        raise ClusterUnavailable(f"{', '.join(missing)} not installed (apt-get install slurm-wlm)")
    if os.geteuid() != 0:
        raise ClusterUnavailable(
            "not root: the portal's worker submits as each user with sbatch --uid, root's"
        )
    folder = Path(tempfile.mkdtemp(prefix="portal-slurm-", dir="/tmp"))
    folder.chmod(0o755)  # the jobs' accounts reach their folders under it
    node = socket.gethostname().split(".")[0]
    try:
        conf = _write_conf(folder, node)
    except PermissionError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise ClusterUnavailable(f"cannot make the fake GPUs' devices (mknod: {exc.strerror})") from None
    env = {**os.environ, "SLURM_CONF": str(conf)}
    with open(folder / "log" / "daemons.out", "wb") as out:  # the children keep their own copies
        ctld = subprocess.Popen(["slurmctld", "-D", "-i"], env=env, stdout=out, stderr=subprocess.STDOUT)
        slurmd = subprocess.Popen(["slurmd", "-D"], env=env, stdout=out, stderr=subprocess.STDOUT)
    cluster = Cluster(folder, conf, node, folder / "log" / "jobcomp.txt", ctld, slurmd)
    try:
        wait_for(lambda: _idle(cluster), START_SECONDS, what="the Slurm node idle")
    except BaseException:
        cluster_stop(cluster)
        raise
    return cluster


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Cluster]:
    try:
        cluster = cluster_start()
    except ClusterUnavailable as exc:
        _skip_or_fail(str(exc))
    try:
        yield cluster
    finally:
        cluster_stop(cluster)


def _idle(cluster: Cluster) -> bool:
    if cluster.ctld.poll() is not None or cluster.slurmd.poll() is not None:
        log = (cluster.folder / "log" / "daemons.out").read_text(errors="replace")[-2000:]
        raise AssertionError(f"a Slurm daemon exited at its start:\n{log}")
    try:
        return "State=IDLE" in cluster.commands.show("node")
    except SlurmError:
        return False


def cluster_stop(cluster: Cluster) -> None:
    """Every job cancelled, then the daemons, then what a job left, each by its handle."""
    cluster.ctld.send_signal(signal.SIGCONT)  # a test that froze it and failed
    with contextlib.suppress(AssertionError):
        cluster.controller_start()  # a test that stopped it and failed: its jobs are cancelled first
    with contextlib.suppress(SlurmError, AssertionError):  # what is left is killed below, by its handles
        cluster.cancel_all()
    for daemon in (cluster.slurmd, cluster.ctld):
        daemon.terminate()
    for daemon in (cluster.slurmd, cluster.ctld):
        try:
            daemon.wait(10)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    for proc in _leftovers(cluster.conf):
        try:
            proc.kill()
        except psutil.Error:
            continue
    shutil.rmtree(cluster.folder, ignore_errors=True)
