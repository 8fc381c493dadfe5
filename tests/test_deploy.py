"""The install of docs/deploy.md, run as written (issue 42, "Done when").

One machine stands in for the portal host and two GPU hosts (gpu01, gpu02), each with a folder of
its own for /etc/gpu-portal and /var/lib/gpu-portal. PostgreSQL and Redis are throwaway servers of
the test's (tests/fault_servers.py) set up by the doc's steps: the role and database by psql, the
doc's pg_hba.conf line (on 127.0.0.1 for the lab's network), Redis with `requirepass`. The secret
key and the env file are the doc's (deploy/env.example with the servers' addresses and passwords),
copied to each GPU host with its per-host lines and the doc's simulated inventory. Each unit runs
its own ExecStartPre= and ExecStart= lines from deploy/*.service, with its Environment= and the env
file over them, as systemd would; the first hour is the doc's (createsuperuser, a person added in
/admin/, team_create), and everything over HTTP goes through what the doc's TLS proxy adds (Host,
X-Forwarded-Proto, X-Forwarded-For). The doc's words that the test runs are checked to be in the doc
(`documented`), so the two cannot drift apart.

The units run as the test's own account (User=gpuportal cannot be taken here: the checkout's
Python may not be reachable by another account). Where that is root, the GPU hosts also say
JOB_USER=root, as the doc allows; otherwise the worker would rightly refuse.

Where this machine cannot run the throwaway servers the tests skip, saying why; on CI they fail.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import psycopg
import pytest
import redis

from portal.processes import die_with_parent
from portal.settings import BASE_DIR
from tests.conftest import free_port
from tests.fault_servers import TAG_VAR, Api, ThrowawayPostgres, ThrowawayRedis, leftovers, unavailable
from tests.isolation import OUTPUT
from tests.test_https import ENV_EXAMPLE, env_file
from tests.test_settings_safety import command, unit
from tests.waiting import wait_for

pytestmark = [pytest.mark.deploy, pytest.mark.worker]

DEPLOY_MD = (BASE_DIR / "docs" / "deploy.md").read_text()
UNITS = {role: BASE_DIR / "deploy" / f"gpu-portal-{role}.service" for role in ("web", "collector", "worker")}
HOST_PATHS = ("/etc/gpu-portal", "/var/lib/gpu-portal")
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # what a unit gets
PORTAL_URL = env_file(ENV_EXAMPLE)["PORTAL_URL"]
CLIENT = "192.0.2.10"  # a browser's address, as the proxy hands it on (X-Forwarded-For)
_PASSWORD_COMMAND = "python3 -c 'import secrets; print(secrets.token_urlsafe(24))'"
_SECRET_KEY_COMMAND = "python3 -c 'import secrets; print(secrets.token_urlsafe(50))'"
JOB = b'import os\nprint("ran on", os.environ.get("CUDA_VISIBLE_DEVICES", "?"), flush=True)\n'


def documented(text: str) -> str:
    """A step of docs/deploy.md, word for word: the test runs what the doc says, or fails here."""
    assert text in DEPLOY_MD, f"docs/deploy.md no longer says {text!r}: change the test with it"
    return text


def _output(line: str) -> str:
    """What a documented `python3 -c ...` prints (python3: this interpreter)."""
    argv = shlex.split(line)
    return subprocess.run([sys.executable, *argv[1:]], check=True, capture_output=True, text=True).stdout


class Host:
    """One machine of the layout: its /etc/gpu-portal and /var/lib/gpu-portal in a folder of its
    own, and the units' processes on it, each logging to its own file."""

    def __init__(self, root: Path, name: str, *, tag: str, logs: Path) -> None:
        self.name, self.folder, self.tag, self.logs = name, root / name, tag, logs
        self.etc = self.folder / "etc" / "gpu-portal"
        self.etc.mkdir(parents=True, mode=0o750)  # install -d -m 0750 -o root -g gpuportal
        (self.folder / "var" / "lib" / "gpu-portal").mkdir(parents=True)  # the units' StateDirectory=
        self.procs: dict[str, subprocess.Popen] = {}

    def here(self, text: str) -> str:
        """A path of the host (/etc/gpu-portal/..., /var/lib/gpu-portal/...) in its folder."""
        for path in HOST_PATHS:
            text = text.replace(path, f"{self.folder}{path}")
        return text

    def install(self, name: str, content: str) -> None:
        """A file of /etc/gpu-portal, mode 0640 (root:gpuportal on a real host)."""
        path = self.etc / name
        path.write_text(content)
        path.chmod(0o640)

    def env(self, role: str | None = None, **changes: str) -> dict[str, str]:
        """What systemd gives the role's unit: its Environment= lines with the env file over them
        (EnvironmentFile= wins); without a role, the env file alone, as `systemd-run -p
        EnvironmentFile=` gives a command run by hand. A change of "" leaves the variable out."""
        defaults = unit(UNITS[role])[0] if role else {}
        env = {"PATH": SYSTEMD_PATH, **defaults, **env_file(self.etc / "env"), TAG_VAR: self.tag, **changes}
        return {name: self.here(value) for name, value in env.items() if value != ""}

    def start(self, name: str, role: str | None, line: str, **changes: str) -> subprocess.Popen:
        """A unit's command line (ExecStart=, ExecStartPre=) or a documented command, started."""
        env = self.env(role, **changes)
        with open(self.log_path(name), "w") as log:
            self.procs[name] = subprocess.Popen(
                [self.here(arg) for arg in command(line, env)],
                cwd=BASE_DIR,  # WorkingDirectory=/opt/gpu-portal
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        return self.procs[name]

    def run(self, name: str, role: str | None, line: str, **changes: str) -> str:
        """Run it to its end, which must be a success; its output."""
        self.start(name, role, line, **changes)
        return self.done(name)

    def manage(self, *argv: str, wait: bool = True, **changes: str) -> subprocess.Popen:
        """A manage.py command as the doc runs it (systemd-run with the env file), run to its end,
        which must be a success (with `wait`)."""
        line = f"/opt/gpu-portal/.venv/bin/python manage.py {shlex.join(argv)}"
        proc = self.start(f"manage-{argv[0]}", None, line, **changes)
        if wait:
            self.done(f"manage-{argv[0]}")
        return proc

    def done(self, name: str) -> str:
        """A process that runs to its end, ended: it must be a success. Its output."""
        assert self.procs[name].wait(timeout=180) == 0, f"{name} failed on {self.name}:\n{self.output(name)}"
        return self.output(name)

    def log_path(self, name: str) -> Path:
        return self.logs / f"{self.name}-{name}.log"

    def output(self, name: str) -> str:
        return self.log_path(name).read_text(errors="replace")

    def alive(self) -> bool:
        """True while every long-running process runs; an AssertionError naming one that ended."""
        for name, proc in self.procs.items():
            if proc.poll() is not None and not name.startswith(("manage-", "pre-", "refused-")):
                raise AssertionError(f"{self.name}'s {name} exited {proc.returncode}:\n{self.output(name)}")
        return True


def stop_all(hosts: list[Host]) -> list[str]:
    """systemctl stop on every host at once: SIGTERM to each unit's main process (KillMode=mixed),
    then each reaped; those still running 30 s later (then SIGKILLed)."""
    procs = {f"{host.name}'s {name}": proc for host in hosts for name, proc in host.procs.items()}
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    deadline, late = time.monotonic() + 30, []
    for name, proc in procs.items():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            late.append(name)
    return late


class Proxy(httpx.BaseTransport):
    """The TLS proxy of docs/deploy.md ("HTTPS", nginx): a request for PORTAL_URL handed on to the
    web unit's 127.0.0.1:PORT over plain HTTP with the Host it came with, X-Forwarded-Proto and
    X-Forwarded-For. The client sees https://, so it keeps the portal's Secure cookies."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        headers = {**request.headers, "X-Forwarded-Proto": "https", "X-Forwarded-For": CLIENT}
        url = request.url.copy_with(scheme="http", host="127.0.0.1", port=self.port)
        return self.inner.handle_request(
            httpx.Request(request.method, url, headers=headers, stream=request.stream)
        )


class Install:
    """The lab of docs/deploy.md on this machine: the servers, the portal host and the GPU hosts
    with their files; `close` stops everything and deletes it."""

    def __init__(self, tag: str, logs: Path) -> None:
        self.tag, self.logs = tag, logs
        self.servers_tag = f"{tag}-servers"  # not the units': `leftovers(tag)` finds only what they left
        logs.mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix="deploy-"))
        self.people_password = secrets.token_urlsafe(16)
        self.postgres: ThrowawayPostgres | None = None
        self.redis: ThrowawayRedis | None = None
        self.portal = Host(self.root, "portal", tag=tag, logs=logs)
        self.hosts = [Host(self.root, name, tag=tag, logs=logs) for name in ("gpu01", "gpu02")]
        self.port = free_port()

    def database(self) -> str:
        """Install the portal host, steps 2 and 3: the role and its database by psql, the GPU
        hosts' pg_hba.conf line, a restart. Its DATABASE_URL's password."""
        password = _output(documented(_PASSWORD_COMMAND)).strip()
        self.postgres = ThrowawayPostgres(tag=self.servers_tag, logs=self.logs)
        self.postgres.start()
        role = documented("CREATE ROLE gpuportal LOGIN PASSWORD 'PASSWORD';")
        role = role.replace("'PASSWORD'", f"'{password}'")
        sql = f"{role}\n{documented('CREATE DATABASE gpuportal OWNER gpuportal;')}\n"
        psql = [str(self.postgres.bin / "psql"), *shlex.split(documented("psql -v ON_ERROR_STOP=1"))[1:]]
        psql += ["-h", "127.0.0.1", "-p", str(self.postgres.port), "-U", "postgres"]
        subprocess.run(psql, input=sql, check=True, capture_output=True, text=True)
        hba = self.postgres.data / "pg_hba.conf"
        line = documented("host    gpuportal  gpuportal  10.0.0.0/24    scram-sha-256")
        hba.write_text(line.replace("10.0.0.0/24", "127.0.0.1/32 ") + "\n" + hba.read_text())
        self.postgres.restart()
        # The role needs its password now: the cluster's own lines below trust everyone else.
        url = f"postgres://gpuportal@127.0.0.1:{self.postgres.port}/gpuportal"
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(url, connect_timeout=5).close()
        return password

    def broker(self) -> str:
        """Install the portal host, step 4: Redis with `requirepass`. Its REDIS_URL's password."""
        documented("requirepass PASSWORD")
        password = _output(_PASSWORD_COMMAND).strip()
        self.redis = ThrowawayRedis(tag=self.servers_tag, logs=self.logs, password=password)
        self.redis.start()
        with pytest.raises(redis.AuthenticationError), redis.Redis(port=self.redis.port) as anyone:
            anyone.ping()
        return password

    def portal_host(self, database_password: str, redis_password: str) -> None:
        """Install the portal host, steps 5 and 6: the secret key, and env.example with the servers'
        addresses and passwords, this run's port and one web worker (WEB_CONCURRENCY)."""
        assert self.postgres is not None and self.redis is not None
        self.portal.install("secret_key", _output(documented(_SECRET_KEY_COMMAND)))
        env = ENV_EXAMPLE.read_text()
        env = _setting(env, "DATABASE_URL", f"gpuportal:{database_password}", self.postgres.port)
        env = _setting(env, "REDIS_URL", f":{redis_password}", self.redis.port)
        self.portal.install("env", env + f"\nPORT={self.port}\nWEB_CONCURRENCY=1\n")

    def gpu_hosts(self) -> None:
        """Install on a GPU host, steps 3 and 4, with the lines of "Trying it on servers without
        GPUs": the portal host's env and secret key, and the per-host lines."""
        inventory = re.search(r"```yaml\n(# /etc/gpu-portal/inventory\.yaml\n.*?)```", DEPLOY_MD, re.DOTALL)
        assert inventory, "docs/deploy.md has no /etc/gpu-portal/inventory.yaml example"
        for host in self.hosts:
            host.install("secret_key", (self.portal.etc / "secret_key").read_text())
            host.install("inventory.yaml", inventory[1])
            lines = [
                documented("GPU_BACKEND=simulated"),
                documented("SIMULATED_INVENTORY=/etc/gpu-portal/inventory.yaml"),
                f"WORKER_SERVER={host.name}",
                "WORKER_CONCURRENCY=2",
                # As root, say it (docs/deploy.md, step 4): the units run as the test's account.
                *(["JOB_USER=root"] if os.geteuid() == 0 else []),
            ]
            host.install("env", (self.portal.etc / "env").read_text() + "\n".join(lines) + "\n")

    def close(self) -> None:
        stop_all([self.portal, *self.hosts])
        for server in (self.redis, self.postgres):
            if server is not None:
                server.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _setting(env: str, name: str, credentials: str, port: int) -> str:
    """env.example's line for a server's URL, with the throwaway server's port and the password in
    it (portal-host: 127.0.0.1)."""
    example = env_file(ENV_EXAMPLE).get(name)
    assert example, f"deploy/env.example sets no {name}, which step 6 of Install the portal host edits"
    url = urlsplit(example)._replace(netloc=f"{credentials}@127.0.0.1:{port}")
    return env.replace(f"{name}={example}", f"{name}={urlunsplit(url)}")


@pytest.fixture(scope="module")
def install() -> Iterator[Install]:
    if why := unavailable():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the deployment test, but {why}")
        pytest.skip(why)
    tag = uuid.uuid4().hex
    lab = Install(tag, OUTPUT / f"deploy-{tag[:8]}")
    try:
        lab.portal_host(lab.database(), lab.broker())
        lab.gpu_hosts()
        yield lab
    finally:
        lab.close()


# --- issue 42 item 3 on the units as installed ---------------------------------------------------

UNSAFE = {
    "DEBUG on": ({"DEBUG": "1"}, "DEBUG is on: Django's debug pages would show tracebacks"),
    "no secret key": ({"SECRET_KEY_FILE": ""}, "SECRET_KEY is not set, nor SECRET_KEY_FILE"),
    "a short secret key": (
        {"SECRET_KEY_FILE": "/etc/gpu-portal/secret_key-short"},
        "characters, fewer than 50: it could be guessed",
    ),
    "a well-known secret key": (
        {"SECRET_KEY_FILE": "/etc/gpu-portal/secret_key-changeme"},
        "SECRET_KEY is a well-known placeholder",
    ),
    "no ALLOWED_HOSTS": ({"ALLOWED_HOSTS": ""}, "ALLOWED_HOSTS is not set"),
    "no PORTAL_URL": ({"PORTAL_URL": ""}, "PORTAL_URL is not set"),
}
REFUSED = "The portal does not start: a deployment may not run with these settings"


def test_each_unsafe_setting_is_refused_at_start_naming_it(install):
    """Each setting of "Refused at start" wrong in turn in the installed env file, each on one unit's
    own ExecStart= (every unit gets two): it refuses to start, naming the setting (the web unit's
    gunicorn: its worker fails to boot, and gunicorn exits). All at once: none reaches a server."""
    gpu02 = install.hosts[1]
    for host in (install.portal, gpu02):
        host.install("secret_key-short", secrets.token_urlsafe(20))
        host.install("secret_key-changeme", "changeme\n")
    units = [("web", install.portal), ("collector", install.portal), ("worker", gpu02)]
    started = []
    for n, (case, (changes, says)) in enumerate(UNSAFE.items()):
        role, host = units[n % len(units)]
        name = f"refused-{role}-{n}"
        proc = host.start(name, role, unit(UNITS[role])[2], **changes, PORT=str(free_port()))
        started.append((f"{role} with {case}", says, host, name, proc))
    wrong = []
    for what, says, host, name, proc in started:
        code = proc.wait(timeout=120)
        if code == 0 or REFUSED not in host.output(name) or says not in host.output(name):
            wrong.append(f"{what}: exit {code}, said:\n{host.output(name)[-1500:]}")
    assert not wrong, "\n\n".join(wrong)


# --- the install, the first hour, and a booking's job on its host --------------------------------


def _answers(client: httpx.Client) -> bool:
    try:
        return client.get("/login/").status_code == 200
    except httpx.TransportError:
        return False


def _hidden(page: str) -> dict[str, str]:
    """A form's hidden fields (the CSRF token, the admin's inline formsets' management forms)."""
    return dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', page))


def _portal_host_starts(install: Install) -> None:
    """Install the portal host, steps 7 and 9: the web unit's ExecStartPre= lines in order, each to
    its end, then its ExecStart=, and the collector's (After= the web unit); the first admin. What
    needs only the migrated database runs beside the static files' collection, to keep the test
    short: createsuperuser, and each GPU host's step 6, its worker."""
    portal = install.portal
    _, (check, migrate, *others), start = unit(UNITS["web"])
    assert "System check identified no issues" in portal.run("pre-check", "web", check)
    assert "Applying gpus.0001_initial... OK" in portal.run("pre-migrate", "web", migrate)
    for host in install.hosts:
        host.start("worker", "worker", unit(UNITS["worker"])[2])
    documented("manage.py createsuperuser")
    portal.manage(
        "createsuperuser", "--noinput", "--username", "admin", "--email", "admin@lab.example",
        wait=False, DJANGO_SUPERUSER_PASSWORD=install.people_password,
    )  # fmt: skip
    for n, line in enumerate(others):
        portal.run(f"pre-{n}", "web", line)
    portal.start("web", "web", start)
    portal.start("collector", "collector", unit(UNITS["collector"])[2])
    portal.done("manage-createsuperuser")


def _admin_adds(admin: httpx.Client, username: str, password: str) -> None:
    """The first hour, step 1, without a directory: (`/admin/` → Users → Add user), as the admin."""
    documented("(`/admin/` → Users → Add user)")
    login = admin.get("/admin/login/")
    fields = {**_hidden(login.text), "username": "admin", "password": password, "next": "/admin/"}
    signed_in = admin.post("/admin/login/", data=fields)
    assert signed_in.status_code == 302, signed_in.text[-2000:]
    form = admin.get("/admin/auth/user/add/")
    assert form.status_code == 200, form.text[-2000:]
    fields = {**_hidden(form.text), "username": username, "password1": password, "password2": password}
    added = admin.post("/admin/auth/user/add/", data={**fields, "usable_password": "true", "_save": "Save"})
    assert added.status_code == 302, re.findall(r'class="errorlist[^"]*"[^>]*>(.*?)</ul>', added.text, re.S)


def _first_hour(install: Install) -> None:
    """The first hour: the first admin adds alice in /admin/, and runs team_create with her as the
    team's leader."""
    portal, password = install.portal, install.people_password
    with httpx.Client(
        base_url=PORTAL_URL, transport=Proxy(install.port), headers={"Origin": PORTAL_URL}, timeout=30
    ) as admin:
        wait_for(lambda: portal.alive() and _answers(admin), timeout=60, what="the web unit to answer")
        _admin_adds(admin, "alice", password)
    documented("manage.py team_create vision-lab --leader alice --members bob,carol")
    portal.manage("team_create", "vision-lab", "--leader", "alice")


def _online(install: Install, api: Api) -> bool:
    for host in (install.portal, *install.hosts):
        host.alive()
    for host in install.hosts:
        answer = api.call("GET", f"/api/v1/servers/{host.name}/")
        if answer.status_code != 200 or answer.json()["status"] != "online":
            return False
    return True


def test_the_documented_install_runs_a_bookings_job_on_its_host(install):
    _portal_host_starts(install)
    _first_hour(install)
    api = Api(PORTAL_URL, "alice", password=install.people_password, via=Proxy(install.port))
    wait_for(lambda: _online(install, api), timeout=60, what="gpu01 and gpu02 online")

    booking = api.book(count=1, server="gpu02")
    assert booking.status_code == 201, booking.text
    job_id = api.run(JOB, tag=install.tag, reservation=booking.json()["id"])
    wait_for(lambda: _online(install, api) and api.finished(job_id), timeout=60, what=f"job {job_id}")

    job = api.job(job_id)
    assert (job["status"], job["server"]) == ("succeeded", "gpu02"), job
    assert "ran on" in api.log(job_id)
    gpu01, gpu02 = install.hosts
    assert f"Job {job_id} finished: succeeded" in gpu02.output("worker")
    assert f"Job {job_id} " not in gpu01.output("worker")
    api.close()
    # systemctl stop on each host: every unit ends within its time, and nothing is left running.
    assert stop_all([install.portal, *install.hosts]) == []
    left = leftovers(install.tag, install.root)
    assert not left, f"left running: {[(p.pid, p.name()) for p in left]}"
