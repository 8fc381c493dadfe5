"""What a deployment may not start with (docs/deploy.md, "Refused at start"), read by portal/settings.py.

PORTAL_DEVELOPMENT=1 marks a developer's checkout: `make run`, the test suite (tests/isolation.py),
the benchmarks (bench/common.py) and `make gpu-check` set it. There the portal makes up what a
laptop lacks (a secret key kept in the var folder, localhost for ALLOWED_HOSTS and PORTAL_URL) and
allows DEBUG. Anywhere else (the systemd units, `manage.py` run by hand on a server) each of those
is a deployment's silent mistake: debug pages with tracebacks and settings for anyone, a key that
differs per host or that anyone can look up (and so forge sessions with), links in mails that lead
to localhost. So every process (gunicorn, the Celery workers, `manage.py`) refuses to start while
one stands, with one message that names each setting and its fix.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlsplit

from portal.env import ImproperlyConfiguredEnv, env_bool, env_secret_kept, env_str

__all__ = ["JOB_USER", "JOB_USER_ROOT", "PORTAL_DEVELOPMENT"]

PORTAL_DEVELOPMENT = env_bool("PORTAL_DEVELOPMENT", False)

SECRET_KEY_MIN_LENGTH = 50  # Django's own check (security.W009) asks for as many
# Words of the placeholders people paste from examples and tutorials, compared with letters and
# digits only ("CHANGE-ME" is "changeme"); Django's startproject marks its throwaway keys
# "django-insecure-". Any key containing one is refused, however long.
KNOWN_SECRET_WORDS = (
    "changeme",
    "replaceme",
    "changethis",
    "placeholder",
    "yoursecret",
    "secretkey",
    "notsecret",
    "insecure",
    "example",
)
MAKE_A_KEY = (
    "python3 -c 'import secrets; print(secrets.token_urlsafe(50))' > /etc/gpu-portal/secret_key"
    " on the portal host (root:gpuportal, mode 0640), SECRET_KEY_FILE=/etc/gpu-portal/secret_key in"
    " the env file, and the same file on every host"
)

# The OS account jobs run as (read by the GPU hosts' workers). Empty: the worker's own, which can
# read what the worker can (its env file with DATABASE_URL and SECRET_KEY): for a one-person
# machine, and refused on a worker run as root outside PORTAL_DEVELOPMENT
# (jobs.host.worker.jobs_account_check). "root": the same, said on purpose: such a worker starts,
# saying so loudly in its log and on the admins' dashboard (JOB_USER_ROOT; JOB_USER is then "",
# as the account is the worker's own). "@owner": each job runs as its owner's Unix account (their
# profile's, from the directory or set by admins, else their username). An account or @owner
# needs a worker with CAP_SETUID, CAP_SETGID, CAP_KILL and CAP_CHOWN, none of which a job keeps
# (docs/jobs.md, "Who a job runs as").
JOB_USER = env_str("JOB_USER", "").strip()
JOB_USER_ROOT = JOB_USER == "root"
if JOB_USER_ROOT:
    JOB_USER = ""
elif JOB_USER and JOB_USER != "@owner" and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*\$?", JOB_USER):
    raise ImproperlyConfiguredEnv(
        f"JOB_USER={JOB_USER!r} is neither an account name (e.g. gpujob) nor @owner (each job as its"
        " owner's Unix account)"
    )


def secret_key_read(keep: Path) -> str:
    """SECRET_KEY (or SECRET_KEY_FILE). Only under PORTAL_DEVELOPMENT is a missing one made up,
    once, into `keep`; elsewhere it stays "" and `deployment_refuse` says how to make one."""
    if PORTAL_DEVELOPMENT:
        return env_secret_kept("SECRET_KEY", keep)
    return env_str("SECRET_KEY", "").strip()


def secret_key_problem(key: str) -> str:
    """Why `key` cannot sign a deployment's sessions ("" when it can)."""
    if not key:
        said = "SECRET_KEY is not set, nor SECRET_KEY_FILE"
        if source := os.environ.get("SECRET_KEY_FILE"):
            said = f"SECRET_KEY_FILE={source} holds no key"
        return f"{said}. Every host needs the same one: {MAKE_A_KEY}."
    words = re.sub(r"[^a-z0-9]", "", key.lower())
    known = next((word for word in KNOWN_SECRET_WORDS if word in words), None)
    if known or len(set(key)) < 5:
        return (
            f"SECRET_KEY is a well-known placeholder{f' (it contains {known!r})' if known else ''}:"
            f" anyone could sign sessions with it and sign in as anyone. Make a random one: {MAKE_A_KEY}."
        )
    if len(key) < SECRET_KEY_MIN_LENGTH:
        return (
            f"SECRET_KEY has {len(key)} characters, fewer than {SECRET_KEY_MIN_LENGTH}: it could be"
            f" guessed. Make a longer one: {MAKE_A_KEY}."
        )
    return ""


def deployment_problems(*, debug: bool, secret_key: str) -> list[str]:
    """Each setting a deployment may not start with, in words that name the fix ([] when none).
    ALLOWED_HOSTS and PORTAL_URL are asked of the environment: their defaults are localhost's."""
    problems = []
    if debug:
        problems.append(
            "DEBUG is on: Django's debug pages would show tracebacks, settings and SQL to anyone"
            " who meets an error. Remove DEBUG from the env file (or set DEBUG=0)."
        )
    if problem := secret_key_problem(secret_key):
        problems.append(problem)
    portal_url = env_str("PORTAL_URL", "").strip()
    if not env_str("ALLOWED_HOSTS", "").strip():
        host = urlsplit(portal_url).hostname or "portal.example.org"
        problems.append(
            "ALLOWED_HOSTS is not set: the web server would answer only to localhost. Set it to the"
            f" host names people use, comma-separated, e.g. ALLOWED_HOSTS={host}."
        )
    if not portal_url:
        problems.append(
            "PORTAL_URL is not set: links in mails and calendar feeds would lead to localhost. Set it"
            " to the address people use, e.g. PORTAL_URL=https://portal.example.org."
        )
    return problems


def deployment_refuse(*, debug: bool, secret_key: str) -> None:
    """Outside PORTAL_DEVELOPMENT, ImproperlyConfiguredEnv naming every unsafe or missing setting."""
    if PORTAL_DEVELOPMENT:
        return
    problems = deployment_problems(debug=debug, secret_key=secret_key)
    if problems:
        raise ImproperlyConfiguredEnv(
            "The portal does not start: a deployment may not run with these settings"
            ' (docs/deploy.md, "Refused at start"):\n'
            + "".join(f"  - {problem}\n" for problem in problems)
            + "On a developer's machine PORTAL_DEVELOPMENT=1 allows them (make run and the tests set it)."
        )
