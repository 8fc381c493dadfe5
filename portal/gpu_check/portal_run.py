"""The portal under check: `make run`'s command on a temporary var folder, and its REST API.

Started in a session of its own, stopped by its process group (SIGTERM, then SIGKILL): runportal
stops its children, embedded_redis its Redis. Nothing is signalled by a bare pid.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil

from portal.gpu_check.bootstrap import ROOT
from portal.gpu_check.waiting import Deadline

START_SECONDS = 180
STOP_SECONDS = 40
ADMIN, MEMBER, OTHER = "gpucheck-admin", "gpucheck-alice", "gpucheck-bob"
# Faster than `make run`'s defaults, so that a stop "per the policy" fits in the run; every other
# setting is make run's. The check reads these back (`Portal.settings`).
SETTINGS = {
    "TELEMETRY_INTERVAL_SECONDS": "1",
    "WATCHDOG_INTERVAL_SECONDS": "1",
    "WATCHDOG_STOP_AFTER_SECONDS": "5",
    "WATCHDOG_KILL_GRACE_SECONDS": "3",
    "JOB_KILL_GRACE_SECONDS": "3",
    "RUNPORTAL_STOP_GRACE_SECONDS": "15",
}
# Where they point elsewhere (a test's database, a shared Redis), the portal under check gets its own.
NOT_INHERITED = (
    "DATABASE_URL",
    "REDIS_URL",
    "JOB_FOLDERS",
    "JOB_SPOOL_DIR",
    "GPU_BACKEND",
    "PORTAL_INSTANCE",
)
USERS = """
import os
from django.contrib.auth import get_user_model
from django.core.management import call_command
from portal.models import Membership, Profile, Team
call_command("migrate", interactive=False, verbosity=0)
User, password = get_user_model(), os.environ["GPU_CHECK_PASSWORD"]
User.objects.create_superuser("gpucheck-admin", "", password)
team = Team.objects.create(name="GPU check", slug="gpu-check")
for name, unix in (("gpucheck-alice", os.environ["GPU_CHECK_OS_USER"]), ("gpucheck-bob", None)):
    user = User.objects.create_user(name, "", password)
    Membership.objects.create(team=team, user=user, role=Membership.Role.MEMBER)
    Profile.objects.update_or_create(user=user, defaults={"unix_account": unix})
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Api:
    """One user's REST API client (a token from /api/v1/token/)."""

    def __init__(self, base: str, username: str, password: str) -> None:
        self.client = httpx.Client(base_url=base, timeout=15)
        answer = self.client.post("/api/v1/token/", data={"username": username, "password": password})
        answer.raise_for_status()
        self.token = answer.json()["token"]
        self.client.headers["Authorization"] = f"Token {self.token}"

    def get(self, path: str, **params: Any) -> Any:
        answer = self.client.get(path, params=params)
        answer.raise_for_status()
        body = answer.json()
        return body["results"] if isinstance(body, dict) and "results" in body else body

    def post(self, path: str, data: dict[str, Any], files: dict[str, Any] | None = None) -> Any:
        answer = (
            self.client.post(path, data=data, files=files) if files else self.client.post(path, json=data)
        )
        if answer.status_code >= 400:
            raise RuntimeError(f"POST {path}: {answer.status_code} {answer.text[:300]}")
        return answer.json()

    def text(self, path: str) -> str:
        return self.client.get(path).text


class Portal:
    def __init__(self, var: Path) -> None:
        self.var = var
        self.port = free_port()
        self.base = f"http://localhost:{self.port}"  # 127.0.0.1 is LAB_ORIGIN's host
        self.password = secrets.token_urlsafe(16)
        self.os_user = getpass.getuser()
        self.log = var / "portal.log"
        self.proc: subprocess.Popen[bytes] | None = None
        # Those the checks' expectations depend on: the check's own, and the lab's where it set them.
        documented = {"GPU_CONTEXT_HEADROOM_MB": 512, "WATCHDOG_MEMORY_TOLERANCE_MB": 256}
        self.settings = {name: float(os.environ.get(name, default)) for name, default in documented.items()}
        self.settings.update((name, float(value)) for name, value in SETTINGS.items())
        self.env = self._env()

    def _env(self) -> dict[str, str]:
        env = {name: value for name, value in os.environ.items() if name not in NOT_INHERITED}
        return {
            **env,
            **SETTINGS,
            "PORTAL_VAR_DIR": str(self.var),
            "PORT": str(self.port),
            "BIND_ADDRESS": "127.0.0.1",
            "PORTAL_DEMO_PASSWORD": self.password,
            "GPU_CHECK_PASSWORD": self.password,
            "GPU_CHECK_OS_USER": self.os_user,
            "PYTHONUNBUFFERED": "1",
            # `make run`'s, on a throwaway var folder: no deployment (portal/settings_safety.py).
            "PORTAL_DEVELOPMENT": "1",
        }

    def start(self, deadline: Deadline) -> None:
        """Users first (migrate and create them), then `make run`'s command; up once it answers."""
        manage = [sys.executable, "manage.py"]
        made = subprocess.run(
            [*manage, "shell", "-c", USERS],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=deadline.left(),
        )
        if made.returncode:
            raise RuntimeError(f"could not create the check's users: {made.stderr[-1500:]}")
        command = [sys.executable, "-m", "portal.embedded_redis", "--socket", str(self.var / "r.sock"), "--"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [*command, *manage, "runportal"],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline.wait_for(self._answers, "answer from the portal's web server (see its log)")

    def _answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"the portal exited ({self.proc.returncode}): {self.tail()}")
        try:
            return httpx.get(self.base + "/login/", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def api(self, username: str) -> Api:
        return Api(self.base, username, self.password)

    def tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        """SIGTERM to the portal's group; past STOP_SECONDS SIGKILL to it and to its children's groups."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_SECONDS)
            return
        except subprocess.TimeoutExpired:
            pass
        groups = {proc.pid}
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                groups.add(os.getpgid(child.pid))
        groups.discard(os.getpgrp())
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        proc.wait()
