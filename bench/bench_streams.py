"""Live log streams under load (issue 21, item 6; docs/live.md, docs/benchmarks.md "Live log streams").

The real web server as `make run` starts it (gunicorn + portal.asgi_worker.Worker, two workers,
portal.workers.web_argv) on a throw-away database (PostgreSQL by default, like bench_booking:
DATABASE_URL wins; SQLite when no PostgreSQL answers) and the bench's Redis. One job is RUNNING.

1. **Print → on screen, no load.** Chromium opens the job page (templates/jobs/job_detail.html,
   static/js/job_log.js); a MutationObserver records when each line's text reaches #job-log.
   A writer process appends timestamped lines through jobs.logs.store.LogWriter, as the worker does.
2. **500 streams.** A client process (asyncio + httpx, one process) opens 500
   `GET /api/v1/jobs/<id>/log/stream/` with a token and reads them; the writer prints 10 lines/s
   for STEADY_S, a stretch that spans at least two keep-alives (15 s), so the keep-alive's status
   read is inside the figure. Each line carries time.time() at the write: latency = received −
   written, over every line on every stream. Meanwhile a thread asks GET /api/v1/jobs/ and
   /api/v1/servers/ 4 times a second; the gunicorn workers' RSS, threads, the database's
   connections and Redis' clients are sampled. The browser tab stays open (stream 501).
3. **Idle pages.** The job still running and printing nothing: requests Chromium makes in
   IDLE_S from the open job page, and from a freshly opened dashboard.

A stream that misses or repeats a line is a correctness failure (exit 1). Missed goals print
MISSED. Run alone: `.venv/bin/python -m portal.embedded_redis -- .venv/bin/python -m bench.bench_streams`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import ROOT, database_url_for_subprocess, report, setup_django_test_db, stop, tail
from tests.waiting import wait_for

STREAMS = 500
OPEN_AT_ONCE = 50  # connections the clients open concurrently while ramping up
RATE = 10.0  # lines/s while the 500 streams are open
STEADY_S = 35.0
BROWSER_RATE, BROWSER_LINES = 5.0, 30
IDLE_S = 30.0
API_EVERY_S = 0.25
API_PATHS = ("/api/v1/jobs/", "/api/v1/servers/")
SEED_LINES = 20
MB = 1024 * 1024
TICK = re.compile(r"tick (\d+) (\d+\.\d+)")
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/bench_streams"


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


# --- the writer process: LogWriter as the worker uses it --------------------------------------------


def writer_main(job_id: int, rate: float, seconds: float, first: int) -> None:
    import django

    django.setup()
    from jobs.logs.store import LogWriter

    writer = LogWriter(job_id)
    n, began = first, time.monotonic()
    while (due := began + (n - first) / rate) < began + seconds:
        time.sleep(max(0.0, due - time.monotonic()))
        writer.feed(f"tick {n} {time.time():.6f}\n".encode())
        writer.maybe_flush()
        n += 1
    writer.flush()  # not close(): the job goes on running, and its watchers stay
    print(n - first, flush=True)


# --- the client process: STREAMS streams in one event loop ------------------------------------------


async def clients_main(base: str, job_id: int, token: str, streams: int) -> None:
    import httpx

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * streams + 256)), hard))
    halt = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, halt.set)
    samples: list[tuple[int, float, float]] = []  # (line, written, latency)
    seen: list[dict[int, int]] = [{} for _ in range(streams)]
    errors: list[str] = []
    opened = 0
    gate = asyncio.Semaphore(OPEN_AT_ONCE)
    all_open = asyncio.Event()
    url = f"{base}/api/v1/jobs/{job_id}/log/stream/"
    headers = {"Authorization": f"Token {token}", "Accept": "text/event-stream"}
    limits = httpx.Limits(max_connections=streams + 10, max_keepalive_connections=0)
    timeout = httpx.Timeout(60.0, connect=30.0, pool=60.0)

    async def one(i: int, http: httpx.AsyncClient) -> None:
        nonlocal opened
        got_seed = False
        await gate.acquire()
        try:
            async with http.stream("GET", url, headers=headers) as response:
                if response.status_code != 200:
                    errors.append(f"HTTP {response.status_code}")
                    return
                async for line in response.aiter_lines():
                    now = time.time()
                    if not line.startswith("data: "):
                        continue
                    if not got_seed and "seed" in line:
                        got_seed = True
                        gate.release()
                        opened += 1
                        if opened == streams:
                            all_open.set()
                    elif m := TICK.search(line):
                        n = int(m.group(1))
                        seen[i][n] = seen[i].get(n, 0) + 1
                        samples.append((n, float(m.group(2)), now - float(m.group(2))))
            errors.append("stream ended")
        except (httpx.HTTPError, OSError) as exc:
            errors.append(type(exc).__name__)
        finally:
            if not got_seed:
                gate.release()

    lags: list[float] = []

    async def lag_probe() -> None:  # how late this loop wakes: the clients' own share of a latency
        while True:
            at = time.perf_counter()
            await asyncio.sleep(0.05)
            lags.append(time.perf_counter() - at - 0.05)

    cpu0 = time.process_time()
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        started = time.monotonic()
        tasks = [asyncio.create_task(one(i, http)) for i in range(streams)]
        probe = asyncio.create_task(lag_probe())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_open.wait(), 120)
        print(f"OPEN {opened} {time.monotonic() - started:.2f} {len(errors)}", flush=True)
        await halt.wait()
        probe.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    print(
        "RESULT "
        + json.dumps(
            {
                "samples": samples,
                "seen": [{str(k): v for k, v in s.items()} for s in seen],
                "errors": errors,
                "lag_p95": pct(lags, 95),
                "lag_max": max(lags, default=0.0),
                "cpu_s": time.process_time() - cpu0,
            }
        ),
        flush=True,
    )


# --- the bench process ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def use_postgres_if_there() -> None:
    """PostgreSQL unless DATABASE_URL names a database; SQLite when none answers on 5432."""
    if os.environ.get("DATABASE_URL"):
        return
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", 5432), timeout=1):
        os.environ["DATABASE_URL"] = DEFAULT_DATABASE_URL


class Sampler(threading.Thread):
    """Every 0.2 s: the gunicorn workers' RSS and threads, the database's connections, Redis' clients."""

    def __init__(self, master, db_count) -> None:  # type: ignore[no-untyped-def]
        super().__init__(daemon=True)
        self.master, self.db_count = master, db_count
        self.halt = threading.Event()
        self.peak = {"rss": 0, "threads": 0, "db": 0, "redis": 0}

    def rss_threads(self) -> tuple[int, int]:
        rss = threads = 0
        for child in self.master.children():
            with contextlib.suppress(Exception):
                rss += child.memory_info().rss
                threads += child.num_threads()
        return rss, threads

    def sample(self) -> dict[str, int]:
        import redis
        from django.conf import settings

        rss, threads = self.rss_threads()
        clients = redis.Redis.from_url(settings.REDIS_URL).info("clients")["connected_clients"]
        return {"rss": rss, "threads": threads, "db": self.db_count(), "redis": clients}

    def run(self) -> None:
        while not self.halt.wait(0.2):
            with contextlib.suppress(Exception):
                for key, value in self.sample().items():
                    self.peak[key] = max(self.peak[key], value)


class ApiProbe(threading.Thread):
    """GET the API every API_EVERY_S, alternating paths; latencies by phase."""

    def __init__(self, base: str, token: str) -> None:
        super().__init__(daemon=True)
        self.base, self.token = base, token
        self.phase = "baseline"
        self.samples: dict[str, list[float]] = {}
        self.failures: dict[str, int] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        import httpx

        with httpx.Client(
            base_url=self.base, timeout=30, headers={"Authorization": f"Token {self.token}"}
        ) as http:
            n = 0
            while not self.halt.wait(API_EVERY_S):
                phase, path = self.phase, API_PATHS[n % len(API_PATHS)]
                n += 1
                at = time.perf_counter()
                try:
                    ok = http.get(path).status_code == 200
                except httpx.HTTPError:
                    ok = False
                took = time.perf_counter() - at
                if ok:
                    self.samples.setdefault(phase, []).append(took)
                else:
                    self.failures[phase] = self.failures.get(phase, 0) + 1


def worker_cpu(master) -> float:  # type: ignore[no-untyped-def]
    """CPU seconds the gunicorn workers have used."""
    return sum(sum(child.cpu_times()[:2]) for child in master.children())


def run_writer(env: dict[str, str], job_id: int, rate: float, seconds: float, first: int) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "bench.bench_streams",
        "writer",
        str(job_id),
        str(rate),
        str(seconds),
        str(first),
    ]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


OBSERVER = """() => {
  window.__seen = [];
  const log = document.getElementById('job-log');
  new MutationObserver(() => {
    const at = performance.timeOrigin + performance.now();
    const text = log.textContent;
    const re = /tick (\\d+) (\\d+\\.\\d+)/g;
    let m;
    re.lastIndex = window.__scanned || 0;
    while ((m = re.exec(text)) !== null) window.__seen.push([+m[1], +m[2], at / 1000]);
    window.__scanned = text.lastIndexOf('\\n') + 1;
  }).observe(log, {childList: true, characterData: true, subtree: true});
}"""


def screen_delays(tab, first: int, last: int) -> list[float]:  # type: ignore[no-untyped-def]
    return [at - written for n, written, at in tab.evaluate("window.__seen") if first <= n < last]


def main() -> int:
    use_postgres_if_there()
    from django.conf import settings

    database = settings.DATABASES["default"]
    database.setdefault("TEST", {})["NAME"] = (
        "test_bench_streams"
        if "postgresql" in database["ENGINE"]
        else str(ROOT / "var" / "bench_streams.sqlite3")
    )
    teardown = setup_django_test_db()
    scratch = Path(tempfile.mkdtemp(prefix="bench-streams-"))
    procs: list[subprocess.Popen] = []
    try:
        return run(scratch, procs)
    finally:
        for proc in procs:
            stop(proc, timeout=10)
        teardown()
        shutil.rmtree(scratch, ignore_errors=True)


def seed() -> tuple[int, str]:  # (job id, token); the user "bench" has password "password"
    from django.contrib.auth import get_user_model

    import jobs.tasks
    from gpus.booking import reservation_create
    from gpus.services import server_report_ingest
    from gpus.simulated.inventory import server_names
    from jobs.logs.store import LogWriter
    from jobs.models import Job
    from jobs.submit import ScriptUpload, job_submit
    from portal.models import Membership, Team
    from portal.services import api_token_create
    from tests.factories import make_snapshot

    jobs.tasks.run_job.apply_async = lambda *args, **kwargs: None  # no worker: the bench writes the log
    server = server_names()[0]
    server_report_ingest(snapshot=make_snapshot(server, gpus=4, simulated=True))
    user = get_user_model().objects.create_user("bench", password="password")
    team = Team.objects.create(name="Bench Lab", slug="bench-lab")
    Membership.objects.create(team=team, user=user, role=Membership.Role.MEMBER)
    booking = reservation_create(user=user, gpus=[f"GPU-{server}-00"])
    job = job_submit(
        user=user, reservation=booking, script=ScriptUpload(name="train.py", content=b"print(1)\n")
    )
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING)
    writer = LogWriter(job.pk)
    for n in range(SEED_LINES):
        writer.feed(f"seed {n}\n".encode())
    writer.flush()
    return job.pk, api_token_create(user=user, name="bench", expires_at=None)[1]


def run(scratch: Path, procs: list[subprocess.Popen]) -> int:
    import psutil
    from django.db import connection

    from portal.workers import web_argv
    from tests.browser import CHROMIUM, CHROMIUM_ARGS, log_in

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request of the API probe
    job_id, token = seed()
    db_name = connection.settings_dict["NAME"]

    def db_count() -> int:
        if connection.vendor != "postgresql":
            return 0
        import psycopg

        with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres") as pg:
            return pg.execute(
                "select count(*) from pg_stat_activity where datname = %s", [db_name]
            ).fetchone()[0]

    port = free_port()
    # The portal's own origin: 127.0.0.1 is the labs' (LAB_ORIGIN's default), which answers only
    # for JupyterLab sessions (a 404 for the API: the bench waited out its minute on it).
    base = f"http://localhost:{port}"
    env = {
        **os.environ,
        "DATABASE_URL": database_url_for_subprocess(),
        "ALLOWED_HOSTS": "127.0.0.1,localhost",
        "PORTAL_INSTANCE_ID": f"bench-streams-{os.getpid()}",  # the writer's channel is the server's
    }
    os.environ["PORTAL_INSTANCE_ID"] = env["PORTAL_INSTANCE_ID"]
    web_log = scratch / "gunicorn.log"
    with open(web_log, "w") as out:
        web = subprocess.Popen(
            web_argv(f"127.0.0.1:{port}", access_log=False),
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    procs.append(web)

    import httpx

    def answers() -> bool:
        if web.poll() is not None:
            raise RuntimeError(f"gunicorn exited with {web.returncode}:\n{tail(web_log)}")
        with contextlib.suppress(httpx.HTTPError):
            return (
                httpx.get(f"{base}/api/v1/jobs/", headers={"Authorization": f"Token {token}"}).status_code
                == 200
            )
        return False

    wait_for(answers, 60, what="gunicorn to answer")
    master = psutil.Process(web.pid)
    wait_for(lambda: len(master.children()) == 2, 30, what="two gunicorn workers")
    for _ in range(10):  # warm both workers: the API, the job page, a stream opened and closed
        for path in (*API_PATHS, f"/api/v1/jobs/{job_id}/log/"):
            httpx.get(base + path, headers={"Authorization": f"Token {token}"})
        with httpx.stream(
            "GET", f"{base}/api/v1/jobs/{job_id}/log/stream/", headers={"Authorization": f"Token {token}"}
        ) as r:
            next(r.iter_lines())
    sampler = Sampler(master, db_count)
    idle = sampler.sample()
    api = ApiProbe(base, token)
    api.start()
    next_tick = 0

    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"  # Playwright's sync API runs a loop in this thread
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(base_url=base, viewport={"width": 1400, "height": 900})
        tab = context.new_page()
        tab.set_default_timeout(30_000)
        log_in(tab, "bench")
        job_requests: list[tuple[float, str]] = []
        tab.on("request", lambda request: job_requests.append((time.monotonic(), request.url)))
        tab.goto(f"/jobs/{job_id}/")
        tab.wait_for_function("document.getElementById('job-log').textContent.includes('seed 19')")
        tab.evaluate(OBSERVER)

        # 1. print -> on screen, no load
        seconds = BROWSER_LINES / BROWSER_RATE
        writer = run_writer(env, job_id, BROWSER_RATE, seconds, next_tick)
        written = int(writer.communicate(timeout=seconds + 30)[0])
        next_tick += written
        wait_for(
            lambda: len(tab.evaluate("window.__seen")) >= next_tick,
            10,
            what="the lines on the page",
            interval=0.05,
        )
        quiet = screen_delays(tab, 0, next_tick)
        before = sampler.sample()  # one stream (the tab) open

        # 2. 500 streams
        api.phase = "ramp"
        clients = subprocess.Popen(
            [sys.executable, "-m", "bench.bench_streams", "clients", base, str(job_id), token, str(STREAMS)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(clients)
        opened_line = clients.stdout.readline().split()
        if not opened_line or opened_line[0] != "OPEN":
            raise RuntimeError(f"the clients said {opened_line!r}")
        opened, open_s = int(opened_line[1]), float(opened_line[2])
        sampler.start()
        api.phase = "load"
        load_first = next_tick
        client_proc = psutil.Process(clients.pid)
        cpu_at, client_at, load_at = worker_cpu(master), sum(client_proc.cpu_times()[:2]), time.monotonic()
        writer = run_writer(env, job_id, RATE, STEADY_S, next_tick)
        mid = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            writer.wait(STEADY_S / 2)
        mid = sampler.sample()
        written = int(writer.communicate(timeout=STEADY_S + 60)[0])
        next_tick += written
        time.sleep(1.0)  # the last lines' way
        server_cpu, load_s = worker_cpu(master) - cpu_at, time.monotonic() - load_at
        client_cpu = sum(client_proc.cpu_times()[:2]) - client_at
        end = sampler.sample()
        clients.send_signal(signal.SIGUSR1)
        out = clients.communicate(timeout=120)[0]
        result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        sampler.halt.set()
        loaded_screen = screen_delays(tab, load_first, next_tick)

        # 3. idle pages
        api.phase = "idle"
        tab.wait_for_timeout(2000)  # the 500 streams' ends
        since = time.monotonic()
        tab.wait_for_timeout(IDLE_S * 1000)  # not time.sleep: Playwright delivers events while it waits
        job_idle = [url for at, url in job_requests if at >= since]
        tab.close()  # one tab at a time: a tab in the background has its timers throttled
        dash = context.new_page()
        dash_requests: list[str] = []
        dash.on("request", lambda request: dash_requests.append(request.url))
        dash.goto("/")
        dash.wait_for_load_state("networkidle")
        dash_loading = len(dash_requests)
        dash_requests.clear()
        dash.wait_for_timeout(IDLE_S * 1000)
        dash_idle = list(dash_requests)
        context.close()
        browser.close()
    api.halt.set()
    api.join()

    # --- figures ---
    # Only the lines printed while all streams were open: earlier ones came from the database at open.
    timed = [(written, latency) for n, written, latency in result["samples"] if n >= load_first]
    lat = [latency for _, latency in timed]
    missing = sum(1 for s in result["seen"] for n in range(load_first, next_tick) if str(n) not in s)
    repeated = sum(1 for s in result["seen"] for v in s.values() if v > 1)
    expected = STREAMS * (next_tick - load_first)
    per_stream = (end["rss"] - before["rss"]) / STREAMS
    print(
        f"Live log streams ({connection.vendor}, gunicorn + uvicorn worker × 2 as `make run`, "
        f"{STREAMS} streams, {RATE:g} lines/s for {STEADY_S:g} s, keep-alive {15} s)"
    )
    print(
        f"  streams open {opened}/{STREAMS} in {open_s:.1f} s ({OPEN_AT_ONCE} at a time),"
        f" errors {len(result['errors'])}"
    )
    ok_p95 = pct(lat, 95) <= 0.5
    report("delivery written -> received, p50", pct(lat, 50) * 1000, "ms", "(none)", True)
    report("delivery written -> received, p95", pct(lat, 95) * 1000, "ms", "<= 500 ms", ok_p95)
    report("delivery written -> received, p99", pct(lat, 99) * 1000, "ms", "(none)", True)
    report("delivery written -> received, max", max(lat, default=float("nan")) * 1000, "ms", "(none)", True)
    report("lines received / written × streams", len(lat), "", f"= {expected}", len(lat) == expected)
    report("lines missing / repeated (all streams)", missing + repeated, "", "= 0", missing + repeated == 0)
    for phase in ("baseline", "ramp", "load", "idle"):
        samples = api.samples.get(phase, [])
        if not samples:
            continue
        goal = phase in ("ramp", "load")
        report(f"API {phase}: p50 ({len(samples)} GETs)", pct(samples, 50) * 1000, "ms", "(none)", True)
        p95 = pct(samples, 95)
        report(
            f"API {phase}: p95", p95 * 1000, "ms", "<= 1000 ms" if goal else "(none)", p95 <= 1 or not goal
        )
        report(
            f"API {phase}: max, failures {api.failures.get(phase, 0)}",
            max(samples) * 1000,
            "ms",
            "(none)",
            True,
        )
    report("server RSS per stream (workers, end of load)", per_stream / 1024, "KiB", "(none)", True)
    print(
        f"    workers' RSS: idle {idle['rss'] / MB:.0f} MB, 1 stream {before['rss'] / MB:.0f} MB, "
        f"{STREAMS} streams mid {mid['rss'] / MB:.0f} / end {end['rss'] / MB:.0f}"
        f" / peak {sampler.peak['rss'] / MB:.0f} MB"
    )
    print(
        f"    with {STREAMS} streams: worker threads {end['threads']} (peak {sampler.peak['threads']}, "
        f"idle {before['threads']}); Redis clients {end['redis']} (idle {before['redis']}); "
        f"database connections peak {sampler.peak['db']}"
    )
    print(
        f"    clients' own loop lag p95 {result['lag_p95'] * 1000:.0f} ms,"
        f" max {result['lag_max'] * 1000:.0f} ms; CPU during the writes: clients"
        f" {client_cpu / load_s:.0%} of a core, web workers {server_cpu / load_s:.0%} (of 2 cores: 200%)"
    )
    by_second: dict[int, list[float]] = {}
    for written, latency in timed:
        by_second.setdefault(int(written), []).append(latency)
    t0 = min(by_second, default=0)
    for second in sorted(by_second, key=lambda s: -max(by_second[s]))[:3]:
        in_it = by_second[second]
        print(
            f"    worst second t+{second - t0:.0f} s: p95 {pct(in_it, 95) * 1000:.0f} ms,"
            f" max {max(in_it) * 1000:.0f} ms"
        )
    if result["errors"]:
        print(f"    client errors: {sorted(set(result['errors']))}")
    report(
        f"print -> on screen (Chromium), median of {len(quiet)}",
        statistics.median(quiet) * 1000,
        "ms",
        "(none)",
        True,
    )
    report(
        "print -> on screen (Chromium), p95", pct(quiet, 95) * 1000, "ms", "<= 200 ms", pct(quiet, 95) <= 0.2
    )
    if loaded_screen:
        report(
            f"the same with {STREAMS} streams, median of {len(loaded_screen)}",
            statistics.median(loaded_screen) * 1000,
            "ms",
            "(none)",
            True,
        )
        report(f"the same with {STREAMS} streams, p95", pct(loaded_screen, 95) * 1000, "ms", "(none)", True)
    report("idle job page: requests per minute", len(job_idle) * 60 / IDLE_S, "/min", "(none)", True)
    report("idle dashboard: requests per minute", len(dash_idle) * 60 / IDLE_S, "/min", "(none)", True)
    asked = sorted({u.replace(base, "") for u in job_idle})
    print(f"    job page asked for: {asked}")
    print(
        f"    dashboard: {dash_loading} requests to load, then"
        f" {sorted({u.replace(base, '') for u in dash_idle})}"
    )
    return 0 if missing + repeated == 0 and opened == STREAMS else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["writer"]:
        writer_main(int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))
    elif sys.argv[1:2] == ["clients"]:
        asyncio.run(clients_main(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])))
    else:
        sys.exit(main())
