"""Jobs: submit → first line of the script, launcher overhead on Keras, and a 1 GiB log download.

What is measured (MB = 2**20 bytes)
    1. Submit → first line. A real `celery -A portal worker` for a simulated GPU host
       (GPU_BACKEND=simulated, queue host.<name>, prefork pool, --concurrency 1 as in production)
       runs on the bench's test database and the configured Redis (REDIS_URL). A user in a team
       books one card (`reservation_create`); then 20 jobs, one after the other (one job per booking
       at a time), each an upload whose first statement is
       `import time; print("FIRST", time.time(), flush=True)`: t0 = time.time(); `job_submit(...)`
       (it dispatches when its atomic block commits: the bench runs in autocommit); poll the row until
       the job finished; read "FIRST <t>" back from the stored log (`jobs.logs.store.log_stream`); t − t0.
       2 warm-up jobs first. Compared with a bare `python script.py` started by the bench (the same
       interpreter; time from before Popen to the printed time; median of 20 after 2 warm-ups).
       Goal: overhead (portal median − bare median) ≤ 0.5 s. The split of the portal's median at the
       row's started_at (the worker's Popen returned) is printed too, without a goal.
    2. Launcher overhead on jobs/examples/keras_example.py --epochs 3 (TensorFlow on the CPU): wall
       time of `python keras_example.py` against
       `python -u jobs/host/launcher-bin/launcher.py keras_example.py` with a realistic PORTAL_LAUNCH_CONFIG,
       both in the same environment otherwise (a fake CUDA_VISIBLE_DEVICES UUID, 2 intra-op / 1 inter-op
       threads through TF_NUM_*_THREADS and OMP_NUM_THREADS, TF_CPP_MIN_LOG_LEVEL=1,
       PYTHONUNBUFFERED=1). One warm-up each, then 6 runs each in ABBA order.
       Goal: median launcher / median direct ≤ 1.05.
    1b. Live log: a job prints 12 timestamped lines a quarter-second apart; the bench polls the
       stored log every 20 ms (what the browser's once-a-second poll reads) and reports how long
       each line took from print() to readable. Goal: max ≤ 1 s (the page adds its poll interval).
    3. Log download. A finished job row holds 1 GiB of realistic log text (timestamped ~100-character
       lines) as 1024 LogChunk rows of 1 MiB, bulk-created the way LogWriter stores them with
       JOB_LOG_MAX_MB=1024 (the first 512 MiB head chunks, the rest tail chunks, none dropped).
       The real web server (`python -m gunicorn portal.wsgi --workers 1 --threads 4`) runs on the test
       database; GET /api/v1/jobs/<id>/log/ with a DRF token, read 1 MiB at a time with http.client
       and discarded, while a thread samples the RSS of the gunicorn master and worker every 20 ms.
       Goals: ≥ 200 MB/s (bytes / wall seconds); bytes received = bytes stored; peak RSS growth over
       the baseline taken after a warm-up request ≤ 50 MB. For diagnosis (no goal): the same log
       read through `log_stream` in the bench process, i.e. the database side alone.

Runs on the configured database (SQLite under PORTAL_VAR_DIR by default; set DATABASE_URL for
PostgreSQL: the bench creates test_<name> and drops it). Jobs' folders go to a temporary JOB_ROOTS.
A missed goal prints MISSED; the exit code is non-zero only on errors.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

from bench.common import (
    ROOT,
    database_url_for_subprocess,
    report,
    setup_django_test_db,
    stop,
    tail,
)
from portal.workers import worker_argv
from tests.waiting import WaitTimedOut, wait_for

MB = 1024 * 1024
JOBS, BARE_RUNS, WARMUP = 20, 20, 2
FIRST_SOURCE = b'import time; print("FIRST", time.time(), flush=True)\n'
FIRST_LINE = re.compile(rb"FIRST (\d+\.\d+)")
POLL_S = 0.02

EXAMPLE = ROOT / "jobs" / "examples" / "keras_example.py"
KERAS_RUNS, KERAS_EPOCHS = 6, 3
LAUNCH_CONFIG = {
    "job_id": 1,
    "memory_limit_mb": 7680,
    "allow_growth": False,
    "memory_fraction": 0.33,
    "intra_op_threads": 2,
    "inter_op_threads": 1,
    "soft_placement": True,
    "log_placement": False,
    "mirrored": False,
}
FAKE_GPU = "GPU-5f0c1d2e-3a4b-4c5d-8e9f-0a1b2c3d4e5f"

LOG_BYTES = 1024 * MB
LOG_CAP_MB = 1024  # JOB_LOG_MAX_MB the chunks are laid out for: 512 MiB head, 512 MiB tail
DISTINCT_CHUNKS = 16
INSERT_BATCH = 16  # chunks per INSERT: 16 MiB
RSS_SAMPLE_S = 0.02


# --- 1. submit → first line ---------------------------------------------------------------------


def start_worker(server: str, db_url: str, scratch: Path) -> tuple[subprocess.Popen, Path]:
    from django.conf import settings

    log_path = scratch / "worker.log"
    env = {
        **os.environ,
        # The bench's own instance: left to the worker, it is derived from the test database's URL,
        # not the database the bench's settings were read with, so its Celery keys differed and every
        # job's message went unheard until the worker's pickup sent it again, 15 s later.
        "PORTAL_INSTANCE_ID": settings.PORTAL_INSTANCE_ID,
        "DATABASE_URL": db_url,
        "GPU_BACKEND": "simulated",
        "WORKER_SERVER": server,
        "JOB_ROOTS": str(scratch / "jobs"),
        "JOB_FOLDERS": str(scratch / "job-folders"),
    }
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            worker_argv(f"host.{server}", f"{server}@bench"),  # prefork, as in production
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {proc.returncode}:\n{tail(log_path)}")
        return " ready." in log_path.read_text(errors="replace")

    try:
        wait_for(ready, 90, what="the Celery worker to be ready")
    except BaseException:
        stop(proc)
        raise
    return proc, log_path


def run_first_job(user, booking, worker_log: Path, image=None) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """One job (in container `image`, if given: bench_containers): (submit → first line, submit →
    started_at), in seconds."""
    from django.db import transaction

    from jobs.logs.store import log_stream
    from jobs.models import Job
    from jobs.submit import ScriptUpload, job_submit

    t0 = time.time()
    with transaction.atomic():  # dispatched on commit: the image is set before any worker sees it
        job = job_submit(user=user, reservation=booking, script=ScriptUpload("first.py", FIRST_SOURCE))
        if image is not None:
            Job.objects.filter(pk=job.pk).update(image=image)
    finished = {s.value for s in Job.FINISHED}

    def done() -> bool:
        return Job.objects.filter(pk=job.pk, status__in=finished).exists()

    try:
        wait_for(done, 60, what=f"job {job.pk} to finish", interval=POLL_S)
    except WaitTimedOut as exc:
        raise RuntimeError(f"{exc}; the worker's log ends:\n{tail(worker_log)}") from None
    job.refresh_from_db()
    log = b"".join(log_stream(job.pk))
    match = FIRST_LINE.search(log)
    if job.status != Job.Status.SUCCEEDED or not match:
        raise RuntimeError(f"job {job.pk} {job.status}: {job.message}\n{log.decode(errors='replace')}")
    return float(match.group(1)) - t0, job.started_at.timestamp() - t0


LIVE_SOURCE = b"""
import time
for n in range(12):
    print("LINE", n, time.time(), flush=True)
    time.sleep(0.25)
"""
LIVE_LINE = re.compile(rb"LINE (\d+) (\d+\.\d+)")


def run_live_job(user, booking) -> list[float]:  # type: ignore[no-untyped-def]
    """print() in the job → the line readable from the database (what the browser polls),
    for 12 lines a quarter-second apart, polling every 20 ms as a tailing client would."""
    from jobs.logs.store import log_stream
    from jobs.models import Job
    from jobs.submit import ScriptUpload, job_submit

    job = job_submit(user=user, reservation=booking, script=ScriptUpload("live.py", LIVE_SOURCE))
    seen: dict[int, float] = {}
    delays = []
    deadline = time.time() + 60
    while len(seen) < 12 and time.time() < deadline:
        now = time.time()
        for number, printed in LIVE_LINE.findall(b"".join(log_stream(job.pk))):
            if int(number) not in seen:
                seen[int(number)] = now
                delays.append(now - float(printed))
        time.sleep(POLL_S)
    wait_for(lambda: Job.objects.get(pk=job.pk).is_finished, 30, what=f"job {job.pk} to finish")
    return delays


def run_bare(script: Path) -> float:
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, cwd=script.parent)
    out, _ = proc.communicate()
    match = FIRST_LINE.search(out)
    if proc.returncode != 0 or not match:
        raise RuntimeError(f"bare python run failed ({proc.returncode}): {out!r}")
    return float(match.group(1)) - t0


def bench_submit(user, booking, server: str, db_url: str, scratch: Path) -> None:  # type: ignore[no-untyped-def]
    worker, worker_log = start_worker(server, db_url, scratch)
    try:
        runs = [run_first_job(user, booking, worker_log) for _ in range(WARMUP + JOBS)][WARMUP:]
        live = run_live_job(user, booking)
    finally:
        stop(worker)
    script = scratch / "first.py"
    script.write_bytes(FIRST_SOURCE)
    bare = [run_bare(script) for _ in range(WARMUP + BARE_RUNS)][WARMUP:]
    portal_s = statistics.median(r[0] for r in runs)
    started_s = statistics.median(r[1] for r in runs)
    first_after_start_s = statistics.median(r[0] - r[1] for r in runs)
    bare_s = statistics.median(bare)
    overhead = portal_s - bare_s
    print(f"Submit → first line ({JOBS} jobs, prefork worker --concurrency 1, median)")
    report("submit → first line, through the portal", portal_s, "s", "(none)", True)
    report("  of which submit → subprocess started", started_s, "s", "(none)", True)
    report("  of which subprocess started → first line", first_after_start_s, "s", "(none)", True)
    report("bare `python script.py` → first line", bare_s, "s", "(none)", True)
    report("overhead (portal − bare)", overhead, "s", "<= 0.5 s", overhead <= 0.5)
    print(f"    portal max {max(r[0] for r in runs):.3f} s, bare max {max(bare):.3f} s")
    print(f"Live log (12 lines a quarter-second apart, read back every {POLL_S * 1000:.0f} ms)")
    report("print() → line readable, median", statistics.median(live), "s", "(none)", True)
    report("print() → line readable, max", max(live), "s", "<= 1 s", max(live) <= 1.0)
    print("    the browser polls once a second on top: a line shows within about 1.5 s")


# --- 2. launcher overhead on Keras -------------------------------------------------------------------


def keras_env() -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "USER", "TMPDIR", "VIRTUAL_ENV")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(
        {
            "CUDA_VISIBLE_DEVICES": FAKE_GPU,
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "TF_FORCE_GPU_ALLOW_GROWTH": "false",
            "TF_NUM_INTRAOP_THREADS": "2",
            "TF_NUM_INTEROP_THREADS": "1",
            "OMP_NUM_THREADS": "2",
            "TF_CPP_MIN_LOG_LEVEL": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def timed_run(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system of the child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=EXAMPLE.parent, capture_output=True, timeout=300)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    if done.returncode != 0 or b"done: accuracy=" not in done.stdout:
        raise RuntimeError(
            f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout.decode()[-2000:]}"
            f"{done.stderr.decode()[-3000:]}"
        )
    return elapsed, cpu


def bench_launcher() -> None:
    from jobs.host.launch import (
        LAUNCHER,  # the file the worker runs (after django.setup(): it imports models)
    )

    if not EXAMPLE.is_file():
        print(f"Launcher overhead: {EXAMPLE.relative_to(ROOT)} is missing; skipped")
        return
    args = [EXAMPLE.name, "--epochs", str(KERAS_EPOCHS)]
    direct_argv = [sys.executable, *args]
    launcher_argv = [sys.executable, "-u", str(LAUNCHER), *args]
    env = keras_env()
    launcher_env = {**env, "PORTAL_LAUNCH_CONFIG": json.dumps(LAUNCH_CONFIG)}
    timed_run(direct_argv, env)  # warm-ups: page cache, .pyc files
    timed_run(launcher_argv, launcher_env)
    direct, launched = [], []
    for n in range(KERAS_RUNS):
        # ABBA order, so drift in the machine's speed during the runs falls on both sides.
        pair = [(direct, direct_argv, env), (launched, launcher_argv, launcher_env)]
        for runs, argv, run_env in pair if n % 2 == 0 else pair[::-1]:
            runs.append(timed_run(argv, run_env))
    direct_s, launched_s = (statistics.median(r[0] for r in runs) for runs in (direct, launched))
    direct_cpu, launched_cpu = (statistics.median(r[1] for r in runs) for runs in (direct, launched))
    ratio = launched_s / direct_s
    print(f"Launcher overhead (keras_example.py --epochs {KERAS_EPOCHS}, {KERAS_RUNS} runs each, median)")
    report("python keras_example.py", direct_s, "s", "(none)", True)
    report(f"python -u {LAUNCHER.relative_to(ROOT)} keras_example.py", launched_s, "s", "(none)", True)
    report("ratio launcher / direct", ratio, "x", "<= 1.05", ratio <= 1.05)
    report("CPU time ratio launcher / direct (less noisy)", launched_cpu / direct_cpu, "x", "(none)", True)
    print(
        "    wall s: direct "
        + " ".join(f"{r[0]:.2f}" for r in direct)
        + " / launcher "
        + " ".join(f"{r[0]:.2f}" for r in launched)
        + f"; CPU s medians {direct_cpu:.2f} / {launched_cpu:.2f}"
    )


# --- 3. 1 GiB log download ---------------------------------------------------------------------------


def log_chunks() -> list[bytes]:
    """DISTINCT_CHUNKS different 1 MiB pieces of a training log, cut at 1 MiB like LogWriter."""
    base = 1_714_560_000.0
    text = bytearray()
    step = 0
    need = DISTINCT_CHUNKS * MB
    while len(text) < need:
        step += 1
        at = base + step * 0.037
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at * 1000) % 1000:03d}Z "
        line = (
            f"{step % 1000:4d}/1000 [==============================] - ETA: 0s"
            f" - loss: {1 / (1 + step % 977):.6f}"
            f" - accuracy: {0.5 + (step % 499) / 1000:.4f} - lr: {1e-3 * 0.99 ** (step % 50):.3e}\n"
        )
        text += (stamp + line).encode()
    return [bytes(text[i * MB : (i + 1) * MB]) for i in range(DISTINCT_CHUNKS)]


def store_big_log(user, booking) -> tuple[int, float]:  # type: ignore[no-untyped-def]
    """A finished job with LOG_BYTES of log; returns (job id, seconds it took to store)."""
    from django.db import transaction
    from django.utils import timezone

    from jobs.models import Job, LogChunk

    started = time.perf_counter()
    allocation = booking.allocations.select_related("gpu__server").first()
    now = timezone.now()
    job = Job.objects.create(
        owner=user,
        reservation=booking,
        team=booking.team,
        server=allocation.gpu.server,
        gpu_uuids=[allocation.gpu_id],
        name="big_log.py",
        script_source="print('a lot')\n",
        status=Job.Status.SUCCEEDED,
        not_before=booking.start,
        created_at=now - timedelta(hours=2),
        dispatched_at=now - timedelta(hours=2),
        started_at=now - timedelta(hours=2),
        finished_at=now,
        exit_code=0,
    )
    pieces = log_chunks()
    head_limit = LOG_CAP_MB * MB // 2
    total, seq = 0, 0
    while total < LOG_BYTES:
        rows = []
        for _ in range(INSERT_BATCH):
            if total >= LOG_BYTES:
                break
            data = pieces[seq % DISTINCT_CHUNKS][: LOG_BYTES - total]
            seq += 1
            rows.append(
                LogChunk(job=job, seq=seq, start=total, size=len(data), head=total < head_limit, data=data)
            )
            total += len(data)
        with transaction.atomic():
            LogChunk.objects.bulk_create(rows)
    Job.objects.filter(pk=job.pk).update(log_bytes=total, log_dropped_bytes=0)
    return job.pk, time.perf_counter() - started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str, token: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", path, headers={"Authorization": f"Token {token}"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class RssSampler(threading.Thread):
    """Peak summed RSS of the given processes, sampled every RSS_SAMPLE_S."""

    def __init__(self, procs: list) -> None:  # type: ignore[type-arg]
        super().__init__(daemon=True)
        self.procs = procs
        self.peak = self.rss()
        self.halt = threading.Event()

    def rss(self) -> int:
        return sum(p.memory_info().rss for p in self.procs)

    def run(self) -> None:
        while not self.halt.wait(RSS_SAMPLE_S):
            self.peak = max(self.peak, self.rss())


def download(port: int, path: str, token: str) -> tuple[int, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    start = time.perf_counter()
    received = 0
    try:
        conn.request("GET", path, headers={"Authorization": f"Token {token}"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"GET {path}: {response.status} {response.read()[:500]!r}")
        while data := response.read(MB):
            received += len(data)
    finally:
        conn.close()
    return received, time.perf_counter() - start


def bench_log_download(user, booking, db_url: str, scratch: Path) -> None:  # type: ignore[no-untyped-def]
    import psutil
    from django.db import connection

    from jobs.logs.store import log_stream
    from portal.services import api_token_create

    job_id, store_s = store_big_log(user, booking)
    token = api_token_create(user=user, name="benchmark", expires_at=None)[1]

    start = time.perf_counter()
    streamed = sum(len(piece) for piece in log_stream(job_id))
    stream_s = time.perf_counter() - start
    if streamed != LOG_BYTES:
        raise RuntimeError(f"log_stream gave {streamed} bytes of {LOG_BYTES}")

    port = free_port()
    log_path = scratch / "gunicorn.log"
    env = {**os.environ, "DATABASE_URL": db_url, "ALLOWED_HOSTS": "127.0.0.1,localhost"}
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gunicorn",
                "portal.wsgi",
                "-b",
                f"127.0.0.1:{port}",
                "--workers",
                "1",
                "--threads",
                "4",
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:

        def answers() -> bool:
            if server.poll() is not None:
                raise RuntimeError(f"gunicorn exited with {server.returncode}:\n{tail(log_path)}")
            try:
                return get(port, f"/api/v1/jobs/{job_id}/", token)[0] == 200
            except OSError:
                return False

        wait_for(answers, 60, what="gunicorn to answer")
        # Warm-up: the log view's code path, on the last MiB only.
        status, body = get(port, f"/api/v1/jobs/{job_id}/log/?offset={LOG_BYTES - MB}", token)
        if status != 200 or len(body) != MB:
            raise RuntimeError(f"warm-up log request: {status}, {len(body)} bytes")
        master = psutil.Process(server.pid)
        procs = [master, *master.children(recursive=True)]
        sampler = RssSampler(procs)
        baseline = sampler.peak
        sampler.start()
        try:
            received, wall_s = download(port, f"/api/v1/jobs/{job_id}/log/", token)
        finally:
            sampler.halt.set()
            sampler.join()
        growth = (sampler.peak - baseline) / MB
    finally:
        stop(server)
    rate = received / MB / wall_s
    print(f"Log download (1 GiB in 1 MiB chunks, {connection.vendor}, gunicorn 1 worker × 4 threads)")
    report("GET /api/v1/jobs/<id>/log/", rate, "MB/s", ">= 200", rate >= 200)
    report(
        "bytes received / stored (MiB)", received / MB, "MB", f"= {LOG_BYTES // MB}", received == LOG_BYTES
    )
    report("peak RSS growth of gunicorn (master + worker)", growth, "MB", "<= 50 MB", growth <= 50)
    report(
        "log_stream in the bench process (database only)", LOG_BYTES / MB / stream_s, "MB/s", "(none)", True
    )
    print(
        f"    download {wall_s:.2f} s; storing the log took {store_s:.1f} s;"
        f" baseline RSS {baseline / MB:.0f} MB"
    )


# --- main -------------------------------------------------------------------------------------------


def main() -> int:
    teardown = setup_django_test_db()
    scratch = Path(tempfile.mkdtemp(prefix="bench-jobs-"))
    try:
        from django.contrib.auth import get_user_model
        from django.db import connection

        from gpus.booking import reservation_create
        from gpus.services import server_report_ingest
        from gpus.simulated.inventory import server_names
        from portal.models import Membership, Team
        from tests.factories import make_snapshot

        print(f"Jobs ({connection.vendor})")
        db_url = database_url_for_subprocess()
        server = server_names()[0]
        server_report_ingest(snapshot=make_snapshot(server, gpus=4, simulated=True))
        user = get_user_model().objects.create_user("bench", password="bench-password")
        team = Team.objects.create(name="Bench Lab", slug="bench-lab")
        Membership.objects.create(team=team, user=user, role=Membership.Role.MEMBER)
        booking = reservation_create(user=user, gpus=[f"GPU-{server}-00"])

        bench_submit(user, booking, server, db_url, scratch)
        bench_launcher()
        bench_log_download(user, booking, db_url, scratch)
    finally:
        teardown()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
