"""The help of deploy/env.example's generated part: every variable the settings read, by section,
with one line for a sysadmin (portal/env_example.py writes the file; `make env-example`).

Only words live here. Each setting's default and the values it takes come from its reader in
portal/env.py as the settings call it, and what a unit's Environment= sets from deploy/*.service:
the generator adds both, so none is written here. A setting the readers read that is missing here,
or a name here that nothing reads, stops the generator, naming it. docs/configuration.md says more
about each one.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    name: str
    help: str
    # Read by another program (gunicorn, the units' command lines, `make run`), never by the
    # settings: its default is what a unit's Environment= gives it, else empty.
    external: bool = False


@dataclass(frozen=True)
class Section:
    title: str
    intro: str
    settings: tuple[Setting, ...]


def _section(title: str, text: str, intro: str = "") -> Section:
    """`text`: a setting a paragraph, `NAME: help`, its help continued on indented lines; `NAME*:`
    is a variable read by another program (Setting.external)."""
    paragraphs: list[list[str]] = []
    for line in textwrap.dedent(text).strip().splitlines():
        if line.startswith(" "):
            paragraphs[-1].append(line.strip())
        else:
            paragraphs.append([line])
    settings = []
    for paragraph in paragraphs:
        name, _, help_text = " ".join(paragraph).partition(": ")
        settings.append(Setting(name.rstrip("*"), help_text, external=name.endswith("*")))
    return Section(title, intro, tuple(settings))


WEB = _section(
    "Web (portal host)",
    text="""
BIND_ADDRESS*: Address gunicorn binds (gpu-portal-web.service; also `make run`): 127.0.0.1 behind a
    reverse proxy on this host, 0.0.0.0 to serve directly.
PORT: Port gunicorn binds (gpu-portal-web.service; also `make run`).
WEB_CONCURRENCY*: gunicorn's worker processes, read by gunicorn itself.
GUNICORN_CMD_ARGS*: Extra gunicorn options, read by gunicorn itself, e.g. --workers 8 --timeout 60; its
    --workers wins over WEB_CONCURRENCY.
SESSION_COOKIE_SECURE: The session cookie goes over HTTPS only. Default: HTTPS's value.
CSRF_COOKIE_SECURE: The CSRF cookie goes over HTTPS only. Default: HTTPS's value.
SECURE_SSL_REDIRECT: Redirect http:// requests to https://. Default: HTTPS's value.
SECURE_HSTS_SECONDS: How long browsers remember to use HTTPS only (HSTS max-age), seconds; a year with
    HTTPS, else 0. Start a new deployment at 3600 and raise it once HTTPS works for everyone.
SECURE_HSTS_INCLUDE_SUBDOMAINS: HSTS includeSubDomains (subdomains of the portal's own host). Default:
    HTTPS's value.
SECURE_HSTS_PRELOAD: HSTS preload. Default: HTTPS's value.
TRUST_PROXY_SSL_HEADER: Believe the proxy's X-Forwarded-Proto: https. Only behind a proxy that always
    sets it, with gunicorn bound to 127.0.0.1. Default: HTTPS's value.
LAB_TICKET_SECONDS: How long the portal's single-use ticket into a lab may take to reach LAB_ORIGIN, s.
LAB_RELAY_BEAT_SECONDS: A lab is relayed to only while its supervisor beat within this long, s (it beats
    each second).
LAB_RECHECK_SECONDS: An open lab websocket asks this often whether its sign-in still stands, s.
LOG_STREAM_KEEPALIVE_SECONDS: Live logs (docs/live.md): a comment line on a quiet stream this often, s,
    so that proxies keep it open; keep it below the proxy's read timeout (nginx: proxy_read_timeout).
DEBUG: Never on in production: tracebacks and settings in error pages. The portal refuses to start with
    it; only a developer's machine (PORTAL_DEVELOPMENT=1, never this file) allows it.
TIME_ZONE: Time zone for display, an IANA name. Stored times are UTC either way.
LOG_LEVEL: Root log level: DEBUG, INFO, WARNING, ERROR.
""",
)

DATA = _section(
    "Database, Redis and outages (all hosts)",
    text="""
DATABASE_STATEMENT_TIMEOUT_SECONDS: PostgreSQL cancels a statement that runs longer, s; 0: no limit (a
    long `migrate` by hand).
REDIS_SOCKET_TIMEOUT_SECONDS: Connect and socket timeout of every Redis connection, s.
PORTAL_INSTANCE_ID: Which portal this is, in every Redis key and job; every host must agree. Empty: a
    digest of where the database lives (DATABASE_URL less its password), which they do.
OUTAGE_RETRY_AFTER_SECONDS: Retry-After of the 503 answered while the database or Redis is away, s.
MAIL_REQUEUE_MINUTES: A queued mail whose Celery message was lost is sent again after this long.
""",
)

TELEMETRY = _section(
    "Telemetry (all hosts)",
    text="""
TELEMETRY_INTERVAL_SECONDS: How often each GPU host publishes a report, s.
SERVER_OFFLINE_AFTER_SECONDS: A server whose last report is older than this shows offline, s.
TELEMETRY_HISTORY_SECONDS: One stored chart sample per card every this many seconds.
TELEMETRY_RETENTION_HOURS: Chart history kept, hours (pruned by the portal's worker every 10 min).
USAGE_RETENTION_DAYS: Hourly usage rollups (docs/reports.md) are kept this many days.
GPU_CONTEXT_HEADROOM_MB: MiB held back per card for the CUDA context, cuDNN etc.: bookable = total -
    driver reserved - this.
""",
)

GPU_BACKEND = _section(
    "GPU backend (GPU hosts)",
    text="""
GPU_BACKEND: auto: NVML where its library is installed, else the labelled simulation; nvml: never
    simulate; simulated; slurm: this worker is a Slurm cluster's (docs/slurm.md). A driver that fails to
    start is retried loudly, never simulated.
NVML_ROUND_TIMEOUT_SECONDS: How long one telemetry round waits for the cards before reporting a hung one
    unresponsive, s.
NVML_INIT_RETRY_MAX_SECONDS: Longest wait between attempts to start NVML (1, 2, 4 ... s up to this).
SIMULATED_INVENTORY: YAML inventory for GPU_BACKEND=simulated. Empty: gpus/simulated_inventory.yaml. To
    try the real layout on servers without GPUs, a file naming each host's WORKER_SERVER
    (docs/deploy.md, "Trying it on servers without GPUs").
SIMULATED_PROCESSES_FILE: Real local processes shown on simulated cards (manage.py
    simulate_gpu_process).
""",
)

JOBS = _section(
    "Jobs",
    text="""
JOB_ROOTS: Folders where job scripts may live and jobs work, the same paths on every GPU host, e.g.
    /srv/gpu-jobs,/home.
JOB_FOLDERS: Where each job's own folder job-<id> is made: its outputs land there, so put it on the data
    volume beside (never inside) JOB_ROOTS, in a tree only the worker writes (mode 0711).
JOB_INTERPRETERS: Named Python environments for jobs, e.g.
    default=/opt/gpu-portal/.venv/bin/python,tf=/opt/conda/envs/tf/bin/python; default is the worker's
    python unless given.
JOB_USER: The account jobs run as on GPU hosts: an account (e.g. gpujob; uncomment AmbientCapabilities
    in gpu-portal-worker.service), or @owner: each job as its owner's Unix account (docs/jobs.md).
    Empty: the worker's own, which can read this file; a worker run as root refuses to start so, unless
    JOB_USER=root says it on purpose (then said in its log at each start and on the admins' dashboard).
JOB_MIN_UID: No job runs as an account below this uid (root, system accounts).
JOB_KILL_GRACE_SECONDS: Cancel and time limits: SIGTERM, then SIGKILL this many seconds later.
JOB_LOG_MAX_MB: Per-job log cap in MB; past it the first and last halves are kept.
JOB_DRAIN_SECONDS: After a job's main process exits, its output is read this much longer, s (what it
    printed last).
JOB_SPOOL_DIR: GPU hosts: what the database could not take yet (log bytes, a job's end), written once it
    is back. The worker's alone.
JOB_END_WAIT_SECONDS: How long a supervisor retries recording its job's end itself, s; then the spool
    thread does.
JOB_UPLOAD_MAX_KB: Largest script upload, KB.
JOB_HEARTBEAT_SECONDS: Heartbeat of a running job, s.
JOB_LOST_AFTER_SECONDS: A running job with no heartbeat this long is lost, s; at least 3 heartbeats.
JOB_RECONCILE_SECONDS: How often the job reconciler (in the portal host's worker) runs, s.
SLURM_LOST_AFTER_SECONDS: A Slurm job without news this long (its cluster silent, a state the portal
    does not know) ends lost, saying what Slurm last said, s (docs/slurm.md).
""",
)

CONTAINERS = _section(
    "Containers (GPU hosts; docs/containers.md)",
    text="""
CONTAINER_MODE: root: the worker's Podman starts each container as the job's account; rootless: the
    job's account's own Podman.
CONTAINER_PODMAN: The podman program, found on PATH if bare.
CONTAINER_DEVICE_DIR: Where /dev/nvidia<N>, nvidiactl and nvidia-uvm* are found without a CDI spec.
CONTAINER_CDI_DIRS: Where an NVIDIA CDI spec (nvidia-ctk cdi generate) is looked for.
CONTAINER_CONF: The containers.conf the portal writes. Empty: <PORTAL_VAR_DIR>/containers.conf.
CONTAINER_START_SECONDS: A container not started this long after `podman run` fails its job, s.
CONTAINER_PULL_SECONDS: A pull that takes longer fails, s.
CONTAINER_ROOTLESS_STORAGE_DIR: Rootless: each account's images in <this>/<uid>, on a local disk (never
    NFS). Empty: <PORTAL_VAR_DIR>/rootless-storage.
CONTAINER_ROOTLESS_RUN_DIR: Rootless: each account's runtime folder in <this>/<uid>, at most 50
    characters with /<uid>/containers. Empty: /run/portal-ctr/<a digest of PORTAL_INSTANCE_ID>.
""",
)

SESSIONS = _section(
    "Interactive sessions: gpu exec, gpu shell, JupyterLab (docs/sessions.md)",
    intro="SESSION_BIND_ADDRESS is per host: see the last section.",
    text="""
SESSION_BEAT_SECONDS: How often `gpu exec` and `gpu shell` tell the portal they still run, s.
SESSION_LOST_AFTER_SECONDS: A session with no beat this long is ended as lost, s; at least 3 beats.
SESSION_WARN_MINUTES: A session is warned this long before its booking ends, minutes.
SESSION_IDLE_MINUTES: A JupyterLab session with no kernel activity this long is ended, minutes.
SESSION_START_SECONDS: How long a JupyterLab server may take to answer before its session fails, s.
""",
)

BOOKINGS = _section(
    "Bookings",
    text="""
BOOKING_DEFAULT_HOURS: Length of a booking whose end is left empty, hours.
BOOKING_MAX_HOURS: The longest booking anyone may make, hours (a member quota can only lower it).
BOOKING_HORIZON_DAYS: How far ahead a booking may reach, days.
BOOKING_PAST_GRACE_MINUTES: A start this many minutes in the past is still accepted.
IDLE_UTIL_PCT: Idle bookings (docs/booking.md): a card with no process and utilization below this
    percentage is idle (0: never, which turns idle warnings off).
IDLE_WARN_MINUTES: Minutes a booking's cards must all be idle before its owner is warned.
IDLE_RELEASE_MINUTES: Minutes after the warning at which a still-idle booking is released, in teams that
    turned auto-release on.
IDLE_CHECK_SECONDS: How often the portal host's worker checks for idle bookings, s.
NO_SHOW_MINUTES: A booking unused from its start this long is a no-show: its owner is told.
""",
)

MAIL = _section(
    "Notifications and mail (the portal's worker; docs/notifications.md)",
    intro="Every notification is in its person's inbox; mail is a copy. Links in mails start with"
    " PORTAL_URL.",
    text="""
EMAIL_DELIVERY: smtp (needs EMAIL_HOST), file (each mail a file in EMAIL_FILE_PATH) or console (the
    worker's log). Default: smtp when EMAIL_HOST is set, else file.
EMAIL_HOST: The SMTP server, e.g. smtp.lab.example.org.
EMAIL_PORT: The SMTP port. Default: 25; 587 with EMAIL_USE_TLS; 465 with EMAIL_USE_SSL.
EMAIL_USE_TLS: STARTTLS after connecting (usually port 587).
EMAIL_USE_SSL: Or TLS from the first byte (usually port 465); not both.
EMAIL_TIMEOUT: Seconds each SMTP step may take.
EMAIL_HOST_USER: SMTP login; empty: none.
EMAIL_HOST_PASSWORD: SMTP password; better EMAIL_HOST_PASSWORD_FILE=/etc/gpu-portal/smtp-password.
DEFAULT_FROM_EMAIL: The sender, an address the relay accepts.
EMAIL_SUBJECT_PREFIX: Put before every subject.
EMAIL_FILE_PATH: Where EMAIL_DELIVERY=file writes.
NOTIFY_MAIL_EVERY_MINUTES: At most one mail per person and violation this often, minutes (0: no limit).
JOB_END_NOTIFY_MIN_MINUTES: A job's success is told by default only when it ran this long, minutes;
    failures always.
""",
)

WATCHDOG = _section(
    "The GPU watchdog (GPU hosts; docs/watchdog.md)",
    text="""
WATCHDOG_INTERVAL_SECONDS: Read the cards and judge every process this often, s.
WATCHDOG_MEMORY_TOLERANCE_MB: MiB a job may exceed its share of a card by before it is over_memory.
WATCHDOG_STOP_AFTER_SECONDS: Default grace before a stop (admins override per kind in the admin), s.
WATCHDOG_ZOMBIE_STOP_AFTER_SECONDS: The same for zombie processes, s.
WATCHDOG_KILL_GRACE_SECONDS: A process the watchdog stops itself gets SIGTERM, then SIGKILL this much
    later, s. Empty: JOB_KILL_GRACE_SECONDS, this release only (a warning says so).
WATCHDOG_DRY_RUN: Record and notify, never signal a process: a good first week on a new host.
WATCHDOG_REPEAT_OFFENCES: From this many violations of one person in a week on, their leaders are told.
""",
)

QUEUE = _section(
    "The queue (the portal's worker; docs/queue.md)",
    text="""
QUEUE_SCHEDULE_SECONDS: How often the scheduler makes a pass, s (and at once when a card frees up).
QUEUE_DEFAULT_TIME_LIMIT_MINUTES: A queued job's time limit when it gives none, minutes.
QUEUE_FAIRSHARE_WEIGHT: Priority = fair-share factor x this + age factor x QUEUE_AGE_WEIGHT - nice.
QUEUE_AGE_WEIGHT: See QUEUE_FAIRSHARE_WEIGHT.
QUEUE_AGE_MAX_HOURS: The age factor grows from 0 to 1 over this much waiting, hours.
QUEUE_BACKFILL_DEPTH: How many waiting jobs, highest priority first, hold their start against backfill.
QUEUE_ESTIMATE_HORIZON_HOURS: Estimated starts reach this far past the longest pending job, hours.
FAIRSHARE_HALF_LIFE_DAYS: Booked GPU-hours count for fair share with this half-life, days.
PREEMPT_GRACE_SECONDS: A preempted job gets SIGTERM, then SIGKILL this much later, s.
LEND_AFTER_MINUTES: A booking idle this long may be lent to preemptible queued jobs, minutes.
LEND_GRACE_SECONDS: A borrower leaves a lent card within this grace when its owner comes back, s.
""",
)

SIGN_IN = _section(
    "Sign-in with the lab's accounts (portal host; docs/identity.md)",
    intro="LDAP needs `apt install libldap2-dev libsasl2-dev` and"
    " `.venv/bin/pip install -r requirements-ldap.txt`.",
    text="""
IDENTITY_GROUP_TEAMS: Directory groups -> team slug:role (member or leader), e.g.
    vision-lab=vision-lab:member,vision-lab-pi=vision-lab:leader. Memberships of these teams follow the
    groups at every sign-in; other teams are never touched.
IDENTITY_ADMIN_GROUPS: Members of these groups are admins. Empty: admin rights never set from the
    directory.
IDENTITY_LINK_LOCAL_ACCOUNTS: A first directory sign-in binds an existing account of the same username
    only if it has no password and is not staff; true: also accounts with a local password (never
    staff).
LDAP_SERVER_URI: ldap://, ldaps:// or ldapi:// URI(s) of the directory. Empty: LDAP off.
LDAP_START_TLS: STARTTLS on ldap://; not with ldaps://.
LDAP_CA_CERT_FILE: CA certificate(s) for the server's certificate. Empty: the system's CAs.
LDAP_BIND_DN: The portal's service account, e.g. cn=gpu-portal,ou=services,dc=lab,dc=example.
LDAP_BIND_PASSWORD: Its password; better LDAP_BIND_PASSWORD_FILE=/etc/gpu-portal/ldap-password.
LDAP_USER_SEARCH_BASE: Where people are, e.g. ou=people,dc=lab,dc=example. Required with LDAP.
LDAP_USER_FILTER: Finds the typed username; Active Directory: (sAMAccountName=%(user)s).
LDAP_GROUP_SEARCH_BASE: Where groups are; required with IDENTITY_GROUP_TEAMS or IDENTITY_ADMIN_GROUPS.
    Empty: groups not read.
LDAP_GROUP_TYPE: The directory's kind of groups (case does not matter).
LDAP_GROUP_FILTER: Narrows the groups searched. Default: the type's object class.
LDAP_UNIX_ACCOUNT_ATTR: The attribute holding the Unix account; Active Directory: sAMAccountName.
LDAP_UNIX_ACCOUNT_TRUSTED: Only the directory's admins set it (and LDAP_USERNAME_ATTR): it is the
    person's Unix account, jobs run as it. false: only a claim, confirmed by an admin in the user admin.
LDAP_USERNAME_ATTR: The attribute that, lower-cased, names a new account; Active Directory:
    sAMAccountName.
LDAP_TIMEOUT_SECONDS: Connection and search timeout, s.
OIDC_ISSUER: OpenID Connect: the provider's https:// issuer; register https://<portal>/oidc/callback/ as
    the redirect URI of a confidential client. Empty: single sign-on off.
OIDC_CLIENT_ID: The portal's client id at the provider. Required with OIDC.
OIDC_CLIENT_SECRET: Its secret; better OIDC_CLIENT_SECRET_FILE=/etc/gpu-portal/oidc-secret.
OIDC_LAB_NAME: The login page's button reads "Sign in with <this>".
OIDC_SCOPES: Scopes asked for; must include openid.
OIDC_USERNAME_CLAIM: Names a new account at a first sign-in; later ones go by the provider's sub.
OIDC_GROUPS_CLAIM: The claim listing group names; missing means no groups.
OIDC_UNIX_ACCOUNT_CLAIM: The claim holding the Unix account. Empty: the username claim stands in.
OIDC_UNIX_ACCOUNT_TRUSTED: true only if people cannot edit that claim (or their username) at the
    provider: it is then their Unix account. false: only a claim, confirmed by an admin in the user
    admin.
OIDC_SIGN_ALGO: RS256/384/512, ES256/384/512 or HS256.
OIDC_TIMEOUT_SECONDS: Timeout of each request to the provider, s.
""",
)

LIMITS = _section(
    "Sign-in limits and API tokens (docs/security.md)",
    text="""
LOGIN_FAILURE_LIMIT: Failed sign-ins within the window that lock an account, and separately a client
    address.
LOGIN_FAILURE_WINDOW_MINUTES: The window, minutes; a lock lifts a window after the last try. Admins
    unlock in Admin -> Users.
LOGIN_FAILURE_LOG_DAYS: Days each failed sign-in is kept for the record.
API_TOKEN_DEFAULT_DAYS: Days a new API token lasts when none is given (0: until revoked).
API_TOKEN_MAX_DAYS: The most days any token may last (0: no limit).
IDEMPOTENCY_KEY_HOURS: Hours a change made under an API Idempotency-Key is remembered (docs/api.md).
IDEMPOTENCY_IN_PROGRESS_SECONDS: A key's request unanswered this long is reported "unknown", not "still
    being done".
""",
)

TOOLS = _section(
    "The lab's other tools (docs/integrations.md)",
    text="""
METRICS_TOKEN: Prometheus scrapes GET /metrics with "Authorization: Bearer <this>"; empty: no /metrics.
    Or METRICS_TOKEN_FILE=/etc/gpu-portal/metrics-token.
DCGM_HPC_JOB_MAPPING_DIR: On a GPU host with DCGM exporter: the folder it reads with
    --hpc-job-mapping-dir, e.g. /run/dcgm-job-map. Empty: none written.
CHANNEL_ENCRYPTION_KEYS: Fernet keys of chat and webhook channels (the first encrypts). Empty: derived
    from SECRET_KEY, so changing SECRET_KEY then makes stored channels unreadable.
CHANNEL_SCHEMES: The apprise schemes people may add.
CHANNEL_RETRIES: Tries of a failing delivery after the first.
CHANNEL_TIMEOUT_SECONDS: Each send's connect and read timeout, s.
CHANNEL_ALLOWED_HOSTS: Hosts inside the lab's network that channels may send to, e.g.
    mattermost.lab,10.0.5.0/24. Empty: only public addresses.
CHANNEL_TEST_EVERY_SECONDS: One test of a channel this often, s.
CALENDAR_PAST_DAYS: Calendar feeds hold bookings that ended up to this many days ago.
CALENDAR_MAX_EVENTS: The most events in one calendar feed.
""",
)

PER_HOST = _section(
    "Per host (GPU hosts only; leave commented in the shared copy)",
    text="""
WORKER_SERVER: This server's name in the portal; its queue is host.<name>. Letters, digits, - and _.
WORKER_CONCURRENCY*: Celery processes of the worker = jobs run at once: at least as many as bookings can
    run at once on this host (cards x memory shares per card). `make run`: 4.
SESSION_BIND_ADDRESS: Where this host's JupyterLab servers listen, an address the portal's proxy
    reaches: on a multi-host install, set it to this host's address on the portal's network.
""",
)

SECTIONS = (
    WEB,
    DATA,
    TELEMETRY,
    GPU_BACKEND,
    JOBS,
    CONTAINERS,
    SESSIONS,
    BOOKINGS,
    MAIL,
    WATCHDOG,
    QUEUE,
    SIGN_IN,
    LIMITS,
    TOOLS,
    PER_HOST,
)

# Read by the settings, but never a deployment's: said at the file's end, with why.
LEFT_OUT = {
    "PORTAL_DEVELOPMENT": "a developer's machine (make run and the tests set it); a server refuses none of"
    " the unsafe settings with it, so the web unit's check --deploy stops on it (portal.W001).",
    "PORTAL_ASGI": "set by portal/asgi.py for the web server's own process.",
    "RUNPORTAL_STOP_GRACE_SECONDS": "`make run`'s Ctrl-C.",
    "PORTAL_DEMO_PASSWORD": "the demo accounts of `make run` and `manage.py seed_demo`.",
}
