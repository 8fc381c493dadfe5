import os
import socket
import subprocess
import sys
import time

import psycopg
import pytest

from jobs.host.watchdog import kill_grace
from portal.env import (
    POSTGRES_DEFAULT_OPTIONS,
    ImproperlyConfiguredEnv,
    env_bool,
    env_choice,
    env_int,
    env_list,
    env_str,
    parse_database_url,
)


def test_it_reads_booleans_and_rejects_nonsense(monkeypatch):
    monkeypatch.setenv("FLAG", "yes")
    assert env_bool("FLAG") is True
    monkeypatch.setenv("FLAG", "0")
    assert env_bool("FLAG", True) is False
    monkeypatch.setenv("FLAG", "maybe")
    with pytest.raises(ImproperlyConfiguredEnv, match="FLAG='maybe' is not a boolean"):
        env_bool("FLAG")


def test_it_reads_integers_with_bounds(monkeypatch):
    assert env_int("NOPE_UNSET", 7) == 7
    monkeypatch.setenv("PORT_X", "8080")
    assert env_int("PORT_X", 1, min_value=1, max_value=65535) == 8080
    monkeypatch.setenv("PORT_X", "80a")
    with pytest.raises(ImproperlyConfiguredEnv, match="PORT_X='80a' is not an integer"):
        env_int("PORT_X", 1)
    monkeypatch.setenv("PORT_X", "70000")
    with pytest.raises(ImproperlyConfiguredEnv, match="above the maximum 65535"):
        env_int("PORT_X", 1, max_value=65535)


def test_it_reads_lists_choices_and_file_secrets(monkeypatch, tmp_path):
    monkeypatch.setenv("HOSTS", "a.lab, b.lab,,")
    assert env_list("HOSTS", []) == ["a.lab", "b.lab"]
    monkeypatch.setenv("BACKEND", "NVML")
    assert env_choice("BACKEND", "auto", ("auto", "nvml", "simulated")) == "nvml"
    monkeypatch.setenv("BACKEND", "cuda")
    with pytest.raises(ImproperlyConfiguredEnv, match="must be one of: auto, nvml, simulated"):
        env_choice("BACKEND", "auto", ("auto", "nvml", "simulated"))
    secret = tmp_path / "key"
    secret.write_text("s3cret\n")
    monkeypatch.setenv("SECRET_KEY_FILE", str(secret))
    assert env_str("SECRET_KEY") == "s3cret"
    monkeypatch.setenv("SECRET_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(ImproperlyConfiguredEnv, match="SECRET_KEY_FILE"):
        env_str("SECRET_KEY")


def test_it_parses_database_urls():
    pg = parse_database_url("postgres://postgres:pw@127.0.0.1:5432/test?sslmode=disable")
    assert pg["ENGINE"] == "portal.postgresql"
    assert (pg["NAME"], pg["USER"], pg["PASSWORD"], pg["HOST"], pg["PORT"]) == (
        "test",
        "postgres",
        "pw",
        "127.0.0.1",
        "5432",
    )
    assert pg["OPTIONS"] == {**POSTGRES_DEFAULT_OPTIONS, "sslmode": "disable"}
    assert pg["OPTIONS"]["connect_timeout"] == "5"  # a dead host fails in seconds
    assert parse_database_url("postgres://h/db?connect_timeout=30")["OPTIONS"]["connect_timeout"] == "30"
    lite = parse_database_url("sqlite:////srv/portal/db.sqlite3")
    assert lite["NAME"] == "/srv/portal/db.sqlite3"
    assert lite["OPTIONS"]["transaction_mode"] == "IMMEDIATE"
    with pytest.raises(ImproperlyConfiguredEnv, match="scheme 'mysql' is not supported"):
        parse_database_url("mysql://root@localhost/x")
    with pytest.raises(ImproperlyConfiguredEnv, match="names no database"):
        parse_database_url("postgres://localhost")


def test_it_refuses_a_bad_setting_at_start_up():
    """A typo in the environment stops the settings module loading, naming the variable."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "GPU_BACKEND": "cuda"}
    result = subprocess.run(
        [sys.executable, "-c", "import portal.settings"], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode != 0
    assert "GPU_BACKEND='cuda' must be one of" in result.stderr


def _settings_with(**env: str) -> subprocess.CompletedProcess:
    """portal.settings loaded afresh with `env` over this one, neither grace set unless given."""
    base = {k: v for k, v in os.environ.items() if not k.endswith("KILL_GRACE_SECONDS")}
    code = "import portal.settings as s; print(s.WATCHDOG_KILL_GRACE_SECONDS, s.JOB_KILL_GRACE_SECONDS)"
    return subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize(
    ("env", "read", "warned"),
    [
        ({}, "None 10", False),
        ({"JOB_KILL_GRACE_SECONDS": "3"}, "None 3", True),
        ({"WATCHDOG_KILL_GRACE_SECONDS": "4"}, "4 10", False),
        ({"WATCHDOG_KILL_GRACE_SECONDS": "4", "JOB_KILL_GRACE_SECONDS": "3"}, "4 3", False),
    ],
)
def test_the_watchdogs_grace_falls_back_to_the_old_setting_with_a_warning(env, read, warned):
    """Only JOB_KILL_GRACE_SECONDS set: the watchdog still reads it for one release, and says so."""
    result = _settings_with(**env)
    assert result.stdout.strip() == read, result.stderr
    assert ("set WATCHDOG_KILL_GRACE_SECONDS" in result.stderr) is warned


def test_the_watchdogs_grace_refuses_nonsense():
    result = _settings_with(WATCHDOG_KILL_GRACE_SECONDS="0")
    assert result.returncode != 0
    assert "WATCHDOG_KILL_GRACE_SECONDS=0 is below the minimum 1" in result.stderr


def test_the_watchdog_kills_after_its_own_grace_else_the_old_one(settings):
    settings.WATCHDOG_KILL_GRACE_SECONDS, settings.JOB_KILL_GRACE_SECONDS = None, 3
    assert kill_grace() == 3
    settings.WATCHDOG_KILL_GRACE_SECONDS = 4
    assert kill_grace() == 4


@pytest.mark.parametrize(
    ("given", "refused"), [("localhost", True), ("lab-host.example", True), ("::1", False)]
)
def test_the_labs_bind_address_must_be_an_address(given, refused):
    """The worker binds a lab's socket itself and proves it by its address (jobs.host.lab_listener)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "SESSION_BIND_ADDRESS": given}
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from django.conf import settings; import portal.settings as s; print(s.SESSION_BIND_ADDRESS)",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if refused:
        assert result.returncode != 0
        assert f"SESSION_BIND_ADDRESS={given!r} must be an IP address" in result.stderr
    else:
        assert result.stdout.strip() == given, result.stderr


def test_a_database_host_that_never_answers_fails_the_connection_in_seconds():
    """A listener that takes the TCP connection and then says nothing (a hung PostgreSQL, a
    half-open firewall) fails the connect after connect_timeout, not the kernel's minutes."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the backlog; nobody ever answers
        port = silent.getsockname()[1]
        entry = parse_database_url(f"postgres://postgres@127.0.0.1:{port}/test?connect_timeout=1")
        began = time.monotonic()
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(
                host=entry["HOST"],
                port=entry["PORT"],
                dbname=entry["NAME"],
                user=entry["USER"],
                **entry["OPTIONS"],
            )
        assert time.monotonic() - began < 5
