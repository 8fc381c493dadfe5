"""`make run`: the web server plus one Celery worker per GPU host this machine stands for.

The one web server answers two host names: the portal on localhost and JupyterLab sessions on
LAB_ORIGIN, 127.0.0.1 by default (labs are served from an origin of their own: jobs/sessions/lab_proxy.py).

With real NVML that is this host; with the simulated inventory it is every simulated
server, so the whole portal can be tried on a laptop (gpus/hosts.py answers, through
portal/hooks.py). A child that dies is restarted
(portal/supervisor.py); Ctrl-C or SIGTERM stops everything started, and a second one during
that stop kills it all at once.
"""

from __future__ import annotations

import ipaddress
import os
import signal
from urllib.parse import urlsplit

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from portal.env import env_int, env_str
from portal.hooks import HostDiscoveryError, worker_hosts
from portal.services import demo_data_seed
from portal.supervisor import ChildSpec, ProcessSupervisor
from portal.workers import web_argv, worker_argv


def _worker_servers() -> tuple[list[str], bool]:
    """The GPU hosts this machine stands for, as the gpus app answers (portal/hooks.py)."""
    try:
        return worker_hosts()
    except HostDiscoveryError as exc:
        raise CommandError(str(exc)) from exc


def _chatty() -> bool:
    """LOG_LEVEL=debug: Celery's banners and every request in the terminal, as they come."""
    return env_str("LOG_LEVEL", "INFO").upper() == "DEBUG"


def _lab_note(bind: str, port: int) -> str:
    """What to say when LAB_ORIGIN is not this web server as the browser on this machine reaches
    it ("" when it is): labs would not open."""
    lab = urlsplit(settings.LAB_ORIGIN)
    on_loopback = lab.hostname in ("localhost", "::1") or lab.hostname.startswith("127.")
    if not on_loopback:
        return ""  # a name of the machine's, or a TLS proxy's: the operator's to point here
    if (lab.port or {"http": 80, "https": 443}[lab.scheme]) != port or not _listens_on_loopback(bind):
        return (
            f"LAB_ORIGIN={settings.LAB_ORIGIN} is not this web server ({bind}:{port}): labs will not"
            " open. Set LAB_ORIGIN to a second name of this machine on that port."
        )
    if bind != "127.0.0.1":
        return (
            f"Labs open only in a browser on this machine (LAB_ORIGIN={settings.LAB_ORIGIN}): set"
            " LAB_ORIGIN to a second name of this machine (not the portal's) for other machines."
        )
    return ""


# Celery warns, in every worker it starts as root, that it runs as root: three times on the
# simulated inventory, after the URL. runportal says it once, before the URL, with the reason
# (_root_note), and keeps Celery's out of the workers' output (a -W filter: the warning's start).
CELERY_ROOT_WARNING = "ignore:You're running the worker with superuser privileges"


def _root_note() -> str:
    """Why the workers run as root, and who the jobs run as ("" when not root)."""
    if os.geteuid() != 0:
        return ""
    if settings.JOB_USER:
        jobs = f"jobs run as JOB_USER={settings.JOB_USER}, never as root (JOB_MIN_UID)."
    elif settings.JOB_USER_ROOT:
        jobs = "JOB_USER=root, so jobs run as root too, as asked."
    else:
        jobs = (
            "JOB_USER is not set, so jobs run as root too: on a shared server set JOB_USER=gpujob"
            " (one account for every job) or JOB_USER=@owner (each owner's Unix account)."
        )
    return (
        "Running as root, and so are the workers (Celery warns against it; said once here): on a"
        " GPU host the host worker needs root to start each job as JOB_USER's account, stop it"
        f" and read the cards' processes; {jobs} See docs/deploy.md."
    )


# A setting read under its old name warns at start-up (portal.env.env_int_renamed): runportal's
# own start said it once, before the URL; its children would say it again after it.
SETTINGS_WARNINGS = "ignore::FutureWarning:portal.settings"


def _worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A child's environment: the command's, with `extra` on top, and the warnings runportal says
    once itself filtered out: the renamed settings' and, as root, Celery's (_root_note). Jobs
    never inherit PYTHONWARNINGS (jobs/environment.py's INHERITED_ENV)."""
    filters = [os.environ.get("PYTHONWARNINGS", ""), SETTINGS_WARNINGS]
    if os.geteuid() == 0:
        filters.append(CELERY_ROOT_WARNING)
    return {**os.environ, **(extra or {}), "PYTHONWARNINGS": ",".join(filter(None, filters))}


def _listens_on_loopback(bind: str) -> bool:
    try:
        return bind in ("0.0.0.0", "::") or ipaddress.ip_address(bind).is_loopback
    except ValueError:
        return bind == "localhost"


class Command(BaseCommand):
    help = "Serve the portal with its workers (what `make run` calls)."

    def handle(self, *args, **options) -> None:
        call_command("migrate", interactive=False, verbosity=0)
        call_command("collectstatic", interactive=False, verbosity=0)
        seeded = demo_data_seed(password=settings.PORTAL_DEMO_PASSWORD)
        servers, simulated = _worker_servers()
        # The portal's own worker (collector, job reconciler, the portal's one beat) apart from
        # the GPU hosts' workers, whose pool slots are held by jobs for as long as they run.
        beat = str(settings.VAR_DIR / "celerybeat-schedule")
        quiet = not _chatty()
        portal_worker = worker_argv("portal", "portal@%h", beat_schedule=beat, quiet=quiet)
        children = [ChildSpec("worker portal", portal_worker, _worker_env())]
        concurrency = env_int("WORKER_CONCURRENCY", 4, min_value=1)
        for name in servers:
            env = _worker_env({"WORKER_SERVER": name, "GPU_BACKEND": "simulated" if simulated else "nvml"})
            argv = worker_argv(f"host.{name}", f"{name}@%h", concurrency=concurrency, quiet=quiet)
            children.append(ChildSpec(f"worker host.{name}", argv, env))
        bind = env_str("BIND_ADDRESS", "127.0.0.1")
        web = web_argv(f"{bind}:{settings.PORT}", access_log=_chatty())
        children.append(ChildSpec("web server", web, _worker_env()))
        self._greet(
            bind,
            servers if simulated else [],
            show_logins=seeded or settings.PORTAL_DEMO_PASSWORD == "gpu-lab-demo",
        )
        # Adopting orphans: a job in a session of its own under a host worker killed for not
        # stopping in time is still stopped, and nothing is left running after us.
        supervisor = ProcessSupervisor(
            children, log=self._log, stop_grace=settings.RUNPORTAL_STOP_GRACE_SECONDS, adopt_orphans=True
        )
        signal.signal(signal.SIGINT, supervisor.request_stop)
        signal.signal(signal.SIGTERM, supervisor.request_stop)
        # A closed terminal must not leave the children running without us; under nohup
        # (SIGHUP ignored) it must not stop the portal either.
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
            signal.signal(signal.SIGHUP, supervisor.request_stop)
        supervisor.run()

    def _greet(self, bind: str, simulated: list[str], *, show_logins: bool) -> None:
        """What a newcomer needs, the URL and the demo logins last: the lines left on screen."""
        if note := _root_note():
            self.stdout.write(self.style.WARNING(note))
        if note := _lab_note(bind, settings.PORT):
            self.stdout.write(self.style.WARNING(note))
        if simulated:
            self.stdout.write(
                f"No NVIDIA driver here: SIMULATED servers {', '.join(simulated)} (labelled in the UI)."
            )
        self.stdout.write(
            "A worker or the web server that dies is restarted; Ctrl-C stops them all"
            " (a second Ctrl-C without waiting for them)."
        )
        host = "localhost" if bind in ("0.0.0.0", "127.0.0.1") else bind
        self.stdout.write(self.style.SUCCESS(f"\nGPU lab portal: http://{host}:{settings.PORT}/"))
        self.stdout.write(f"JupyterLab sessions: {settings.LAB_ORIGIN}/ (LAB_ORIGIN: labs alone, no portal)")
        if show_logins:
            self.stdout.write(
                f"Demo logins: admin, leader, alice, bob / password {settings.PORTAL_DEMO_PASSWORD!r}"
                " (set PORTAL_DEMO_PASSWORD before the first run; change these on a real deployment)."
            )
        self.stdout.write("")
        self.stdout.flush()

    def _log(self, line: str) -> None:
        self.stdout.write(f"[runportal] {line}")
        self.stdout.flush()  # a line a minute late in a log file helps nobody
