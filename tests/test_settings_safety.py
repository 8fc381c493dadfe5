"""What a deployment refuses to start with (portal/settings_safety.py; issue 42 items 3, 5 and 6).

Each refusal is shown on a real entry point, a fresh process with the environment a unit would
give it and no PORTAL_DEVELOPMENT (tests/isolation.py sets it for the rest of the suite): the
settings imported as every process imports them, `manage.py check`, a Celery worker and the web
unit's own gunicorn line. The units' lines are read from deploy/*.service, so they cannot drift.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from portal.settings import BASE_DIR
from tests.conftest import free_port
from tests.test_https import ENV_EXAMPLE, env_file

WEB_UNIT = BASE_DIR / "deploy" / "gpu-portal-web.service"
PRODUCTION = {
    "SECRET_KEY": secrets.token_urlsafe(50),
    "ALLOWED_HOSTS": "portal.example.org",
    "PORTAL_URL": "https://portal.example.org",
}


def production_env(tmp_path: Path, **overrides: str) -> dict[str, str]:
    """A deployment's environment (no PORTAL_DEVELOPMENT), with its var folder in tmp_path; an
    override of "" leaves that variable out."""
    env = {"PATH": os.environ["PATH"], "PORTAL_VAR_DIR": str(tmp_path / "var"), **PRODUCTION, **overrides}
    return {name: value for name, value in env.items() if value != ""}


def run(argv: list[str], env: dict[str, str], timeout: int = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=timeout)


def load_settings(tmp_path: Path, **overrides: str) -> subprocess.CompletedProcess[str]:
    """What every process does first: gunicorn's workers, Celery and manage.py alike."""
    return run([sys.executable, "-c", "import portal.settings"], production_env(tmp_path, **overrides))


def refused(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0, result.stdout + result.stderr
    assert "The portal does not start: a deployment may not run with these settings" in result.stderr
    return result.stderr


def unit(path: Path) -> tuple[dict[str, str], list[str], str]:
    """A unit's Environment= pairs, ExecStartPre= lines and ExecStart= line."""
    environment, before, start = {}, [], ""
    for line in path.read_text().splitlines():
        key, _, value = line.partition("=")
        if key == "Environment":
            name, _, setting = value.partition("=")
            environment[name] = setting
        elif key == "ExecStartPre":
            before.append(value)
        elif key == "ExecStart":
            start = value
    return environment, before, start


def command(line: str, env: dict[str, str]) -> list[str]:
    """A unit's command line as systemd runs it: ${NAME} from `env`, `%%` as `%` (Celery's own `%h`);
    the checkout's venv for /opt's."""
    line = re.sub(r"\$\{(\w+)\}", lambda m: env[m[1]], line).replace("%%", "%")
    argv = shlex.split(line)
    venv = Path(sys.executable).parent
    return [str(venv / Path(argv[0]).name), *argv[1:]]


# --- item 3: DEBUG, ALLOWED_HOSTS, PORTAL_URL --------------------------------------------------------


def test_a_correct_production_environment_starts_and_makes_up_nothing(tmp_path):
    result = run([sys.executable, "manage.py", "check"], production_env(tmp_path))

    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "var" / "secret_key").exists()


def test_debug_on_is_refused(tmp_path):
    said = refused(load_settings(tmp_path, DEBUG="1"))

    assert "DEBUG is on: Django's debug pages would show tracebacks" in said
    assert "Remove DEBUG from the env file (or set DEBUG=0)" in said


def test_no_allowed_hosts_nor_portal_url_is_refused_naming_both(tmp_path):
    said = refused(load_settings(tmp_path, ALLOWED_HOSTS="", PORTAL_URL=""))

    assert "ALLOWED_HOSTS is not set" in said and "e.g. ALLOWED_HOSTS=portal.example.org" in said
    assert "PORTAL_URL is not set" in said and "e.g. PORTAL_URL=https://portal.example.org" in said


def test_without_allowed_hosts_the_fix_names_portal_urls_host(tmp_path):
    said = refused(load_settings(tmp_path, ALLOWED_HOSTS="", PORTAL_URL="https://gpus.lab.example"))

    assert "e.g. ALLOWED_HOSTS=gpus.lab.example" in said
    assert "PORTAL_URL is not set" not in said


def test_every_problem_is_named_at_once(tmp_path):
    said = refused(load_settings(tmp_path, DEBUG="1", SECRET_KEY="changeme", ALLOWED_HOSTS="", PORTAL_URL=""))

    assert len(re.findall(r"^  - ", said, re.MULTILINE)) == 4
    assert "PORTAL_DEVELOPMENT=1 allows them (make run and the tests set it)" in said


# --- item 5 and the key itself ----------------------------------------------------------------------------


def test_a_missing_secret_key_is_refused_naming_both_variables_and_none_is_made_up(tmp_path):
    said = refused(load_settings(tmp_path, SECRET_KEY=""))

    assert "SECRET_KEY is not set, nor SECRET_KEY_FILE. Every host needs the same one" in said
    assert "SECRET_KEY_FILE=/etc/gpu-portal/secret_key in the env file" in said
    assert not (tmp_path / "var" / "secret_key").exists()


def test_an_empty_secret_key_file_is_refused(tmp_path):
    empty = tmp_path / "secret_key"
    empty.write_text("\n")

    said = refused(load_settings(tmp_path, SECRET_KEY="", SECRET_KEY_FILE=str(empty)))

    assert f"SECRET_KEY_FILE={empty} holds no key" in said


@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("changeme", "SECRET_KEY is a well-known placeholder (it contains 'changeme')"),
        ("CHANGE-ME-" + "to-something-long-enough-for-the-length-check", "it contains 'changeme'"),
        # Fixed keys, not secrets.token_urlsafe: xdist's workers must collect the same test ids.
        (
            "django-insecure-" + "p6xBgNdKZfpc5t68_Lc1vNotrxzkAVtCFQrAdsjQBCjUx7HGEmcecavC",
            "it contains 'insecure'",
        ),
        ("a" * 60, "SECRET_KEY is a well-known placeholder:"),
        ("RYt0ZJVeUOO8d_fzRM1TIN5h8Ec", "characters, fewer than 50: it could be guessed"),
    ],
    ids=["changeme", "change-me", "django-insecure", "one-character", "short"],
)
def test_a_short_or_well_known_secret_key_is_refused(tmp_path, key, says):
    said = refused(load_settings(tmp_path, SECRET_KEY=key))

    assert says in said
    assert len(key) < 20 or key not in said  # a real key, however weak, is never printed


def test_a_developers_machine_may_run_with_the_defaults_and_gets_a_key_made_up(tmp_path):
    env = {"PATH": os.environ["PATH"], "PORTAL_VAR_DIR": str(tmp_path / "var"), "PORTAL_DEVELOPMENT": "1"}

    result = run([sys.executable, "-c", "import portal.settings"], {**env, "DEBUG": "1"})

    assert result.returncode == 0, result.stderr
    assert len((tmp_path / "var" / "secret_key").read_text()) >= 50


# --- every entry point refuses ------------------------------------------------------------------------------


def test_a_celery_worker_refuses_to_start(tmp_path):
    argv = [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", "portal", "--pool", "solo"]

    said = refused(run(argv, production_env(tmp_path, DEBUG="1")))

    assert "DEBUG is on" in said


def test_the_web_units_gunicorn_refuses_to_start(tmp_path):
    environment, _, start = unit(WEB_UNIT)
    env = production_env(tmp_path, **{**environment, "PORT": str(free_port()), "DEBUG": "1"})

    result = run(command(start, env), env)

    assert result.returncode != 0
    assert "DEBUG is on" in result.stderr and "Worker failed to boot" in result.stderr


def test_the_web_unit_checks_the_deployment_before_it_migrates_or_serves(tmp_path):
    """Its first ExecStartPre is `check --deploy` at WARNING, and it passes with env.example."""
    environment, before, _ = unit(WEB_UNIT)
    assert before[0].endswith("manage.py check --deploy --fail-level WARNING")
    assert "migrate" in before[1]
    secret = tmp_path / "secret_key"
    secret.write_text(secrets.token_urlsafe(50))
    env = {**production_env(tmp_path, SECRET_KEY=""), **environment, **env_file(ENV_EXAMPLE)}
    env.update(SECRET_KEY_FILE=str(secret), PORTAL_VAR_DIR=str(tmp_path / "var"))

    passes = run(command(before[0], env), env, timeout=120)
    fails = run(command(before[0], env), {**env, "DEBUG": "1"}, timeout=120)

    assert passes.returncode == 0, passes.stderr + passes.stdout
    assert "System check identified no issues" in passes.stdout
    assert "DEBUG is on" in refused(fails)


def test_a_deployment_env_file_with_portal_development_stops_the_web_unit(tmp_path):
    """PORTAL_DEVELOPMENT=1 would switch every refusal above off in silence: the web unit's own
    `check --deploy` at WARNING names it (portal/checks.py) and stops the unit, the one problem."""
    environment, before, _ = unit(WEB_UNIT)
    env = {**production_env(tmp_path, SECRET_KEY=""), **environment, **env_file(ENV_EXAMPLE)}
    secret = tmp_path / "secret_key"
    secret.write_text(secrets.token_urlsafe(50))
    env.update(SECRET_KEY_FILE=str(secret), PORTAL_VAR_DIR=str(tmp_path / "var"), PORTAL_DEVELOPMENT="1")

    result = run(command(before[0], env), env, timeout=120)

    assert result.returncode != 0, result.stdout + result.stderr
    assert "(portal.W001) PORTAL_DEVELOPMENT is on" in result.stderr, result.stderr
    assert "identified 1 issue" in result.stderr, result.stderr
    assert "Remove PORTAL_DEVELOPMENT from the deployment's env file" in result.stderr


def test_the_development_check_is_a_deployment_warning_only(settings):
    """The suite runs with PORTAL_DEVELOPMENT (tests/isolation.py) and never with --deploy: the
    check is deploy-only, so `manage.py check` and `make run` stay quiet."""
    from django.core import checks

    from portal.checks import DEVELOPMENT_IN_DEPLOYMENT, development_mode_check

    assert [m.id for m in checks.run_checks(include_deployment_checks=False)] == []
    found = development_mode_check()
    assert [(m.id, m.level) for m in found] == [(DEVELOPMENT_IN_DEPLOYMENT, checks.WARNING)]
    settings.PORTAL_DEVELOPMENT = False
    assert development_mode_check() == []


# --- item 6: the web unit's workers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env_file_says", "workers"),
    [({}, 3), ({"GUNICORN_CMD_ARGS": "--workers 8"}, 8), ({"WEB_CONCURRENCY": "5"}, 5)],
)
def test_the_web_units_workers_follow_the_documented_knobs(tmp_path, env_file_says, workers):
    """GUNICORN_CMD_ARGS="--workers 8" in the env file had no effect while the unit's own
    `--workers 3` won. The env file wins over the unit's Environment= lines, as in systemd."""
    environment, _, start = unit(WEB_UNIT)
    env = {**production_env(tmp_path), **environment, **env_file_says}

    result = run([*command(start, env), "--print-config"], env)

    assert result.returncode == 0, result.stderr
    config = dict(re.findall(r"^(\w+)\s+= (.*)$", result.stdout, re.MULTILINE))
    assert config["workers"] == str(workers)
    assert config["control_socket_disable"] == "True"  # no $HOME/.gunicorn/gunicorn.ctl
