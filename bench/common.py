"""Shared set-up for benchmarks: Django on a throw-away copy of the configured database."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
os.environ["PORTAL_DEVELOPMENT"] = "1"  # a throwaway portal, not a deployment (portal/settings_safety.py)

from bench import memory  # noqa: E402 - after the path and settings above
from portal.workers import worker_argv  # noqa: E402
from tests.waiting import wait_for  # noqa: E402


def setup_django_test_db() -> Callable[[], None]:
    """Create a fresh test database (test_<name>); returns the function that drops it."""
    import django

    django.setup()
    from django.db import connection
    from django.test.utils import setup_test_environment

    setup_test_environment()
    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True)

    def teardown() -> None:
        connection.creation.destroy_test_db(old_name, verbosity=0)

    return teardown


def median_ms(fn: Callable[[], object], *, repeat: int, warmup: int = 3) -> float:
    return memory.median_ms(fn, repeat=repeat, warmup=warmup)


@contextlib.contextmanager
def counted() -> Iterator[list[str]]:
    """The statements run meanwhile, through an execute wrapper: a request empties Django's own
    query log as it starts. (No COPY among them: the ingest's are counted from the query log.)"""
    from django.db import connection

    queries: list[str] = []

    def count(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        queries.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(count):
        yield queries


def report(name: str, value: float, unit: str, goal: str, ok: bool) -> None:
    """A figure, printed beside its goal and kept in the run's record (bench/memory.py)."""
    print(f"  {name:<48} {value:10.2f} {unit:<6} goal {goal:<10} {'OK' if ok else 'MISSED'}")
    memory.record(name, value, unit, goal)


def database_url_for_subprocess() -> str:
    """The test database's URL, for the worker and web server processes."""
    from django.db import connection

    from portal.env import database_url

    return database_url(connection.settings_dict)


def stop(proc: subprocess.Popen | None, timeout: float = 20) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


class Workers:
    """The portal's worker (collector, scheduler, reconciler) and one simulated host's, started
    on the bench's database and Redis, for the end-to-end figures."""

    def __init__(
        self, server: str, scratch: Path, *, declarations: Path | None = None, **host_env: str
    ) -> None:
        env = {
            **os.environ,
            "DATABASE_URL": database_url_for_subprocess(),
            "GPU_BACKEND": "simulated",
            "SIMULATED_PROCESSES_FILE": str(declarations or scratch / "simulated-gpu-processes.json"),
            "JOB_ROOTS": str(scratch / "jobs"),
            "JOB_FOLDERS": str(scratch / "job-folders"),
            "EMAIL_DELIVERY": "file",
            "EMAIL_FILE_PATH": str(scratch / "mail"),
        }
        node = f"bench-{os.getpid()}"
        self.logs = {"portal": scratch / "worker-portal.log", "host": scratch / "worker-host.log"}
        self.procs: dict[str, subprocess.Popen] = {}
        try:
            self._start("portal", worker_argv("portal", f"portal@{node}"), {**env, "WORKER_SERVER": "portal"})
            self._start(
                "host",
                worker_argv(f"host.{server}", f"{server}@{node}"),
                {**env, "WORKER_SERVER": server, **host_env},
            )
        except BaseException:
            self.close()
            raise

    def _start(self, role: str, argv: list[str], env: dict[str, str]) -> None:
        with open(self.logs[role], "w") as log:
            self.procs[role] = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        def ready() -> bool:
            for role, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"the {role} worker exited with {proc.returncode}:\n{self.tail()}")
            return all(" ready." in path.read_text(errors="replace") for path in self.logs.values())

        wait_for(ready, 90, what="the Celery workers to be ready")

    def tail(self) -> str:
        return "\n".join(f"--- {role} worker:\n{tail(path)}" for role, path in self.logs.items())

    def close(self) -> None:
        for proc in self.procs.values():
            stop(proc)


def lab(*, servers: int, gpus: int, users: int, teams: int):  # type: ignore[no-untyped-def]
    """A lab: `users` in `teams` (the first of each leads it), `servers` reporting × `gpus` cards.
    Returns the users and the cards as (uuid, server id), in server and index order."""
    from gpus.models import GPU
    from gpus.services import servers_report_ingest
    from portal.models import Membership, Team
    from tests.factories import UserFactory, make_snapshot

    made = [Team.objects.create(name=f"Team {t}", slug=f"team-{t}") for t in range(teams)]
    people = [UserFactory(username=f"user{u:02d}") for u in range(users)]
    Membership.objects.bulk_create(
        Membership(team=made[u % teams], user=user, role="leader" if u < teams else "member")
        for u, user in enumerate(people)
    )
    servers_report_ingest(snapshots=[make_snapshot(f"bench{s:02d}", gpus=gpus) for s in range(servers)])
    return people, list(GPU.objects.order_by("server__name", "index").values_list("uuid", "server_id"))
