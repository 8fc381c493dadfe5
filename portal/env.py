"""Typed readers for environment variables that fail loudly on nonsense.

A typo in a deployment's environment must stop the process at start-up with a message
naming the variable, never silently fall back to a default.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import secrets
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit


class ImproperlyConfiguredEnv(ValueError):
    pass


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class EnvRead:
    """A variable a reader below was asked for: its default, spelled as an env file spells it,
    and the values it takes ("1-5", "one of: a, b"). deploy/env.example is generated from these
    (portal/env_example.py), so its commented-out lines show what the settings really do."""

    name: str
    default: str
    takes: str = ""


# Every variable read so far in this process, the first read of each (the settings' own, at load).
READS: dict[str, EnvRead] = {}


def _spelled(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return ",".join(f"{key}={item}" for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in value)
    return "" if value is None else str(value)


def _read(name: str, default: object, takes: str = "") -> None:
    READS.setdefault(name, EnvRead(name, _spelled(default), takes))


def _bounds(min_value: int | None, max_value: int | None) -> str:
    if min_value is not None and max_value is not None:
        return f"{min_value}-{max_value}"
    if min_value is not None:
        return f"at least {min_value}"
    return "" if max_value is None else f"at most {max_value}"


def _raw(name: str) -> str | None:
    """The variable's value; `NAME_FILE` (a path) wins so secrets can live in files."""
    file_path = os.environ.get(f"{name}_FILE")
    if file_path:
        try:
            return Path(file_path).read_text().strip()
        except OSError as exc:
            raise ImproperlyConfiguredEnv(f"{name}_FILE={file_path!r} cannot be read: {exc}") from exc
    return os.environ.get(name)


def env_str(name: str, default: str = "") -> str:
    _read(name, default)
    value = _raw(name)
    return default if value is None else value


def env_bool(name: str, default: bool = False) -> bool:
    _read(name, default)
    value = _raw(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfiguredEnv(f"{name}={value!r} is not a boolean: use 1/0, true/false, yes/no")


def env_int(name: str, default: int, *, min_value: int | None = None, max_value: int | None = None) -> int:
    _read(name, default, _bounds(min_value, max_value))
    value = _raw(name)
    if value is None or value.strip() == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise ImproperlyConfiguredEnv(f"{name}={value!r} is not an integer") from None
    if min_value is not None and number < min_value:
        raise ImproperlyConfiguredEnv(f"{name}={number} is below the minimum {min_value}")
    if max_value is not None and number > max_value:
        raise ImproperlyConfiguredEnv(f"{name}={number} is above the maximum {max_value}")
    return number


def env_int_renamed(
    name: str, *, was: str, min_value: int | None = None, max_value: int | None = None
) -> int | None:
    """`name` as env_int; None when unset, for the caller to read `was` in its place, the name it
    takes over from, for one release. Where only `was` is set, a warning at start-up says so."""
    _read(name, None, _bounds(min_value, max_value))
    if not (_raw(name) or "").strip() and (_raw(was) or "").strip():
        warnings.warn(
            f"{was} is read in place of {name}, for this release only: set {name} (docs/configuration.md)",
            FutureWarning,
            stacklevel=2,
        )
    return env_int(name, 0, min_value=min_value, max_value=max_value) or None


def env_list(name: str, default: list[str]) -> list[str]:
    _read(name, default, "comma-separated")
    value = _raw(name)
    if value is None:
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


def env_pairs(name: str, default: dict[str, str]) -> dict[str, str]:
    """`a=/x,b=/y` → {"a": "/x", "b": "/y"}; names are letters, digits, '.', '_' and '-'."""
    _read(name, default, "comma-separated name=value pairs")
    value = _raw(name)
    if value is None or not value.strip():
        return dict(default)
    pairs: dict[str, str] = {}
    for item in value.split(","):
        key, sep, path = (part.strip() for part in item.partition("="))
        if not sep or not key or not path or not all(c.isalnum() or c in "._-" for c in key):
            raise ImproperlyConfiguredEnv(
                f"{name}: {item.strip()!r} is not name=value (e.g. default=/usr/bin/python3)"
            )
        if key in pairs:
            raise ImproperlyConfiguredEnv(f"{name}: {key!r} is given twice")
        pairs[key] = path
    return pairs


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    _read(name, default, f"one of: {', '.join(choices)}")
    value = env_str(name, default).strip().lower()
    if value not in choices:
        raise ImproperlyConfiguredEnv(f"{name}={value!r} must be one of: {', '.join(choices)}")
    return value


def env_origin(name: str, default: str) -> str:
    """A web origin, `scheme://host[:port]` (http or https; no path, query or user), normalised as
    browsers write it in an Origin header: lower case, no default port, no trailing slash."""
    _read(name, default, "scheme://host[:port]")
    value = env_str(name, default).strip()
    example = f"e.g. {name}=https://labs.portal.example"
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        raise ImproperlyConfiguredEnv(f"{name}={value!r} is not an origin: {example}") from None
    scheme, host = parts.scheme.lower(), (parts.hostname or "")
    if scheme not in ("http", "https") or not re.fullmatch(r"[a-z0-9.-]+|[0-9a-f:.]+", host) or port == 0:
        raise ImproperlyConfiguredEnv(f"{name}={value!r} is not an http:// or https:// origin: {example}")
    if parts.username is not None or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ImproperlyConfiguredEnv(f"{name}={value!r} must be scheme://host[:port] alone: {example}")
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    default_port = {"http": 80, "https": 443}[scheme]
    return f"{scheme}://{host}" + (f":{port}" if port not in (None, default_port) else "")


def env_ip(name: str, default: str, *, example: str) -> str:
    """An IP address (IPv6 with or without brackets), never a host name: what it names must not
    change with whoever answers DNS next."""
    _read(name, default, "an IP address")
    value = env_str(name, default).strip()
    try:
        return str(ipaddress.ip_address(value.strip("[]")))
    except ValueError:
        message = f"{name}={value!r} must be an IP address ({example}), not a host name"
        raise ImproperlyConfiguredEnv(message) from None


def env_absolute_path(name: str, *, example: str) -> str:
    """An absolute path, or "" when unset: a relative one would depend on the process's folder."""
    _read(name, "", "an absolute path")
    value = env_str(name, "").strip()
    if value and not Path(value).is_absolute():
        raise ImproperlyConfiguredEnv(f"{name}={value!r} must be an absolute path ({example})")
    return value


def env_secret(name: str, *, min_length: int) -> str:
    """A shared secret (or `NAME_FILE`), "" when unset; a short one is refused: it would be guessed."""
    _read(name, "", f"at least {min_length} characters")
    value = env_str(name, "").strip()
    if 0 < len(value) < min_length:
        raise ImproperlyConfiguredEnv(
            f"{name} has {len(value)} characters: use at least {min_length}, e.g. the output of"
            ' python -c "import secrets; print(secrets.token_urlsafe(32))"'
        )
    return value


def env_secret_kept(name: str, keep: Path) -> str:
    """`name` (or `NAME_FILE`); unset, one generated once into `keep` (mode 0600), so sessions and
    signed values survive restarts of a portal nobody configured (`make run`)."""
    key = env_str(name)
    if key:
        return key
    if not keep.exists():
        keep.write_text(secrets.token_urlsafe(50))
        keep.chmod(0o600)
    return keep.read_text().strip()


def redis_url_for_celery(redis_url: str) -> str:
    """Kombu names a unix socket redis+socket://; everything else is the URL itself."""
    if redis_url.startswith("unix://"):
        return "redis+socket://" + redis_url.removeprefix("unix://")
    return redis_url


def instance_id(database: dict) -> str:
    """PORTAL_INSTANCE_ID's default: a digest of where the database lives (never its password), so
    checkouts sharing a database agree and two databases never do."""
    if database["ENGINE"].endswith("sqlite3"):
        where = str(Path(database["NAME"]).resolve())
    else:
        where = "{ENGINE}://{HOST}:{PORT}/{NAME}".format_map({"HOST": "", "PORT": "", **database})
    return hashlib.sha256(where.encode()).hexdigest()[:16]


def database_url(settings_dict: dict) -> str:
    """A DATABASES entry back as a URL: how tests and benchmarks hand their throw-away test
    database to the worker and web server processes they start."""
    if settings_dict["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{settings_dict['NAME']}"
    auth = quote(settings_dict["USER"], safe="")
    if settings_dict["PASSWORD"]:
        auth += ":" + quote(settings_dict["PASSWORD"], safe="")
    host = settings_dict["HOST"] or "127.0.0.1"
    return f"postgres://{auth}@{host}:{settings_dict['PORT'] or 5432}/{settings_dict['NAME']}"


POSTGRES_DEFAULT_OPTIONS = {
    "connect_timeout": "5",
    "keepalives": "1",
    "keepalives_idle": "30",
    "keepalives_interval": "10",
    "keepalives_count": "3",
    # Data unacknowledged for 30 s (a peer that vanished mid-query: a frozen VM, a blackholed
    # route) fails the connection instead of the kernel's ~15 minutes of retransmits.
    "tcp_user_timeout": "30000",
}


def parse_database_url(url: str, *, var: str = "DATABASE_URL") -> dict:
    """`postgres://user:pass@host:port/name` or `sqlite:///abs/path` → a DATABASES entry."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "sqlite":
        path = unquote(parts.path)
        if path.startswith("//"):  # sqlite:////abs/path
            path = path[1:]
        if not path or path == "/":
            raise ImproperlyConfiguredEnv(
                f"{var}={url!r} names no SQLite file: use sqlite:///path/db.sqlite3"
            )
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": path,
            # IMMEDIATE takes the write lock at BEGIN, so two booking transactions
            # serialise instead of both reading "free" and failing at commit.
            "OPTIONS": {
                "transaction_mode": "IMMEDIATE",
                "timeout": 20,
                "init_command": "PRAGMA journal_mode=WAL;",
            },
        }
    if scheme in {"postgres", "postgresql", "pgsql"}:
        name = unquote(parts.path.lstrip("/"))
        if not name:
            raise ImproperlyConfiguredEnv(f"{var}={url!r} names no database: add /dbname")
        options = {key: values[-1] for key, values in parse_qs(parts.query).items()}
        # A host that is down or unreachable must fail a connection in seconds, not hang a
        # worker, a request or a runner's retry loop on the kernel's TCP timeout (minutes):
        # every caller retries on its own schedule. Keepalives find a dead peer on an idle
        # pooled connection the same way. The URL's own values win (?connect_timeout=30).
        options = {**POSTGRES_DEFAULT_OPTIONS, **options}
        return {
            # Django's, with a deadline on every wait for the server (portal/postgresql/base.py).
            "ENGINE": "portal.postgresql",
            "NAME": name,
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(parts.port or ""),
            "OPTIONS": options,
            "CONN_MAX_AGE": 60,
            "CONN_HEALTH_CHECKS": True,
        }
    raise ImproperlyConfiguredEnv(
        f"{var}={url!r}: scheme {scheme!r} is not supported; use postgres:// or sqlite:///"
    )


def lab_origin_problem(
    lab_origin: str, *, portal_url: str, trusted: list[str], cookie_domains: dict, https: bool
) -> str:
    """Why LAB_ORIGIN would let a lab page act as its user on the portal ("" if it would not)."""
    lab = urlsplit(lab_origin)
    host = (lab.hostname or "").lower()
    fix = "give the labs a host name of their own, e.g. LAB_ORIGIN=https://labs.portal.example"
    if host == (urlsplit(portal_url).hostname or "").lower():
        return (
            f"LAB_ORIGIN={lab_origin!r} has the portal's own host name (PORTAL_URL={portal_url!r}), and"
            f' cookies do not tell ports apart: {fix} (docs/deploy.md, "JupyterLab sessions")'
        )
    for name, domain in cookie_domains.items():
        covered = (domain or "").lstrip(".").lower()
        if covered and (host == covered or host.endswith(f".{covered}")):
            return (
                f"{name}={domain!r} sends the portal's cookie to LAB_ORIGIN's host {host!r} too:"
                f" leave {name} unset (host-only cookies), or give LAB_ORIGIN a host outside {covered!r}"
            )
    for origin in trusted:
        scheme, _, pattern = origin.lower().partition("://")
        wildcard = pattern.startswith("*.") and host.endswith(pattern[1:])
        if origin.lower().rstrip("/") == lab_origin or (scheme == lab.scheme and wildcard):
            return (
                f"CSRF_TRUSTED_ORIGINS lists {origin!r}, which covers LAB_ORIGIN={lab_origin!r}: a lab"
                " page could post the portal's forms as its user. Take it out of CSRF_TRUSTED_ORIGINS"
            )
    if https and lab.scheme != "https":
        return (
            f"HTTPS=true but LAB_ORIGIN={lab_origin!r}: set LAB_ORIGIN to the https:// address of the"
            " labs' host name, e.g. https://labs.portal.example (docs/deploy.md)"
        )
    return ""
