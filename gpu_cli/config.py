"""Where the portal is and the token for it: the config file that `gpu login` writes, or the env.

The file is click's per-user config folder for "gpu-portal" (~/.config/gpu-portal/config.json on
Linux), readable by its owner only (0600): the token is as good as the password.
GPU_PORTAL_URL and GPU_PORTAL_TOKEN override it (CI jobs, shared machines, tests).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import click

from gpu_cli.errors import Unreachable

APP_NAME = "gpu-portal"
URL_ENV = "GPU_PORTAL_URL"
TOKEN_ENV = "GPU_PORTAL_TOKEN"


@dataclass(frozen=True)
class Login:
    url: str
    token: str


def config_path() -> Path:
    return Path(click.get_app_dir(APP_NAME)) / "config.json"


def portal_url(text: str) -> str:
    """The portal's root URL as given to `gpu login`: 'http://host:8000/', or its API root
    'http://host:8000/api/v1/' (what people copy from the API docs) → 'http://host:8000'."""
    url = text.strip().rstrip("/").removesuffix("/api/v1")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise click.BadParameter(f"{text!r}: give the portal's address, e.g. http://gpu-portal.lab:8000/")
    return url


def _stored() -> dict[str, str]:
    path = config_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise Unreachable(f"Cannot read {path} ({exc}); run `gpu login URL` again.") from None
    data = data if isinstance(data, dict) else {}
    # Edited by hand ({"url": 8000}): said as a file that cannot be read, not an AttributeError.
    if not all(isinstance(data.get(key, ""), str) for key in ("url", "token")):
        raise Unreachable(f"Cannot read {path} (its url and token must be text); run `gpu login URL` again.")
    return data


def stored_login() -> Login | None:
    """The login `gpu login` stored (not the environment's), if any."""
    stored = _stored()
    if not stored.get("url") or not stored.get("token"):
        return None
    return Login(url=portal_url(stored["url"]), token=stored["token"])


def current() -> Login:
    """The login to use: the environment's, else the stored one; neither is exit code 3."""
    stored = _stored()
    url = os.environ.get(URL_ENV) or stored.get("url")
    token = os.environ.get(TOKEN_ENV) or stored.get("token")
    if not url or not token:
        raise Unreachable(f"Not logged in: run `gpu login URL`, or set {URL_ENV} and {TOKEN_ENV}.")
    return Login(url=portal_url(url), token=token)


def save(login: Login, username: str) -> Path:
    """Write the login for this user only: a new 0600 file moved into place, so the token is
    never readable by others, not even for a moment, and a crash leaves the old file whole."""
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    temporary = path.with_name(path.name + ".new")
    temporary.unlink(missing_ok=True)  # O_CREAT's mode applies only to a file it creates
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        json.dump({"url": login.url, "token": login.token, "username": username}, file, indent=2)
    os.replace(temporary, path)
    return path


def forget() -> str | None:
    """Delete the stored login; the URL it was for, or None if there was none."""
    try:
        url = _stored().get("url")
    except Unreachable:  # unreadable or corrupt: deleting it is what was asked
        url = None
    config_path().unlink(missing_ok=True)
    return url if isinstance(url, str) else None
